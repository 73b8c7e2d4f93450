"""The framework alternative in words (issue 28): when the HF Trainer recipe vramplan emits by default
needs a distributed engine or offload on one GPU (or nothing fits), the same search with TRL's
SFTTrainer (``--framework trl``: no fp32 upcast of a quantized base, bf16 QLoRA adapters, its fused
LM head; setup/frameworks.py) may train in VRAM. The plan then says so, with its numbers, in a note
of kind ``framework``: the user's framework is theirs to choose, so it is never switched silently."""

from __future__ import annotations

from typing import Any

from ..setup.frameworks import framework, with_framework_defaults
from ..setup.wording import describe
from ..specs import ModelSpec, Note, SpecError
from .core import Search
from .geometry import BatchShape, Target
from .labels import savers_text, size
from .rank import residency
from .verdicts import Candidate

#: the framework whose preparation the note compares with the HF recipe's
ALTERNATIVE = "trl"


def framework_note(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any],
                   error_band: float | None, ranks: tuple[int, ...] | None, chosen: Candidate | None) -> Note | None:
    """A note naming ``--framework trl`` and what it trains in VRAM, when the chosen plan (None: no
    fit) is not GPU-resident on one GPU and a resident TRL plan fits; None otherwise."""
    if ("framework" in fixed or target.gpus != 1 or fixed.get("objective", "sft") != "sft"
            or (chosen is not None and residency(chosen.setup) == 0)):
        return None
    alt_fixed = with_framework_defaults({**fixed, "framework": ALTERNATIVE})
    try:
        alt = Search(spec, target, shape, alt_fixed, error_band, ranks=ranks).run().choose()
    except SpecError:  # the alternative is advice: fixed knobs it cannot take give none
        return None
    if alt is None or residency(alt.setup) != 0:
        return None
    fw = framework(ALTERNATIVE)
    now = "nothing fits" if chosen is None else f"this plan needs {savers_text(chosen.setup)}"
    return Note(f"--framework {fw.name} ({fw.title}, {fw.version}: no fp32 upcast of a quantized base, bf16 QLoRA "
                f"adapters, its fused LM head) trains {describe(alt.setup)} in VRAM: "
                f"{size(alt.device_total_bytes)} of {size(target.gpu.usable_memory_bytes)}, ~{alt.tokens_per_s:,.0f} "
                f"tokens/s; {now} with the HF Trainer recipe vramplan emits by default (peft's "
                f"prepare_model_for_kbit_training)", "framework")

