"""vramplan: will it fit? GPU memory of one LLM fine-tuning step.

    from vramplan import estimate, load_model, load_gpu, plan, Setup
    bd = estimate(load_model("llama-3.1-8b"), Setup(method="lora", checkpointing=True), load_gpu("rtx-4090"))
    bd.fits, bd.device_total_bytes
    plan("llama-3.1-8b", "rtx-4090", global_batch=16)   # the fastest setup that fits: a Plan

Importing vramplan never imports torch: ``trace`` (the fake-tensor tier, which does), ``estimate`` and
``plan`` are loaded on first use.
"""

from __future__ import annotations

import os as _os
import signal as _signal
import sys as _sys
from typing import TYPE_CHECKING, Any


def _interrupted_at_startup(signum, frame) -> None:  # pragma: no cover - timing dependent
    _os.write(2, b"error: interrupted\n")
    _os._exit(130)


# Run as the `vramplan` command (never when a program imports vramplan): Ctrl-C while the modules
# import is one line and exit 130, not a traceback; vramplan.cli restores the default handler.
if (_os.path.basename(_sys.argv[0] if _sys.argv else "") in ("vramplan", "__main__.py", "-m")
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler):
    _signal.signal(_signal.SIGINT, _interrupted_at_startup)

from .model.profiles import load_gpu, load_model  # noqa: E402
from .specs import Breakdown, GpuSpec, ModelSpec, Plan, Setup, SpecError  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from .estimator import estimate
    from .run.tracer import trace
    from .search import plan

__version__ = "0.1.0"

__all__ = [
    "Breakdown",
    "GpuSpec",
    "ModelSpec",
    "Plan",
    "Setup",
    "SpecError",
    "__version__",
    "estimate",
    "load_gpu",
    "load_model",
    "plan",
    "trace",
]


#: the public functions loaded on first use: ``vramplan models`` and ``gpus`` never import the estimator or
#: the search, and only ``trace`` imports torch
_LAZY = {"estimate": ("estimator", "estimate"), "plan": ("search", "plan"), "trace": ("run.tracer", "trace")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        fn = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = fn  # cached: the next lookup finds it without this hook
        return fn
    raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
