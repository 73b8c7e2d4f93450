"""`vramplan trace`: the peak of live tensors when the real transformers/peft step runs on fake
tensors. Only the command's body imports torch (through :mod:`vramplan.run.tracer`)."""

from __future__ import annotations

import click

from ..specs import Setup
from .estimate import print_breakdown
from .options import (
    gpu_options,
    load_model_checked,
    print_json,
    quiet_libraries,
    setup_options,
    user_errors,
)


@click.command()
@click.argument("model")
@setup_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the Breakdown as one JSON object.")
@user_errors
def trace(model: str, setup: Setup, gpu_name: str | None, gpu_memory: str | None, as_json: bool) -> None:
    """Peak of live tensors when the real transformers/peft step runs on fake tensors (needs torch)."""
    from ..setup.inputs import resolve_gpu

    gpu = resolve_gpu(gpu_name, gpu_memory)
    spec = load_model_checked(model, setup, gpu)
    quiet_libraries()
    from ..run.tracer import trace as run_trace  # imports torch: only here

    bd = run_trace(spec, setup, gpu=gpu)
    print_json(bd.to_json()) if as_json else print_breakdown(bd)
