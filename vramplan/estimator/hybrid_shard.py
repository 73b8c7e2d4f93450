"""Hybrid sharding (HSDP, ``Setup.dp_replicate`` > 1): FSDP shards within groups of
``S = gpus // dp_replicate`` GPUs and replicates across ``dp_replicate`` such groups.

How the pinned libraries run it (read off their source; verified against the real 4-rank runs of
:mod:`vramplan.truths.hsdp_truth`, ``vramplan validate --knob hybrid_shard``):

- FSDP2 (accelerate 1.15 ``fsdp_version: 2``): ``ParallelismConfig(dp_replicate_size=R,
  dp_shard_size=S)`` builds a ``(dp_replicate, dp_shard)`` DeviceMesh (parallelism_config.py
  ``build_device_mesh``) and ``fsdp2_prepare_model`` (utils/fsdp_utils.py) hands
  ``mesh[("dp_replicate", "dp_shard_cp")]`` to torch 2.13's ``fully_shard``: placements
  ``(Replicate(), Shard(0))``, so every parameter is chunked over the S ranks of its shard group
  (``FSDPParam._init_sharded_param``), all-gathers run within that group, and
  ``_fsdp_collectives.foreach_reduce`` reduce-scatters each group's gradients within the shard
  group and then all-reduces the reduce-scatter output (one shard, reduce dtype) in place across
  the R replicas. That output is kept in ``FSDPParamGroup._all_reduce_state`` until
  ``finalize_backward`` (the root's final callback), so it lives to the end of the backward; when
  the reduce dtype is the shards' dtype the sharded gradients are views of it (no extra bytes),
  under a MixedPrecisionPolicy (fp32 shards, 16-bit reduce) each group's 16-bit output is held
  beside its fp32 gradient: :func:`held_reduce_bytes`.
- FSDP1 (``fsdp_sharding_strategy: HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2``): accelerate passes no
  process group, so torch 2.13 (``_init_utils._init_intra_and_inter_node_groups``) shards within
  the ``torch.cuda.device_count()`` GPUs of a node and all-reduces across nodes, in place on the
  new sharded gradient (``_runtime_utils._reduce_grad``): per rank the memory of FULL_SHARD /
  SHARD_GRAD_OP on S ranks. S is one node's GPUs, so ``dp_replicate`` is the node count.

Either way each rank holds what FSDP on S ranks holds (plus FSDP2's held outputs); the activations
are one rank's micro-batch, as without it. The all-reduce moves one gradient shard per rank across
the replicas each optimizer step (:func:`replica_bytes`, priced by cost/model.py ``comm_s``).
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError


def shard_ranks(setup: Setup) -> int:
    """The ranks FSDP shards over: the shard group of hybrid sharding, all GPUs otherwise."""
    return setup.gpus // max(setup.dp_replicate, 1)


def check_hybrid(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for hybrid sharding the truths do not run (one line each)."""
    if setup.dp_replicate <= 1:
        return
    why = None
    if setup.tp > 1 or setup.cp > 1:
        why = "hybrid sharding with tensor/context parallelism (3-D HSDP x TP) is not modelled yet; use --tp 1 --cp 1"
    elif setup.offload_params != "none":
        why = "hybrid sharding with FSDP CPU offload is not modelled yet (not run on the CPU ranks)"
    elif setup.fsdp_version == 1 and (setup.quant != "none" or setup.optimizer not in ("adamw", "adamw-fused", "sgd")):
        why = ("FSDP1 hybrid sharding is modelled with a 16/32-bit base and torch AdamW/SGD (what the 4-rank "
               "truth runs); use --fsdp-version 2 for QLoRA")
    elif setup.modules_to_save.strip():
        why = "hybrid sharding with modules_to_save is not modelled yet"
    if why:
        raise SpecError(why)


def held_reduce_bytes(setup: Setup, shard_elements: int) -> int:
    """FSDP2 HSDP: the 16-bit reduce-scatter output a group keeps for its all-reduce until the end of
    the backward (``FSDPParamGroup._all_reduce_state``), for ``shard_elements`` trainable shard
    elements; 0 where the sharded gradients are views of it (reduce dtype = shard dtype) or off."""
    if setup.dp_replicate <= 1 or setup.fsdp_version != 2 or not setup.precision.endswith("-mixed"):
        return 0
    return 2 * shard_elements


def replica_bytes(trainable_params: int, setup: Setup) -> float:
    """Bytes each rank sends (and receives) per optimizer step in the all-reduce across replicas: a
    ring all-reduce of its gradient shard (``trainable_params / S`` elements in the reduce dtype)
    over ``dp_replicate`` ranks moves ``2 (R - 1) / R`` of it."""
    r = setup.dp_replicate
    if r <= 1:
        return 0.0
    # the reduce dtype: the MixedPrecisionPolicy's 16 bits, else the gradients' own (fp32 adapters, fp32)
    mixed = setup.precision.endswith("-mixed")
    reduce_bytes = 2 if mixed else 4 if (setup.adapters or setup.precision == "fp32") else 2
    return 2 * (r - 1) / r * trainable_params / shard_ranks(setup) * reduce_bytes


def shard_nodes(setup: Setup, nodes: int) -> int:
    """Nodes one FSDP shard group spans (its all-gathers and reduce-scatters cross the network only
    then): a group within one node's GPUs, else ``nodes / dp_replicate`` of them."""
    if setup.dp_replicate <= 1 or nodes <= 1:
        return nodes
    per_node = max(setup.gpus // nodes, 1)
    return 1 if per_node % shard_ranks(setup) == 0 else max(nodes // setup.dp_replicate, 2)



def hsdp_held(fm) -> int:
    """Every group's held reduce output (:func:`held_reduce_bytes`) at the end of the backward, for the
    breakdown's ``hsdp_reduce_held`` component (``fm``: the FsdpMemory of FSDP, or None)."""
    return getattr(fm, "ar_held_end", 0) if fm is not None else 0
