"""`vramplan validate`: every knob's estimate against its truth, as an error table.

The matrix lives in :mod:`vramplan.validate.matrix`; this module only runs it and prints. A knob that
cannot be verified on this machine is printed as such, with the reason.
"""

from __future__ import annotations

import contextlib
import sys
import time

import click

from ..setup.wording import describe
from .options import calibration_options, print_json, user_errors


@click.command()
@click.option("--quick", is_flag=True, help="The small subset run in CI (one family, a few knobs).")
@click.option("--knob", "knobs", multiple=True, metavar="K",
              help="Only these knobs (repeatable): canonical, quantization, optimizer, precision, attention, "
                   "grad_accum, checkpointing, selective_checkpointing, moe, loss, framework, modules_to_save, dora, "
                   "optimizer_in_backward, activation_offload, liger, padding_free, gptq_awq, zero, fsdp, fsdp2, "
                   "hybrid_shard, ddp, device_map, tp, cp, pp, device_overheads, measured, dpo, orpo, kto, grpo, eval.")
@click.option("--measurements", default="calibration/measurements", show_default=True, metavar="DIR",
              help="Records of `vramplan measure`/`sweep`: the 'measured' truth column.")
@click.option("--throughput", is_flag=True,
              help="Instead: the cost model's tokens/s vs the published runs of calibration/throughput/ "
                   "(predicted/measured per row and per GPU class, in-sample and held out, pairs ordered, the "
                   "rows each fitted constant rests on). No torch; about a second.")
@click.option("--published", is_flag=True,
              help="Instead: the estimate vs the published real-GPU peaks (calibration/published/), per row, "
                   "source, method, quantity and family, and every excluded row with its reason. No torch.")
@calibration_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable rows and summary.")
@user_errors
def validate(quick: bool, knobs: tuple[str, ...], measurements: str, throughput: bool, published: bool,
             no_calibration: bool, calibration_file: str | None, as_json: bool) -> None:
    """Estimate vs truth (fake-tensor trace, a real CPU run, N DeepSpeed processes, or the recorded
    measurements) for every knob: error per setup, median and worst per knob. The default matrix takes a few
    minutes; --quick well under one."""
    if throughput:
        _throughput(as_json)
        return
    if published:
        from .validate_published import run_published

        run_published(as_json, no_calibration, calibration_file)
        return
    from ..run.models import require_torch
    from ..specs import SpecError
    from ..validate.matrix import KNOBS, matrix, row_json, run_case, summarize, unverified_rows

    unknown = [k for k in knobs if k not in KNOBS]
    if unknown:
        raise SpecError(f"unknown knob {unknown[0]!r}; knobs: {', '.join(KNOBS)}")
    require_torch()
    t0 = time.perf_counter()
    cases = [c for c in matrix(quick) if not knobs or c.knob in knobs]
    rows = []
    # the libraries log to stdout (DeepSpeed's accelerator notice): keep stdout for the results
    with contextlib.redirect_stdout(sys.stderr):
        for i, case in enumerate(cases):
            click.echo(f"\r[{i + 1}/{len(cases)}] {case.knob}: {case.model}", nl=False, err=True)
            rows += run_case(case)
        if cases:
            click.echo("", err=True)
        rows += unverified_rows(quick, knobs, measurements)
    summary = summarize(rows)
    seconds = time.perf_counter() - t0
    if as_json:
        print_json({
            "rows": [row_json(r) for r in rows],
            "summary": [s.__dict__ for s in summary],
            "seconds": round(seconds, 1),
        })
        return
    _print_table(rows, summary, seconds)


