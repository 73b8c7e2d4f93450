"""The truth for pipeline parallelism (``--pp N``), alone and with data parallelism beside it
(``--gpus`` = ``pp x dp``): ``gpus`` gloo processes on this machine running torch 2.13's own
``torch.distributed.pipelining`` schedule, one stage per rank (``dp`` ranks per stage), per rank.

    runs = run_pp(tiny_config(PP_BASE, layers=4), [Setup(pp=2, gpus=2, grad_accum=2)], world=2)
    runs[0].ranks[1].device_bytes            # stage 1's peak of "GPU" tensor bytes

Each rank is a subprocess (``python -m vramplan.truths.pipeline JOB``) started by
:func:`vramplan.truths.ranks.launch_ranks`, as the other N-process truths' are.

What runs is a manual stage split as torchtitan makes one (``pipeline_module_split``): every rank
builds the model (random weights, seed 0, the setup's dtype, SDPA, HF gradient checkpointing when
asked) and keeps its stage's part of it (:func:`stage_layers`: an even split of the decoder layers,
the first stages one more when they do not divide; the first stage keeps the embedding, the last the
final norm and the head; the rest is dropped), wrapped in :class:`StageModule`, which runs
transformers' own ``LlamaModel.forward`` over the kept layers (``inputs_embeds`` on the later
stages). ``PipelineStage(module, stage, N, cpu, group=pp)`` and ``ScheduleGPipe`` / ``Schedule1F1B``
with ``n_microbatches = grad_accum`` and transformers' ``ForCausalLMLoss`` (logits upcast to fp32,
labels shifted) as ``loss_fn``; the step is ``schedule.step(ids, target=ids, losses=losses,
return_outputs=False)`` (torchtitan's call: the last stage keeps no logits for the caller; the first
stage gets ``ids`` of ``grad_accum x batch`` rows, which the schedule splits), then torch AdamW
(foreach) over the stage's parameters, ``zero_grad(set_to_none=True)``. Three steps; the peak of
the second and third, the lower of the two (gloo's worker threads free a p2p's tensors a moment
late: :mod:`vramplan.truths.tp_truth`), per phase too (forward: inside ``forward_one_chunk``,
backward: inside ``backward_one_chunk`` and the FSDP2 reduce after it, ``perform_reduce_grad``; the
rest of the schedule's step counts to the last one).

Data parallelism beside the pipeline (``gpus > pp``; estimator/pipeline_check.py ``data_parallel``):
the ranks form torchtitan's mesh, ``pp`` outermost (``init_device_mesh("cpu", (pp, dp))``: rank
``r`` is stage ``r // dp``), each data-parallel group its own batch (seed per ``dp`` coordinate).

- FSDP2 (``--fsdp full_shard --fsdp-version 2``): each stage sharded over its ``dp`` ranks as
  torchtitan does it (:func:`_fully_shard_stage`); the pipeline stage drives it
  (``backward_maybe_with_nosync``, ``perform_reduce_grad``). gloo's reduce-scatter clones its whole
  input, which NCCL does not: the truth runs FSDP2's reduce-scatter through a stand-in that
  all-reduces FSDP2's own input in place (:func:`_nccl_like_reduce_scatter`). Counted by a
  :class:`vramplan.truths.fsdp.ResizingCounter` (FSDP2 frees and re-allocates unsharded parameters by
  resizing storages) that counts a DTensor by its local shard and drains each of the data-parallel
  group's collectives (:class:`vramplan.truths.tp_truth.DTensorCounter`), not the pipeline's p2p.
- DDP (no ``--fsdp``): torch's ``DistributedDataParallel`` around each stage (``bucket_cap_mb=25``,
  ``gradient_as_bucket_view=False``, the defaults), built inside the counter (its Reducer allocates
  the buckets then); the stage runs every micro-batch but the last under ``no_sync``
  (``forward_maybe_with_nosync`` / ``backward_maybe_with_nosync``). The stage is given its input and
  output shapes (``input_args`` / ``output_args``): torch 2.13's dynamic metadata inference runs the
  DDP module outside ``no_sync`` and its Reducer then fails its first bucket rebuild
  (``reducer.cpp`` ``_rebuild_buckets``: "rebuilt parameter indices size is not same as original model
  parameters size"), which the static path skips.

``VRAMPLAN_PP_DETAIL=DIR`` appends each rank's live tensors at its peak to ``DIR/rank<r>.txt``
(``VRAMPLAN_DETAIL_PHASE=forward|backward|reduce|optimizer``: at that phase's peak instead).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..specs import Setup, SpecError
from .ranks import RankPeak, failed_launch_rows, launch_ranks, rank_worker
from .tiny import TINY_SHAPE, tiny_config, tiny_model

#: The tiny model the PP truth runs: Llama-3.1's shape (untied head: a tied one is refused under
#: --pp, estimator/pipeline.py), TINY_SHAPE widths, 4 layers (2 per stage on 2 ranks, 1 on 4).
PP_BASE = "meta-llama/Llama-3.1-8B"
PP_LAYERS = 4
PP_SEQ = 256


@dataclass(frozen=True)
class PpRun:
    """A setup run by real pipeline stages: one RankPeak per rank (= stage)."""

    setup: Setup
    ranks: tuple[RankPeak, ...]


def run_pp(config: dict, setups: list[Setup], world: int, seq: int = PP_SEQ, timeout_s: float = 600) -> list[PpRun]:
    """Run each setup (``gpus == world``, ``pp`` dividing it) on ``world`` processes, in one launch."""
    for s in setups:
        if s.gpus != world or world % s.pp:
            raise SpecError(f"setup has pp={s.pp}, gpus={s.gpus} but the launch has {world} processes")
    got = launch_ranks("vramplan.truths.pipeline", {"config": config, "setups": [s.to_dict() for s in setups],
                                                    "seq": seq}, world, timeout_s, {}, "PP")
    return [PpRun(s, tuple(RankPeak(**got[r][i]) for r in range(world))) for i, s in enumerate(setups)]


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of ``stage`` (estimator/pipeline.py ``stage_layers``: one split)."""
    from ..estimator.pipeline import stage_layers as split

    return split(num_layers, stages, stage)


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers)


