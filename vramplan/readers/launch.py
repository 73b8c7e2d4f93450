"""The launch files a training config points to: a DeepSpeed JSON and an accelerate config YAML.

DeepSpeed 0.19.8 (``deepspeed/runtime/zero/config.py``): ``zero_optimization.stage`` defaults to
0, ``offload_optimizer``/``offload_param`` to none (``device: none``); its bucket sizes
(``reduce_bucket_size``, ``allgather_bucket_size``, ``stage3_prefetch_bucket_size``) are not
what vramplan models (``vramplan.estimator.distributed``: h² buckets, no prefetch), so a number
there is a warning. accelerate 1.15 (``accelerate/commands/config/config_args.py``):
``num_processes`` is the GPU count, ``distributed_type`` DEEPSPEED (``deepspeed_config``:
``zero_stage``, ``offload_*_device``, or a ``deepspeed_config_file``) or FSDP (``fsdp_config``).
"""

from __future__ import annotations

from pathlib import Path

from ..setup.inputs import load_structured
from .common import Fields, Mapped, resolve_file

__all__ = ["read_accelerate", "read_deepspeed", "read_deepspeed_file", "read_fsdp"]

_OFFLOADS = ("none", "cpu", "nvme")
_BUCKETS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size")


def _device(f: Fields | None, key: str) -> str:
    if f is None:
        return "none"
    device = f.str("device", "none")
    if device not in _OFFLOADS:
        raise f.bad("device", "none, cpu or nvme", device)
    return device


def read_deepspeed(data: dict, where: str, m: Mapped, key: str = "deepspeed") -> None:
    """A DeepSpeed config's ZeRO stage and offloads into ``m.setup``."""
    f = Fields(data, where)
    zero = f.sub("zero_optimization")
    if zero is None:
        m.setup["zero_stage"] = 0
        return
    stage = zero.int("stage", 0, auto_ok=True)
    if stage not in (0, 1, 2, 3):
        raise zero.bad("stage", "0, 1, 2 or 3", stage)
    m.setup["zero_stage"] = stage
    m.setup["offload_optimizer"] = _device(zero.sub("offload_optimizer"), "offload_optimizer")
    m.setup["offload_params"] = _device(zero.sub("offload_param"), "offload_param")
    if stage != 3 and m.setup["offload_params"] != "none":
        m.ignore(f"{key}.zero_optimization.offload_param", m.setup["offload_params"],
                 "DeepSpeed offloads parameters only at stage 3")
        m.setup["offload_params"] = "none"
    if stage == 0 and m.setup["offload_optimizer"] != "none":
        m.ignore(f"{key}.zero_optimization.offload_optimizer", m.setup["offload_optimizer"],
                 "DeepSpeed offloads the optimizer only at stage 1-3")
        m.setup["offload_optimizer"] = "none"
    for name in _BUCKETS:
        value = zero.raw(name)
        if value is not None and value != "auto":
            m.ignore(f"{key}.zero_optimization.{name}", value,
                     "vramplan models its own ZeRO buckets (h² elements, no stage-3 prefetch)")


def read_deepspeed_file(value, config_path: Path, m: Mapped, key: str = "deepspeed") -> None:
    """A config's ``deepspeed`` field: a path (resolved against the config's folder and its
    parents) or the DeepSpeed config inline."""
    from ..specs import SpecError

    if isinstance(value, dict):
        read_deepspeed(value, f"{config_path}: {key}", m, key)
        return
    if not isinstance(value, str):
        raise SpecError(f"{config_path}: {key} must be a path to a DeepSpeed JSON; got {value!r}")
    from ..specs import SpecError

    path = resolve_file(value, config_path)
    try:
        data = load_structured(path, "DeepSpeed config")
    except SpecError as exc:
        raise SpecError(f"{config_path}: {key}: {exc}") from None
    read_deepspeed(data, str(path), m, key)


#: accelerate / transformers FSDP sharding names -> vramplan's fsdp
_FSDP = {"full_shard": "full_shard", "1": "full_shard", "shard_grad_op": "shard_grad_op", "2": "shard_grad_op",
         "no_shard": "no_shard", "3": "no_shard"}
#: FSDP1's hybrid strategies (accelerate 1.15 FSDP_SHARDING_STRATEGY, torch ShardingStrategy 4/5): the
#: strategy within a node, replicated across nodes (Setup.dp_replicate = the nodes)
_HYBRID = {"hybrid_shard": "full_shard", "4": "full_shard", "hybrid_shard_zero2": "shard_grad_op",
           "_hybrid_shard_zero2": "shard_grad_op", "5": "shard_grad_op"}


