"""The framework a plan runs when the user names none (issue 28).

``plan`` with no ``framework`` plans the HF Trainer recipe vramplan emits by default (train.py:
peft's ``prepare_model_for_kbit_training``, full-vocabulary logits). On one GPU, when that plan needs a
distributed engine or CPU offload, fits only inside the margins, or does not fit at all, the same search
runs with TRL's SFTTrainer (setup/frameworks.py: no fp32 upcast of a quantized base, bf16 QLoRA
adapters, its fused chunked LM head), which most users run, then with Unsloth (estimator/unsloth.py:
offloaded checkpointing, fused chunked cross-entropy) (:data:`ALTERNATIVES`); the first whose plan
stays in VRAM with the margins (or, when none does, the first that fits where the HF recipe's does
not or fits in VRAM where it offloads to the CPU: a plan that says it is tight) is the plan, and a
note of kind ``framework`` says so, with the HF recipe's plan beside it and ``--framework hf`` to keep
it. A framework the user names (``--framework``, a config file a reader read, ``plan --from``) is never
switched. ``emit`` writes the framework's own config (TRL's ``trl sft`` YAML) for such a plan.

A named framework's plan that does not fit, or fits only with a distributed engine or CPU offload
on one GPU, says which other framework trains in VRAM there (:func:`other_framework`: a note of kind
``what_would_fit``, the fastest of those that stay resident with the margins): "--framework trl
--seq 32768 does not fit on an RTX 4090" answers with Unsloth's in-VRAM plan, not with ZeRO-3."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..setup.frameworks import framework, with_framework_defaults
from ..specs import Note, Plan, SpecError
from .labels import describe, savers_text, size
from .rank import quality, residency

#: the frameworks a default plan turns to, in order, when the HF recipe cannot stay in VRAM with its margins
ALTERNATIVES = ("trl", "unsloth")
#: what each alternative does that the HF recipe does not (the note's words)
WHY = {"trl": "no fp32 upcast of a quantized base, bf16 QLoRA adapters, its fused LM head",
       "unsloth": "no fp32 upcast, layer inputs offloaded to host RAM, its fused chunked cross-entropy"}


def _resident(p: Plan) -> bool:
    return p.fits and not p.tight and residency(p.setup) == 0


def switch_framework(run: Callable[..., Plan], fixed: dict[str, Any], chosen: Plan, relax: bool = True) -> Plan:
    """``chosen`` (the HF recipe's plan, ``run(**fixed)``), or the plan of the first of
    :data:`ALTERNATIVES` that stays in VRAM with its margins on one GPU where the HF recipe's does not
    (or, when nothing else does, the first that fits where the HF recipe's does not fit at all), with a
    ``framework`` note; ``relax``: the switched plan's what-would-fit notes (planner.py)."""
    if _resident(chosen) or fixed.get("objective", "sft") != "sft":
        return chosen
    fallback, tried = None, []
    for name in ALTERNATIVES:
        try:
            # only a fitting alternative is taken: the what-would-fit search (relax) is not needed for it
            alt = run(**with_framework_defaults({**fixed, "framework": name}), relax=False)
        except SpecError:  # knobs the alternative does not take: the HF recipe's plan stands
            continue
        if _resident(alt):
            return _switched(alt, chosen, tried)
        # no alternative stays resident with the margins: one that fits in VRAM, even inside the margins
        # only, over the HF recipe's nothing or its CPU offload on one GPU (DeepSpeed ZeRO-3 offload on a
        # consumer card: several times slower, and not what practitioners run); the plan says it is tight
        in_vram = residency(alt.setup) == 0 < residency(chosen.setup)
        if fallback is None and alt.fits and (not chosen.fits or in_vram):
            fallback = alt
        tried.append(alt)
    if fallback is None:
        # nothing fits anywhere: the closest is the framework whose smallest setup needs least (Unsloth's
        # QLoRA in VRAM over the HF recipe's ZeRO offload on a consumer card), with its what-would-fit notes
        closest = min((p for p in tried if not p.fits), key=lambda p: p.breakdown.device_total_bytes, default=None)
        if chosen.fits or closest is None or (closest.breakdown.device_total_bytes
                                              >= chosen.breakdown.device_total_bytes):
            return chosen
        near = (run(**with_framework_defaults({**fixed, "framework": closest.setup.framework}), relax=True)
                if relax else closest)
        return _switched(near, chosen, [p for p in tried if p is not closest])
    if fallback.tight and relax:  # the plan is the fallback's: its notes say what fits with the margins (planner.py)
        fallback = run(**with_framework_defaults({**fixed, "framework": fallback.setup.framework}), relax=True)
    return _switched(fallback, chosen, [p for p in tried if p is not fallback])


def _not_resident(p: Plan) -> str:
    fw = framework(p.setup.framework)
    if not p.fits:
        return f"{fw.title}: nothing fits (closest: {size(p.breakdown.device_total_bytes)})"
    return f"{fw.title}: {'inside the margins only' if p.tight else 'only with a distributed engine or offload'}"


def _switched(alt: Plan, chosen: Plan, tried: list[Plan]) -> Plan:
    """``alt`` with the ``framework`` note saying why it replaced the HF recipe's ``chosen``."""
    fw = framework(alt.setup.framework)
    if not chosen.fits:
        hf = f"nothing fits (closest: {savers_text(chosen.setup)}, {size(chosen.breakdown.device_total_bytes)})"
    else:
        hf = f"{savers_text(chosen.setup)}, {size(chosen.breakdown.device_total_bytes)}"
        hf += ", inside the margins only" if chosen.tight else ""
        hf += f", ~{chosen.tokens_per_s:,.0f} tokens/s" if chosen.tokens_per_s else ""
    does = "trains in VRAM on this card" if alt.fits else "comes closest (nothing fits this card)"
    note = Note(f"framework: {fw.name} ({fw.title}, {fw.version}: {WHY[fw.name]}) {does}; "
                f"the HF Trainer recipe vramplan emits as train.py (peft's prepare_model_for_kbit_training, full "
                f"logits): {hf}{''.join('; ' + _not_resident(p) for p in tried)}. --framework hf keeps it",
                "framework")
    return dataclasses.replace(alt, notes=(*alt.notes, note))


def other_framework(run: Callable[..., Plan], user_fixed: dict[str, Any], chosen: Plan) -> Plan:
    """``chosen`` (the plan of the framework the user named), with a ``what_would_fit`` note naming
    the fastest other framework of :data:`~vramplan.search.any_framework.CANDIDATES` whose plan stays
    in VRAM with the margins, when ``chosen`` does not (one GPU; ``user_fixed``: the knobs the user
    fixed, the framework's own loss default not among them)."""
    from .any_framework import CANDIDATES

    named = user_fixed.get("framework")
    if _resident(chosen) or named not in CANDIDATES or user_fixed.get("objective", "sft") != "sft":
        return chosen
    if user_fixed.get("loss") == framework(named).default_loss:  # the named framework's own loss, not the user's
        user_fixed = {k: v for k, v in user_fixed.items() if k != "loss"}
    fits: list[Plan] = []
    for name in CANDIDATES:
        if name == named:
            continue
        try:
            alt = run(**with_framework_defaults({**user_fixed, "framework": name}, given=tuple(user_fixed)),
                      relax=False)
        except SpecError:  # a knob the other framework does not take
            continue
        if _resident(alt) and (not chosen.fits or quality(alt.setup) >= quality(chosen.setup)):
            fits.append(alt)
    if not fits:
        return chosen
    best = max(fits, key=lambda p: (quality(p.setup), p.tokens_per_s or 0.0))
    fw = framework(best.setup.framework)
    note = Note(f"with --framework {fw.name} ({fw.title}): {describe(best.setup)}, in VRAM "
                f"({size(best.breakdown.device_total_bytes)}, ~{best.tokens_per_s or 0:,.0f} tokens/s)",
                "what_would_fit")
    return dataclasses.replace(chosen, notes=(*chosen.notes, note))
