"""``--framework any``: the plan of each modelled framework, and the one to run, saying why.

The frameworks differ in how they prepare the model (setup/frameworks.py), so on a small card one may
train in VRAM where another needs a distributed engine and CPU offload. ``plan(..., framework="any")``
plans each of :data:`CANDIDATES` (axolotl stands for LLaMA-Factory too: their preparation is modelled
alike; Unsloth: estimator/unsloth.py) and takes, in this order: one that fits; one that stays
resident (no engine or offload on one GPU); one that fits with the margins (not tight); the better
quality tier (full > LoRA on a 16-bit base > 8-bit > QLoRA); among tight ones, the one that needs
least; the faster; the first of :data:`CANDIDATES` on a tie (the HF recipe ``emit``'s train.py runs).
Where none fits, the one whose closest setup needs least memory.
A note of kind ``framework`` names the choice and each other framework's plan in one line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..setup.frameworks import framework, with_framework_defaults
from ..specs import Note, Plan
from .labels import size
from .rank import quality, residency

#: the frameworks ``any`` plans, in tie order
CANDIDATES = ("hf", "trl", "axolotl", "unsloth")


def _key(p: Plan, index: int) -> tuple:
    # a plan with the margins before a tight one; among tight ones, the one that needs least; where none
    # fits, the closest: the one whose smallest setup needs least
    if not p.fits:
        return (True, p.breakdown.device_total_bytes, index)
    room = p.breakdown.device_total_bytes if p.tight else 0
    return (False, residency(p.setup), p.tight, -quality(p.setup), room,
            -(p.tokens_per_s or 0.0), index)


def _line(p: Plan) -> str:
    fw = framework(p.setup.framework)
    if not p.fits:
        return (f"{fw.name} ({fw.title}): nothing fits (closest: {p.setup.method}, "
                f"{size(p.breakdown.device_total_bytes)})")
    where = "in VRAM" if residency(p.setup) == 0 else "with a distributed engine or offload"
    return (f"{fw.name} ({fw.title}): {p.setup.method} {where}, {size(p.breakdown.device_total_bytes)}, "
            f"~{p.tokens_per_s:,.0f} tokens/s")


def plan_any(run: Callable[..., Plan], fixed: dict[str, Any]) -> Plan:
    """``run(**fixed)`` (planner.plan with everything else bound) for each candidate framework; the
    chosen plan with a ``framework`` note (see the module docstring)."""
    plans = [run(**with_framework_defaults({**fixed, "framework": name})) for name in CANDIDATES]
    order = sorted(range(len(plans)), key=lambda i: _key(plans[i], i))
    chosen, others = plans[order[0]], [plans[i] for i in order[1:]]
    fw = framework(chosen.setup.framework)
    note = Note(f"framework: {fw.name} ({fw.title}, {fw.version}) chosen from --framework any; "
                + "; ".join(_line(p) for p in [chosen, *others]), "framework")
    return dataclasses.replace(chosen, notes=(*chosen.notes, note))