def read_fsdp(strategy, config: Fields | None, m: Mapped, key: str, nodes: int = 1) -> None:
    """FSDP: a sharding strategy name (``full_shard``; accelerate's ``FULL_SHARD``/``1``; HF's
    ``fsdp: "full_shard auto_wrap"`` list) and an ``fsdp_config`` (offload, version). FSDP1's
    HYBRID_SHARD(_ZERO2) shards within each of ``nodes`` nodes (``dp_replicate``)."""
    words = strategy if isinstance(strategy, list) else str(strategy).split()
    names = {**_FSDP, **_HYBRID}
    mode = next((names[w.lower()] for w in map(str, words) if w.lower() in names), None)
    hybrid = next((w for w in map(str, words) if w.lower() in _HYBRID), None)
    if config is not None:
        named = config.raw("fsdp_sharding_strategy", config.raw("sharding_strategy"))
        reshard = config.raw("fsdp_reshard_after_forward", config.raw("reshard_after_forward"))
        for value in (named, reshard):
            if value is not None and str(value).lower() in names:
                mode = names[str(value).lower()]
                hybrid = value if str(value).lower() in _HYBRID else hybrid
            elif value is True:
                mode = "full_shard"
            elif value is False:
                mode = "shard_grad_op"
        version = config.int("fsdp_version", None) or config.int("version", None)
        if version == 2:  # FSDP2 (fully_shard): estimator/fsdp2.py
            m.setup["fsdp_version"] = 2
        if config.bool("fsdp_offload_params", False) or config.bool("offload_params", False):
            m.setup["offload_params"] = "cpu"
        if config.bool("fsdp_activation_checkpointing", False) or config.bool("activation_checkpointing", False):
            m.setup["checkpointing"] = True
    if mode is None:
        return
    m.setup["fsdp"] = mode
    if hybrid is not None and nodes > 1:
        m.setup["dp_replicate"] = nodes
    elif hybrid is not None:
        m.assume(f"{key}.fsdp_sharding_strategy", hybrid, f"{hybrid} shards within a node; on one node that is "
                 f"{mode.upper()} over its GPUs (for N nodes: --dp-replicate N)")


def read_accelerate(data: dict, where: str, m: Mapped) -> None:
    """An accelerate config YAML: GPU count, DeepSpeed or FSDP, mixed precision."""
    f = Fields(data, where)
    kind = f.str("distributed_type", "NO")
    processes = f.int("num_processes", None)
    machines = f.int("num_machines", 1)
    if processes is not None and processes > 0:
        m.gpus = processes
        if machines > 1:
            m.ignore("num_machines", machines, "nodes are a plan option (vramplan plan --nodes); GPUs counted")
    if kind == "DEEPSPEED":
        ds = f.sub("deepspeed_config")
        file = ds.str("deepspeed_config_file") if ds else None
        if file:
            read_deepspeed_file(file, Path(where), m, "deepspeed_config.deepspeed_config_file")
        elif ds is not None:
            stage = ds.int("zero_stage", 0)
            if stage not in (0, 1, 2, 3):
                raise ds.bad("zero_stage", "0, 1, 2 or 3", stage)
            m.setup["zero_stage"] = stage
            for mine, theirs in (("offload_optimizer", "offload_optimizer_device"),
                                 ("offload_params", "offload_param_device")):
                device = ds.str(theirs, "none")
                if device not in ("none", "cpu", "nvme"):
                    raise ds.bad(theirs, "none, cpu or nvme", device)
                m.setup[mine] = device
            if stage != 3:
                m.setup["offload_params"] = "none"
    elif kind == "FSDP":
        read_fsdp("full_shard", f.sub("fsdp_config"), m, "fsdp_config", nodes=max(machines, 1))
        _parallelism(f.sub("parallelism_config"), m)
    elif kind == "MULTI_GPU" and f.sub("parallelism_config") is not None:
        _tp_beside_fsdp2(f.sub("parallelism_config"), m)
    elif kind not in ("NO", "MULTI_GPU"):
        m.ignore("distributed_type", kind, "only NO, MULTI_GPU, DEEPSPEED and FSDP are modelled")
    mixed = f.str("mixed_precision", "no")
    if mixed not in ("no", "bf16", "fp16"):
        m.ignore("mixed_precision", mixed, "only no, bf16 and fp16 are modelled")
    if mixed in ("bf16", "fp16"):
        m.amp = mixed


def _tp_beside_fsdp2(pc: Fields, m: Mapped) -> None:
    """A MULTI_GPU config with ``parallelism_config`` tp and dp_shard sizes (what emit/accelerate.py
    writes for ``--tp`` beside FSDP2: transformers 5.24 applies both at load, estimator/tp_fsdp2.py):
    tensor parallelism beside FSDP2 full_shard; the other sizes as :func:`_parallelism` reads them."""
    _parallelism(pc, m)
    shard = pc.int("parallelism_config_dp_shard_size", None) or pc.int("dp_shard_size", None) or 1
    if m.setup.get("tp", 1) > 1 and shard > 1:
        m.setup.update(fsdp="full_shard", fsdp_version=2)


def _parallelism(pc: Fields | None, m: Mapped) -> None:
    """accelerate 1.15's ``parallelism_config`` (FSDP2; ``accelerate launch`` exports each key as
    PARALLELISM_CONFIG_*): the HSDP replicas, tensor and context parallel sizes. ``dp_shard_size``
    is what the rest leaves of ``num_processes`` (accelerate checks the product)."""
    if pc is None:
        return
    for mine, theirs in (("dp_replicate", "dp_replicate_size"), ("tp", "tp_size"), ("cp", "cp_size")):
        value = pc.int(f"parallelism_config_{theirs}", None) or pc.int(theirs, None)
        if value is not None and value > 1:
            m.setup[mine] = value
    strategy = pc.str("parallelism_config_cp_comm_strategy", None) or pc.str("cp_comm_strategy", None)
    if m.setup.get("cp", 1) > 1 and strategy not in (None, "allgather"):  # estimator/context_parallel.py
        m.ignore("parallelism_config_cp_comm_strategy", strategy, "the estimate models torch's allgather rotate "
                 "method (every rank's K/V gathered at once); alltoall passes one block at a time and holds less")
