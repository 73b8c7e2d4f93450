"""`vramplan gpus`: the shipped GPU profiles."""

from __future__ import annotations

import dataclasses

import click

from ..util.units import gib
from .options import print_json, user_errors


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@user_errors
def gpus(as_json: bool) -> None:
    """The shipped GPU profiles: usable memory, bf16 support, speed."""
    from ..model.profiles import gpus as shipped_gpus

    specs = sorted(shipped_gpus(), key=lambda g: (g.usable_memory_bytes, g.name))
    if as_json:
        print_json([{**dataclasses.asdict(g), "aliases": list(g.aliases)} for g in specs])
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("name")
    table.add_column("display name", overflow="fold")
    table.add_column("usable GiB", justify="right")
    table.add_column("bf16")
    table.add_column("TFLOP/s", justify="right")
    table.add_column("GB/s", justify="right")
    for g in specs:
        tflops = g.bf16_tflops_dense if g.bf16 and g.bf16_tflops_dense else g.fp16_tflops_dense
        table.add_row(
            g.name, g.display_name, gib(g.usable_memory_bytes), "yes" if g.bf16 else "no",
            f"{tflops:g}" if tflops else "-", f"{g.memory_bandwidth_gbps:g}" if g.memory_bandwidth_gbps else "-",
        )
    console = Console(highlight=False)
    console.print(table)
    console.print("[dim]TFLOP/s: dense bf16 (fp16 where the GPU has no bf16); GB/s: memory bandwidth[/]")
