"""The planner: the setup an expert would run on a target, the trade-offs around it, and why
the others fail.

``plan(model, gpu, **constraints)`` searches every Setup knob the user left free, judging memory
with :func:`vramplan.estimator.estimate` only (never a formula of its own) and speed with
:mod:`vramplan.cost.model`. The space is not enumerated blindly:

1. **Families** (method x base quantization x LoRA rank) are searched one by one. The rank is
   the user's (``--lora-rank``, default 16; a range ``8..64`` is searched at its ends and the
   powers of two between). Each family's memory-saving knobs (checkpointing, 8-bit optimizer,
   ZeRO stage, FSDP, CPU/NVMe offload, attention) form *saver configurations*, those the
   compatibility table (:mod:`vramplan.setup.compat`) knows not to run left out.
2. **Residency classes** (:func:`.rank.placement`: GPU-resident; a distributed engine on one GPU;
   CPU offload; NVMe offload) are searched apart, so a faster offload plan never hides a resident one.
3. **Monotone feasibility**: within one placement, turning a saver on never adds memory, so the
   configuration with every saver of that placement is estimated first at micro-batch 1; if it
   does not fit, no configuration of that placement can, and none is expanded.
4. **Branch and bound**: tokens/s never falls as the micro-batch grows, so a configuration's speed
   at the largest allowed micro-batch bounds it from above, computed from the cost model alone.
   Configurations are visited fastest bound first and the visit stops once the bound is below
   the class's best found.
5. **Micro-batch**: memory rises with the micro-batch, so the largest fitting one is found by a
   bisection seeded with a linear extrapolation from micro-batches 1 and 2 (with the micro-batch
   free, the chosen plan's is then raised to the largest integer that fits when that is faster).

**Fit** (:class:`.evaluate.Evaluator`) means the high end of the estimate's error band plus an
allocator allowance is within the usable memory, ``device_total * (1 + band) +
ALLOCATOR_ALLOWANCE_BYTES <= usable``, and the headroom is at least ``--margin`` of it (default
:data:`DEFAULT_MARGIN`, 10 %): ``band`` is the estimate's calibrated error band, or
:data:`DEFAULT_ERROR_BAND` until calibration exists. Host RAM is always checked for CPU offload:
``--host-ram``, else this machine's RAM when it holds the GPU planned for, else the GPU profile's
typical host (NVMe offload: the buffers ZeRO-Infinity pins there). Only when nothing fits with the
margins is a plan accepted without them, and then it is marked tight.

**Choice** (:mod:`.rank`): GPU-resident first (offload, or a distributed engine on one GPU, only
when nothing else fits at any tier; NVMe only when CPU offload does not fit either); then the best
quality tier (full > LoRA on a 16-bit base > LoRA on an 8-bit base > QLoRA) while it is at most
:data:`.rank.TIER_SLOWDOWN_MAX` times slower than a lower tier (a better tier passed over is named
in a note); then the most tokens/s. A much faster lower tier is named in a note.

Knobs the search does not vary unless fixed by the user: the loss implementation (``hf``), LoRA
alpha/dropout/targets, double quantization, and optimizers that change the recipe (SGD, Lion,
Adafactor): the search keeps AdamW semantics (fused AdamW or bitsandbytes 8-bit AdamW, which
matches it in quality, Dettmers et al. 2022). DPO/GRPO keep their algorithm (lengths, GRPO's
num_generations and reference); DPO's reference model and GRPO's generation engine with vLLM's share
of the card are searched (:meth:`.space.Space.objective_knobs`). Offload uses DeepSpeed's CPU Adam, so it goes with
AdamW only. LoRA on an 8-bit base (LLM.int8) and GPTQ/AWQ bases are searched only when ``--quant``
asks for them (int8 trains several times slower than NF4 in bitsandbytes; GPTQ/AWQ need a
pre-quantized checkpoint). On a GPU without bf16, full fine-tuning uses fp16 mixed precision and adapters an fp16
base.

The package, along its seams: :mod:`.geometry` (the target and the batch), :mod:`.space` (the
knobs), :mod:`.verdicts` (typed candidates and misfits), :mod:`.evaluate` (memory and speed, with
the caches), :mod:`.core` (the search), :mod:`.rank` (the objective), :mod:`.relax` ("what would
fit"), :mod:`.explain` (every word of the plan), :mod:`.labels` (names of things) and
:mod:`.planner` (``plan()``).

May import: util, specs, model, setup, estimator, cost.
"""

from .core import Result, Search
from .evaluate import ALLOCATOR_ALLOWANCE_BYTES, DEFAULT_ERROR_BAND, HOST_RAM_SHARE, Evaluator
from .explain import misfit_text
from .geometry import DEFAULT_HOST_RAM_PER_GPU, DEFAULT_MARGIN, BatchShape, Target, batch_shape
from .labels import describe, method_name, quality_label, savers_text
from .planner import parse_rank, plan
from .rank import MUCH_FASTER, TIERS, choose, quality, residency, tier
from .relax import Relaxation
from .space import DEFAULT_LORA_RANK, FIXABLE, LORA_RANKS, Space
from .verdicts import Candidate, Misfit

__all__ = [
    "ALLOCATOR_ALLOWANCE_BYTES", "DEFAULT_ERROR_BAND", "DEFAULT_HOST_RAM_PER_GPU", "DEFAULT_LORA_RANK",
    "DEFAULT_MARGIN", "FIXABLE", "HOST_RAM_SHARE", "LORA_RANKS", "MUCH_FASTER", "TIERS", "BatchShape", "Candidate",
    "Evaluator", "Misfit", "Relaxation", "Result", "Search", "Space", "Target", "batch_shape", "choose", "describe",
    "method_name", "misfit_text", "parse_rank", "plan", "quality", "quality_label", "residency", "savers_text",
    "tier",
]