def _stage_module(config: dict, setup: Setup, stage: int, stages: int):
    """This rank's stage of the model (see the module docstring)."""
    import torch
    import transformers

    from ..run.models import adapt_for_training, hf_config

    transformers.logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(hf_config(config, None), dtype=dtype,
                                                         attn_implementation="sdpa")
    full.config.use_cache = False
    full = adapt_for_training(full, setup)  # gradient checkpointing on every layer when asked
    layers = stage_layers(full.config.num_hidden_layers, stages, stage)
    inner = full.model
    inner.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
    first, last = stage == 0, stage == stages - 1
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = torch.nn.Identity()

    class StageModule(torch.nn.Module):
        """One pipeline stage: transformers' ``LlamaModel.forward`` over the kept layers (token ids
        on the first stage, the previous stage's hidden states on the others), the head on the last."""

        def __init__(self, inner, head):
            super().__init__()
            self.inner = inner
            self.head = head

        def forward(self, x):
            if first:
                hidden = self.inner(input_ids=x, use_cache=False).last_hidden_state
            else:
                hidden = self.inner(inputs_embeds=x, use_cache=False).last_hidden_state
            return self.head(hidden) if last else hidden

    module = StageModule(inner, full.lm_head if last else None)
    del full
    return module.train()


def _fully_shard_stage(module, mesh, first: bool, last: bool) -> None:
    """FSDP2 over the stage's data-parallel ranks as torchtitan applies it to each pipeline stage
    (torchtitan ``models/llama3/infra/parallelize.py`` ``apply_fsdp``, called per model part by
    ``parallelize_llama``): the embedding, each decoder layer and the final norm with the head one
    ``fully_shard`` group each, ``reshard_after_forward=False`` (its ``"default"`` policy under PP:
    ``not pp_enabled``; the norm and head group always ``False``), then the root; no
    ``MixedPrecisionPolicy`` cast for a pure 16/32-bit model (each parameter gathered in its dtype)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if first:
        fully_shard(module.inner.embed_tokens, mesh=mesh, reshard_after_forward=False)
    for layer in module.inner.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    if last:
        fully_shard([module.inner.norm, module.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh)
    comm = _nccl_like_reduce_scatter(mesh.get_group())
    for m in module.modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups:
            m.set_custom_reduce_scatter(comm)


def _nccl_like_reduce_scatter(group):
    """FSDP2's reduce-scatter as NCCL runs it, on gloo: gloo's ``reduce_scatter_tensor`` all-reduces a
    clone of the whole input and copies the rank's chunk out (torch 2.13
    ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), a transient of the input's size that
    ``ncclReduceScatter`` does not allocate; this one all-reduces FSDP2's own reduce-scatter input in
    place (``foreach_reduce`` drops it afterwards) and copies the chunk: the same sharded gradients,
    the same FSDP2 buffers, no clone (installed with ``FSDPModule.set_custom_reduce_scatter``). Checked
    against gloo's own ``reduce_scatter_tensor`` on ``group`` before use (a mismatch raises)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class NcclLikeReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])

    comm = NcclLikeReduceScatter()
    x = torch.arange(group.size() * 6, dtype=torch.float32) * (group.rank() + 1)
    want, got = torch.empty(6), torch.empty(6)
    dist.reduce_scatter_tensor(want, x.clone(), group=group)
    comm(output_tensor=got, input_tensor=x.clone(), group=group, op=dist.ReduceOp.SUM)
    if not torch.equal(want, got):
        raise RuntimeError(f"the reduce-scatter stand-in gives {got.tolist()}, gloo {want.tolist()}")
    return comm


