"""What the commands share: one-line errors and warnings, the setup and GPU options, JSON output.

Errors a user can fix (``SpecError``, unreadable files, bad sizes) print one line,
``error: <message>``, on stderr and exit 2, as click's own usage errors do; warnings print
``warning: <message>`` on stderr and leave the exit code alone.

The setup options are defined once, in :data:`SETUP_OPTIONS` (commands/setup_options.py):
:func:`setup_options` adds them all to a command as settings with the canonical step's defaults
(``estimate``, ``trace``, ``measure``), :func:`knob_options` adds a chosen few as knobs that default to None (``plan``
searches the ones not given). Light at import: click and vramplan's torch-free modules only.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Collection, Iterable
from typing import Any

import click

from ..setup.frameworks import with_framework_defaults
from ..specs import Setup, SpecError
from .setup_options import BY_FIELD, FLAG, LORA_FIELDS, SETUP_FIELDS, SETUP_OPTIONS, Count, SetupOption

__all__ = ["FLAG", "Count", "LORA_FIELDS", "SETUP_FIELDS", "SETUP_OPTIONS", "SetupOption", "calibration_options",
           "corrections_for", "fail", "given_fields", "gpu_options", "knob_options", "load_model_checked",
           "make_setup", "print_json", "quiet_libraries", "setting_option", "setup_options", "silence_stdout",
           "stack_for", "transformers_option", "usage_line", "user_errors", "warn", "warn_lora_unused"]

# ----------------------------------------------------------------------------------------------
# Errors and warnings


def fail(message: str) -> None:
    """Print ``error: message`` as one line on stderr and exit 2."""
    line = " ".join(str(message).split()) or "invalid input"
    click.echo(f"error: {line}", err=True)
    raise SystemExit(2)


def warn(message: str) -> None:
    """Print ``warning: message`` as one line on stderr."""
    click.echo(f"warning: {' '.join(str(message).split())}", err=True)


def usage_line(exc: click.ClickException) -> str:
    """A click usage error (a missing argument, an unknown option, a bad choice) as the one
    ``error:`` line every other input error is, naming the command's ``--help``."""
    message = " ".join(exc.format_message().split()) or "invalid usage"
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None and isinstance(exc, click.UsageError) else ""
    return f"error: {message}{hint}"


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit after a closed pipe stays quiet."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (e.g. under a test runner)
        pass


def user_errors(fn: Callable) -> Callable:
    """Turn the errors a user can act on into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpecError as exc:
            fail(str(exc))
        except BrokenPipeError:
            # stdout closed early (`vramplan models | head`): the reader has what it wanted
            silence_stdout()
            raise SystemExit(0) from None
        except OSError as exc:
            where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
            fail(f"{where}{exc.strerror or exc}")

    return wrapper


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout."""
    click.echo(json.dumps(obj, indent=2))


def quiet_libraries() -> None:
    """Keep the libraries the tracer drives from printing to stderr: their deprecation warnings
    and bitsandbytes' note about optional CPU kernels are about their code, not the user's setup."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|peft)\.")
    for name in ("bitsandbytes", "transformers", "peft", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def setup_options(fn: Callable) -> Callable:
    """Add every setup option to a command; the command receives them as one ``setup`` (a Setup)."""

    @functools.wraps(fn)
    @user_errors
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        values = {k: kwargs.pop(k) for k in list(kwargs) if k in SETUP_FIELDS}
        values = with_framework_defaults(values, given_fields(["loss"]))
        kwargs["setup"] = make_setup(values)
        warn_lora_unused(values["method"], given_fields(LORA_FIELDS))
        return fn(*args, **kwargs)

    for option in reversed(SETUP_OPTIONS):
        wrapper = option.setting()(wrapper)
    return wrapper


def setting_option(field: str, help_text: str | None = None) -> Callable:
    """The one setup option of ``field`` as a setting with the canonical default (``--help``
    says ``help_text`` when given)."""
    return BY_FIELD[field].setting(help_text)


def knob_options(helps: dict[str, str | None]) -> Callable:
    """Add the setup options named by ``helps`` (field -> help, in ``--help`` order) as knobs:
    None when not given. ``vramplan plan`` fixes the knobs given and searches the others."""

    def decorate(fn: Callable) -> Callable:
        for field, help_text in reversed(helps.items()):
            fn = BY_FIELD[field].knob(help_text)(fn)
        return fn

    return decorate


def make_setup(values: dict) -> Setup:
    """A Setup from option values; its validation messages name the flags the user typed."""
    try:
        return Setup(**values)
    except SpecError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field in FLAG:
            message = FLAG[field] + message[len(field):]
        raise SpecError(message) from None


def given_fields(fields: Iterable[str]) -> list[str]:
    """Those of ``fields`` (option names) the user typed on the command line."""
    ctx = click.get_current_context()
    return [k for k in fields if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE]


def prequantized_knobs(model: str, given: dict) -> dict:
    """The knobs a pre-quantized upload's name implies (model/profiles.py ``prequantized``) that ``given`` (the
    Setup fields the user set) does not set, after the inference note is printed; a setup that cannot train
    such a checkpoint (full fine-tuning, another base quantization) is one error line."""
    from ..model.profiles import model_note, model_warning, prequantized

    knobs = prequantized(model)
    stored = f"{model} stores {knobs.get('quant')} weights"
    if knobs and given.get("method") == "full":
        raise SpecError(f"{stored}: transformers trains adapters on a quantized checkpoint, not its weights "
                        f"(full fine-tuning refused); use --method {knobs['method']}, or the 16-bit base model")
    if knobs and given.get("quant") not in (None, knobs["quant"]):
        raise SpecError(f"{stored}: --quant {given['quant']} cannot load it; use --quant {knobs['quant']}, "
                        "or the 16-bit base model")
    for note in (model_note(model), model_warning(model)):  # (after the refusals: an error is the one line printed)
        if note:
            warn(note)
    return {k: v for k, v in knobs.items() if k not in given}


def warn_lora_unused(method: str | None, given: Collection[str]) -> None:
    """Warn about LoRA options given with --method full (they would be silently ignored)."""
    if method != "full":
        return
    flags = [FLAG[k] for k in LORA_FIELDS if k in given]
    if flags:
        warn(f"{', '.join(flags)} {'has' if len(flags) == 1 else 'have'} no effect with --method full")


# ----------------------------------------------------------------------------------------------
# GPU options and the model

def _gpu_alias(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Warn when ``--gpu`` is an alias of several cards (``a100``): it names the card chosen."""
    if value:
        from ..setup.inputs import ambiguous_gpu_alias

        found = ambiguous_gpu_alias(value)
        if found:
            chosen, others = found
            warn(f"--gpu {value} could mean {', '.join([chosen, *others])}; using {chosen} (pass its full name "
                 "to choose)")
    return value


