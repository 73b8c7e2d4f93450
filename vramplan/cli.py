"""The ``vramplan`` command line: a click group whose commands share one set of setup options.

Import cost matters (``vramplan estimate`` should answer in well under 0.3 s): this module imports
only click and vramplan's torch-free modules at the top; rich is imported by the printing
functions and torch only inside ``vramplan trace``. ``tests/test_imports.py`` holds that line.

Errors a user can fix (``SpecError``, unreadable files, bad sizes) print one line,
``error: <message>``, on stderr and exit 2, as click's own usage errors do; warnings print
``warning: <message>`` on stderr and leave the exit code alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Any, Callable

import click

from .specs import (ATTENTIONS, FSDP_MODES, LOSSES, METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, QUANTS, Setup,
                    SpecError)

_DEFAULT = Setup()

# ----------------------------------------------------------------------------------------------
# Errors and warnings


def _fail(message: str) -> None:
    """Print ``error: message`` as one line on stderr and exit 2."""
    line = " ".join(str(message).split()) or "invalid input"
    click.echo(f"error: {line}", err=True)
    raise SystemExit(2)


def _warn(message: str) -> None:
    click.echo(f"warning: {' '.join(str(message).split())}", err=True)


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (e.g. under a test runner)
        pass


def _user_errors(fn: Callable) -> Callable:
    """Turn the errors a user can act on into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecError as exc:
            _fail(str(exc))
        except BrokenPipeError:
            # stdout closed early (`vramplan models | head`): not an error of the user's input
            _silence_stdout()
            raise SystemExit(1) from None
        except OSError as exc:
            where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            _fail(f"{where}{exc.strerror or exc}")

    return wrapper


# ----------------------------------------------------------------------------------------------
# Setup options: defined once, shared by every command that takes a setup

#: Setup field -> the option that sets it, so validation messages name what the user typed.
_FLAG = {
    "method": "--method", "lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha",
    "lora_dropout": "--lora-dropout", "lora_targets": "--lora-targets", "quant": "--quant",
    "double_quant": "--double-quant", "quant_bits": "--quant-bits", "quant_group_size": "--quant-group-size",
    "precision": "--precision", "optimizer": "--optimizer",
    "checkpointing": "--checkpointing", "attn": "--attn", "batch": "--batch", "seq": "--seq",
    "grad_accum": "--grad-accum", "zero_stage": "--zero", "offload_optimizer": "--offload-optimizer",
    "offload_params": "--offload-params", "gpus": "--gpus", "loss": "--loss", "pad_mask": "--pad-mask",
    "fsdp": "--fsdp",
}

