"""The emitted multi-GPU accelerate configs (FSDP1, FSDP2, tensor and context parallelism) and their
train.py, launched by ``accelerate launch`` on CPU gloo ranks.

    accelerate launch --config_file accelerate_config.yaml --main_process_port PORT \\
        -m vramplan.truths.cpu_launch train.py --cpu --max-steps 2 --no-save

(:func:`cpu_command` makes that from the emitted launch command.) Each rank then writes
``launch.rankN.json`` (in its working directory) saying what trained it: the accelerate state's
distributed type, the FSDP version and how many modules FSDP wrapped, the model's tensor-parallel
size and DTensor parameters, the parameter elements this rank holds against the model's, the
plugin's sharding/offload/precision, the environment the launcher exported, the process group.

Real (accelerate 1.15, transformers 5.24, torch 2.13): the launcher (``_validate_launch_command``
reads the emitted YAML, ``multi_gpu_launcher`` exports ``prepare_multi_gpu_env``'s
ACCELERATE_USE_FSDP / FSDP_* / ACCELERATE_MIXED_PRECISION and starts the ranks through
``torch.distributed.run``), the emitted train.py unchanged, the HF Trainer and the Accelerator it
builds, ``FullyShardedDataParallelPlugin()`` reading those variables, ``Accelerator.prepare`` (FSDP1
wrapping, or ``fsdp2_prepare_model``'s ``fully_shard`` calls and ``fsdp2_load_full_state_dict``'s
broadcast from rank 0 under ``fsdp_cpu_ram_efficient_loading``; for tensor parallelism
``from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))``'s DTensor shards and the
Trainer's ``ParallelismConfig(tp_size)``), the collectives over gloo.

Why this module exists: on a machine without an accelerator, accelerate 1.15 runs neither FSDP nor
tensor parallelism. ``accelerate launch --config_file <emitted FSDP1 yaml> train.py --cpu`` fails on
every rank in ``FullyShardedDataParallelPlugin.__post_init__`` (``fsdp_sync_module_states: true``
makes it look up an accelerator device: "There are currently no available devices found"); the
FSDP2 yaml launches, but ``AcceleratorState`` on CPU is MULTI_CPU (state.py: only the accelerator
branch turns the state into FSDP and keeps the plugin), so the Trainer's ``is_fsdp_enabled`` is
False and it trains the unsharded model under MULTI_CPU, silently; a tensor-parallel model stops in
``ParallelismConfig._validate_accelerator``, which accepts FSDP2, DeepSpeed and multi-device states,
not MULTI_CPU. (``accelerate launch --cpu`` runs one process: ``launch_command`` takes
``simple_launcher`` for ``--cpu``.)

Stand-ins, each what the accelerator branch does in its place, nothing else changed:

1. ``AcceleratorState`` built with an FSDP plugin on a MULTI_CPU state takes the accelerator
   branch's three steps (state.py ``AcceleratorState.__init__``): distributed type FSDP,
   ``fsdp_plugin.set_mixed_precision`` unless "no", ``state.fsdp_plugin``; PartialState's
   distributed type too (AcceleratorState re-reads it), and the device ``cpu`` (MULTI_CPU names it
   ``cpu:RANK``), as the truths :mod:`vramplan.truths.fsdp` / :mod:`vramplan.truths.fsdp2` set it.
2. The FSDP1 plugin's ``param_init_fn`` (``sync_module_states``) materializes on ``cpu`` instead
   of the accelerator's current device (used only for modules on the meta device).
3. FSDP1 ``sync_module_states``: torch's ``_check_module_states_for_sync_module_states`` (it refuses
   CPU tensors) is skipped, so FSDP's own broadcast of rank 0's weights runs over gloo.
4. CPU offload: ``Tensor.pin_memory`` is a copy that reads as pinned (pinning needs an
   accelerator), and the CPU stream's ``synchronize`` returns at once (FSDP1's offload waits on the
   device stream after the backward).
5. Tensor parallelism: ``ParallelismConfig._validate_accelerator`` counts MULTI_CPU as the
   multi-device state it accepts; ``Accelerator.prepare_model`` then takes its tensor-parallel
   branch (no DDP wrapper), as on GPUs.
6. Context parallelism: inside ``Accelerator.maybe_context_parallel`` (torch's ``context_parallel``,
   entered by the Trainer per batch), ``F.scaled_dot_product_attention`` is torch 2.13's own ring on
   the cp group with the stand-in per-block kernel of :func:`vramplan.truths.cp_truth.ring_sdpa`: torch's
   CP dispatcher takes CUDA's flash/efficient/cuDNN SDPA only, not CPU's.
7. Leaving: the emitted script's closing ``dist.destroy_process_group()`` ends the rank (flush,
   ``os._exit(0)``), as does the script's ``SystemExit(0)``: tearing gloo's groups down can abort a
   rank whose work is done (exit -6), which is a CPU artefact, not the emitted script's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

#: the per-rank report each launched rank writes into its working directory
REPORT = "launch.rank{rank}.json"


def cpu_command(command: str, port: int) -> list[str]:
    """The emitted ``accelerate launch --config_file ... train.py ...`` command (as
    :func:`vramplan.emit.launch_command` writes it) with this module in front of the script and the
    rendezvous on ``port``: launcher, config and script arguments stay as emitted."""
    import shlex

    argv = shlex.split(command)
    if argv[:2] != ["accelerate", "launch"] or "--config_file" not in argv:
        raise ValueError(f"not an accelerate launch of an emitted config: {command}")
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return [*argv[:script], "--main_process_port", str(port), "-m", __name__, *argv[script:]]


def _fsdp_state_on_cpu() -> None:
    """Stand-in 1: the accelerator branch of ``AcceleratorState.__init__`` for a CPU state."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None, fsdp_plugin=None,
             *args, **kwargs):
        original(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        if fsdp_plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        for state in (PartialState(), self):
            state.distributed_type = DistributedType.FSDP
            state.device = torch.device("cpu")
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def _fsdp1_on_cpu() -> None:
    """Stand-ins 2 and 3: FSDP1's ``sync_module_states`` with CPU modules."""
    import accelerate.utils.dataclasses as acc_dataclasses
    import torch
    import torch.distributed.fsdp._init_utils as init_utils

    plugin_cls = acc_dataclasses.FullyShardedDataParallelPlugin
    original = plugin_cls.__post_init__

    def post_init(self):
        if self.fsdp_version == 2 or torch.accelerator.is_available():
            return original(self)
        found = acc_dataclasses.is_cuda_available
        current = torch.cuda.current_device
        acc_dataclasses.is_cuda_available, torch.cuda.current_device = (lambda: True), (lambda: "cpu")
        try:
            return original(self)  # param_init_fn = to_empty(device="cpu")
        finally:
            acc_dataclasses.is_cuda_available, torch.cuda.current_device = found, current

    plugin_cls.__post_init__ = post_init
    init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def _offload_on_cpu() -> None:
    """Stand-in 4 (as vramplan.truths.fsdp's worker): a pinned copy is a copy, and the CPU stream's
    ``synchronize`` (FSDP1's offload waits on it after the backward) returns at once."""
    import torch

    if torch.accelerator.is_available():
        return
    pinned: set[int] = set()  # storages the stand-in "pinned" (an address reused later reads as pinned: no copy)
    is_pinned = torch.Tensor.is_pinned

    def pin_memory(self, *a, **k):
        copy = self.clone()
        pinned.add(copy.untyped_storage().data_ptr())
        return copy

    # FSDP2 re-pins a shard that is not pinned (FSDPParam.reset_sharded_param at lazy init): a copy
    # that never reads as pinned would leave the all-gather reading the old shard, the optimizer the new
    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = lambda self, *a, **k: self.untyped_storage().data_ptr() in pinned or is_pinned(self)
    stream_cls = type(torch.cpu.current_stream())
    if not hasattr(stream_cls, "synchronize"):
        stream_cls.synchronize = lambda self: None  # CPU ops are synchronous


def _tp_on_cpu() -> None:
    """Stand-in 5: ``ParallelismConfig._validate_accelerator`` counts a MULTI_CPU state as the
    multi-device state it accepts (the one check that refuses a tensor-parallel model on CPU ranks)."""
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            return original(self, accelerator)
        multi_device = Accelerator.multi_device
        Accelerator.multi_device = property(lambda acc: acc.use_distributed)
        try:
            return original(self, accelerator)
        finally:
            Accelerator.multi_device = multi_device

    ParallelismConfig._validate_accelerator = validate


#: the local sequence length of each ring attention call of this rank (stand-in 6), for the report
RING_SEQS: list[int] = []


def _cp_on_cpu() -> None:
    """Stand-in 6: the ring attention of the CP truth inside ``Accelerator.maybe_context_parallel``."""
    import contextlib

    from accelerate import Accelerator

    from .cp_truth import ring_sdpa

    original = Accelerator.maybe_context_parallel

    @contextlib.contextmanager
    def maybe_context_parallel(self, *args, **kwargs):
        with original(self, *args, **kwargs):
            pc = self.parallelism_config
            if pc is None or not pc.cp_enabled:
                yield
                return
            with ring_sdpa(self.torch_device_mesh["cp"].get_group(), seen=RING_SEQS):
                yield

    Accelerator.maybe_context_parallel = maybe_context_parallel


def _report_after_training() -> None:
    """Wrap ``Trainer.train``: once it returns, write what trained the model (:data:`REPORT`)."""
    import transformers

    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        rank = int(os.environ.get("RANK", "0"))
        report = sharding_report(self)
        tmp = Path(f".{REPORT.format(rank=rank)}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, REPORT.format(rank=rank))  # atomic: a reader never sees half a report
        return result

    transformers.Trainer.train = train


def sharding_report(trainer) -> dict:
    """What the Trainer's accelerator did with the model: FSDP version, wrapped modules, this
    rank's parameter elements (FSDP1: its flat parameters' shards; FSDP2: its DTensors' local
    shards) against the model's, and the plugin's settings."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    state = trainer.accelerator.state
    pc = trainer.accelerator.parallelism_config  # the Trainer's ParallelismConfig (tensor parallelism), or None
    plugin = getattr(state, "fsdp_plugin", None)
    wrapped = trainer.model_wrapped
    fsdp1 = [m for m in wrapped.modules() if isinstance(m, FSDP)]
    fsdp2 = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    if fsdp1:  # each unit's flat parameter: this rank's padded shard of its unpadded whole
        flat = [m._handle.flat_param for m in fsdp1 if m._handle is not None]
        local, whole = sum(f.numel() for f in flat), sum(f._unpadded_unsharded_size.numel() for f in flat)
    else:  # a DTensor's numel is the global one
        params = list(wrapped.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        whole = sum(p.numel() for p in params)
    report = {
        "rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "distributed_type": str(state.distributed_type).split(".")[-1], "mixed_precision": state.mixed_precision,
        "is_fsdp_enabled": trainer.is_fsdp_enabled, "fsdp1_modules": len(fsdp1), "fsdp2_modules": len(fsdp2),
        "local_param_numel": local, "model_param_numel": whole, "global_step": trainer.state.global_step,
        "wrapper": type(wrapped).__name__, "tp_size": getattr(trainer.model, "tp_size", None) or 1,
        "dtensor_params": sum(isinstance(p, DTensor) for p in wrapped.parameters()),
        "parallelism": None if pc is None else {k: getattr(pc, f"{k}_size") for k in ("dp_replicate", "dp_shard", "tp",
                                                                                     "cp")},
        "ring_seqs": RING_SEQS[:8],  # context parallelism: the sequence each ring attention call ran on
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FSDP_", "ACCELERATE_"))},
    }
    if plugin is not None:
        report["fsdp"] = {
            "version": plugin.fsdp_version,
            "sharding_strategy": str(plugin.sharding_strategy).split(".")[-1] if plugin.fsdp_version == 1 else None,
            "reshard_after_forward": plugin.reshard_after_forward if plugin.fsdp_version == 2 else None,
            "offload": type(plugin.cpu_offload).__name__ if plugin.fsdp_version == 2 else
            bool(plugin.cpu_offload.offload_params),
            "mixed_precision_policy": None if plugin.mixed_precision_policy is None else
            str(getattr(plugin.mixed_precision_policy, "param_dtype", None)),
        }
    return report


def install_stand_ins() -> None:
    """Stand-ins 1-6 (the module docstring), in this process."""
    _fsdp_state_on_cpu()
    _fsdp1_on_cpu()
    _offload_on_cpu()
    _tp_on_cpu()
    _cp_on_cpu()


def main(argv: list[str]) -> None:
    """Install the stand-ins and the report, then run ``argv[0]`` (the emitted train.py) as
    ``__main__`` with the rest of ``argv`` as its arguments."""
    if not argv:
        raise SystemExit("error: usage: accelerate launch ... -m vramplan.truths.cpu_launch train.py [ARGS]")
    install_stand_ins()
    _report_after_training()
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    _end_at_group_exit()
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:  # the emitted script ends with ``raise SystemExit(main())``
        if done.code not in (0, None):
            raise
    from .ranks import exit_rank

    exit_rank()  # the script finished and the report is written: skip the teardown where gloo can abort


def _end_at_group_exit() -> None:
    """The emitted train.py's last act is ``dist.destroy_process_group()`` (then ``return 0``): the rank
    ends there instead (:func:`vramplan.truths.ranks.exit_rank`), every collective of the script being
    done. Destroying a gloo group whose worker threads (the device mesh's sub-groups, context
    parallelism's ring) are still joinable aborts the process ("terminate called without an active
    exception", exit -6) after the work is finished; NCCL on GPUs has no such teardown."""
    import torch.distributed as dist

    from .ranks import exit_rank

    def destroy_process_group(group=None):
        if group is not None:  # a sub-group the script drops: nothing to end
            return None
        exit_rank()

    dist.destroy_process_group = destroy_process_group


if __name__ == "__main__":
    main(sys.argv[1:])
