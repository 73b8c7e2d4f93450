"""The planner: the fastest Setup that fits a target, the trade-offs around it, and why the others fail.

``plan(model, gpu, **constraints)`` searches every Setup knob the user left free, judging memory
with :func:`vramplan.estimator.estimate` only (never a formula of its own) and speed with
:mod:`vramplan.cost`. The space is not enumerated blindly:

1. **Families** (method x base quantization x LoRA rank) are searched one by one. Each family's
   memory-saving knobs (checkpointing, 8-bit optimizer, ZeRO stage, CPU/NVMe offload, attention)
   form *saver configurations*.
2. **Monotone feasibility**: within one ZeRO stage, turning a saver on never adds memory, so the
   configuration with every saver of that stage is estimated first at micro-batch 1; if it does not
   fit, no configuration of that stage can, and none is expanded.
3. **Branch and bound**: tokens/s never falls as the micro-batch grows (for a fixed global batch
   fewer micro-steps amortise the same work), so a configuration's speed at the largest allowed
   micro-batch bounds it from above, computed from the cost model alone. Configurations are visited
   fastest bound first and the visit stops once the bound is below the family's best found.
4. **Micro-batch**: memory rises with the micro-batch, so the largest fitting one is found by a
   bisection seeded with a linear extrapolation from micro-batches 1 and 2.

**Fit** means ``device_total * (1 + band) <= usable`` where ``band`` is the estimate's calibrated
error band, or :data:`DEFAULT_ERROR_BAND` until calibration exists. Only when nothing fits with
that margin is a plan accepted without it, and then it is marked tight.

**Ranking**: the highest tokens/s wins, except that among plans within :data:`SPEED_TOLERANCE` of
the fastest the highest quality wins (full > LoRA by rank > LoRA on an int8 base > QLoRA by rank,
:func:`quality`); equal quality falls back to speed, then to less memory. So the chosen plan is
never more than ``SPEED_TOLERANCE`` slower than the fastest that fits.

Knobs the search does not vary unless fixed by the user: the loss implementation (``hf``), LoRA
alpha/dropout/targets, double quantization, and optimizers that change the recipe (SGD, Lion,
Adafactor): the search keeps AdamW semantics (fused AdamW or bitsandbytes 8-bit AdamW, which
matches it in quality, Dettmers et al. 2022). Offload uses DeepSpeed's CPU Adam, so it goes with
AdamW only. On a GPU without bf16, full fine-tuning uses fp16 mixed precision and adapters an fp16
base.

The package, along its seams: :mod:`.geometry` (the target and the batch), :mod:`.space` (the
knobs), :mod:`.verdicts` (typed candidates and misfits), :mod:`.evaluate` (memory and speed, with
the caches), :mod:`.core` (the search), :mod:`.rank` (the objective), :mod:`.relax` ("what would
fit"), :mod:`.explain` (every word of the plan), :mod:`.labels` (names of things) and
:mod:`.planner` (``plan()``).
"""

from .core import Result, Search
from .evaluate import DEFAULT_ERROR_BAND, HOST_RAM_SHARE, Evaluator
from .explain import misfit_text
from .geometry import BatchShape, Target, batch_shape
from .labels import describe, method_name, quality_label, savers_text
from .planner import plan
from .rank import SPEED_TOLERANCE, quality
from .relax import Relaxation
from .space import FIXABLE, LORA_RANKS, Space
from .verdicts import Candidate, Misfit

__all__ = [
    "DEFAULT_ERROR_BAND", "FIXABLE", "HOST_RAM_SHARE", "LORA_RANKS", "SPEED_TOLERANCE", "BatchShape", "Candidate",
    "Evaluator", "Misfit", "Relaxation", "Result", "Search", "Space", "Target", "batch_shape", "describe",
    "method_name", "misfit_text", "plan", "quality", "quality_label", "savers_text",
]
