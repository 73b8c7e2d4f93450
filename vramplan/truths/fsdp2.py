"""The truth for FSDP2 (``fully_shard``, accelerate ``fsdp_version: 2``): N processes on this machine, per rank.

    runs = run_fsdp2(tiny_config(), [Setup(fsdp="full_shard", fsdp_version=2, gpus=2)], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes

Each rank is a subprocess (``python -m vramplan.truths.fsdp2 JOB``, gloo, CPU) started by
:func:`vramplan.truths.ranks.launch_ranks`, as the FSDP1 truth's are (:mod:`vramplan.truths.fsdp`).

FSDP2 as the HF Trainer runs it with accelerate 1.15 (``fsdp_version: 2``): torch 2.13's
``fully_shard`` runs on CPU with gloo (all-gather, reduce-scatter and all-reduce of gloo). The
worker builds the model as the FSDP1 truth does (:func:`vramplan.truths.fsdp.build_model`), creates
the optimizer over the Trainer's parameter groups *before* preparing (transformers 5.24
``Trainer._prepare_for_training``: "Can't delay optimizer creation when using FSDP2", so peft's
``fsdp_auto_wrap_policy`` is not installed either), then calls ``Accelerator.prepare(model,
optimizer)``, i.e. accelerate's own ``_prepare_fsdp2`` / ``fsdp2_prepare_model``: each decoder
layer ``fully_shard``-ed (TRANSFORMER_BASED_WRAP), the input embedding its own group (untied), the
final norm and head (and a tied embedding) one group with ``reshard_after_forward=False``, the
root last; trainable parameters upcast to fp32 under mixed precision (not with a bitsandbytes
base); the ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype)`` from the precision.
As in :mod:`vramplan.truths.fsdp`, accelerate's state is set to FSDP on the CPU device (it only turns
FSDP on for accelerators). ``fsdp_reshard_after_forward``: True for ``--fsdp full_shard``, False
for ``shard_grad_op``.

A QLoRA base is the FSDP1 truth's (bitsandbytes 4-bit weights packed in the load dtype), which
``fully_shard`` shards as floating parameters. fp16 MixedPrecisionPolicy runs without a loss
scaler here (accelerate builds its torch.amp GradScaler for an accelerator; its scale and inf
flags are a few bytes and it unscales the gradients in place).

Counting: the FSDP1 truth's :class:`vramplan.truths.fsdp.ResizingCounter` (FSDP2 also frees and
re-allocates unsharded parameters by resizing storages in place) that counts a DTensor by its
local shard (:class:`vramplan.truths.tp_truth.DTensorCounter`: a DTensor is a wrapper whose own
"storage" has the global size), the peak over the second step. Every rank holds the same padded
shards, so the ranks' peaks agree.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..specs import Setup, SpecError
from .hsdp import attach_mesh
from .ranks import RankPeak, counter_peak, failed_launch_rows, launch_ranks, rank_worker
from .tiny import MOE_BASES, OTHER_BASES, TINY_BASE, TINY_SEQ, tiny_config, tiny_model


@dataclass(frozen=True)
class Fsdp2Run:
    """A setup run by real FSDP2 ranks: one RankPeak per rank, and how many FSDP param groups."""

    setup: Setup
    ranks: tuple[RankPeak, ...]
    groups: int  # fully_shard-ed modules holding parameters

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


def run_fsdp2(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ,
              timeout_s: float = 600) -> list[Fsdp2Run]:
    """Run each FSDP2 setup on ``world`` processes, in one launch."""
    for s in setups:
        if s.gpus != world or s.fsdp == "none" or s.fsdp_version != 2:
            raise SpecError(f"run_fsdp2 runs FSDP2 setups on {world} ranks; got fsdp={s.fsdp} "
                            f"fsdp_version={s.fsdp_version} gpus={s.gpus}")
    got = launch_ranks("vramplan.truths.fsdp2", {"config": config, "setups": [s.to_dict() for s in setups], "seq": seq},
                       world, timeout_s, {"ACCELERATE_USE_CPU": "true"}, "FSDP2")
    return [Fsdp2Run(s, tuple(RankPeak(**got[r][i]["peak"]) for r in range(world)), got[0][i]["groups"])
            for i, s in enumerate(setups)]


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, accelerate)


def fsdp2_plugin(setup: Setup):
    """accelerate's FSDP2 plugin with the emitted accelerate config's values (emit/accelerate.py)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=setup.fsdp == "full_shard",
        auto_wrap_policy="transformer_based_wrap",
        cpu_offload=setup.offload_params == "cpu",
        # emitted True: rank 0 loads, the others get the shards broadcast; every rank here builds
        # the same seeded weights, and after prepare it changes no step memory
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT",
    )


