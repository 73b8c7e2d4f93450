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

from ..inputs import load_structured
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


def read_fsdp(strategy, config: Fields | None, m: Mapped, key: str) -> None:
    """FSDP: a sharding strategy name (``full_shard``; accelerate's ``FULL_SHARD``/``1``; HF's
    ``fsdp: "full_shard auto_wrap"`` list) and an ``fsdp_config`` (offload, version)."""
    words = strategy if isinstance(strategy, list) else str(strategy).split()
    mode = next((_FSDP[w.lower()] for w in map(str, words) if w.lower() in _FSDP), None)
    if config is not None:
        named = config.raw("fsdp_sharding_strategy", config.raw("sharding_strategy"))
        reshard = config.raw("fsdp_reshard_after_forward", config.raw("reshard_after_forward"))
        for value in (named, reshard):
            if value is not None and str(value).lower() in _FSDP:
                mode = _FSDP[str(value).lower()]
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
        read_fsdp("full_shard", f.sub("fsdp_config"), m, "fsdp_config")
    elif kind not in ("NO", "MULTI_GPU"):
        m.ignore("distributed_type", kind, "only NO, MULTI_GPU, DEEPSPEED and FSDP are modelled")
    mixed = f.str("mixed_precision", "no")
    if mixed not in ("no", "bf16", "fp16"):
        m.ignore("mixed_precision", mixed, "only no, bf16 and fp16 are modelled")
    if mixed in ("bf16", "fp16"):
        m.amp = mixed
