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

__all__ = ["FORMAT_NAMES", "config_options", "is_config_file", "setup_from_config"]

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


def is_config_file(name: str, config_format: str | None) -> bool:
    """Whether MODEL names a training config: forced by --format, any YAML file, or a JSON file
    that is not a model's config.json and reads as one of the formats."""
    if config_format is not None:
        return True
    if not os.path.isfile(name) or os.path.basename(name) == "config.json":
        return False
    if name.lower().endswith((".yaml", ".yml")):  # a model is a config.json: YAML is a training config
        return True
    from ..inputs import load_structured
    from ..readers import detect

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
