"""The parallel layouts the search proposes beside plain FSDP / ZeRO / TP: hybrid sharding across
nodes and tensor parallelism x FSDP2 within one. Pure: Setups in, Setups out; what each layout
models and refuses is the estimator's (estimator/hybrid_shard.py, estimator/tp_fsdp2.py), the
price of its collectives cost/model.py's (vramplan/cost/parallel.py).

- **HSDP** (several nodes): FSDP shards within each node's GPUs and replicates across the nodes
  (``dp_replicate = nodes``), as a practitioner runs a model too large for one GPU on several
  nodes: the all-gathers and reduce-scatters of every layer stay on the node's NVLink/PCIe, only
  one gradient shard per rank crosses the network. Proposed beside each plain FSDP setup, in the
  FSDP1 (HYBRID_SHARD, ``HYBRID_SHARD_ZERO2``) and FSDP2 (accelerate's ``(dp_replicate, dp_shard)``
  mesh) forms where estimator/hybrid_shard.py models them: FSDP1 with a 16-bit base and torch
  AdamW/SGD, FSDP2 also QLoRA; neither with CPU offload. ``dp_replicate`` other than the node count
  is not searched (FSDP1 HYBRID_SHARD shards within one node; a shard group over several nodes
  would send its gathers over the network again).
- **TP x FSDP2** (one node, 4+ GPUs): each ``tp`` consecutive GPUs hold a TP shard of every layer
  and FSDP2 shards that over the ``gpus / tp`` groups (transformers 5.24's load-time mesh), for
  every ``tp`` that divides the GPUs with ``dp_shard >= 2``; where estimator/tp_fsdp2.py models it:
  full fine-tuning of a 16-bit base with torch AdamW, no gradient accumulation, a free micro-batch
  (a global batch is per-GPU sequences; TP's data-parallel ranks are ``gpus / tp``).

A fixed placement (``--zero``, ``--offload-*``, ``--fsdp``, ``--fsdp-version``, ``--dp-replicate``) is
kept as given: neither layout is proposed beside it; nor TP x FSDP2 beside a fixed optimizer other
than torch AdamW.
"""

from __future__ import annotations

from typing import Any

from ..estimator.eval_step import eval_unmodelled
from ..estimator.tensor_parallel import check_tp
from ..setup.checks import check
from ..setup.compat import runs
from ..specs import Setup, SpecError

#: Fixed knobs that rule out proposing a layout of this module (the user chose the placement: a fixed
#: ``--fsdp`` is that FSDP over all the GPUs, as the plan ran it before these layouts were searched).
PLACEMENT_KNOBS = ("zero_stage", "offload_optimizer", "offload_params", "fsdp", "fsdp_version", "dp_replicate")


def _legal(space: Any, s: Setup) -> bool:
    """``s`` is modelled (Setup's, the estimator's and the pinned libraries' checks) and its eval step too."""
    try:
        check(space.model, s)
        if s.tp > 1:
            check_tp(space.model, s)
    except SpecError:
        return False
    return runs(s, space.model) and not eval_unmodelled(s)


def hybrid_shards(space: Any, s: Setup) -> list[Setup]:
    """Several nodes: ``s`` (a plain FSDP saver setup of ``space``, a :class:`~.space.Space`) with
    hybrid sharding over the nodes, each FSDP version modelled (none when ``s`` is not FSDP, offloads,
    or the user fixed a placement)."""
    nodes, f = space.target.nodes, space.fixed
    if nodes < 2 or s.fsdp == "none" or s.dp_replicate > 1 or any(k in f for k in PLACEMENT_KNOBS):
        return []
    out = []
    for version in (1, 2):
        try:
            c = s.replace(dp_replicate=nodes, fsdp_version=version)
        except SpecError:  # e.g. one GPU per node: no shard group of 2
            continue
        if _legal(space, c):
            out.append(c)
    return out


def tp_degrees(gpus: int) -> tuple[int, ...]:
    """The TP degrees beside FSDP2 on ``gpus`` GPUs: divisors ``tp >= 2`` leaving ``dp_shard >= 2``."""
    return tuple(t for t in range(2, gpus // 2 + 1) if gpus % t == 0)


def tp_fsdp2_splits(space: Any, family: Setup) -> list[Setup]:
    """One node of 4+ GPUs: ``family`` under TP x FSDP2 at each of :func:`tp_degrees`, without and with
    checkpointing, where estimator/tp_fsdp2.py models it (the module docstring says where; its checks
    decide, so LoRA is proposed the day ``check_tp_fsdp2`` stops refusing it)."""
    target, f = space.target, space.fixed
    # a global batch is split per GPU (geometry.BatchShape.per_gpu); TP x FSDP2's data ranks are gpus / tp
    if (target.nodes > 1 or target.gpus < 4 or space.shape.per_gpu is not None or any(k in f for k in PLACEMENT_KNOBS)
            or f.get("optimizer", "adamw") != "adamw"):
        return []
    out = []
    for tp in tp_degrees(target.gpus):
        for ck in space.choices("checkpointing", (False, True)):
            try:
                s = family.replace(tp=tp, fsdp="full_shard", fsdp_version=2, optimizer="adamw", checkpointing=ck,
                                   zero_stage=0, offload_optimizer="none", offload_params="none")
            except SpecError:
                continue
            if _legal(space, s):
                out.append(s)
    return out
