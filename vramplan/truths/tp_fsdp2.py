"""The truth for tensor parallelism combined with FSDP2 sharding (``--tp N --fsdp full_shard
--fsdp-version 2``, ``gpus = tp x dp_shard``): ``gpus`` gloo processes on this machine, per rank.

    runs = run_tp_fsdp2(tiny_config(), [Setup(tp=2, gpus=4, fsdp="full_shard", fsdp_version=2)], world=4)
    runs[0].ranks[3].device_bytes            # rank 3's peak of "GPU" tensor bytes

How transformers 5.24 and accelerate 1.15 run it (read from their sources):

- transformers 5.24 builds the 2-D mesh itself at load: ``from_pretrained(...,
  distributed_config=DistributedConfig(tp_plan="auto", tp_size=T, fsdp_size=D))``
  (``distributed/utils.initialize_distributed_mesh``: one mesh ``("pp", "dp_replicate", "fsdp",
  "tp")``, tp innermost, so ranks ``0..T-1`` are one TP group), then
  ``distributed/mixin.maybe_distribute_model`` applies the TP plan over the ``tp`` sub-mesh
  (``distributed/tensor_parallel.apply_tensor_parallelism``, as for ``--tp`` alone) and FSDP2 over
  the ``fsdp`` sub-mesh (``distributed/fsdp.apply_fully_sharded_data_parallelism`` with the
  config's ``base_model_fsdp_plan``: each decoder layer and an untied embedding
  ``free_full_weight`` = ``reshard_after_forward=True``, the final norm with the head (tied: the
  embedding) one ``keep_full_weight`` group, then the root; no MixedPrecisionPolicy unless
  ``fsdp_mixed_precision``), before the weights are read, so every parameter is loaded straight
  into its 2-D shard. A TP-sharded weight becomes a DTensor over ``(fsdp, tp)`` whose local tensor
  is FSDP's chunk of dim 0 of the TP shard (torch 2.13 ``FSDPParam._init_sharded_param``,
  ``_StridedShard`` on a TP ``Shard(0)``); a norm a DTensor over ``fsdp`` alone.
- ``from_pretrained``'s ``device_mesh=`` is dropped when a ``distributed_config`` is given
  (``modeling_utils.from_pretrained``: ``device_mesh = mesh_manager.get_mesh(...)``), and
  ``DistributedConfig(tp_size=T)`` alone on ``T x D`` processes raises ("The parallel mesh
  requires T processes"): in transformers 5.24 a TP model on a larger world is loaded this way only.
- The HF Trainer (``Trainer._build_accelerator_args``) then builds
  ``ParallelismConfig(tp_size=T, dp_shard_size=D)`` from ``model.config.distributed_config``.
  Under the emitted multi-GPU accelerate config (emit/accelerate.py) accelerate 1.15's ``prepare``
  finds every parameter a DTensor (``_prepare_tp`` converts none) and, the model being
  tensor-parallel, wraps no DDP (``prepare_model``): no second ``fully_shard``, no fp32 upcast.
  Under ``distributed_type: FSDP`` it would not run: ``_prepare_tp`` imports
  ``transformers.integrations.tensor_parallel.ReplicateParallel``, gone in 5.24 (ImportError,
  run here). The optimizer is torch AdamW over the Trainer's groups split by device mesh
  (``Trainer.create_optimizer``: the 2-D weights and the 1-D norms cannot share a foreach call).
- CPU stand-in: the shard-on-read leaves each loaded shard a view of the whole tensor read, as
  for ``--tp`` alone (:func:`vramplan.truths.tp_truth.own_shards` gives each its own storage); FSDP2
  adopts the new parameters at its lazy init (``FSDPParam.reset_sharded_param``).

The step is the TP truth's (:mod:`vramplan.truths.tp_truth`): ``model(input_ids, labels).loss
.backward()``, ``opt.step()``, ``zero_grad(set_to_none=True)``, HF checkpointing, counted by
:class:`vramplan.truths.fsdp.ResizingCounter` (FSDP2 frees unsharded parameters by resizing) that
counts a DTensor by its local tensor (:class:`vramplan.truths.tp_truth.DTensorCounter`, which also
drains each gloo collective); the lower of the second and third steps' peaks. Each dp_shard group
runs its own batch (a seed per ``fsdp`` coordinate), the two ranks of a TP group the same one.
"""