def _runs_on(func, args: tuple, kwargs: dict, group_name: str) -> bool:
    """Whether the c10d op ``func`` runs on the process group ``group_name``: its ``group_name``
    argument (the functional collectives) or its ``ProcessGroup`` (c10d's in-place ones; boxed as a
    ScriptObject under a dispatch mode), as :class:`vramplan.truths.tp_truth.DTensorCounter` finds it."""
    from torch.distributed.distributed_c10d import ProcessGroup

    for i, arg in enumerate(func._schema.arguments):
        value = kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None
        if arg.name == "group_name" and value is not None:
            return value == group_name
        if type(value).__name__ == "ScriptObject":
            value = ProcessGroup.unbox(value)
        if isinstance(value, ProcessGroup):
            return value.group_name == group_name
    return False


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from transformers.loss.loss_utils import ForCausalLMLoss

    from ..estimator.pipeline_check import data_parallel
    from ..run.live import SplitCounter
    from ..run.models import torch_optimizer
    from .fsdp import ResizingCounter
    from .tp_truth import DTensorCounter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stages, dp = setup.pp, world // setup.pp
    stage_index, dp_index = divmod(rank, dp)  # torchtitan's mesh: pp outermost, then the data-parallel dims
    kind = data_parallel(setup)
    pp_group = dp_mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))
        pp_group, dp_mesh = mesh.get_group("pp"), mesh["dp"]
    first, last = stage_index == 0, stage_index == stages - 1
    module = _stage_module(config, setup, stage_index, stages)
    vocab = int(config["vocab_size"])

    class PpCounter(DTensorCounter, ResizingCounter):
        """Counts a DTensor by its local shard, re-reads storages FSDP2 resizes, and drains the
        data-parallel group's collectives (not the pipeline's sends and receives: the peer stage
        issues other ops)."""

        def _after_op(self, func, args, kwargs):
            if kind == "fsdp2" and func.namespace in ("c10d", "_c10d_functional") and \
                    func._opname not in ("wait_tensor", "barrier") and \
                    _runs_on(func, args, kwargs, dp_mesh.get_group().group_name):
                dist.all_reduce(torch.zeros(1), group=dp_mesh.get_group())

    counter = PpCounter() if kind != "none" else SplitCounter(detail=bool(os.environ.get("VRAMPLAN_PP_DETAIL")))
    counter.detail = bool(os.environ.get("VRAMPLAN_PP_DETAIL"))
    if kind == "fsdp2":
        _fully_shard_stage(module, dp_mesh, first, last)
    counter.track(module)
    with counter:
        counter.phase("init")
        if kind == "ddp":  # inside the counter: the Reducer allocates its buckets at construction
            module = torch.nn.parallel.DistributedDataParallel(module, process_group=dp_mesh.get_group(),
                                                               bucket_cap_mb=25, gradient_as_bucket_view=False)
    static = {}
    if kind == "ddp":  # the stage's shapes given: the dynamic metadata inference runs the DDP module outside
        # no_sync, and its Reducer then counts every parameter twice ("rebuilt parameter indices size is not
        # same as original model parameters size", reducer.cpp _rebuild_buckets)
        dtype = next(module.parameters()).dtype
        h, meta = int(config["hidden_size"]), torch.device("meta")
        hidden = torch.empty(setup.batch, seq, h, dtype=dtype, device=meta, requires_grad=True)
        static = {"input_args": torch.empty(setup.batch, seq, dtype=torch.long, device=meta) if first
                  else hidden,  # requires_grad: the stages send the gradients back (_derive_grad_metas)
                  "output_args": torch.empty(setup.batch, seq, vocab, dtype=dtype, device=meta, requires_grad=True)
                  if last else hidden}
    stage = PipelineStage(module, stage_index, stages, torch.device("cpu"), group=pp_group, **static)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[setup.pp_schedule]
    schedule = cls(stage, n_microbatches=setup.grad_accum,
                   loss_fn=lambda logits, target: ForCausalLMLoss(logits, target, vocab))
    opt = torch_optimizer(setup, [p for p in module.parameters() if p.requires_grad])
    ids = torch.randint(0, vocab, (setup.batch * setup.grad_accum, seq),
                        generator=torch.Generator().manual_seed(1 + dp_index))

    def phased(fn, name):
        def run(*args, **kwargs):
            counter.phase(name)
            return fn(*args, **kwargs)
        return run

    stage.forward_one_chunk = phased(stage.forward_one_chunk, "forward")
    stage.backward_one_chunk = phased(stage.backward_one_chunk, "backward")
    stage.perform_reduce_grad = phased(stage.perform_reduce_grad, "reduce")
    measured = []
    with counter:
        for step in range(3):
            if step == 2:
                measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks),
                                 dict(counter.at_peak)))
            if step >= 1:
                counter.start_measuring()
            losses = [] if last else None
            args = (ids,) if first else ()
            schedule.step(*args, target=ids if last else None, losses=losses, return_outputs=False)
            del losses
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.phase(None)
    measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks),
                     dict(counter.at_peak)))
    device, phase, _, at_peak = min(measured, key=lambda m: m[0])
    phases = {p: min(m[2].get(p, 0) for m in measured) for p in measured[0][2]}
    # the reduce runs inside the schedule's step, after the last backward: the estimate's backward phase
    phase = "backward" if phase == "reduce" else phase
    phases["backward"] = max(phases.get("backward", 0), phases.pop("reduce", 0))
    if counter.detail:
        lines = sorted(((n, counter.sites.get(s, "?")) for s, n in at_peak.items()), reverse=True)
        text = f"rank {rank} peak {device} in {phase}:\n" + "\n".join(f"  {n:>10} {site}" for n, site in lines)
        with open(os.path.join(os.environ["VRAMPLAN_PP_DETAIL"], f"rank{rank}.txt"), "a") as f:
            f.write(f"{kind} {setup.pp_schedule} n={setup.grad_accum} ck={setup.checkpointing} b={setup.batch}\n"
                    f"{text}\n")
    del module, opt, schedule, stage
    gc.collect()
    return {"rank": rank, "device_bytes": device, "phase": phase, "phase_peaks": phases, "host_bytes": 0,
            "init_bytes": 0}


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: The verified PP matrix (full fine-tuning): both schedules, micro-batch counts at and above the
#: stage count, checkpointing, a micro-batch of 2.
PP_MATRIX = (
    {"pp_schedule": "1f1b", "grad_accum": 2}, {"pp_schedule": "gpipe", "grad_accum": 2},
    {"pp_schedule": "1f1b", "grad_accum": 4}, {"pp_schedule": "gpipe", "grad_accum": 4},
    {"pp_schedule": "1f1b", "grad_accum": 4, "checkpointing": True},
    {"pp_schedule": "gpipe", "grad_accum": 3, "batch": 2},
)


