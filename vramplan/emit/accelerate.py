"""Accelerate config (``accelerate_config.yaml``, for ``accelerate launch --config_file``).

The distributed type follows the plan: DEEPSPEED for ZeRO (the plugin points at ds_config.json,
which then owns precision, clipping and accumulation: accelerate refuses the same settings in
both files), FSDP when the Setup shards with FSDP, MULTI_GPU for plain data parallelism over
several GPUs, NO for one GPU. Multi-node plans give the node count and port; each node passes its
own ``--machine_rank`` and node 0's ``--main_process_ip`` on the command line.
"""

from __future__ import annotations

import yaml

from ..estimator.tp_fsdp2 import combined, dp_shard
from ..specs import Plan, SpecError
from .common import DS_CONFIG, MAIN_PORT, comment, fsdp1_strategy, fsdp_mode, header_lines

#: Setup.precision -> accelerate's mixed_precision under FSDP: the "-mixed" precisions run FSDP's
#: MixedPrecision over fp32 shards (accelerate upcasts trainable shards); pure bf16/fp16 run
#: without a policy on the 16-bit-loaded model (16-bit shards), what vramplan.truths.fsdp runs and
#: estimator/fsdp.py models.
MIXED_PRECISION = {"bf16": "no", "bf16-mixed": "bf16", "fp16": "no", "fp16-mixed": "fp16", "fp32": "no"}

#: Setup.precision -> accelerate's mixed_precision on one GPU and under DDP: autocast only for the
#: "-mixed" precisions. ``accelerate launch`` exports it as ACCELERATE_MIXED_PRECISION, and the
#: Trainer takes it from there whenever train.py passes neither bf16 nor fp16 -- so pure bf16
#: must say "no" here, or the launched step would run under autocast, not the one estimated.
_AUTOCAST = {"bf16": "no", "bf16-mixed": "bf16", "fp16": "no", "fp16-mixed": "fp16", "fp32": "no"}


def accelerate_config(plan: Plan) -> dict:
    """The Accelerate config mapping for ``plan`` (a new dict; the plan is not touched)."""
    s = plan.setup
    fsdp = fsdp_mode(plan)
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if s.zero_stage:
        cfg["distributed_type"] = "DEEPSPEED"
        ds: dict = {"deepspeed_config_file": DS_CONFIG, "zero3_init_flag": s.zero_stage == 3}
        if plan.nodes > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        cfg["deepspeed_config"] = ds
    elif combined(s):  # --tp beside FSDP2: transformers shards both at load (estimator/tp_fsdp2.py)
        cfg.update(_tp_fsdp2_config(s))
    elif fsdp != "none":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = _fsdp2_config(plan) if s.fsdp_version == 2 else {
            "fsdp_version": 1,
            "fsdp_sharding_strategy": fsdp1_strategy(s),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_offload_params": s.offload_params == "cpu",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,
            "fsdp_use_orig_params": True,
        }
        cfg["mixed_precision"] = MIXED_PRECISION[s.precision]
        if s.dp_replicate > 1:
            _hybrid(plan, cfg)
        if s.cp > 1:  # context parallelism over FSDP2 (estimator/context_parallel.py)
            cfg["parallelism_config"] = _cp_config(s)
    else:
        # a layer split (device_map) is one process over every GPU: no data parallelism
        cfg["distributed_type"] = "MULTI_GPU" if s.gpus > 1 and s.device_map == "none" else "NO"
        cfg["mixed_precision"] = _AUTOCAST[s.precision]
    cfg.update(
        downcast_bf16="no",
        machine_rank=0,
        num_machines=plan.nodes,
        num_processes=1 if s.device_map != "none" else s.gpus,
        gpu_ids="all",
        main_training_function="main",
        rdzv_backend="static",
        same_network=True,
        use_cpu=False,
    )
    if plan.nodes > 1:
        cfg["main_process_port"] = MAIN_PORT
    return cfg


