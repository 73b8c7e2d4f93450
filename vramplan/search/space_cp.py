"""Context parallelism in the plan search (``--cp``, estimator/context_parallel.py): for long
sequences, groups of ``cp`` GPUs of one machine split each sequence (torch 2.13's ring attention,
accelerate 1.15's ``ParallelismConfig(dp_shard_size=gpus / cp, cp_size=cp)`` over FSDP2), so each
holds the activations, logits and loss of ``seq / cp`` tokens: what lets a step fit whose FSDP2 step
at the full sequence does not. Pure: Setups in, Setups out. Proposed for every ``cp >= 2`` dividing
the GPUs where the estimator models it (check_cp: FSDP2 over all the GPUs, SDPA, a 16-bit base,
``seq`` divisible by ``2 x cp``), with and without checkpointing, with the optimizer the FSDP2 truth
runs (torch AdamW); the cost model prices its ring (vramplan/cost/cp.py), so the smallest ``cp`` that
fits wins and plain FSDP2 wins wherever it fits. Not beside a fixed placement (``--zero``,
``--offload-*``, ``--fsdp``, ``--tp``), several nodes, or a fixed per-GPU batch (a CP group shares
one micro-batch).
"""

from __future__ import annotations

from typing import Any

from ..estimator.context_parallel import check_cp
from ..estimator.eval_step import eval_unmodelled
from ..setup.checks import check
from ..setup.compat import runs
from ..specs import Setup, SpecError

_PLACEMENT = ("zero_stage", "offload_optimizer", "offload_params", "fsdp", "fsdp_version", "dp_replicate", "tp",
              "device_map")


def cp_degrees(gpus: int, seq: int) -> tuple[int, ...]:
    """The CP degrees on ``gpus`` GPUs: divisors ``cp >= 2`` whose ``2 x cp`` chunks divide ``seq``."""
    return tuple(c for c in range(2, gpus + 1) if gpus % c == 0 and seq % (2 * c) == 0)


def cp_splits(space: Any, family: Setup) -> list[Setup]:
    """One node of 2+ GPUs: ``family`` under context parallelism at each of :func:`cp_degrees` (FSDP2
    full_shard over all the GPUs), without and with checkpointing, where estimator/context_parallel.py
    models it."""
    target, f = space.target, space.fixed
    if (target.nodes > 1 or target.gpus < 2 or space.shape.per_gpu is not None or any(k in f for k in _PLACEMENT)
            or f.get("optimizer", "adamw") != "adamw"):
        return []
    out = []
    for cp, ck in ((c, k) for c in cp_degrees(target.gpus, family.seq) for k in space.choices("checkpointing",
                                                                                           (False, True))):
        try:
            s = family.replace(cp=cp, fsdp="full_shard", fsdp_version=2, optimizer="adamw", checkpointing=ck,
                               zero_stage=0, tp=1, offload_optimizer="none", offload_params="none")
            check(space.model, s)
            check_cp(space.model, s)
        except SpecError:
            continue
        if runs(s, space.model) and not eval_unmodelled(s):
            out.append(s)
    return out


__all__ = ["cp_degrees", "cp_splits"]