def _print_table(rows, summary, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(160, Console().width))
    table = Table(show_edge=False, pad_edge=False)
    for col, just in (("knob", "left"), ("model", "left"), ("setup", "left"), ("truth", "left"),
                      ("quantity", "left"), ("truth MiB", "right"), ("est. MiB", "right"), ("error", "right")):
        table.add_column(col, justify=just, overflow="fold")
    for r in rows:
        if not r.verified:
            what = "" if r.model == "-" else f"{describe(r.setup)}: "
            table.add_row(r.knob, r.model.split("/")[-1], f"[yellow]not verified:[/] {what}{r.why}", r.truth,
                          "-", "-", "-", "-")
            continue
        err = f"{r.error:+.2%}"
        style = "red" if abs(r.error) > 0.05 else None
        quantity = r.quantity.replace("_bytes", "")
        table.add_row(r.knob, r.model.split("/")[-1], describe(r.setup), r.truth, quantity,
                      f"{r.truth_bytes / 2**20:,.1f}", f"{r.estimated_bytes / 2**20:,.1f}", err, style=style)
    console.print(table)
    console.print()
    head = Table(show_edge=False, pad_edge=False, title="tensor peak, per knob")
    for col in ("knob", "rows", "median |error|", "worst", "note"):
        head.add_column(col, justify="left" if col in ("knob", "note") else "right", overflow="fold")
    for s in summary:
        if s.verified:
            head.add_row(s.knob, str(s.rows), f"{s.median_abs_error:.2%}", f"{s.worst_error:+.2%}", "")
        else:
            head.add_row(s.knob, "0", "-", "-", f"not verified: {s.why}")
    console.print(head)
    console.print(f"[dim]{seconds:.0f} s[/]")
    sys.stdout.flush()