def _fsdp2_config(plan: Plan) -> dict:
    """accelerate 1.15's FSDP2 keys (``FullyShardedDataParallelPlugin`` with ``fsdp_version: 2``,
    what vramplan.truths.fsdp2 prepares and estimator/fsdp2.py models): ``shard_grad_op`` is
    ``fsdp_reshard_after_forward: false``; FSDP2 has no sharding strategy, backward prefetch or
    use_orig_params keys. ``fsdp_sync_module_states`` only because ``accelerate launch`` asks for
    it beside ``fsdp_cpu_ram_efficient_loading`` (utils/launch.py, prepare_multi_gpu_env)."""
    s = plan.setup
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": s.fsdp == "full_shard",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_offload_params": s.offload_params == "cpu",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_sync_module_states": True,
    }


def _hybrid(plan: Plan, cfg: dict) -> None:
    """Hybrid sharding (estimator/hybrid_shard.py). FSDP2: accelerate 1.15's ``parallelism_config``
    mapping (``accelerate launch`` copies its keys onto its ``--parallelism_config_*`` arguments and
    exports them as PARALLELISM_CONFIG_* with ACCELERATE_USE_PARALLELISM_CONFIG, from which
    ``Accelerator`` builds ``ParallelismConfig``: utils/launch.py prepare_extend_env_parallelism_config).
    FSDP1: HYBRID_SHARD shards within one node's GPUs (torch's ``_init_intra_and_inter_node_groups``
    over ``torch.cuda.device_count()``), so the replicas must be the nodes."""
    s = plan.setup
    if s.fsdp_version == 2:
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": s.dp_replicate,
                                     "parallelism_config_dp_shard_size": s.gpus // s.dp_replicate}
    elif plan.nodes != s.dp_replicate:
        raise SpecError(f"FSDP1 HYBRID_SHARD shards within one node's GPUs: dp_replicate ({s.dp_replicate}) must "
                        f"equal the nodes ({plan.nodes}); use --nodes {s.dp_replicate} or --fsdp-version 2")


def _cp_config(s) -> dict:
    """``--cp`` (estimator/context_parallel.py): accelerate 1.15's ``parallelism_config`` keys
    (``commands/launch.py``: ``--parallelism_config_cp_size``, ``_cp_backend``, ``_cp_comm_strategy``;
    ``utils/launch.prepare_extend_env_parallelism_config`` exports them as PARALLELISM_CONFIG_*, from
    which ``Accelerator`` builds ``ParallelismConfig(cp_size=N)`` and the HF Trainer 5.24 shards each
    batch under ``maybe_context_parallel``). ``allgather`` is the rotate method modelled (accelerate's
    default ``cp_comm_strategy``), torch the only backend; dp_shard is what is left (1: FSDP2 shards
    over the joint dp_shard_cp mesh)."""
    return {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": s.gpus // s.cp,
            "parallelism_config_tp_size": 1, "parallelism_config_cp_size": s.cp,
            "parallelism_config_cp_backend": "torch", "parallelism_config_cp_comm_strategy": "allgather"}


def _tp_fsdp2_config(s) -> dict:
    """``--tp`` beside FSDP2 (estimator/tp_fsdp2.py): transformers 5.24 applies both at load
    (train.py's ``DistributedConfig(tp_size, fsdp_size)``), so accelerate must not prepare FSDP
    itself: with ``distributed_type: FSDP`` accelerate 1.15's ``Accelerator._prepare_tp`` imports
    ``ReplicateParallel``, gone from transformers 5.24 (ImportError). MULTI_GPU with the parallelism
    fields accelerate 1.15 reads (``parallelism_config_tp_size`` / ``dp_shard_size``:
    ``commands/launch.py _validate_launch_command`` turns ``use_parallelism_config`` on for a
    non-empty ``parallelism_config``, ``utils/launch.prepare_extend_env_parallelism_config``
    exports them); the Trainer builds the same ``ParallelismConfig`` from the model."""
    return {"distributed_type": "MULTI_GPU", "mixed_precision": _AUTOCAST[s.precision],
            "parallelism_config": {"parallelism_config_dp_replicate_size": 1,
                                   "parallelism_config_dp_shard_size": dp_shard(s),
                                   "parallelism_config_tp_size": s.tp, "parallelism_config_cp_size": 1}}


def dumps(plan: Plan, config: dict) -> str:
    """The YAML text: the header as comments, then the mapping."""
    return comment(header_lines(plan)) + yaml.safe_dump(config, sort_keys=False, width=100)
