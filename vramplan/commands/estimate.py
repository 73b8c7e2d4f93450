"""`vramplan estimate`: the analytic memory of one training step, and the table that prints a Breakdown.

No torch, milliseconds: the estimator is :func:`vramplan.estimator.estimate`; this module prints.
"""

from __future__ import annotations

import click

from ..specs import Setup
from ..units import gib
from ..wording import describe, params
from .options import gpu_options, print_json, setup_options, user_errors, warn


@click.command()
@click.argument("model")
@setup_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the Breakdown as one JSON object.")
@user_errors
def estimate(model: str, setup: Setup, gpu_name: str | None, gpu_memory: str | None, as_json: bool) -> None:
    """Analytic memory estimate of one training step of MODEL (no torch, milliseconds)."""
    from ..estimator import estimate as run_estimate
    from ..inputs import resolve_gpu
    from ..profiles import load_model

    gpu = resolve_gpu(gpu_name, gpu_memory)
    bd = run_estimate(load_model(model), setup, gpu)  # checks the setup against the model and GPU
    for note in bd.notes:  # the analytic tier's notes are the check's warnings
        warn(note)
    print_json(bd.to_json()) if as_json else print_breakdown(bd)


_SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def print_breakdown(bd) -> None:
    """The human-readable report of one Breakdown: components, peak phase, headline numbers, fit."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]{bd.model}[/] · {bd.tier}")
    console.print(describe(bd.setup))
    console.print(f"params: {params(bd.params_total)} total, {params(bd.params_trainable)} trainable")

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("phases")
    table.add_column("note", overflow="fold")
    for c in bd.components:
        name = c.name if c.where == "gpu" else f"{c.name} ({c.where})"
        phases = "all" if set(c.phases) >= {"forward", "backward", "optimizer"} else " ".join(_SHORT_PHASE.get(p, p) for p in c.phases)
        # terms not live in the peak phase are dimmed: they do not add to the peak
        style = None if bd.phase in c.phases or c.where != "gpu" else "dim"
        table.add_row(name, gib(c.bytes), phases, c.note, style=style)
    console.print(table)

    peaks = " · ".join(f"{ph} {gib(b)}" for ph, b in bd.phase_peaks_bytes.items())
    console.print(f"peak phase: [bold]{bd.phase}[/] ({peaks} GiB)")
    head = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    head.add_column()
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_row("tensor peak", f"{gib(bd.tensor_peak_bytes)} GiB", "live tensors at the peak")
    head.add_row("peak allocated", f"{gib(bd.peak_allocated_bytes)} GiB", "torch.cuda.max_memory_allocated")
    head.add_row("peak reserved", f"{gib(bd.peak_reserved_bytes)} GiB", "torch.cuda.max_memory_reserved")
    head.add_row("device total", f"{gib(bd.device_total_bytes)} GiB", "nvidia-smi; judged for fit")
    if bd.host_bytes:
        head.add_row("host RAM", f"{gib(bd.host_bytes)} GiB", "offloaded state")
    console.print(head)
    if bd.error_band is not None:
        console.print(f"error band: ±{bd.error_band:.0%}")
    for note in bd.notes:
        console.print(f"[dim]note: {note}[/]")

    if bd.gpu is None:
        console.print("no GPU given: pass --gpu NAME or --gpu-memory 24GiB to check the fit")
    elif bd.fits:
        console.print(f"[bold green]fits[/] on {bd.gpu.display_name} ({gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{gib(bd.headroom_bytes)} GiB headroom")
    else:
        console.print(f"[bold red]does not fit[/] on {bd.gpu.display_name} ({gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{gib(-bd.headroom_bytes)} GiB short")
