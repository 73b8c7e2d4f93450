"""Which one-rank estimate a parallel layout takes: estimator/step.py's ``estimate`` hands a
pipeline-, context-, expert- or tensor-parallel setup to the module that models one stage or rank of it
(each calls ``estimate`` back for the single-GPU terms). Torch-free."""

from __future__ import annotations

from collections.abc import Callable

from ..specs import Setup


def rank_estimator(setup: Setup) -> Callable | None:
    """``rank_estimate(model, setup, gpu, corrections, stack, estimate)`` of the layout, or None (one
    GPU, DDP, ZeRO, FSDP, a layer split: estimator/step.py itself). Expert parallelism first (it refuses PP/CP
    beside it: estimator/expert_parallel.py check_ep), then pipeline parallelism: it refuses TP/CP beside it
    (estimator/pipeline.py check_pp)."""
    if setup.ep > 1:  # one expert-parallel rank (tp == ep): its experts, the all-to-all's rows
        from .expert_parallel import rank_estimate

        return rank_estimate
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
