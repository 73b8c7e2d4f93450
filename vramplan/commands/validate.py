"""`vramplan validate`: every knob's estimate against its truth, as an error table.

The matrix lives in :mod:`vramplan.validate`; this module only runs it and prints. A knob that
cannot be verified on this machine is printed as such, with the reason.
"""

from __future__ import annotations

import contextlib
import sys
import time

import click

from ..wording import describe
from .options import print_json, user_errors


@click.command()
@click.option("--quick", is_flag=True, help="The small subset run in CI (one family, a few knobs).")
@click.option("--knob", "knobs", multiple=True, metavar="K",
              help="Only these knobs (repeatable): canonical, quantization, optimizer, precision, attention, "
                   "grad_accum, checkpointing, moe, loss, zero, fsdp, ddp, gptq_awq, device_overheads, measured.")
@click.option("--measurements", default="calibration/measurements", show_default=True, metavar="DIR",
              help="Records of `vramplan measure`/`sweep`: the 'measured' truth column.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable rows and summary.")
@user_errors
def validate(quick: bool, knobs: tuple[str, ...], measurements: str, as_json: bool) -> None:
    """Estimate vs truth (fake-tensor trace, a real CPU run, N DeepSpeed processes, or the recorded
    measurements) for every knob: error per setup, median and worst per knob. The default matrix takes a few minutes; --quick well under one."""
    from ..run.models import require_torch
    from ..specs import SpecError
    from ..validate import KNOBS, matrix, row_json, run_case, summarize, unverified_rows

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
            table.add_row(r.knob, r.model.split("/")[-1], f"[yellow]not verified:[/] {what}{r.why}", r.truth, "-", "-", "-", "-")
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
