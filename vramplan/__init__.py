"""vramplan: will it fit? GPU memory of one LLM fine-tuning step.

    from vramplan import estimate, load_model, load_gpu, plan, Setup
    bd = estimate(load_model("llama-3.1-8b"), Setup(method="lora", checkpointing=True), load_gpu("rtx-4090"))
    bd.fits, bd.device_total_bytes
    plan("llama-3.1-8b", "rtx-4090", global_batch=16)   # the fastest setup that fits: a Plan

Importing vramplan never imports torch: ``trace`` (the fake-tensor tier, which does) is loaded on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .estimator import estimate
from .profiles import load_gpu, load_model
from .search import plan
from .specs import Breakdown, GpuSpec, ModelSpec, Plan, Setup, SpecError

if TYPE_CHECKING:  # pragma: no cover
    from .run.tracer import trace

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


def __getattr__(name: str) -> Any:
    if name == "trace":
        # Cache the function here: the next lookup finds it without this hook.
        from .run.tracer import trace as fn

        globals()["trace"] = fn
        return fn
    raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
