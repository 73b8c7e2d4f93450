"""Estimate vs published real-GPU peaks (calibration/published/records.jsonl). Prints; asserts nothing.

    python benchmarks/published_accuracy.py            # per-row table, per-group summary, per-token slopes,
                                                       # step intercepts, excluded rows with reasons
    python benchmarks/published_accuracy.py --json     # the same, machine-readable
    python benchmarks/published_accuracy.py --records PATH
    python benchmarks/published_accuracy.py --no-calibration   # the raw model (published device terms)

The estimates carry the committed calibration (calibration/coefficients.json) as `vramplan
estimate` does; its device terms are fitted on these runs' allocated vs nvidia-smi, so the
device_total rows are in-sample with it (`vramplan calibrate` refits them).

Comparable rows: HF modelling code, exact lengths, every knob expressible, a config we hold, a
quantity we predict (calibration/published/README.md). error = estimate / measured - 1; "under"
is the share of rows under-estimated by more than 3 %.
"""

from __future__ import annotations

import argparse
import json
import time

from vramplan.calibration.published import (
    UNDER,
    compare,
    estimate_record,
    excluded,
    exclusion_counts,
    load_records,
    step_intercepts,
    summarize,
    token_slopes,
)
from vramplan.estimator.corrections import calibration_for
from vramplan.model.profiles import load_gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", default=None, help="records JSONL (default: calibration/published/records.jsonl)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-calibration", action="store_true", help="the raw model (published device terms)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    records = load_records(args.records)
    def estimator(r):
        return estimate_record(r, calibration_for(load_gpu(r["gpu"]), enabled=not args.no_calibration)[0])

    rows = sorted(compare(records, estimator=estimator), key=lambda r: (r.quantity, r.error))
    summary = summarize(rows)
    slopes = token_slopes(records, rows)
    intercepts = step_intercepts(records, slopes)
    out = excluded(records)
    if args.json:
        print(json.dumps({"rows": [dict(r.__dict__, error=r.error) for r in rows],
                          "summary": [s.__dict__ for s in summary],
                          "token_slopes": [dict(t.__dict__, excess_per_token=t.excess_per_token, error=t.error)
                                           for t in slopes],
                          "step_intercepts": [dict(i.__dict__, excess_bytes=i.excess_bytes) for i in intercepts],
                          "excluded": [e.__dict__ for e in out]}, indent=2))
        return
    print(f"{'id':58s} {'family':8s} {'method':6s} {'quantity':9s} {'meas GiB':>9s} {'est GiB':>8s} {'error':>8s} "
          f"{'phase':9s} approx")
    for r in rows:
        print(f"{r.id[:58]:58s} {r.family:8s} {r.method:6s} {r.quantity:9s} {r.measured_bytes / 2**30:9.2f} "
              f"{r.estimated_bytes / 2**30:8.2f} {r.error:+8.1%} {r.phase:9s} {'yes' if r.approximated else ''}")
    print()
    print(f"{'group':12s} {'key':42s} {'rows':>4s} {'median|e|':>9s} {'p90|e|':>8s} {'worst':>8s} "
          f"{'under>' + format(UNDER, '.0%'):>9s}")
    for s in summary:
        print(f"{s.group:12s} {s.key[:42]:42s} {s.rows:4d} {s.median_abs_error:9.1%} {s.p90_abs_error:8.1%} "
              f"{s.worst_error:+8.1%} {s.under_share:9.0%}")
    print()
    print("per-token slopes (rows differing only in the micro-batch; bytes per added token per GPU)")
    for t in slopes:
        err = "-" if t.error is None else f"{t.error:+.1%}"
        print(f"  {t.ids[0][:52]:52s} -> {t.ids[1].rsplit('-', 1)[-1]:4s} {t.quantity:12s} {t.gpus} {t.fsdp:10s} "
              f"meas {t.measured_per_token:9.0f}  est {t.estimated_per_token:9.0f}  {err:>7s}")
    print()
    print("step intercepts (allocated: peak - allocation after training - slope x tokens, MiB; FSDP1: vs the root "
          "and one layer unit unsharded)")
    for i in intercepts:
        print(f"  {i.ids[0][:52]:52s} {i.gpus} {i.fsdp:10s} meas {i.measured_bytes / 2**20:9.1f}  root+1 layer "
              f"{i.one_layer_bytes / 2**20:9.1f}  excess {i.excess_bytes / 2**20:+7.1f}  (a layer unit "
              f"{i.layer_bytes / 2**20:.0f})")
    print()
    print(f"{len(records)} records: {len({r.id for r in rows})} comparable ({len(rows)} rows), {len(out)} excluded")
    for reason, n in exclusion_counts(records):
        print(f"  {n:4d}  {reason}")
    print()
    print("excluded rows")
    for e in out:
        print(f"  {e.id[:60]:60s} {e.source:40s} {e.reason}")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