def _throughput(as_json: bool) -> None:
    """The cost model against the published throughput rows (vramplan.cost.throughput): pure arithmetic.
    Per row, per GPU class (in-sample and left out one at a time), and what each constant is fitted on."""
    from ..cost import fit as cost_fit
    from ..cost.throughput import RATIO_BAND, bar_met, by_class, compare, coverage, load_records, pairs, summarize

    records = load_records()
    rows, fit = compare(records), cost_fit.fit(records)
    loo = {r.id: r for r in cost_fit.leave_one_out(records)}
    s, classes = summarize(rows), by_class(rows, list(loo.values()), fit)
    lo, hi = RATIO_BAND
    meets = lo <= s.median_ratio <= hi and s.pair_share >= 0.85
    met = bar_met(classes)
    cover = coverage(rows, fit)
    if as_json:
        print_json({"rows": [{"id": r.id, "model": r.model, "gpu": r.gpu, "gpu_class": r.gpu_class, "gpus": r.gpus,
                              "setup": describe(r.setup), "fit_role": fit.role[r.id],
                              "measured_tokens_per_s": r.measured_tokens_per_s,
                              "predicted_tokens_per_s": round(r.predicted_tokens_per_s, 1), "ratio": round(r.ratio, 4),
                              "held_out_ratio": round(loo[r.id].ratio, 4),
                              "terms_s": {k: round(v, 4) for k, v in r.terms_s.items() if v}} for r in rows],
                    "classes": [{"gpu_class": c.gpu_class, "gpus": list(c.gpus), "rows": c.in_sample.rows,
                                 "mfu": round(c.mfu, 4), "constant": c.constant, "fitted_on": list(c.fitted_on),
                                 "checks": list(c.checks), "in_sample": _summary_json(c.in_sample),
                                 "held_out": _summary_json(c.held_out), "meets_bar": c.meets} for c in classes],
                    "constants": {k: {"value": round(v, 4), "fitted_on": fit.fitted_on.get(k, [])}
                                  for k, v in fit.constants.items()},
                    "bar": {"ratio_band": list(RATIO_BAND), "classes_meeting": sum(c.meets for c in classes),
                            "classes_needed": 3, "met": met},
                    "coverage": cover,
                    "summary": {**s.__dict__, "pair_share": s.pair_share, "meets_bar": meets}})
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(160, Console().width))
    table = Table(show_edge=False, pad_edge=False, title="tokens/s per GPU: cost model vs published runs")
    for col in ("record", "model", "gpu", "setup", "measured", "predicted", "pred/meas", "held out", "fit",
                "largest terms (s/step)"):
        table.add_column(col, justify="right" if col in ("measured", "predicted", "pred/meas", "held out") else "left",
                         overflow="fold")
    for r in rows:
        top = sorted(((v, k) for k, v in r.terms_s.items() if v > 0), reverse=True)[:3]
        table.add_row(r.id, r.model, f"{r.gpus}x {r.gpu}", describe(r.setup), f"{r.measured_tokens_per_s:,.0f}",
                      f"{r.predicted_tokens_per_s:,.0f}", f"{r.ratio:.3f}", f"{loo[r.id].ratio:.3f}", fit.role[r.id],
                      " ".join(f"{k} {v:.2f}" for v, k in top))
    console.print(table)
    per = Table(show_edge=False, pad_edge=False, title="per GPU class (held out: each row predicted by constants "
                                                       "fitted without it)")
    for col in ("class", "cards", "rows", "MFU", "fitted on", "median", "range", "held-out median", "held-out range",
                "pairs", "bar"):
        per.add_column(col, justify="left" if col in ("class", "cards", "fitted on", "bar") else "right",
                       overflow="fold")
    for c in classes:
        h, i = c.held_out, c.in_sample
        fitted = (f"{len(c.fitted_on)} rows" if c.constant else "not fitted (default MFU)") + (
            f"; {len(c.checks)} check rows" if c.checks and c.constant else "")
        bar = "met" if c.meets else ("fewer than 2 rows" if h.rows < 2 else "missed")
        per.add_row(c.gpu_class, ", ".join(c.gpus), str(i.rows), f"{c.mfu:.3f}", fitted, f"{i.median_ratio:.3f}",
                    f"{i.min_ratio:.3f}-{i.max_ratio:.3f}", f"{h.median_ratio:.3f}",
                    f"{h.min_ratio:.3f}-{h.max_ratio:.3f}", f"{i.pairs_ordered}/{i.pairs}", bar)
    console.print(per)
    for c in classes:
        i = c.in_sample
        console.print(f"{c.gpu_class}: {i.rows} row{'s' if i.rows != 1 else ''}: median predicted/measured "
                      f"{i.median_ratio:.3f} (range "
                      f"{i.min_ratio:.3f}-{i.max_ratio:.3f}); same-model pairs ordered as measured "
                      f"{i.pairs_ordered}/{i.pairs}; held out {c.held_out.median_ratio:.3f}")
    console.print(f"{s.rows} rows: median predicted/measured {s.median_ratio:.3f} (range {s.min_ratio:.3f}-"
                  f"{s.max_ratio:.3f}); same-model pairs ordered as measured {s.pairs_ordered}/{s.pairs} "
                  f"({s.pair_share:.0%}); bar (median {lo}-{hi}, >= 85 % ordered): {'met' if meets else 'missed'}")
    console.print(f"per-class bar (held-out median {lo}-{hi} on >= 2 rows, >= 3 classes): "
                  f"{sum(c.meets for c in classes)} classes: {'met' if met else 'missed'}")
    console.print(f"cards with a measured row: {', '.join(cover['measured'])}; no row but in a fitted class: "
                  f"{', '.join(cover['class_only']) or '-'}; no measured row ({len(cover['none'])} cards: the "
                  f"unfitted default MFU, tokens/s unvalidated): {', '.join(cover['none'])}")
    console.print("fitted constants (vramplan/cost/constants.py; stage 1 on fms-acceleration refs/a100_80gb.csv, "
                  "stage 2 one MFU per GPU class on that class's rows):")
    for k, v in fit.constants.items():
        ids = fit.fitted_on.get(k, [])
        mfu = f" (MFU {1 / v:.3f})" if k.startswith("inv_mfu:") and v else ""
        console.print(f"  {k} = {v:.4g}{mfu}: {len(ids)} rows: {_id_ranges(ids)}")
    for p in pairs(rows):
        if not p.ordered:
            console.print(f"  misordered: {p.a.id} vs {p.b.id}")


def _summary_json(s) -> dict:
    return {"rows": s.rows, "median_ratio": round(s.median_ratio, 4), "min_ratio": round(s.min_ratio, 4),
            "max_ratio": round(s.max_ratio, 4), "pairs": s.pairs, "pairs_ordered": s.pairs_ordered}


def _id_ranges(ids: list[str]) -> str:
    """Row ids, those sharing a table prefix written once: ``fms-a100_80gb-r008,r010``."""
    out: dict[str, list[str]] = {}
    for i in ids:
        head, _, tail = i.rpartition("-")
        out.setdefault(head, []).append(tail)
    return "; ".join(f"{head}-{','.join(tails)}" for head, tails in out.items()) or "-"
