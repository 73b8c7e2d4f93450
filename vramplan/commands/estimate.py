"""`vramplan estimate`: the analytic memory of one training step, and the table that prints a Breakdown.

No torch, milliseconds: the estimator is :func:`vramplan.estimator.estimate`; this module prints.
"""

from __future__ import annotations

import click

from ..setup.wording import describe, params
from ..specs import Setup, SpecError
from ..util.units import gib
from .from_config import config_options, is_config_file, setup_from_config
from .options import (
    calibration_options,
    corrections_for,
    given_fields,
    gpu_options,
    prequantized_knobs,
    print_json,
    setup_options,
    stack_for,
    transformers_option,
    user_errors,
    warn,
)


@click.command()
@click.argument("model")
@setup_options
@gpu_options
@calibration_options
@config_options
@transformers_option
@click.option("--json", "as_json", is_flag=True, help="Print the Breakdown as one JSON object.")
@user_errors
def estimate(model: str, setup: Setup, gpu_name: str | None, gpu_memory: str | None, no_calibration: bool,
             calibration_file: str | None, config_format: str | None, model_override: str | None,
             accelerate_file: str | None, transformers_version: str | None, as_json: bool) -> None:
    """Analytic memory estimate of one training step of MODEL (no torch, milliseconds).

    The device terms are the committed calibration (docs/commands/estimate.md); --no-calibration
    shows the raw model. MODEL may be a training config (axolotl, LLaMA-Factory, TRL, torchtune,
    HF TrainingArguments, accelerate, DeepSpeed: docs/formats/); setup flags given override it."""
    from ..estimator import estimate as run_estimate
    from ..estimator.corrections import uncalibrated_reason
    from ..model.profiles import load_model, unsloth_checkpoint_note
    from ..setup.inputs import resolve_gpu

    if is_config_file(model, config_format):
        model, setup = setup_from_config(model, config_format, model_override, setup, accelerate_file)
    elif model_override or accelerate_file:
        raise SpecError("--model and --accelerate-config go with a training config (MODEL is not one)")
    else:  # a re-upload or pre-quantized upload: the note, and the quantization its name says unless given
        given = {k: getattr(setup, k) for k in given_fields(["method", "quant", "quant_bits"])}
        setup = setup.replace(**prequantized_knobs(model, given))
    gpu = resolve_gpu(gpu_name, gpu_memory)
    corrections = corrections_for(gpu, no_calibration, calibration_file)
    stack = stack_for(transformers_version)
    bd = run_estimate(load_model(model), setup, gpu, corrections, stack)  # checks the setup against the model, GPU
    checkpoint = unsloth_checkpoint_note(model) if (bd.setup.framework, bd.setup.quant) == ("unsloth", "nf4") else ""
    for note in (*bd.notes, checkpoint) if checkpoint else bd.notes:  # the analytic tier's notes: the check's warnings
        warn(note)
    if as_json:
        data = bd.to_json()
        if checkpoint:
            data["notes"] = [*data["notes"], checkpoint]
        if bd.setup.pp > 1 and bd.per_rank:  # pipeline parallelism: the stage the headline numbers are
            data["fullest_stage"] = max(bd.per_rank, key=lambda r: (r.device_total_bytes, -r.rank)).rank
        if not stack.is_default:  # the stack the numbers follow, not the default one
            data["modelled_versions"] = {**data["modelled_versions"], "transformers": stack.transformers}
        print_json(data)
    else:
        print_breakdown(bd, uncalibrated_reason(gpu, calibration_file, not no_calibration))


_SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def print_breakdown(bd, uncalibrated: str = "") -> None:
    """The human-readable report of one Breakdown: components, peak phase, headline numbers, fit
    (``uncalibrated``: why no calibration applies, for the calibration line)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]{escape(bd.model)}[/] · {bd.tier}")
    console.print(describe(bd.setup))
    console.print(f"params: {params(bd.params_total)} total, {params(bd.params_trainable)} trainable")

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("phases")
    table.add_column("note", overflow="fold")
    for c in bd.components:
        name = c.name if c.where == "gpu" else f"{c.name} ({c.where})"
        phases = ("all" if set(c.phases) >= {"forward", "backward", "optimizer"}
                  else " ".join(_SHORT_PHASE.get(p, p) for p in c.phases))
        # terms not live in the peak phase are dimmed: they do not add to the peak
        style = None if bd.phase in c.phases or c.where != "gpu" else "dim"
        table.add_row(escape(name), gib(c.bytes), phases, escape(c.note), style=style)
    console.print(table)

    peaks = " · ".join(f"{ph} {gib(b)}" for ph, b in bd.phase_peaks_bytes.items())
    console.print(f"peak phase: [bold]{bd.phase}[/] ({peaks} GiB)")
    head = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    head.add_column()
    head.add_column(justify="right")
    head.add_column(justify="right")
    head.add_column(style="dim")
    for label, key, what in (("tensor peak", "tensor_peak_bytes", "live tensors at the peak"),
                             ("peak allocated", "peak_allocated_bytes", "torch.cuda.max_memory_allocated"),
                             ("peak reserved", "peak_reserved_bytes", "torch.cuda.max_memory_reserved"),
                             ("device total", "device_total_bytes", "nvidia-smi; judged for fit")):
        head.add_row(label, f"{gib(getattr(bd, key))} GiB", band_text(bd, key), what)
    if bd.host_bytes:
        head.add_row("host RAM", f"{gib(bd.host_bytes)} GiB", "", "offloaded state, pinned buffers")
    if bd.component("nvme_offload"):
        head.add_row("NVMe", f"{gib(bd.component('nvme_offload'))} GiB", "", "state ZeRO-Infinity swaps to the drive")
    console.print(head)
    if bd.per_rank:
        ranks = Table(show_edge=False, pad_edge=False)
        unit = "stage" if bd.setup.pp > 1 else "GPU"  # pipeline parallelism: one stage per GPU
        for col in (unit, "layers", "tensor peak", "allocated", "reserved", "device total", "peak phase"):
            ranks.add_column(col, justify="left" if col in (unit, "layers", "peak phase") else "right")
        for r in bd.per_rank:
            layers = f"{r.layers[0]}-{r.layers[-1]} ({len(r.layers)})" if r.layers else "none"
            ranks.add_row(str(r.rank), layers, gib(r.tensor_peak_bytes), gib(r.peak_allocated_bytes),
                          gib(r.peak_reserved_bytes), gib(r.device_total_bytes), r.phase)
        fullest = max(bd.per_rank, key=lambda r: (r.device_total_bytes, -r.rank)).rank
        console.print(f"per {unit} (GiB; the headline numbers are the fullest {unit}'s, {unit} {fullest}):"
                      if unit == "stage" else "per GPU (GiB; the headline numbers are the fullest GPU's):")
        console.print(ranks)
    console.print(f"[dim]{escape(calibration_line(bd, uncalibrated))}[/]")
    if bd.tier == "analytic":
        from ..util.versions import MODELLED

        libs = ", ".join(f"{k} {v}" for k, v in MODELLED.items())
        console.print(f"[dim]models: {libs} (vramplan doctor compares this machine's)[/]")
    for note in bd.notes:
        console.print(f"[dim]note: {escape(note)}[/]")

    if bd.gpu is None:
        console.print("no GPU given: pass --gpu NAME or --gpu-memory 24GiB to check the fit")
    elif bd.fits:
        console.print(f"[bold green]fits[/] on {escape(bd.gpu.display_name)} "
                      f"({gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{gib(bd.headroom_bytes)} GiB headroom")
    else:
        console.print(f"[bold red]does not fit[/] on {escape(bd.gpu.display_name)} "
                      f"({gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{gib(-bd.headroom_bytes)} GiB short")


def band_text(bd, key: str) -> str:
    """``band 7.1-8.3`` (GiB): the error band of one headline number ("" when none is attached)."""
    band = getattr(bd.error_band, key, None) if bd.error_band is not None else None
    if band is None:
        return ""
    lo, hi = band.bounds(getattr(bd, key))
    return f"band {gib(lo)}-{gib(hi)}"


def calibration_line(bd, why: str = "") -> str:
    """One line: which calibration the numbers carry, or that they are the raw model (and ``why``,
    estimator/corrections.py ``uncalibrated_reason``)."""
    c = bd.calibration
    dev = bd.error_band.device_total_bytes if bd.error_band is not None else None
    band = f"; device total band {dev.low:+.0%}/{dev.high:+.0%} ({dev.basis})" if dev is not None else ""
    if c is None:
        return f"calibration: none ({why + ': ' if why else ''}published device terms, the raw model){band}"
    where = "" if c.gpu_class_match else ", not fitted on this GPU's class"
    return (f"calibration: {c.group} ({c.source}{where}): fitted {', '.join(c.fitted) or 'nothing'} "
            f"on {c.fitted_on}; quoted {', '.join(c.quoted) or 'nothing'}{band}")
