"""LLaMA-Factory's ``use_unsloth_gc`` (0.9.5 ``llamafactory/model/model_utils/checkpointing.py``) on this CPU, for
the truth of ``unsloth_gc`` (estimator/unsloth.py ``llamafactory_gc``).

LLaMA-Factory is not installed for this (it pins other library versions): the one file is loaded from its wheel
(:data:`ENV`) and executed as the module it is, its two package imports answered (``extras.logging.get_logger``:
a logger with its ``*_rank0`` methods; ``extras.constants.LAYERNORM_NAMES``, copied from that wheel). Its own
``prepare_model_for_training`` then turns checkpointing on as LLaMA-Factory does (``_gradient_checkpointing_enable``
with ``use_unsloth_gc``: ``UnslothGradientCheckpointing`` wrapped by ``custom_gradient_checkpointing_func``).

One stand-in, :func:`device_copies`: the function's two device moves, ``hidden_states.to("cpu", non_blocking=True)``
in the forward and ``.to("cuda", non_blocking=True)`` in the backward, are a CPU tensor's no-op and a missing
device here; within it each is a copy, the first counted as host memory by a ``SplitCounter`` (run/live.py), the
second as device memory: the two copies a GPU makes. And :func:`bound_layer_calls`, for transformers 5.24's call form
of a checkpointed layer (LLaMA-Factory pins transformers <= 5.8)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import types
from pathlib import Path

from .wheel_files import extracted, installed_modules, wheel_in

__all__ = ["ENV", "VERSION", "bound_layer_calls", "device_copies", "find_wheel", "load"]

#: a LLaMA-Factory wheel (``llamafactory-0.9.5-py3-none-any.whl``)
ENV = "VRAMPLAN_LLAMAFACTORY_WHEEL"
VERSION = "0.9.5"
_MEMBER = "llamafactory/model/model_utils/checkpointing.py"
_NAME = "llamafactory.model.model_utils.checkpointing"
#: llamafactory/extras/constants.py (0.9.5)
LAYERNORM_NAMES = {"norm", "ln"}


def find_wheel() -> Path | None:
    """The LLaMA-Factory wheel :data:`ENV` names, if it holds the checkpointing file; None otherwise."""
    return wheel_in(ENV, (_MEMBER,))


class _Logger(logging.LoggerAdapter):
    """``llamafactory.extras.logging``'s logger: the standard one with its rank-0 methods."""

    def info_rank0(self, *a, **k):
        self.info(*a, **k)

    def warning_rank0(self, *a, **k):
        self.warning(*a, **k)

    warning_rank0_once = warning_rank0


def load(wheel: Path | None = None) -> types.ModuleType:
    """LLaMA-Factory's ``checkpointing`` module (module docstring); FileNotFoundError without the wheel."""
    wheel = wheel or find_wheel()
    root = extracted(str(Path(wheel).resolve()), (_MEMBER,)) if wheel else None
    source = root / _MEMBER if root is not None else None
    if source is None:
        raise FileNotFoundError(f"no {_MEMBER}: set {ENV} to a LLaMA-Factory {VERSION} wheel")
    names = ("llamafactory", "llamafactory.extras", "llamafactory.extras.logging", "llamafactory.extras.constants",
             "llamafactory.model", "llamafactory.model.model_utils", _NAME)
    shims = {name: types.ModuleType(name) for name in names}
    for name in names[:-1]:
        shims[name].__path__ = []
    shims["llamafactory.extras.logging"].get_logger = lambda name=None: _Logger(logging.getLogger(name), {})
    shims["llamafactory.extras.constants"].LAYERNORM_NAMES = LAYERNORM_NAMES
    with installed_modules(shims):
        spec = importlib.util.spec_from_file_location(_NAME, source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def bound_layer_calls(model) -> int:
    """A second stand-in, for the transformers installed here: 5.24's ``GradientCheckpointingLayer`` hands the
    checkpointing function ``partial(forward, self, **kwargs)`` (the plain function), where the transformers
    LLaMA-Factory pins (<= 5.8) hands it ``partial(super().__call__, **kwargs)``, a bound method, whose
    ``__self__`` LLaMA-Factory's ``custom_gradient_checkpointing_func`` reads (``func.func.__self__``: an
    AttributeError otherwise). Each layer's function gets the bound form; the number of layers wrapped."""
    from functools import partial
    from types import MethodType

    wrapped = 0
    for module in model.modules():
        inner = module.__dict__.get("_gradient_checkpointing_func")
        if inner is None:
            continue

        def call(func, *args, _inner=inner):
            if isinstance(func, partial) and not hasattr(func.func, "__self__") and func.args:
                func = partial(MethodType(func.func, func.args[0]), *func.args[1:], **func.keywords)
            return _inner(func, *args)

        module._gradient_checkpointing_func = call
        wrapped += 1
    return wrapped


@contextlib.contextmanager
def device_copies(counter):
    """Within: ``tensor.to("cpu", ...)`` is a copy counted as host memory by ``counter`` (a SplitCounter) and
    ``tensor.to("cuda", ...)`` a copy counted as device memory (module docstring); any other ``.to`` as torch's."""
    import torch

    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if target == "cpu":
            counter.host_context = True  # allocated as host memory (SplitCounter._track)
            try:
                return self.detach().clone()
            finally:
                counter.host_context = False
        if target == "cuda":
            return self.detach().clone()
        return original(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        yield
    finally:
        torch.Tensor.to = original
