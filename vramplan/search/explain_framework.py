"""The framework a plan runs when the user names none (issue 28).

``plan`` with no ``framework`` plans the HF Trainer recipe vramplan emits by default (train.py:
peft's ``prepare_model_for_kbit_training``, full-vocabulary logits). On one GPU, when that plan needs a
distributed engine or CPU offload, fits only inside the margins, or does not fit at all, the same search
runs with TRL's SFTTrainer (:data:`ALTERNATIVE`; setup/frameworks.py: no fp32 upcast of a quantized
base, bf16 QLoRA adapters, its fused chunked LM head), which most users run; when that plan stays in
VRAM with the margins (or is the only one that fits), the plan is TRL's, and a note of kind
``framework`` says so, with the HF recipe's plan beside it and ``--framework hf`` to keep it. A
framework the user names (``--framework``, a config file a reader read, ``plan --from``) is never
switched. ``emit`` writes the framework's own config (TRL's ``trl sft`` YAML) for such a plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..setup.frameworks import framework, with_framework_defaults
from ..specs import Note, Plan, SpecError
from .labels import savers_text, size
from .rank import residency

#: the framework a default plan turns to when the HF recipe cannot stay in VRAM with its margins
ALTERNATIVE = "trl"


def _resident(p: Plan) -> bool:
    return p.fits and not p.tight and residency(p.setup) == 0


def switch_framework(run: Callable[..., Plan], fixed: dict[str, Any], chosen: Plan) -> Plan:
    """``chosen`` (the HF recipe's plan, ``run(**fixed)``), or :data:`ALTERNATIVE`'s plan with a note
    when the HF recipe's is not in VRAM with its margins on one GPU and the alternative's is (or
    only the alternative fits at all)."""
    if _resident(chosen) or fixed.get("objective", "sft") != "sft":
        return chosen
    try:
        # only a fitting alternative is taken: the what-would-fit search (relax) is not needed for it
        alt = run(**with_framework_defaults({**fixed, "framework": ALTERNATIVE}), relax=False)
    except SpecError:  # knobs the alternative does not take: the HF recipe's plan stands
        return chosen
    if not (_resident(alt) or (alt.fits and not chosen.fits)):
        return chosen
    fw = framework(ALTERNATIVE)
    if not chosen.fits:
        hf = "nothing fits"
    else:
        hf = f"{savers_text(chosen.setup)}, {size(chosen.breakdown.device_total_bytes)}"
        hf += ", inside the margins only" if chosen.tight else ""
        hf += f", ~{chosen.tokens_per_s:,.0f} tokens/s" if chosen.tokens_per_s else ""
    note = Note(f"framework: {fw.name} ({fw.title}, {fw.version}: no fp32 upcast of a quantized base, bf16 QLoRA "
                f"adapters, its fused LM head) trains in VRAM on this card; the HF Trainer recipe vramplan "
                f"emits as train.py (peft's prepare_model_for_kbit_training, full logits): {hf}. "
                "--framework hf keeps it", "framework")
    return dataclasses.replace(alt, notes=(*alt.notes, note))
