"""Context parallelism (search/space_cp.py) in words: why a plan took it. Rendered from the evaluator's
verdict of the same settings without it (``Search.fitting_micro_batch``: the estimate and the cost
model the search ranked them with)."""

from __future__ import annotations

from collections.abc import Callable

from ..specs import Note
from .core import Result
from .verdicts import Candidate, Misfit


def cp_notes(result: Result, chosen: Candidate, misfit_text: Callable[[Misfit], str]) -> list[Note]:
    """A ``layout`` note when the plan splits each sequence: the ring's share of the step and what FSDP2
    over the same GPUs at the full sequence does (does not fit, or its speed)."""
    s = chosen.setup
    if s.cp <= 1:
        return []
    share = f"{chosen.step.comm_s / chosen.step.step_s:.0%} of the step in communication"
    alone = result.search.ev.judge(s.replace(cp=1))
    if alone.breakdown is None or alone.misfit is not None:
        other = f"does not fit ({misfit_text(alone.misfit)})" if alone.misfit is not None else "does not fit"
    else:
        other = f"~{alone.tokens_per_s:,.0f} tokens/s"
    groups = f"each of {s.gpus // s.cp} groups of {s.cp} GPUs" if s.gpus > s.cp else f"the {s.cp} GPUs"
    return [Note(f"context parallelism: {groups} split every sequence ({s.seq // s.cp} tokens per GPU: its "
                 f"activations, logits and loss), FSDP2 shards the model over all {s.gpus}, and torch's ring "
                 f"all-gathers K/V and passes dK/dV in every layer ({share}). FSDP2 at the full sequence, same "
                 f"settings: {other}", "layout")]


__all__ = ["cp_notes"]
