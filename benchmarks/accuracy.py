"""Estimate vs truth, printed as error tables. Prints; asserts nothing.

    python benchmarks/accuracy.py                     # estimate vs trace: every family, 4-layer truncations, 2 shapes
    python benchmarks/accuracy.py --full              # the same on whole models (traced at 2 and 3 layers,
                                                      # extrapolated)
    python benchmarks/accuracy.py --validate          # the knob matrix of `vramplan validate` (trace and real CPU runs)
    python benchmarks/accuracy.py --validate --quick  # its CI subset
    python benchmarks/accuracy.py --validate --json   # machine-readable rows and per-knob summary
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from vramplan.specs import Setup
from vramplan.validate.accuracy import FAMILY_MODELS, compare


def family_matrix(full: bool, shapes: list[tuple[int, int]]) -> None:
    layers = None if full else 4
    per_family: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    print(f"{'family':12s} {'method':6s} {'ckpt':4s} {'b x s':>9s} {'trace GiB':>10s} {'est GiB':>9s} "
          f"{'error':>8s}  note")
    for family, model in FAMILY_MODELS.items():
        for method in ("full", "lora"):
            for ckpt in (False, True):
                for b, s in shapes:
                    setup = Setup(method=method, checkpointing=ckpt, batch=b, seq=s)
                    row = compare(model, setup, layers=layers)
                    per_family.setdefault(family, []).append(row.error)
                    flag = "over 5 %" if abs(row.error) > 0.05 else ""
                    print(f"{family:12s} {method:6s} {int(ckpt):4d} {f'{b}x{s}':>9s} {row.traced_bytes / 2**30:10.2f} "
                          f"{row.estimated_bytes / 2**30:9.2f} {row.error:+8.2%}  {flag}", flush=True)
    print()
    print(f"{'family':12s} {'median |err|':>12s} {'worst':>8s}")
    for family, errs in per_family.items():
        worst = max(errs, key=abs)
        print(f"{family:12s} {statistics.median(abs(e) for e in errs):12.2%} {worst:+8.2%}")
    allerr = [abs(e) for errs in per_family.values() for e in errs]
    print(f"{'all':12s} {statistics.median(allerr):12.2%} {max(allerr):8.2%}   ({time.perf_counter() - t0:.0f} s)")


def validate_matrix(quick: bool, as_json: bool) -> None:
    """The matrix of `vramplan validate`: one line per row as it runs, then the per-knob summary."""
    from vramplan.setup.wording import describe
    from vramplan.validate.matrix import matrix, row_json, run_case, summarize, unverified_rows

    t0 = time.perf_counter()
    rows = []
    if not as_json:
        print(f"{'knob':13s} {'model':18s} {'truth':7s} {'quantity':18s} {'truth MiB':>10s} {'est MiB':>10s} "
              f"{'error':>8s}  setup")
    for case in matrix(quick):
        for row in run_case(case):
            rows.append(row)
            if not as_json:
                print(f"{row.knob:13s} {row.model.split('/')[-1][:18]:18s} {row.truth:7s} {row.quantity[:18]:18s} "
                      f"{row.truth_bytes / 2**20:10.1f} {row.estimated_bytes / 2**20:10.1f} {row.error:+8.2%}  "
                      f"{describe(row.setup)}", flush=True)
    rows += unverified_rows(quick)
    summary = summarize(rows)
    seconds = time.perf_counter() - t0
    if as_json:
        print(json.dumps({"rows": [row_json(r) for r in rows], "summary": [s.__dict__ for s in summary],
                          "seconds": round(seconds, 1)}, indent=2))
        return
    print()
    print(f"{'knob':17s} {'rows':>4s} {'median |err|':>12s} {'worst':>8s}  (tensor peak)")
    for s in summary:
        if s.verified:
            print(f"{s.knob:17s} {s.rows:4d} {s.median_abs_error:12.2%} {s.worst_error:+8.2%}")
        else:
            print(f"{s.knob:17s} {0:4d} {'-':>12s} {'-':>8s}  not verified: {s.why}")
    print(f"({seconds:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="whole models instead of 4-layer truncations")
    ap.add_argument("--shapes", default="1x512,4x4096")
    ap.add_argument("--validate", action="store_true", help="the knob matrix of `vramplan validate`")
    ap.add_argument("--quick", action="store_true", help="with --validate: the CI subset")
    ap.add_argument("--json", action="store_true", help="with --validate: JSON rows and summary")
    args = ap.parse_args()
    if args.validate:
        validate_matrix(args.quick, args.json)
        return
    family_matrix(args.full, [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")])


if __name__ == "__main__":
    main()