_SETUP_OPTIONS = [
    click.option("--method", type=click.Choice(METHODS), default=_DEFAULT.method, show_default=True,
                 help="Full fine-tuning, LoRA adapters, or LoRA on a 4-bit base."),
    click.option("--lora-rank", type=int, default=_DEFAULT.lora_rank, show_default=True, help="LoRA rank r."),
    click.option("--lora-alpha", type=int, default=None, help="LoRA alpha  [default: 2 x rank]"),
    click.option("--lora-dropout", type=float, default=_DEFAULT.lora_dropout, show_default=True),
    click.option("--lora-targets", default=_DEFAULT.lora_targets, show_default=True,
                 help="'all-linear' or comma-separated module names (q_proj,v_proj)."),
    click.option("--quant", type=click.Choice(QUANTS), default=_DEFAULT.quant, show_default=True,
                 help="Base-weight quantization (qlora implies nf4; gptq/awq: a pre-quantized checkpoint, "
                      "--method lora)."),
    click.option("--quant-bits", type=int, default=_DEFAULT.quant_bits, show_default=True,
                 help="GPTQ/AWQ bits per weight (gptq: 2, 3, 4, 8; awq: 4)."),
    click.option("--quant-group-size", type=int, default=_DEFAULT.quant_group_size, show_default=True,
                 help="GPTQ/AWQ input channels per scale group (-1: per output channel)."),
    click.option("--double-quant/--no-double-quant", default=_DEFAULT.double_quant, show_default=True,
                 help="Quantize the 4-bit scales too (bitsandbytes bnb_4bit_use_double_quant)."),
    click.option("--precision", type=click.Choice(PRECISIONS), default=_DEFAULT.precision, show_default=True),
    click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=_DEFAULT.optimizer, show_default=True),
    click.option("--checkpointing/--no-checkpointing", default=_DEFAULT.checkpointing, show_default=True,
                 help="HF gradient checkpointing (use_reentrant=False)."),
    click.option("--attn", type=click.Choice(ATTENTIONS), default=_DEFAULT.attn, show_default=True,
                 help="Attention implementation; auto is what transformers picks for the family."),
    click.option("--batch", type=int, default=_DEFAULT.batch, show_default=True, help="Micro-batch size per GPU."),
    click.option("--seq", type=int, default=_DEFAULT.seq, show_default=True, help="Sequence length in tokens."),
    click.option("--grad-accum", type=int, default=_DEFAULT.grad_accum, show_default=True,
                 help="Gradient accumulation steps."),
    click.option("--zero", "zero_stage", type=click.Choice(["0", "1", "2", "3"]), default=str(_DEFAULT.zero_stage),
                 show_default=True, help="DeepSpeed ZeRO stage."),
    click.option("--offload-optimizer", type=click.Choice(OFFLOADS), default=_DEFAULT.offload_optimizer,
                 show_default=True, help="ZeRO optimizer offload (needs --zero 1/2/3)."),
    click.option("--offload-params", type=click.Choice(OFFLOADS), default=_DEFAULT.offload_params,
                 show_default=True, help="ZeRO parameter offload (needs --zero 3); with --fsdp, FSDP's CPU offload."),
    click.option("--fsdp", type=click.Choice(FSDP_MODES), default=_DEFAULT.fsdp, show_default=True,
                 help="PyTorch FSDP sharding (accelerate's FSDP1) instead of ZeRO."),
    click.option("--gpus", type=int, default=_DEFAULT.gpus, show_default=True, help="Number of GPUs (data parallel)."),
    click.option("--loss", type=click.Choice(LOSSES), default=_DEFAULT.loss, show_default=True,
                 help="hf: logits then cross-entropy; chunked: the head and loss per 1024-token chunk."),
    click.option("--pad-mask/--no-pad-mask", default=_DEFAULT.pad_mask, show_default=True,
                 help="Batches carry a padded attention_mask (SDPA gets an explicit mask)."),
]
_SETUP_FIELDS = {f.name for f in dataclasses.fields(Setup)}


