"""The truth for expert parallelism (``--ep N``, beside ``--tp N``): N gloo processes on this machine
running transformers 5.24's own expert parallelism of an MoE model, per rank.

    runs = run_ep(tiny_config("Qwen/Qwen3-30B-A3B"), [Setup(ep=2, tp=2, gpus=2)], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes
    runs[0].ranks[1].routed                  # rows its experts ran per MoE layer, per forward

What runs is the layout transformers documents for an MoE checkpoint on N GPUs
(``DistributedConfig(tp_size=N, ep_size=N)``, e.g. the ``HYV4VLForConditionalGeneration`` and
``MuseSparkModel`` docstrings): ``from_pretrained(..., distributed_config=...)``
(``distributed/mixin.maybe_distribute_model``) applies the dense tensor-parallel plan with the
experts' TP rules dropped (``_resolve_parallel_plans``: "EP rules take precedence") and then
``distributed/expert_parallel.apply_expert_parallelism`` with the model's ``base_model_ep_plan``:
``gate_up_proj`` / ``down_proj`` ``grouped_gemm`` (``MoEParamShard``: ``Shard(0)`` over the EP mesh,
``num_experts / N`` whole experts a rank) and ``mlp.experts`` ``ep_dispatch_experts``
(``EpDispatchExpertsParallel`` with ``AutoEP``, which trains through ``AllToAllEP``: each rank keeps
``1/N`` of the batch the TP group shares, all-to-alls its (token, expert) rows to the experts'
ranks and the outputs back, all-gathers the rows over TP). The router (``mlp.gate``) has no rule:
replicated. The step is tp_truth's (peft LoRA on the column-parallel projections, HF gradient
checkpointing, torch AdamW over the Trainer's per-mesh parameter groups, the lower of two measured
steps) with its counter (DTensors by their local tensors, each collective drained).

The rows an EP rank's experts run depend on the router's choices (the estimate assumes balanced
routing, ``T k / N`` rows a rank): the worker counts them (``routed``: the most any MoE layer's
experts received on this rank in one forward) so a row says how balanced its run was.

The 5.24 legacy form ``DistributedConfig(tp_size=N, tp_plan={}, ep_size=N)`` (the expert plan alone,
as the deprecated ``enable_expert_parallel`` documents it) fails in ``from_pretrained``:
``_resolve_parallel_plans`` raises "`tp_size=2` was requested, but `Qwen3MoeForCausalLM` has no
`tp_plan`" for the empty plan (2 gloo ranks, tiny Qwen3-30B-A3B): EP without TP beside it runs only
with transformers' FSDP2 (``fsdp_size``), not modelled yet (estimator/expert_parallel.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..specs import Setup, SpecError
from .ranks import RankPeak, failed_launch_rows, launch_ranks, rank_worker, saved_checkpoint
from .tiny import TINY_SEQ, tiny_config, tiny_model


@dataclass(frozen=True)
class EpRun:
    """A setup run by real expert-parallel ranks: one RankPeak per rank, and per rank the most rows
    one MoE layer's local experts ran in a forward (the router's balance)."""

    setup: Setup
    ranks: tuple[RankPeak, ...]
    routed: tuple[int, ...]

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


def run_ep(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ, timeout_s: float = 600) -> list[EpRun]:
    """Run each setup (``ep == tp == world``) on ``world`` processes, in one launch."""
    for s in setups:
        if not (s.ep == s.tp == s.gpus == world):
            raise SpecError(f"setup has ep={s.ep}, tp={s.tp}, gpus={s.gpus} but the launch has {world} processes "
                            "(the EP truth runs ep == tp == gpus)")
    got = launch_ranks("vramplan.truths.ep_truth", {"config": config, "setups": [s.to_dict() for s in setups],
                                                 "seq": seq}, world, timeout_s, {}, "EP")
    out = []
    for i, s in enumerate(setups):
        ranks = [dict(got[r][i]) for r in range(world)]
        routed = tuple(int(x.pop("routed")) for x in ranks)
        out.append(EpRun(s, tuple(RankPeak(**x) for x in ranks), routed))
    return out


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, peft)


def _count_routed(seen: list) -> None:
    """Record, per forward of an ``AllToAllEP`` layer, the rows this rank's experts receive
    (``sum(recv_sizes)`` of transformers' ``_dispatch_tokens``); the step is unchanged."""
    from transformers.distributed.expert_parallel import AllToAllEP

    if getattr(AllToAllEP, "_vramplan_counted", False):
        AllToAllEP._vramplan_seen = seen
        return
    original = AllToAllEP._dispatch_tokens

    def dispatch(self, hidden_states, top_k_index, top_k_weights):
        out = original(self, hidden_states, top_k_index, top_k_weights)
        AllToAllEP._vramplan_seen.append(int(out[0].shape[0]))
        return out

    AllToAllEP._dispatch_tokens = dispatch
    AllToAllEP._vramplan_counted = True
    AllToAllEP._vramplan_seen = seen


def build_ep_model(config: dict, setup: Setup, work: str):
    """The checkpoint loaded as the module docstring says, each shard its own storage (tp_truth's CPU
    stand-in for shard-on-read), LoRA / checkpointing on it."""
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..run.models import adapt_for_training
    from .tp_truth import own_shards

    transformers.logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    path = saved_checkpoint(config, dtype, work)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", use_cache=False,
        distributed_config=DistributedConfig(tp_size=setup.tp, ep_size=setup.ep))
    own_shards(model)
    return adapt_for_training(model, setup)


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import gc

    import torch

    from .cpu_truth import make_optimizer
    from .tp_truth import DTensorCounter, measured_steps, trainer_mesh_groups

    seen: list[int] = []
    _count_routed(seen)
    model = build_ep_model(config, setup, work)
    counter = DTensorCounter()
    counter.track(model)
    ids = torch.randint(0, int(config["vocab_size"]), (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    opt = make_optimizer(setup, trainer_mesh_groups(model), model)
    peak = measured_steps(counter, model, ids, opt, setup.grad_accum)
    del model, opt
    gc.collect()
    return {**peak, "routed": max(seen, default=0)}


def _run_legacy(config: dict, setup: Setup, seq: int, work: str) -> dict:
    """Load with the expert plan alone (``DistributedConfig(tp_size=N, tp_plan={}, ep_size=N)``, what the
    deprecated ``enable_expert_parallel`` stands for): the error ``from_pretrained`` raises, or none."""
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    transformers.logging.set_verbosity_error()
    path = saved_checkpoint(config, torch.bfloat16, work)
    try:
        transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_size=setup.ep, tp_plan={},
                                                                             ep_size=setup.ep))
    except (ValueError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": ""}


def expert_plan_alone(config: dict, world: int = 2, timeout_s: float = 300) -> str:
    """The error transformers 5.24 raises on every rank for the expert plan without a TP plan ("" if it
    loads): why ``--ep`` is modelled beside ``--tp`` (estimator/expert_parallel.py)."""
    setup = Setup(ep=world, tp=world, gpus=world)
    got = launch_ranks("vramplan.truths.ep_truth", {"config": config, "setups": [setup.to_dict()], "seq": TINY_SEQ,
                                                 "legacy": True}, world, timeout_s, {}, "EP")
    return got[0][0]["error"]


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: LoRA on the column-parallel attention projections (the row-parallel o_proj's adapter fails under
#: TP in peft 0.21, estimator/tensor_parallel.py; the fused experts' ParamWrapper: estimator/expert_parallel.py).
COLWISE_ATTN = "q_proj,k_proj,v_proj"
#: The verified EP matrix: full fine-tuning, checkpointing, accumulation, batch 2, LoRA (and checkpointed).
EP_MATRIX = ({}, {"checkpointing": True}, {"grad_accum": 2}, {"batch": 2},
             {"method": "lora", "lora_targets": COLWISE_ATTN},
             {"method": "lora", "lora_targets": COLWISE_ATTN, "checkpointing": True})
#: The MoE bases the truth runs, shrunk as tiny.py shrinks them (4 experts, top-2).
EP_BASES = ("Qwen/Qwen3-30B-A3B", "mistralai/Mixtral-8x7B-v0.1")
#: 4 ranks need 4 KV heads (tp = ep = 4; top-2 of 4 experts: half a routed row per token and rank).
FOUR_KV = {"num_key_value_heads": 4}
#: Experts that dominate the step: 8 experts top-4, 256 wide, on 256 tokens (the all-to-all's rows
#: and the experts' saves several times the logits).
WIDE_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 256}
WIDE_SEQ = 256


def ep_config(base: str, shape: dict | None = None) -> dict:
    """The tiny config of ``base`` (tiny.py's MoE shape) with ``shape`` on top."""
    from .tiny import MOE_SHAPE, TINY_SHAPE

    return tiny_config(base, shape={**TINY_SHAPE, **MOE_SHAPE.get(base, {}), **(shape or {})})


def compare_setups(setups: list[Setup], world: int, base: str, shape: dict | None = None,
                   seq: int = TINY_SEQ) -> list[tuple[EpRun, object]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = ep_config(base, shape)
    model = tiny_model(config, base)
    return [(run, estimate(model, run.setup)) for run in run_ep(config, setups, world, seq)]


def launches(quick: bool) -> list[tuple[str, int, dict, int, tuple]]:
    """(base model, world size, shape overrides, sequence length, setups) of each launch of the
    validate matrix."""
    if quick:
        return [(EP_BASES[0], 2, {}, TINY_SEQ, EP_MATRIX[:2])]
    return [(EP_BASES[0], 2, {}, TINY_SEQ, EP_MATRIX), (EP_BASES[1], 2, {}, TINY_SEQ, EP_MATRIX[:2]),
            (EP_BASES[0], 2, WIDE_EXPERTS, WIDE_SEQ, EP_MATRIX[:2] + EP_MATRIX[4:]),
            (EP_BASES[0], 4, FOUR_KV, TINY_SEQ, EP_MATRIX[:2])]


def routed_note(run: EpRun, model) -> str:
    """How balanced the run's routing was: the most rows one MoE layer's experts ran on a rank against
    the balanced ``T k / ep`` the estimate assumes."""
    s = run.setup
    balanced = s.batch * s.seq * model.moe.top_k / s.ep
    return f"routed rows (max over layers, ranks) {max(run.routed)} vs balanced {balanced:.0f}"


def ep_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob ep``: per setup the worst rank's device peak against the
    estimate (``truth="ep-N"``), the router's balance in ``why``."""
    from .row import Row

    rows = []
    for base, world, shape, seq, kws in launches(quick):
        model = tiny_model(ep_config(base, shape), base)
        setups = [Setup(**kw, ep=world, tp=world, gpus=world, seq=seq) for kw in kws]
        try:
            compared = compare_setups(setups, world, base, shape, seq)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so
            rows += failed_launch_rows(setups, world, base, model.family, exc, lambda s: ("ep", "ep"))
            continue
        for run, est in compared:
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", model.family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"ep-{world}", knob="ep", why=routed_note(run, model)))
    return rows


if __name__ == "__main__":
    import json
    from pathlib import Path

    rank_worker(sys.argv[1], _run_legacy if json.loads(Path(sys.argv[1]).read_text()).get("legacy") else _run_one)
