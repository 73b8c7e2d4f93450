"""The groups a parallel layout's collectives run over, and the links they cross, for cost/model.py.

vramplan.cost.model prices a ring collective over the slowest link of its ring (``cost.ring_bandwidth``:
the GPUs' interconnect within a node, the network between nodes). A layout whose collectives do not
span every GPU is priced here by its groups (torch 2.13, transformers 5.24, accelerate 1.15):

- **FSDP / ZeRO-3** (no groups): every GPU gathers every weight and reduce-scatters every gradient.
- **Hybrid sharding** (HSDP, ``dp_replicate`` R, estimator/hybrid_shard.py): the all-gathers and
  reduce-scatters run within a shard group of ``gpus / R`` GPUs (torch's FSDP1
  ``_init_intra_and_inter_node_groups``: one node's GPUs; FSDP2: the ``dp_shard`` dim of accelerate's
  ``(dp_replicate, dp_shard)`` mesh), so with R = nodes they stay on the node's interconnect; only the
  all-reduce of one gradient shard per rank crosses the network (``hybrid_shard.replica_bytes``,
  priced by ``cost.comm_s`` over the nodes).
- **TP x FSDP2** (estimator/tp_fsdp2.py): transformers 5.24's mesh is ``("pp", "dp_replicate", "fsdp",
  "tp")`` with ``tp`` innermost (``distributed/utils.initialize_distributed_mesh``), so a tp group is
  ``tp`` consecutive ranks (one node's GPUs when ``tp`` divides them) and a ``dp_shard`` group is
  every ``tp``-th rank (``gpus / tp`` of them, spanning every node). ``fully_shard`` shards the
  TP-local tensor (torch 2.13 ``FSDPParam._init_sharded_param``) and its all-gather returns that
  TP-local tensor: each rank's FSDP traffic is ``1 / tp`` of the model's, over ``gpus / tp`` ranks.
  TP's all-reduces (``tensor_parallel.comm_bytes_per_micro_step``) run within the tp group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..estimator.hybrid_shard import shard_nodes, shard_ranks
from ..estimator.tp_fsdp2 import combined, dp_shard
from ..specs import Setup


@dataclass(frozen=True)
class ShardGroup:
    """The GPUs one FSDP / ZeRO-3 group shards over, the nodes it spans, and the share of each weight
    and gradient its collectives move (1, or ``1 / tp`` of a TP-sharded model)."""

    ranks: int
    nodes: int
    share: float = 1.0

    def bytes_per_micro_step(self, grad_bytes: float, gathered_bytes: float) -> float:
        """Bytes each rank sends and receives per micro-step: a ring reduce-scatter of the gradients
        (``grad_bytes``) and ring all-gathers of the weights (``gathered_bytes``, every pass) move
        ``(n - 1) / n`` of their bytes; 0 on one rank."""
        return (self.ranks - 1) / self.ranks * self.share * (grad_bytes + gathered_bytes)


def shard_group(setup: Setup, nodes: int) -> ShardGroup:
    """The FSDP group of ``setup`` on ``nodes`` nodes (the module docstring says why)."""
    if combined(setup):  # TP x FSDP2: every tp-th rank, across every node, 1/tp of each weight
        return ShardGroup(dp_shard(setup), nodes, 1.0 / setup.tp)
    return ShardGroup(shard_ranks(setup), shard_nodes(setup, nodes))


def tp_nodes(setup: Setup, nodes: int) -> int:
    """Nodes one tp group spans: ``tp`` consecutive ranks, within one node when ``tp`` divides its
    GPUs (1 without tensor parallelism)."""
    if setup.tp <= 1 or nodes <= 1:
        return 1
    per_node = max(setup.gpus // nodes, 1)
    return 1 if per_node % setup.tp == 0 else max(-(-setup.tp // per_node), 2)
