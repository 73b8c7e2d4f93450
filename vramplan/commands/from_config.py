"""Training configs on the command line: ``vramplan estimate FILE`` and ``plan --from FILE``.

:func:`config_options` adds ``--format``, ``--model`` and ``--accelerate-config``;
:func:`setup_from_config` reads the file (:func:`vramplan.readers.read_config`), prints its
warnings, and lays the setup flags typed on the command line over the file's setup (a flag
given wins). Light at import: click only; the readers (and yaml) load when a file is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import click

from ..specs import Setup, SpecError
from .options import SETUP_FIELDS, given_fields, make_setup, warn

__all__ = ["FORMAT_NAMES", "config_options", "from_options", "is_config_file", "plan_source", "print_as_written",
           "print_changes", "setup_from_config"]

#: vramplan.readers.FORMATS' names (kept here so that --help needs no reader import)
FORMAT_NAMES = ("axolotl", "llamafactory", "trl", "torchtune", "hf", "accelerate", "deepspeed")

_OPTIONS = (
    click.option("--format", "config_format", type=click.Choice(FORMAT_NAMES), default=None,
                 help="Read MODEL as a training config of this format  [default: detected]"),
    click.option("--model", "model_override", metavar="MODEL", default=None,
                 help="With a training config: the model to estimate instead of the one it names."),
    click.option("--accelerate-config", "accelerate_file", metavar="FILE", default=None,
                 help="With a training config: the accelerate config YAML it is launched with."),
)


def config_options(fn: Callable) -> Callable:
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


_FROM_OPTIONS = (
    click.option("--from", "from_file", metavar="FILE", default=None,
                 help="Plan from a training config (axolotl, LLaMA-Factory, TRL, torchtune, HF TrainingArguments): "
                      "its setup is estimated as written, and the plan keeps its model, GPU count, sequence length, "
                      "global batch and quality choices (docs/commands/plan.md); MODEL, if given, replaces its "
                      "model."),
    _OPTIONS[0],
    _OPTIONS[2],
)


def from_options(fn: Callable) -> Callable:
    """``plan``'s ``--from FILE``, ``--format`` and ``--accelerate-config``."""
    for option in reversed(_FROM_OPTIONS):
        fn = option(fn)
    return fn


def plan_source(path: str, config_format: str | None, model: str | None, accelerate_file: str | None,
                gpus: int | None, gpu=None):
    """(ReadConfig, PlanInputs) of ``plan --from FILE``; prints the reader's warnings. ``model``
    and ``gpus``: MODEL and ``--gpus`` when typed (they win over the file); ``gpu``: the target
    GpuSpec, which settles what the file leaves to the GPU (``bf16: auto``)."""
    from ..readers import plan_inputs, read_config

    read = read_config(path, config_format, accelerate=accelerate_file)
    source = plan_inputs(read, model, gpus, gpu)  # an error (no model) before any warning
    for w in read.warnings:
        if not (w.field == "model" and model) and not (w.field == "gpus" and gpus):
            warn(f"{path}: {w}")
    return read, source


def as_written_json(read, source, bd) -> dict:
    """``from_config`` of ``plan --from FILE --json``: the file, its setup as written and its fit."""
    return {"path": read.path, "format": read.format, "model": source.model, "setup": source.setup.to_dict(),
            "global_batch": source.global_batch, "device_total_bytes": bd.device_total_bytes,
            "usable_bytes": bd.gpu.usable_memory_bytes, "fits": bd.fits}


def print_as_written(read, source, bd) -> None:
    """One line: the file's setup as written and whether it fits the GPU."""
    from ..setup.wording import describe
    from ..util.units import gib

    usable = bd.gpu.usable_memory_bytes
    verdict = (f"fits ({gib(bd.headroom_bytes)} GiB headroom)" if bd.fits
               else f"does not fit ({gib(-bd.headroom_bytes)} GiB short)")
    click.echo(f"{read.path} ({read.format}) as written: {describe(source.setup)}: "
               f"{gib(bd.device_total_bytes)} / {gib(usable)} GiB, {verdict}")


def _shown(value) -> str:
    if isinstance(value, tuple):  # --max-memory's caps, as the flag takes them
        from ..setup.max_memory import caps_text

        return caps_text(value) if value else "none"
    return "on" if value is True else "off" if value is False else str(value)


def print_changes(path: str, changes, fits: bool) -> None:
    """The plan's changes to the file's setup, one flag a line (``--batch 8 -> 2``)."""
    from .options import FLAG

    label = "plan" if fits else "closest"
    if not changes:
        click.echo(f"changes vs {path}: none (the {label} is the file's setup)")
        return
    click.echo(f"changes vs {path} (the {label}):")
    for c in changes:
        click.echo(f"  {FLAG.get(c.field, c.field)}: {_shown(c.file)} -> {_shown(c.plan)}")


def is_config_file(name: str, config_format: str | None) -> bool:
    """Whether MODEL names a training config: forced by --format, any YAML file, or a JSON file
    that is not a model's config.json and reads as one of the formats."""
    if config_format is not None:
        return True
    if not os.path.isfile(name) or os.path.basename(name) == "config.json":
        return False
    if name.lower().endswith((".yaml", ".yml")):  # a model is a config.json: YAML is a training config
        return True
    if name.lower().endswith((".sh", ".bash", ".txt", ".cmd")):  # a `trl sft ...` command line (readers.trl_args)
        return True
    from ..readers import detect
    from ..setup.inputs import load_structured

    try:
        return detect(load_structured(name, "training config")) is not None
    except SpecError:
        return False


def setup_from_config(path: str, config_format: str | None, model_override: str | None, setup: Setup,
                      accelerate_file: str | None = None) -> tuple[str, Setup]:
    """(model, setup) from a training config, with the setup flags typed on the command line
    laid over it; prints the reader's warnings."""
    from ..readers import read_config

    read = read_config(path, config_format, accelerate=accelerate_file)
    model = model_override or read.model
    if model is None:
        raise SpecError(f"{path}: names no model; pass --model NAME")
    for w in read.warnings:
        if not (w.field == "model" and model_override):
            warn(f"{path}: {w}")
    typed = given_fields(sorted(SETUP_FIELDS))
    values = {**read.setup.to_dict(), **{k: getattr(setup, k) for k in typed}}
    return model, make_setup(values)
