"""`vramplan validate --published`: the estimate against the published real-GPU rows
(calibration/published/records.jsonl), per row and per source, method, quantity and family, the
share under-estimated by more than 3 %, and every excluded row with its reason. Pure arithmetic
over estimates (:mod:`vramplan.calibration.published`): no torch."""

from __future__ import annotations

import click

from .options import corrections_for, print_json


def run_published(as_json: bool, no_calibration: bool = False, calibration_file: str | None = None,
                  records_path: str | None = None) -> None:
    from ..calibration.published import (
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
    from ..model.profiles import load_gpu

    records = load_records(records_path)
    applied: dict = {}

    def estimator(r):
        if r["gpu"] not in applied:
            applied[r["gpu"]] = corrections_for(load_gpu(r["gpu"]), no_calibration, calibration_file)
        return estimate_record(r, applied[r["gpu"]])

    rows = sorted(compare(records, estimator=estimator), key=lambda r: (r.quantity, r.error))
    summary = summarize(rows)
    slopes = token_slopes(records, rows)
    intercepts = step_intercepts(records, slopes)
    out = excluded(records)
    calibration = sorted({c.calibration.group if c.calibration else "none (raw model)" for c in applied.values()})
    if as_json:
        print_json({"calibration": calibration, "under_threshold": UNDER,
                    "rows": [dict(r.__dict__, error=r.error) for r in rows],
                    "summary": [s.__dict__ for s in summary],
                    "token_slopes": [dict(t.__dict__, excess_per_token=t.excess_per_token, error=t.error)
                                     for t in slopes],
                    "step_intercepts": [dict(i.__dict__, excess_bytes=i.excess_bytes) for i in intercepts],
                    "excluded": [e.__dict__ for e in out]})
        return
    click.echo(f"calibration: {', '.join(calibration)} (the device terms are fitted on these runs' allocated vs "
               f"nvidia-smi: the device total column is in-sample)" if not no_calibration else
               "calibration: none (the raw model, --no-calibration)")
    click.echo(f"{'id':58s} {'family':8s} {'method':6s} {'quantity':12s} {'meas GiB':>9s} {'est GiB':>8s} "
               f"{'error':>8s} {'phase':9s} approx")
    for r in rows:
        click.echo(f"{r.id[:58]:58s} {r.family:8s} {r.method:6s} {r.quantity:12s} {r.measured_bytes / 2**30:9.2f} "
                   f"{r.estimated_bytes / 2**30:8.2f} {r.error:+8.1%} {r.phase:9s} {'yes' if r.approximated else ''}")
    click.echo()
    click.echo(f"{'group':12s} {'key':42s} {'rows':>4s} {'median|e|':>9s} {'p90|e|':>8s} {'worst':>8s} "
               f"{'under>' + format(UNDER, '.0%'):>9s}")
    for s in summary:
        click.echo(f"{s.group:12s} {s.key[:42]:42s} {s.rows:4d} {s.median_abs_error:9.1%} {s.p90_abs_error:8.1%} "
                   f"{s.worst_error:+8.1%} {s.under_share:9.0%}")
    click.echo()
    for s in summary:
        if s.group == "quantity":
            click.echo(f"{s.key}: median |error| {s.median_abs_error:.1%}, p90 {s.p90_abs_error:.1%}, "
                       f"under-estimated by more than {UNDER:.0%} in {s.under_share:.0%} of {s.rows} rows")
    click.echo()
    _echo_slopes(slopes)
    click.echo()
    click.echo("step intercepts (allocated: peak - allocation after training - slope x tokens; FSDP1: vs the root and "
               "one layer unit unsharded, MiB)")
    for i in intercepts:
        click.echo(f"  {i.ids[0][:52]:52s} {i.gpus:4d} {i.fsdp:10s} meas {i.measured_bytes / 2**20:9.1f}  root+1 layer "
                   f"{i.one_layer_bytes / 2**20:9.1f}  excess {i.excess_bytes / 2**20:+7.1f}")
    click.echo()
    click.echo(f"{len(records)} records: {len({r.id for r in rows})} comparable, {len(out)} excluded")
    for reason, n in exclusion_counts(records):
        click.echo(f"  {n:4d}  {reason}")
    click.echo()
    click.echo("excluded rows")
    for e in out:
        click.echo(f"  {e.id[:60]:60s} {e.source:40s} {e.reason}")


def _echo_slopes(slopes) -> None:
    """Rows that differ only in the micro-batch: bytes per added token per GPU, measured vs estimated."""
    click.echo("per-token slopes (rows differing only in the micro-batch; bytes per added token per GPU)")
    click.echo(f"{'rows (fewer -> more tokens)':64s} {'quantity':12s} {'gpus':>4s} {'fsdp':10s} {'meas B/tok':>10s} "
               f"{'est B/tok':>10s} {'excess':>9s} {'error':>7s} phases")
    for t in slopes:
        pair = f"{t.ids[0][:52]} -> {t.ids[1].rsplit('-', 1)[-1]}"
        error = "-" if t.error is None else f"{t.error:+.1%}"
        click.echo(f"{pair[:64]:64s} {t.quantity:12s} {t.gpus:4d} {t.fsdp:10s} {t.measured_per_token:10.0f} "
                   f"{t.estimated_per_token:10.0f} {t.excess_per_token:+9.0f} {error:>7s} {'/'.join(t.phases)}")
