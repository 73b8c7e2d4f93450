"""Hybrid sharding (HSDP, ``Setup.dp_replicate`` > 1) in the FSDP truths: what the CPU ranks need
to run accelerate 1.15's own code for it. Imported by :mod:`vramplan.truths.fsdp2` and
:mod:`vramplan.truths.fsdp`; the rows are :mod:`vramplan.truths.hsdp_truth`'s.

- FSDP2: accelerate builds the 2-D mesh from ``ParallelismConfig(dp_replicate_size, dp_shard_size)``
  (``Accelerator.__init__``: ``parallelism_config.get_device_mesh(device.type)`` then
  ``_validate_accelerator``) and ``fsdp2_prepare_model`` passes ``mesh[("dp_replicate",
  "dp_shard_cp")]`` to ``fully_shard``, which then shards over ``dp_shard`` and all-reduces the
  reduce-scattered gradients over ``dp_replicate`` (torch 2.13 ``_fsdp_collectives.foreach_reduce``).
  On CPU accelerate's state is MULTI_CPU when the Accelerator is built, which ``_validate_accelerator``
  refuses for a ParallelismConfig; so the worker builds it without one, turns the state into FSDP
  (as the FSDP2 truth does) and then runs those same two accelerate calls.
- FSDP1: accelerate passes neither a process group nor a mesh to ``FullyShardedDataParallel``; with
  ``HYBRID_SHARD`` torch 2.13 (``_init_utils._init_process_group_state_for_hybrid_shard``) shards
  within groups of ``device_handle.device_count()`` ranks (one node's GPUs) and all-reduces across
  them. On CPU that count is ``torch.cpu.device_count()`` (1), so the worker sets it to the GPUs
  of one shard group, ``gpus // dp_replicate``: what ``torch.cuda.device_count()`` is on a node.
"""

from __future__ import annotations

from ..specs import Setup


def attach_mesh(acc, setup: Setup) -> None:
    """FSDP2 with ``dp_replicate`` > 1: accelerate's 2-D ``(dp_replicate, dp_shard)`` mesh on the
    state of ``acc`` (an Accelerator already set to FSDP on the CPU device); nothing otherwise."""
    if setup.dp_replicate <= 1:
        return
    from accelerate.utils import ParallelismConfig

    pc = ParallelismConfig(dp_replicate_size=setup.dp_replicate, dp_shard_size=setup.gpus // setup.dp_replicate)
    acc.state.parallelism_config = pc
    acc.state.device_mesh = pc.get_device_mesh("cpu")
    pc._validate_accelerator(acc)


def cpu_node_size(setup: Setup) -> None:
    """FSDP1: the "GPUs per node" torch's HYBRID_SHARD shards within (``torch.cpu.device_count``),
    ``gpus // dp_replicate`` under hybrid sharding and torch's own 1 otherwise."""
    import torch

    size = setup.gpus // setup.dp_replicate if setup.dp_replicate > 1 else 1
    torch.cpu.device_count = lambda: size
