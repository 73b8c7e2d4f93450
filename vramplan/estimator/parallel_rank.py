"""Which one-rank estimate a parallel layout takes: estimator/step.py's ``estimate`` hands a
pipeline-, context- or tensor-parallel setup to the module that models one stage or rank of it
(each calls ``estimate`` back for the single-GPU terms). Torch-free."""

from __future__ import annotations

from collections.abc import Callable

from ..specs import Setup


def rank_estimator(setup: Setup) -> Callable | None:
    """``rank_estimate(model, setup, gpu, corrections, stack, estimate)`` of the layout, or None (one
    GPU, DDP, ZeRO, FSDP, a layer split: estimator/step.py itself). Pipeline parallelism first: it
    refuses TP/CP beside it (estimator/pipeline.py check_pp)."""
    if setup.pp > 1:  # one pipeline stage per GPU: its layers, the schedule's micro-batches in flight
        from .pipeline import rank_estimate

        return rank_estimate
    if setup.cp > 1:  # one context-parallel rank: FSDP2 on seq/cp tokens and the ring
        from .context_parallel import rank_estimate

        return rank_estimate
    if setup.tp > 1:  # one tensor-parallel rank: its shards, the gathered loss
        from .tensor_parallel import rank_estimate

        return rank_estimate
    return None
