"""The truth for pipeline parallelism (``--pp N``): N gloo processes on this machine running torch
2.13's own ``torch.distributed.pipelining`` schedule, one stage per rank, per rank.

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
stages). ``PipelineStage(module, rank, N, cpu)`` and ``ScheduleGPipe`` / ``Schedule1F1B`` with
``n_microbatches = grad_accum`` and transformers' ``ForCausalLMLoss`` (logits upcast to fp32,
labels shifted) as ``loss_fn``; the step is ``schedule.step(ids, target=ids, losses=losses,
return_outputs=False)`` (torchtitan's call: the last stage keeps no logits for the caller; the first
stage gets ``ids`` of ``grad_accum x batch`` rows, which the schedule splits), then torch AdamW
(foreach) over the stage's parameters, ``zero_grad(set_to_none=True)``. Three steps; the peak of
the second and third, the lower of the two (gloo's worker threads free a p2p's tensors a moment
late: :mod:`vramplan.truths.tp_truth`), per phase too (forward: inside ``forward_one_chunk``,
backward: inside ``backward_one_chunk``, the rest of the schedule's step counts to the last one).
``VRAMPLAN_PP_DETAIL=DIR`` appends each rank's live tensors at its peak to ``DIR/rank<r>.txt``.
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
    """Run each setup (``pp == gpus == world``) on ``world`` processes, in one launch."""
    for s in setups:
        if s.pp != world or s.gpus != world:
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


def _stage_module(config: dict, setup: Setup, rank: int, world: int):
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
    layers = stage_layers(full.config.num_hidden_layers, world, rank)
    inner = full.model
    inner.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
    first, last = rank == 0, rank == world - 1
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


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import gc

    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from transformers.loss.loss_utils import ForCausalLMLoss

    from ..run.live import SplitCounter
    from ..run.models import torch_optimizer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    module = _stage_module(config, setup, rank, world)
    vocab = int(config["vocab_size"])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[setup.pp_schedule]
    schedule = cls(stage, n_microbatches=setup.grad_accum,
                   loss_fn=lambda logits, target: ForCausalLMLoss(logits, target, vocab))
    opt = torch_optimizer(setup, [p for p in module.parameters() if p.requires_grad])
    counter = SplitCounter(detail=bool(os.environ.get("VRAMPLAN_PP_DETAIL")))
    counter.track(module)
    ids = torch.randint(0, vocab, (setup.batch * setup.grad_accum, seq), generator=torch.Generator().manual_seed(1))

    def phased(fn, name):
        def run(*args, **kwargs):
            counter.phase(name)
            return fn(*args, **kwargs)
        return run

    stage.forward_one_chunk = phased(stage.forward_one_chunk, "forward")
    stage.backward_one_chunk = phased(stage.backward_one_chunk, "backward")
    measured = []
    with counter:
        for step in range(3):
            if step == 2:
                measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks),
                                 dict(counter.at_peak)))
            if step >= 1:
                counter.start_measuring()
            losses = [] if rank == world - 1 else None
            args = (ids,) if rank == 0 else ()
            schedule.step(*args, target=ids if rank == world - 1 else None, losses=losses, return_outputs=False)
            del losses
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.phase(None)
    measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks),
                     dict(counter.at_peak)))
    device, phase, _, at_peak = min(measured, key=lambda m: m[0])
    phases = {p: min(m[2].get(p, 0) for m in measured) for p in measured[0][2]}
    if counter.detail:
        lines = sorted(((n, counter.sites.get(s, "?")) for s, n in at_peak.items()), reverse=True)
        text = f"rank {rank} peak {device} in {phase}:\n" + "\n".join(f"  {n:>10} {site}" for n, site in lines)
        with open(os.path.join(os.environ["VRAMPLAN_PP_DETAIL"], f"rank{rank}.txt"), "a") as f:
            f.write(f"{setup.pp_schedule} n={setup.grad_accum} ck={setup.checkpointing} b={setup.batch}\n{text}\n")
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


def pp_config(world: int, shape: dict | None = None) -> dict:
    return tiny_config(PP_BASE, layers=max(PP_LAYERS, world), shape={**TINY_SHAPE, **(shape or {})})


def compare_setups(setups: list[Setup], world: int, seq: int = PP_SEQ,
                   shape: dict | None = None) -> list[tuple[PpRun, object]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = pp_config(world, shape)
    model = tiny_model(config, PP_BASE)
    return [(run, estimate(model, run.setup)) for run in run_pp(config, setups, world, seq)]


def launches(quick: bool) -> list[tuple[int, tuple, dict, int]]:
    """(world size, setups, shape overrides, sequence length) of each launch of the validate matrix."""
    if quick:
        return [(2, PP_MATRIX[:2], {}, PP_SEQ)]
    four = tuple(kw for kw in PP_MATRIX if kw["grad_accum"] >= 4) + ({"pp_schedule": "gpipe", "grad_accum": 2},)
    return [(2, PP_MATRIX, {}, PP_SEQ), (4, four, {}, PP_SEQ), (2, PP_MATRIX[2:4], WIDE_VOCAB, WIDE_SEQ)]


def pp_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob pp``: per setup and stage, the stage's device peak
    against the estimate's ``per_rank`` row of that stage (``truth="pp-N"``)."""
    from .row import Row

    rows = []
    family = tiny_model(pp_config(2), PP_BASE).family
    for world, kws, shape, seq in launches(quick):
        setups = [Setup(**{"seq": seq, **kw}, pp=world, gpus=world) for kw in kws]
        try:
            compared = compare_setups(setups, world, seq, shape)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so
            rows += failed_launch_rows(setups, world, PP_BASE, family, exc, lambda s: ("pp", "pp"))
            continue
        for run, est in compared:
            name = f"{PP_BASE}[tiny{' V=' + str(shape['vocab_size']) if shape else ''}] {run.setup.pp_schedule} stage"
            rows += [Row(f"{name} {r.rank}", family, run.setup, r.device_bytes, e.tensor_peak_bytes, r.phase, e.phase,
                         truth=f"pp-{world}", knob="pp") for r, e in zip(run.ranks, est.per_rank, strict=True)]
    return rows


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