def setup_options(fn: Callable) -> Callable:
    """Add every setup option to a command; the command receives them as one ``setup`` (a Setup)."""

    @functools.wraps(fn)
    @_user_errors
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {k: kwargs.pop(k) for k in list(kwargs) if k in _SETUP_FIELDS}
        values["zero_stage"] = int(values["zero_stage"])
        kwargs["setup"] = make_setup(values)
        _warn_unused(values)
        return fn(*args, **kwargs)

    for option in reversed(_SETUP_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


def make_setup(values: dict) -> Setup:
    """A Setup from option values; its validation messages name the flags the user typed."""
    try:
        return Setup(**values)
    except SpecError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field in _FLAG:
            message = _FLAG[field] + message[len(field):]
        raise SpecError(message) from None


def _warn_unused(values: dict) -> None:
    """Warn about LoRA options given with --method full (they would be silently ignored)."""
    ctx = click.get_current_context()
    if values["method"] != "full":
        return
    given = [
        _FLAG[k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
        if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        _warn(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with --method full")


def _gpu_from(gpu_name: str | None, gpu_memory: str | None):
    from .profiles import load_gpu
    from .specs import GpuSpec
    from .units import parse_bytes

    if gpu_name is not None and gpu_memory is not None:
        raise SpecError("pass --gpu or --gpu-memory, not both")
    if gpu_name is not None:
        return load_gpu(gpu_name)
    if gpu_memory is not None:
        try:
            size = parse_bytes(gpu_memory)
        except (ValueError, OverflowError) as exc:
            raise SpecError(f"--gpu-memory: {exc}" if str(exc) else f"--gpu-memory: cannot read {gpu_memory!r}") from None
        return GpuSpec.custom(size)
    return None


def _load(model_name: str, setup: Setup, gpu=None):
    """Resolve MODEL, check the setup against it, print warnings; return the ModelSpec."""
    from .checks import check
    from .profiles import load_model

    model = load_model(model_name)
    for w in check(model, setup, gpu):
        _warn(w)
    return model


# ----------------------------------------------------------------------------------------------
# Printing


def _gib(n: float) -> str:
    return f"{n / 1024**3:,.2f}"


def describe(setup: Setup) -> str:
    """One line naming the setup: method, precision, optimizer, shape, memory savers."""
    parts = [setup.method]
    if setup.adapters:
        parts[0] += f" r={setup.lora_rank} alpha={setup.alpha}"
        if setup.lora_targets != "all-linear":
            parts[0] += f" on {setup.lora_targets}"
    if setup.quant != "none":
        parts.append(f"{setup.quant} base" + (" (double quant)" if setup.double_quant and setup.quant in ("nf4", "fp4") else "")
                     + (f" ({setup.quant_bits}-bit, group {setup.quant_group_size})" if setup.quant in ("gptq", "awq") else ""))
    parts += [setup.precision, setup.optimizer, f"batch {setup.batch} x seq {setup.seq}"]
    if setup.grad_accum > 1:
        parts.append(f"grad accum {setup.grad_accum}")
    parts.append("checkpointing" if setup.checkpointing else "no checkpointing")
    if setup.attn != "auto":
        parts.append(f"attn {setup.attn}")
    if setup.pad_mask:
        parts.append("padding mask")
    if setup.loss != "hf":
        parts.append(f"{setup.loss} loss")
    if setup.gpus > 1:
        parts.append(f"{setup.gpus} GPUs")
    if setup.zero_stage:
        parts.append(f"ZeRO-{setup.zero_stage}")
    if setup.fsdp != "none":
        parts.append(f"FSDP {setup.fsdp.upper()}")
    if setup.offload_optimizer != "none":
        parts.append(f"optimizer offload to {setup.offload_optimizer}")
    if setup.offload_params != "none":
        parts.append(f"param offload to {setup.offload_params}")
    return " · ".join(parts)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


_SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def print_breakdown(bd) -> None:
    """The human-readable report of one Breakdown: components, peak phase, headline numbers, fit."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]{bd.model}[/] · {bd.tier}")
    console.print(describe(bd.setup))
    console.print(f"params: {_params(bd.params_total)} total, {_params(bd.params_trainable)} trainable")

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
        table.add_row(name, _gib(c.bytes), phases, c.note, style=style)
    console.print(table)

    peaks = " · ".join(f"{ph} {_gib(b)}" for ph, b in bd.phase_peaks_bytes.items())
    console.print(f"peak phase: [bold]{bd.phase}[/] ({peaks} GiB)")
    head = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    head.add_column()
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_row("tensor peak", f"{_gib(bd.tensor_peak_bytes)} GiB", "live tensors at the peak")
    head.add_row("peak allocated", f"{_gib(bd.peak_allocated_bytes)} GiB", "torch.cuda.max_memory_allocated")
    head.add_row("peak reserved", f"{_gib(bd.peak_reserved_bytes)} GiB", "torch.cuda.max_memory_reserved")
    head.add_row("device total", f"{_gib(bd.device_total_bytes)} GiB", "nvidia-smi; judged for fit")
    if bd.host_bytes:
        head.add_row("host RAM", f"{_gib(bd.host_bytes)} GiB", "offloaded state")
    console.print(head)
    if bd.error_band is not None:
        console.print(f"error band: ±{bd.error_band:.0%}")
    for note in bd.notes:
        console.print(f"[dim]note: {note}[/]")

    if bd.gpu is None:
        console.print("no GPU given: pass --gpu NAME or --gpu-memory 24GiB to check the fit")
    elif bd.fits:
        console.print(f"[bold green]fits[/] on {bd.gpu.display_name} ({_gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{_gib(bd.headroom_bytes)} GiB headroom")
    else:
        console.print(f"[bold red]does not fit[/] on {bd.gpu.display_name} ({_gib(bd.gpu.usable_memory_bytes)} GiB usable): "
                      f"{_gib(-bd.headroom_bytes)} GiB short")


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


# ----------------------------------------------------------------------------------------------
# Commands


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vramplan", prog_name="vramplan")
def main() -> None:
    """Will it fit? GPU memory of one LLM fine-tuning step, before you rent the GPU.

    MODEL is a shipped name or alias (`vramplan models`), a Hugging Face id, a config.json, or a
    directory holding one.
    """


_gpu_options = [
    click.option("--gpu", "gpu_name", metavar="NAME", help="A shipped GPU (`vramplan gpus`), e.g. rtx-4090, a100-80gb."),
    click.option("--gpu-memory", metavar="SIZE", help="Any GPU by its usable memory, e.g. 24GiB or 80GB."),
]


def gpu_options(fn: Callable) -> Callable:
    for option in reversed(_gpu_options):
        fn = option(fn)
    return fn


@main.command()
@click.argument("model")
@setup_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the Breakdown as one JSON object.")
@_user_errors
def estimate(model: str, setup: Setup, gpu_name: str | None, gpu_memory: str | None, as_json: bool) -> None:
    """Analytic memory estimate of one training step of MODEL (no torch, milliseconds)."""
    from .estimator import estimate as run_estimate

    gpu = _gpu_from(gpu_name, gpu_memory)
    spec = _load(model, setup, gpu)
    bd = run_estimate(spec, setup, gpu)
    _print_json(bd.to_json()) if as_json else print_breakdown(bd)


@main.command()
@click.argument("model")
@setup_options
@gpu_options
@click.option("--json", "as_json", is_flag=True, help="Print the Breakdown as one JSON object.")
@_user_errors
def trace(model: str, setup: Setup, gpu_name: str | None, gpu_memory: str | None, as_json: bool) -> None:
    """Peak of live tensors when the real transformers/peft step runs on fake tensors (needs torch)."""
    gpu = _gpu_from(gpu_name, gpu_memory)
    spec = _load(model, setup, gpu)
    _quiet_libraries()
    from .tracer import trace as run_trace  # imports torch: only here

    bd = run_trace(spec, setup, gpu=gpu)
    _print_json(bd.to_json()) if as_json else print_breakdown(bd)


def _quiet_libraries() -> None:
    """Keep the libraries the tracer drives from printing to stderr: their deprecation warnings
    and bitsandbytes' note about optional CPU kernels are about their code, not the user's setup."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|peft)\.")
    for name in ("bitsandbytes", "transformers", "peft", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@_user_errors
def models(as_json: bool) -> None:
    """The shipped model profiles, with their aliases and parameter counts."""
    from .profiles import load_model, shipped_models

    rows = []
    for hf_id, aliases in sorted(shipped_models().items(), key=lambda kv: kv[0].lower()):
        spec = load_model(hf_id)
        rows.append({"hf_id": hf_id, "aliases": list(aliases), "model_type": spec.model_type,
                     "params_total": spec.params_total})
    if as_json:
        _print_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False)
    for col, kw in (("HF id", {}), ("aliases", {}), ("model_type", {}), ("params (B)", {"justify": "right"})):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(r["hf_id"], ", ".join(r["aliases"]), r["model_type"], f"{r['params_total'] / 1e9:.2f}")
    Console(highlight=False).print(table)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@_user_errors
def gpus(as_json: bool) -> None:
    """The shipped GPU profiles: usable memory, bf16 support, speed."""
    from .profiles import gpus as shipped_gpus

    specs = sorted(shipped_gpus(), key=lambda g: (g.usable_memory_bytes, g.name))
    if as_json:
        _print_json([{**dataclasses.asdict(g), "aliases": list(g.aliases)} for g in specs])
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
            g.name, g.display_name, _gib(g.usable_memory_bytes), "yes" if g.bf16 else "no",
            f"{tflops:g}" if tflops else "-", f"{g.memory_bandwidth_gbps:g}" if g.memory_bandwidth_gbps else "-",
        )
    console = Console(highlight=False)
    console.print(table)
    console.print("[dim]TFLOP/s: dense bf16 (fp16 where the GPU has no bf16); GB/s: memory bandwidth[/]")


# Commands defined in vramplan/commands/ register themselves on `main` when imported.
from .commands import check as _check_cmd  # noqa: E402,F401
from .commands import emit as _emit_cmd  # noqa: E402,F401
from .commands import measure as _measure_cmd  # noqa: E402,F401
from .commands import plan as _plan_cmd  # noqa: E402,F401
from .commands import validate as _validate_cmd  # noqa: E402,F401


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