from __future__ import annotations

import os
import sys

from ..specs import Setup, SpecError
from .ranks import RankPeak, failed_launch_rows, launch_ranks, rank_worker, saved_checkpoint
from .tiny import TINY_BASE, TINY_SEQ, tiny_config, tiny_model
from .tp_truth import TpRun, measured_steps, trainer_mesh_groups

#: A setup run by real TP x FSDP2 ranks: one RankPeak per rank (the TP truth's record).
TpFsdp2Run = TpRun


def run_tp_fsdp2(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ,
                 timeout_s: float = 900) -> list[TpFsdp2Run]:
    """Run each setup (``tp > 1``, FSDP2, ``gpus == world``) on ``world`` processes, in one launch."""
    for s in setups:
        if s.tp < 2 or s.gpus != world or world % s.tp or s.fsdp == "none" or s.fsdp_version != 2:
            raise SpecError(f"run_tp_fsdp2 runs --tp with FSDP2 on {world} ranks; got tp={s.tp} gpus={s.gpus} "
                            f"fsdp={s.fsdp} fsdp_version={s.fsdp_version}")
    got = launch_ranks("vramplan.truths.tp_fsdp2", {"config": config, "setups": [s.to_dict() for s in setups],
                                                 "seq": seq}, world, timeout_s, {"ACCELERATE_USE_CPU": "true"},
                       "TP-FSDP2")
    return [TpFsdp2Run(s, tuple(RankPeak(**got[r][i]) for r in range(world))) for i, s in enumerate(setups)]


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, peft, accelerate)


def _build_model(config: dict, setup: Setup, work: str):
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..run.models import adapt_for_training
    from .tp_truth import own_shards

    transformers.logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    path = saved_checkpoint(config, dtype, work)
    dp_shard = setup.gpus // setup.tp
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", use_cache=False,
        distributed_config=DistributedConfig(tp_plan="auto", tp_size=setup.tp, fsdp_size=dp_shard))
    own_shards(model)  # the CPU stand-in for the shard-on-read copy (truths/tp_truth.py); FSDP2 adopts
    # the new parameters at its lazy init (torch 2.13 FSDPParam.reset_sharded_param)
    return adapt_for_training(model, setup)