def cpu_fsdp_accelerator(setup: Setup):
    """A fresh ``Accelerator`` on CPU whose state says FSDP (accelerate turns FSDP on only for
    accelerators: the truths set the state after it is made), and ``setup``'s FSDP2 plugin, not
    yet attached: (accelerator, plugin)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    from ..emit.accelerate import MIXED_PRECISION

    plugin = fsdp2_plugin(setup)
    AcceleratorState._reset_state()
    acc = Accelerator(mixed_precision=MIXED_PRECISION[setup.precision], cpu=True)
    for st in (PartialState(), acc.state):
        st.distributed_type = DistributedType.FSDP
        st.device = torch.device("cpu")
    return acc, plugin


def _prepare(setup: Setup, model, opt):
    """accelerate's FSDP2 preparation (``Accelerator.prepare(model, optimizer)``), on CPU."""
    acc, plugin = cpu_fsdp_accelerator(setup)
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    attach_mesh(acc, setup)  # hybrid sharding: the 2-D mesh (vramplan.truths.hsdp)
    wrapped, opt = acc.prepare(model, opt)
    return acc, wrapped, opt


def _run_one(config: dict, setup: Setup, seq: int, work: str = "") -> dict:
    import gc

    import torch
    from torch.distributed.fsdp import FSDPModule

    from ..model.architecture import model_spec_from_config
    from ..run.cuda_paths import quant_state_tensors
    from .cpu_truth import make_optimizer
    from .fsdp import ResizingCounter, build_model, trainer_groups
    from .tp_truth import DTensorCounter

    class Fsdp2Counter(DTensorCounter, ResizingCounter):
        """Counts a DTensor by its local shard and re-reads resized storages."""

    spec = model_spec_from_config(config, name="tiny")
    model = build_model(config, setup, work)
    counter = Fsdp2Counter()
    counter.track(model, quant_state_tensors(model))
    ids = torch.randint(0, spec.vocab_size, (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    with counter:
        counter.phase("init")
        # the Trainer creates the optimizer before preparing under FSDP2; accelerate swaps in the
        # sharded parameters (fsdp2_switch_optimizer_parameters)
        opt = make_optimizer(setup, trainer_groups(model), model)
        acc, wrapped, opt = _prepare(setup, model, opt)
        # param groups: fully_shard on a list of modules gives them one state (accelerate's tail)
        groups = len({id(m._get_fsdp_state()) for m in wrapped.modules()
                      if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None})
        for step in range(2):
            if step == 1:
                counter.start_measuring()
            for micro in range(setup.grad_accum):
                last = micro == setup.grad_accum - 1
                # accelerate's accumulate()/no_sync(): set_requires_gradient_sync(False) but the last
                wrapped.set_requires_gradient_sync(last)
                counter.phase("forward")
                loss = wrapped(input_ids=ids, labels=ids).loss
                counter.phase("backward")
                acc.backward(loss)
                del loss
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.phase(None)
    peak = counter_peak(counter)
    del wrapped, model, opt, acc
    gc.collect()
    return {"peak": peak, "groups": groups}


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: The verified FSDP2 matrix (2+ ranks): both reshard modes, LoRA, checkpointing, accumulation,
#: the precisions (fp32 masters under bf16/fp16 MixedPrecisionPolicy; pure 16-bit without one).
FSDP2_MATRIX = (
    {"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"}, {"fsdp": "full_shard", "method": "lora"},
    {"fsdp": "full_shard", "checkpointing": True}, {"fsdp": "shard_grad_op", "method": "lora"},
    {"fsdp": "full_shard", "method": "lora", "checkpointing": True},
    {"fsdp": "full_shard", "grad_accum": 2}, {"fsdp": "full_shard", "method": "lora", "grad_accum": 2},
    {"fsdp": "full_shard", "precision": "bf16-mixed"},
    {"fsdp": "full_shard", "precision": "bf16-mixed", "method": "lora"},
    {"fsdp": "full_shard", "precision": "bf16-mixed", "checkpointing": True, "batch": 2},
    {"fsdp": "full_shard", "precision": "fp16-mixed"}, {"fsdp": "full_shard", "precision": "fp32"},
    {"fsdp": "full_shard", "optimizer": "sgd"}, {"fsdp": "full_shard", "optimizer": "adamw-fused"},
    # QLoRA: bitsandbytes 4-bit weights packed in the load dtype (bnb_4bit_quant_storage), each a
    # Params4bit that fully_shard shards on its packed dim 0; the quant states whole on every rank
    {"fsdp": "full_shard", "method": "qlora"}, {"fsdp": "full_shard", "method": "qlora", "checkpointing": True},
    {"fsdp": "full_shard", "method": "qlora", "precision": "fp32"},
)
#: What the other shapes (untied head: Llama-3.1; q/k/v biases: Qwen2.5) and 4 ranks run.
FSDP2_SHAPES = (FSDP2_MATRIX[0], FSDP2_MATRIX[1], FSDP2_MATRIX[2], FSDP2_MATRIX[9], FSDP2_MATRIX[15])

#: What FSDP2 does not model yet, and why (estimator/fsdp2.py check_fsdp2 refuses each).
FSDP2_UNVERIFIED = (
    ({"fsdp": "full_shard", "offload_params": "cpu"},
     "CPUOffloadPolicy keeps the shards on the host and copies them to the GPU per all-gather; fully_shard runs "
     "it on gloo CPU ranks (accelerate's prepare too), but on a CPU mesh torch 2.13's shard copy "
     "(FSDPParam.all_gather_inputs .to(device)) and gradient copy (foreach_reduce .to(cpu)) return the same "
     "storage: a truth needs stand-in copies for both (not built yet), so the GPU/host split is not measured: "
     "refused"),
    ({"fsdp": "full_shard", "method": "lora", "moe": True},
     "MoE (fused 3-D experts): fully_shard runs the tiny Mixtral here, full and LoRA, but the two ranks' peaks "
     "differ (2.07 vs 2.17 MB full, 3.32 vs 3.67 MB LoRA) and that is not modelled: refused"),
    ({"fsdp": "no_shard"}, "FSDP2 has no NO_SHARD (accelerate 1.15's reshard_after_forward is a bool): refused"),
    ({"fsdp": "full_shard", "optimizer": "adamw-8bit"},
     "bitsandbytes optimizers over DTensor shards are not run: refused"),
)


def launches(quick: bool) -> list[tuple[str, int, tuple]]:
    """(base model, world size, setups) of each launch of the validate matrix."""
    if quick:
        return [(TINY_BASE, 2, FSDP2_MATRIX[:3])]
    return ([(TINY_BASE, 2, FSDP2_MATRIX), (TINY_BASE, 4, FSDP2_SHAPES)]
            + [(b, 2, FSDP2_SHAPES) for b in OTHER_BASES])


def compare_setups(setups: list[Setup], world: int, base: str = TINY_BASE) -> list[tuple[Fsdp2Run, object]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = tiny_config(base)
    model = tiny_model(config, base)
    return [(run, estimate(model, run.setup)) for run in run_fsdp2(config, setups, world)]


def fsdp2_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob fsdp2``: per (setup, world size) the fullest rank's
    device peak against the estimate (``truth="fsdp2-N"``; every rank holds the same padded
    shards, and the rows say so when ranks differ), then what is refused, with why."""
    from .row import Row

    rows = []
    for base, world, kws in launches(quick):
        family = tiny_model(base=base).family
        setups = [Setup(**kw, gpus=world, seq=TINY_SEQ, fsdp_version=2) for kw in kws]
        try:
            compared = compare_setups(setups, world, base)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so, the rest stand
            rows += failed_launch_rows(setups, world, base, family, exc, lambda s: ("fsdp2", "fsdp2"))
            continue
        for run, est in compared:
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"fsdp2-{world}", knob="fsdp2"))
    model = tiny_model()
    for kw, why in FSDP2_UNVERIFIED:
        shown = tiny_model(base=MOE_BASES[0]) if kw.get("moe") else model
        kw = {k: v for k, v in kw.items() if k not in ("hybrid", "moe")}
        rows.append(Row(shown.name, shown.family, Setup(**kw, gpus=2, seq=TINY_SEQ, fsdp_version=2), 0, 0, "", "",
                        truth="fsdp2-2", knob="fsdp2", verified=False, why=why))
    return rows


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
