"""The truth for DeepSpeed ZeRO: the real engine run with N processes on this machine, per rank.

    runs = run_zero(tiny_config(), [Setup(zero_stage=2, gpus=2), ...], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes

Each rank is a subprocess (``python -m vramplan.truths.zero_worker JOB``, started by
:func:`vramplan.truths.ranks.launch_ranks`) with DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``)
and gloo. It runs the canonical step twice through ``deepspeed.initialize`` with the config users
get from ``vramplan emit`` (:func:`ds_config`: :func:`vramplan.emit.deepspeed.setup_config` with
the Setup's own numbers, whose ZeRO block comes from ``vramplan.estimator.distributed.zero_config``).
One launch runs several setups one after the other (each with its own model, engine and counter),
so the test suite pays for process start-up once. The tiny models are in :mod:`vramplan.truths.tiny`;
this module also holds the validate matrix (:func:`zero_rows`).

Counting. A :class:`vramplan.run.live.SplitCounter` is entered before ``deepspeed.initialize``
so that every buffer DeepSpeed allocates is seen; the peak is taken over the second step (the
first allocates the optimizer state and DeepSpeed's lazily created buffers; the second is the
steady state and the larger of the two).

Host versus device. On the CPU accelerator DeepSpeed's "GPU" tensors and its offloaded host
tensors are both CPU tensors, so they are told apart by what owns them, following the code that
places them (DeepSpeed 0.19, runtime/zero/stage_1_and_2.py and stage3.py):
- whatever the client optimizer allocates while it steps on an offloaded partition (its states
  and the step's transients): DeepSpeed runs that step on the host. Seen through torch's own
  optimizer step hooks (``register_step_pre_hook`` / ``register_step_post_hook``);
- the buffers DeepSpeed creates on its offload device (``self.device == "cpu"`` when offloading):
  stage 1/2 ``single_partition_of_fp32_groups`` (fp32 master partition) and its ``.grad``,
  ``param_buffer_of_bit16_for_cpu_offload_groups``, ``temp_grad_buffer_for_cpu_offload``,
  ``accumulated_grads_in_cpu``; stage 3 ``fp32_partitioned_groups_flat`` and their ``.grad``,
  ``grad_partitions_flat_buffer``; with parameter offload the partitioned bf16 parameters
  (``param.ds_tensor``) and ``param_groups_fp16_flat_cpu_memory``; with NVMe the optimizer
  swapper's page-locked buffers (``optimizer_swapper.swap_buffer_manager.all_buffers``).
Everything else (bf16 parameters, gathered parameters, gradient buckets, activations) is what a
GPU would hold. ``device_bytes`` is the peak of the live total minus the live host part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..specs import ModelSpec, Setup, SpecError
from .ranks import RankPeak, failed_launch_rows, launch_ranks
from .tiny import MOE_BASES, OTHER_BASES, TINY_BASE, TINY_SEQ, tiny_config, tiny_model


def ds_config(model: ModelSpec, setup: Setup, nvme_path: str = "/local_nvme") -> dict:
    """The ds_config the truth runs ``setup`` with: the emitter's, as users get it from
    ``vramplan emit`` (:func:`vramplan.emit.deepspeed.setup_config`), with the Setup's numbers where
    the HF Trainer would fill ``"auto"`` (as a loop calling ``deepspeed.initialize`` itself gets it).
    What the CPU run needs besides (gloo, DeepSpeed's CPU accelerator) is the ranks' environment,
    set by :func:`run_zero` and the worker, not the config."""
    from ..emit.deepspeed import setup_config

    return setup_config(model, setup, hf_auto=False, nvme_path=nvme_path)


# ----------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class ZeroRun:
    """A setup run by the real engine: one RankPeak per rank, and which optimizers ran."""

    setup: Setup
    ranks: tuple[RankPeak, ...]
    zero_optimizer: str  # DeepSpeedZeroOptimizer / DeepSpeedZeroOptimizer_Stage3
    inner_optimizer: str  # the client optimizer DeepSpeed steps (torch AdamW)
    #: with ``detail``: per rank, the device bytes live at its peak by (dtype, creation site, phase)
    details: tuple = ()

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


# ----------------------------------------------------------------------------------------------
# the launch (no torch here: the ranks import it)


def run_zero(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ, timeout_s: float = 600,
             detail: bool = False) -> list[ZeroRun]:
    """Run each setup (all with ``gpus == world``) on ``world`` processes, in one launch.

    The ranks are ``python -m vramplan.truths.zero_worker JOB`` subprocesses (no fork of the caller,
    so this works from pytest, a CLI command or a script alike); each writes its results as JSON.
    ``detail``: each rank also reports the device tensors live at its peak by dtype, shape, creation
    site and phase (at the peak of one phase instead with ``VRAMPLAN_DETAIL_PHASE=forward``, say)."""
    for s in setups:
        if s.gpus != world:
            raise SpecError(f"setup has gpus={s.gpus} but the launch has {world} processes")
        if not s.zero_stage:
            raise SpecError("run_zero measures DeepSpeed ZeRO setups (zero_stage 1-3)")
    got = launch_ranks("vramplan.truths.zero_worker", {"config": config, "setups": [s.to_dict() for s in setups],
                                                    "seq": seq, "detail": detail},
                       world, timeout_s, {"DS_ACCELERATOR": "cpu"}, "DeepSpeed")
    runs = []
    for i, s in enumerate(setups):
        ranks = tuple(RankPeak(**got[r][i]["peak"]) for r in range(world))
        details = tuple(tuple(tuple(kv) for kv in got[r][i].get("detail", ())) for r in range(world))
        runs.append(ZeroRun(s, ranks, got[0][i]["zero_optimizer"], got[0][i]["inner_optimizer"], details))
    return runs


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: The verified matrix: every stage, without and with CPU offload (parameters too at stage 3).
ZERO_MATRIX = (
    {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
    {"zero_stage": 1, "offload_optimizer": "cpu"}, {"zero_stage": 2, "offload_optimizer": "cpu"},
    {"zero_stage": 3, "offload_optimizer": "cpu"},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
)

#: NVMe offload (DeepSpeed's async_io op, with libaio): stage 1/2 treat an NVMe optimizer offload
#: as a CPU one; stage 3 swaps the optimizer's fp32 partition through page-locked host buffers.
NVME_MATRIX = ({"zero_stage": 2, "offload_optimizer": "nvme"}, {"zero_stage": 3, "offload_optimizer": "nvme"})

#: LoRA under ZeRO: stage 1/2 cast the adapters to 16 bits with the model, stage 3 keeps peft's
#: fp32 adapters (16-bit once their partitions are offloaded) and saves every Linear's input; with
#: checkpointing on 2+ ranks a recomputed layer keeps its parameters gathered through its backward.
LORA_MATRIX = (
    {"zero_stage": 1, "method": "lora"}, {"zero_stage": 2, "method": "lora"}, {"zero_stage": 3, "method": "lora"},
    {"zero_stage": 2, "method": "lora", "offload_optimizer": "cpu"},
    {"zero_stage": 3, "method": "lora", "offload_optimizer": "cpu", "offload_params": "cpu"},
    {"zero_stage": 2, "method": "lora", "checkpointing": True},
    {"zero_stage": 3, "method": "lora", "checkpointing": True},
)

#: Quantized bases under ZeRO (bitsandbytes; transformers builds them outside zero.Init, so the
#: engine casts everything but the packed weights to 16 bits, adapters included, at every stage).
QUANT_MATRIX = (
    {"zero_stage": 2, "method": "qlora"}, {"zero_stage": 3, "method": "qlora"},
    {"zero_stage": 3, "method": "qlora", "offload_optimizer": "cpu", "offload_params": "cpu"},
    {"zero_stage": 3, "method": "qlora", "checkpointing": True},
    {"zero_stage": 2, "method": "lora", "quant": "int8"},
)

#: bf16-mixed under ZeRO: fp32 weights loaded, cast to bf16 by DeepSpeed's engine, no autocast.
MIXED_MATRIX = (
    {"zero_stage": 1, "precision": "bf16-mixed"}, {"zero_stage": 2, "precision": "bf16-mixed"},
    {"zero_stage": 3, "precision": "bf16-mixed"},
    {"zero_stage": 1, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 2, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 3, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 3, "method": "qlora", "precision": "bf16-mixed"},
)

#: MoE (MOE_BASES, fused 3-D experts) under ZeRO 2 and 3.
MOE_MATRIX = (
    {"zero_stage": 2}, {"zero_stage": 3}, {"zero_stage": 3, "checkpointing": True},
    {"zero_stage": 2, "method": "lora"}, {"zero_stage": 3, "method": "lora"},
)

#: Knobs of the ZeRO matrix that are not verified here, and why.
UNVERIFIED = (
    ({"zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"},
     ("parameter NVMe offload: the emitted config pins 5 swap buffers of 1e8 elements per rank "
      "(2 GB of host RAM for two ranks); not run on this shared 23 GB machine")),
    ({"zero_stage": 2, "precision": "fp16-mixed"},
     ("fp16 (and its dynamic loss scaling): DeepSpeed's CPU accelerator refuses fp16 on this CPU "
      "('Type fp16 is not supported on your device': torch.ops.mkldnn._is_mkldnn_fp16_supported() "
      "is False); the estimate counts fp16 as bf16 (same bytes; the loss scaler keeps scalars)")),
)


def nvme_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) builds here: it needs libaio's headers."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def compare_setups(setups: list[Setup], world: int, base: str = TINY_BASE) -> list[tuple[ZeroRun, Any]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = tiny_config(base)
    model = tiny_model(config, base)
    runs = run_zero(config, setups, world)
    out = []
    for run in runs:
        out.append((run, estimate(model, run.setup)))
    return out


def zero_launches(quick: bool) -> list[tuple[str, int, tuple]]:
    """(base, world size, setups) of each launch of the validate matrix. ``quick``: world sizes 1
    and 2 on stages 1-3, one offload case, LoRA, QLoRA and bf16-mixed on the tiny Llama, and one MoE
    launch; the full matrix adds every offload case, the mixed and quantized matrices, 4 ranks,
    two other dense shapes and both MoE bases on 1 and 2 ranks."""
    worlds = (1, 2) if quick else (1, 2, 4)
    if quick:
        matrix = ZERO_MATRIX[:4] + LORA_MATRIX[1:3] + QUANT_MATRIX[:2] + MIXED_MATRIX[1:2]
        launches = [(TINY_BASE, w, matrix) for w in worlds]
        return launches + [(MOE_BASES[1], 2, (MOE_MATRIX[1], MOE_MATRIX[3]))]
    matrices = (ZERO_MATRIX + (NVME_MATRIX if nvme_available() else ()), LORA_MATRIX, QUANT_MATRIX, MIXED_MATRIX)
    launches = [(TINY_BASE, w, m) for m in matrices for w in worlds]  # a launch each: each has its time limit
    launches += [(base, 2, ZERO_MATRIX) for base in OTHER_BASES]
    return launches + [(base, w, MOE_MATRIX) for base in MOE_BASES for w in (1, 2)]


def zero_rows(quick: bool) -> list:
    """Rows for ``vramplan validate``: one per (setup, world size), the worst rank's device peak as
    the truth (``truth="deepspeed-N"``, ``knob="zero"``), plus unverifiable cases with their reason
    (see :func:`zero_launches` for the matrix)."""
    from .row import Row

    model = tiny_model()
    rows = []
    for base, world, kws in zero_launches(quick):
        family = tiny_model(base=base).family
        setups = [Setup(**kw, gpus=world, seq=TINY_SEQ) for kw in kws]
        try:
            compared = compare_setups(setups, world, base)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so, the rest stand
            rows += failed_launch_rows(setups, world, base, family, exc, lambda s: ("zero", "deepspeed"))
            continue
        for run, est in compared:
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"deepspeed-{world}", knob="zero"))
    unverified = list(UNVERIFIED)
    if not quick and not nvme_available():
        unverified += [(kw, "DeepSpeed's async_io op does not build here (it needs libaio-dev)") for kw in NVME_MATRIX]
    for kw, why in unverified:
        setup = Setup(**kw, gpus=2, seq=TINY_SEQ)
        rows.append(Row(model.name, model.family, setup, 0, 0, "", "", truth="deepspeed-2", knob="zero",
                        verified=False, why=why))
    return rows