def _prepare(setup: Setup, model, opt):
    """What the HF Trainer's accelerator does with the loaded model (``ParallelismConfig(tp_size,
    dp_shard_size)`` from its ``distributed_config``, ``prepare(model, optimizer)``) under the
    multi-GPU accelerate config the plan emits (emit/accelerate.py): accelerate finds every parameter
    a DTensor (``_prepare_tp`` converts none) and, the model being tensor-parallel, wraps no DDP."""
    import torch
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True)
    # on the CPU accelerate is MULTI_CPU, which a ParallelismConfig refuses: MULTI_GPU on the CPU
    # device, then the config the Trainer passes (its checks run as in Accelerator.__init__)
    for st in (PartialState(), acc.state):
        st.distributed_type = DistributedType.MULTI_GPU
        st.device = torch.device("cpu")
    pc = ParallelismConfig(tp_size=setup.tp, dp_shard_size=setup.gpus // setup.tp)
    acc.state.parallelism_config = pc
    acc.state.device_mesh = pc.get_device_mesh("cpu")
    pc._validate_accelerator(acc)
    wrapped, opt = acc.prepare(model, opt)
    return acc, wrapped, opt


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import gc

    import torch

    from .cpu_truth import make_optimizer
    from .fsdp import ResizingCounter
    from .tp_truth import DTensorCounter

    class Counter(DTensorCounter, ResizingCounter):
        """Counts a DTensor by its local shard, re-reads resized storages, drains collectives."""

    model = _build_model(config, setup, work)
    counter = Counter()
    counter.track(model)
    opt = make_optimizer(setup, trainer_mesh_groups(model), model)
    acc, wrapped, opt = _prepare(setup, model, opt)
    dp_rank = int(os.environ["RANK"]) // setup.tp  # the fsdp coordinate: tp is the inner mesh dim
    ids = torch.randint(0, int(config["vocab_size"]), (setup.batch, seq),
                        generator=torch.Generator().manual_seed(1 + dp_rank))
    # no set_requires_gradient_sync: under the multi-GPU state accelerate's no_sync looks for DDP's
    # model.no_sync, which an FSDPModule lacks (Accelerator.no_sync: nullcontext)
    peak = measured_steps(counter, wrapped, ids, opt, setup.grad_accum)
    del wrapped, model, opt, acc
    gc.collect()
    return peak


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: The verified TP x FSDP2 matrix (tp 2 x dp_shard 2): full fine-tuning, with checkpointing, batch 2,
#: gradient accumulation (every micro-batch reduce-scatters: estimator/tp_fsdp2.py accumulated_grad_bytes).
TP_FSDP2_MATRIX = ({}, {"checkpointing": True}, {"batch": 2}, {"grad_accum": 2})
#: An untied head (Llama-3.1: lm_head its own FSDP tail group with the norm) and Qwen3's q/k norms.
TP_FSDP2_BASES = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B")
#: What is refused, and why (estimator/tp_fsdp2.py check_tp_fsdp2).
TP_FSDP2_UNVERIFIED = (
    ({"method": "lora", "lora_targets": "q_proj,k_proj,v_proj,gate_proj,up_proj"},
     "peft 0.21 wraps the Linears after transformers 5.24's load-time fully_shard; its _get_in_out_features "
     "reads the (fsdp, tp) shard's width, lora_B gets out/(tp*dp_shard) rows on a tp-mesh DTensor of global out: "
     "the first forward fails (RuntimeError: shape '[1, 64, 32]' is invalid for input of size 1024, in "
     "transformers' tp_forward; tests/test_tp_lora.py): refused"),
    ({"fsdp": "shard_grad_op"},
     "transformers 5.24 shards with its base_model_fsdp_plan (every layer reshard_after_forward=True); "
     "shard_grad_op has no DistributedConfig field: refused"),
)


def _setups(kws) -> list[Setup]:
    return [Setup(**{"fsdp": "full_shard", **kw}, tp=2, gpus=4, fsdp_version=2, seq=TINY_SEQ) for kw in kws]


def compare_setups(setups: list[Setup], base: str = TINY_BASE) -> list[tuple[TpFsdp2Run, object]]:
    """Run ``setups`` on ``gpus`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = tiny_config(base)
    model = tiny_model(config, base)
    return [(run, estimate(model, run.setup)) for run in run_tp_fsdp2(config, setups, setups[0].gpus)]


def launches(quick: bool) -> list[tuple[str, tuple]]:
    """(base model, setups) of each 4-rank launch of the validate matrix."""
    if quick:
        return [(TINY_BASE, TP_FSDP2_MATRIX[:1])]  # one 4-rank launch (about a minute on 2 busy cores)
    return [(TINY_BASE, TP_FSDP2_MATRIX)] + [(b, TP_FSDP2_MATRIX[:1]) for b in TP_FSDP2_BASES]


def tp_fsdp2_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob tp``: per setup the fullest rank's device peak against
    the estimate (``truth="tp-fsdp2-4"``), then what is refused, with why."""
    from .row import Row

    rows = []
    for base, kws in launches(quick):
        family = tiny_model(base=base).family
        setups = _setups(kws)
        try:
            compared = compare_setups(setups, base)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so
            rows += failed_launch_rows(setups, 4, base, family, exc, lambda s: ("tp", "tp-fsdp2"))
            continue
        for run, est in compared:
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth="tp-fsdp2-4", knob="tp"))
    model = tiny_model()
    for kw, why in TP_FSDP2_UNVERIFIED:
        rows.append(Row(model.name, model.family, _setups([kw])[0], 0, 0, "", "", truth="tp-fsdp2-4", knob="tp",
                        verified=False, why=why))
    return rows


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