#: A wide vocabulary at 16 tokens: the head's and the embedding's whole-matrix gradient temporaries of
#: the later micro-batches (autograd's in-place accumulation) set the stages' peaks.
WIDE_VOCAB = {"vocab_size": 8192}
WIDE_SEQ = 16


#: The verified matrix of data parallelism beside the pipeline (``pp 2 x dp 2`` on 4 ranks): DDP and
#: FSDP2 per stage, both schedules, checkpointing; at the wide vocabulary too, where the parameters
#: and the FSDP2 all-gathers and reduce-scatters (the embedding's, the head's) set the peaks, with a
#: micro-batch of 2, fp32 and shard_grad_op (under PP the same as full_shard: torchtitan keeps the
#: stage gathered either way).
FSDP2_KW = {"fsdp": "full_shard", "fsdp_version": 2}
DP_MATRIX = (
    {"pp_schedule": "1f1b", "grad_accum": 4}, {"pp_schedule": "gpipe", "grad_accum": 4, **FSDP2_KW},
    {"pp_schedule": "1f1b", "grad_accum": 4, "checkpointing": True, **FSDP2_KW},
    {"pp_schedule": "gpipe", "grad_accum": 2, "checkpointing": True},
    {"pp_schedule": "1f1b", "grad_accum": 2, **FSDP2_KW},
)
DP_WIDE = (
    {"pp_schedule": "1f1b", "grad_accum": 2}, {"pp_schedule": "1f1b", "grad_accum": 4, **FSDP2_KW},
    {"pp_schedule": "gpipe", "grad_accum": 3, "batch": 2, **FSDP2_KW},
    {"pp_schedule": "gpipe", "grad_accum": 3, "batch": 2},
    {"pp_schedule": "1f1b", "grad_accum": 2, "precision": "fp32", **FSDP2_KW},
    {"pp_schedule": "gpipe", "grad_accum": 2, "fsdp": "shard_grad_op", "fsdp_version": 2},
)