_GPU_OPTIONS = (
    click.option("--gpu", "gpu_name", metavar="NAME", callback=_gpu_alias,
                 help="A shipped GPU (`vramplan gpus`), e.g. rtx-4090, a100-80gb."),
    click.option("--gpu-memory", metavar="SIZE", help="Any GPU by its usable memory, e.g. 24GiB or 80GB."),
)


def gpu_options(fn: Callable) -> Callable:
    """Add ``--gpu NAME`` and ``--gpu-memory SIZE`` (passed as ``gpu_name`` and ``gpu_memory``;
    :func:`vramplan.setup.inputs.resolve_gpu` turns them into a GpuSpec)."""
    for option in reversed(_GPU_OPTIONS):
        fn = option(fn)
    return fn


# ----------------------------------------------------------------------------------------------
# Calibration: estimate, plan and check apply the committed coefficients unless told not to

_CALIBRATION_OPTIONS = (
    click.option("--no-calibration", "no_calibration", is_flag=True,
                 help="The raw model: published device terms instead of the fitted coefficients."),
    click.option("--calibration", "calibration_file", metavar="FILE",
                 help="Coefficients file of `vramplan calibrate`  [default: ./calibration/coefficients.json, "
                      "else the shipped ones]"),
)


def calibration_options(fn: Callable) -> Callable:
    """Add ``--no-calibration`` and ``--calibration FILE`` (passed as ``no_calibration`` and
    ``calibration_file``); :func:`corrections_for` turns them into the estimator's Corrections."""
    for option in reversed(_CALIBRATION_OPTIONS):
        fn = option(fn)
    return fn


def corrections_for(gpu, no_calibration: bool = False, calibration_file: str | None = None):
    """The Corrections the command applies for ``gpu`` (printing the loader's warnings); an
    explicit ``--calibration FILE`` that cannot be read is an error."""
    from ..estimator.corrections import calibration_for

    if no_calibration and calibration_file:
        raise SpecError("pass --calibration FILE or --no-calibration, not both")
    corrections, warnings = calibration_for(gpu, calibration_file, enabled=not no_calibration)
    for w in warnings:
        warn(w)
    return corrections


# ----------------------------------------------------------------------------------------------
# The library stack: ``--transformers VERSION|installed`` of estimate, plan and check (passed as
# ``transformers_version``; :func:`stack_for` turns it into the estimator's Stack, transformers 5 unless given)
transformers_option = click.option(
    "--transformers", "transformers_version", metavar="VERSION",
    help="The transformers version the step runs on: a version (4.48.1) or 'installed' (this machine's). "
         "Where a known boundary moves memory (4.x: per-expert MoE Linears bitsandbytes quantizes, "
         "reentrant checkpointing; 4.46-4.48: a second fp32 logits copy) the estimate follows it "
         "[default: 5, the modelled stack: `vramplan doctor`].")


def stack_for(version: str | None):
    """The ``Stack`` of ``--transformers``: the default (5), a version, or the installed one."""
    from ..estimator.stack import DEFAULT_STACK, transformers_stack

    if version is None:
        return DEFAULT_STACK
    try:
        return transformers_stack(version)
    except ValueError as exc:
        raise SpecError(f"--transformers: {exc}") from None


def load_model_checked(model_name: str, setup: Setup, gpu=None):
    """Resolve MODEL, check the setup against it and the GPU, print the warnings; return the ModelSpec."""
    from ..model.profiles import load_model
    from ..setup.checks import check

    model = load_model(model_name)
    for w in check(model, setup, gpu):
        warn(w)
    return model