def pp_config(stages: int, shape: dict | None = None) -> dict:
    return tiny_config(PP_BASE, layers=max(PP_LAYERS, stages), shape={**TINY_SHAPE, **(shape or {})})


def compare_setups(setups: list[Setup], world: int, seq: int = PP_SEQ,
                   shape: dict | None = None) -> list[tuple[PpRun, object]]:
    """Run ``setups`` (one ``pp``) on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = pp_config(setups[0].pp, shape)
    model = tiny_model(config, PP_BASE)
    return [(run, estimate(model, run.setup)) for run in run_pp(config, setups, world, seq)]


def launches(quick: bool, dp: bool | None = None) -> list[tuple[int, int, tuple, dict, int]]:
    """(world size, pp, setups, shape overrides, sequence length) of each launch of the validate matrix;
    ``dp``: only the launches with data parallelism beside the pipeline (True) or only those without
    (False)."""
    if quick:
        alone = [(2, 2, PP_MATRIX[:2], {}, PP_SEQ)]
        beside: list = []
    else:
        four = tuple(kw for kw in PP_MATRIX if kw["grad_accum"] >= 4) + ({"pp_schedule": "gpipe", "grad_accum": 2},)
        alone = [(2, 2, PP_MATRIX, {}, PP_SEQ), (4, 4, four, {}, PP_SEQ), (2, 2, PP_MATRIX[2:4], WIDE_VOCAB, WIDE_SEQ)]
        beside = [(4, 2, DP_MATRIX, {}, PP_SEQ), (4, 2, DP_WIDE, WIDE_VOCAB, WIDE_SEQ)]
    return alone + beside if dp is None else beside if dp else alone


def pp_rows(quick: bool, dp: bool | None = None) -> list:
    """Rows for ``vramplan validate --knob pp``: per setup and stage, the stage's device peak (the
    fullest of its data-parallel ranks) against the estimate's ``per_rank`` row of that stage
    (``truth="pp-N"``, N the processes); ``dp`` as in :func:`launches`."""
    from ..estimator.pipeline_check import data_parallel
    from .row import Row

    rows = []
    family = tiny_model(pp_config(2), PP_BASE).family
    for world, pp, kws, shape, seq in launches(quick, dp):
        setups = [Setup(**{"seq": seq, **kw}, pp=pp, gpus=world) for kw in kws]
        try:
            compared = compare_setups(setups, world, seq, shape)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so
            rows += failed_launch_rows(setups, world, PP_BASE, family, exc, lambda s: ("pp", "pp"))
            continue
        for run, est in compared:
            s = run.setup
            beside = "" if world == pp else f" x {data_parallel(s)} {world // pp}"
            name = (f"{PP_BASE}[tiny{' V=' + str(shape['vocab_size']) if shape else ''}] {s.pp_schedule}"
                    f"{beside} stage")
            for e in est.per_rank:
                r = max(run.ranks[e.rank * (world // pp):(e.rank + 1) * (world // pp)], key=lambda x: x.device_bytes)
                rows.append(Row(f"{name} {e.rank}", family, s, r.device_bytes, e.tensor_peak_bytes, r.phase, e.phase,
                                truth=f"pp-{world}", knob="pp"))
    return rows


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
