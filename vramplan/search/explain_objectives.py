"""A DPO/GRPO plan in words: the step's time by phase, what tokens/s counts, and why this reference
(DPO) or this generation engine and share of the card for vLLM (GRPO). Rendered from typed values:
:class:`~vramplan.cost.objectives.ObjectiveCost`, :class:`~vramplan.estimator.vllm_share.VllmShare`
and the evaluator's verdicts of the chosen plan with the other choices."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..cost.objectives import objective_cost
from ..estimator.objectives import lengths, reference
from ..estimator.vllm_share import VllmShare, smallest_fraction, vllm_share
from ..specs import Note
from .core import Result
from .labels import size
from .rank import LIGER_MIN_GAIN
from .space import VLLM_FRACTIONS, family_key
from .verdicts import Candidate, Misfit

#: how explain.py words a misfit (passed in: explain imports this module)
Words = Callable[[Misfit], str]


def objective_notes(result: Result, chosen: Candidate, misfit_text: Words) -> list[Note]:
    """The objective's notes of a plan that fits (none for SFT); ``misfit_text``: explain.misfit_text."""
    s = chosen.setup
    if s.objective == "sft":
        return []
    notes = [speed_note(result, chosen)]
    if s.objective == "grpo":
        notes += generation_notes(result, chosen, misfit_text)
    elif s.objective == "dpo":
        notes += reference_notes(result, chosen)
    return notes


def speed_note(result: Result, chosen: Candidate) -> Note:
    """The step's seconds by phase and what its tokens/s counts."""
    search = result.search
    s, ev = chosen.setup, search.ev
    oc = objective_cost(search.space.model, s, search.target.gpu, search.target.nodes, ev.counts(s))
    lens = lengths(s)
    if s.objective == "grpo":
        waves = f", in {oc.waves} waves of {oc.concurrent}" if oc.waves > 1 else ""
        engine = {"hf": "HF generate", "vllm-colocate": "vLLM colocated", "vllm-server": "vLLM server"}[s.generation]
        text = (f"GRPO step {oc.step_s:.1f} s: generation {oc.generation_s:.1f} s ({engine}: prefill "
                f"{oc.prefill_s:.1f} s, {lens.completion} decode steps of {lens.gen_rows} sequences{waves}, "
                "every completion at max_completion_length), "
                f"reference {oc.reference_s:.1f} s, policy forward/backward/optimizer {oc.policy_s:.1f} s; "
                "tokens/s counts the prompt + completion tokens the policy trains on (TRL's num_tokens), "
                f"{oc.completions / oc.step_s:.2f} completions/s")
    else:
        text = (f"{s.objective.upper()} step {oc.step_s:.1f} s: reference forward {oc.reference_s:.1f} s"
                + (" (precomputed: the same forward once per example before training, priced at one epoch)"
                   if reference(s) == "precomputed" else "")
                + f", policy forward/backward/optimizer {oc.policy_s:.1f} s; tokens/s counts the chosen + rejected "
                f"tokens, {oc.completions / oc.step_s:.2f} pairs/s")
    return Note(text, "objective_speed")


def _share_text(v: VllmShare) -> str:
    return (f"weights {size(v.weights_bytes)} + profile peak {size(v.activation_bytes)} + {size(v.fixed_bytes)} "
            f"non-torch and CUDA graphs leave {size(max(v.kv_bytes, 0))} of KV cache")


def generation_notes(result: Result, chosen: Candidate, misfit_text: Words) -> list[Note]:
    """Why this engine and share: the chosen share's arithmetic and its neighbours' verdicts."""
    search = result.search
    s, gpu, model = chosen.setup, search.target.gpu, search.space.model
    lens = lengths(s)
    batch = f"{lens.gen_rows} x {lens.row_len} tokens"
    fixed = search.space.fixed
    if s.generation == "vllm-server":
        return [Note("generation: vLLM server on other GPUs (fixed); its GPUs are not planned here", "generation")]
    if s.generation == "hf":
        if "generation" in fixed:
            return [Note("generation: HF generate (fixed)", "generation")]
        return [Note(_why_not_vllm(result, chosen, misfit_text), "generation")]
    v = vllm_share(model, s, gpu)
    parts = [f"vLLM {s.vllm_memory_fraction:.2f} of the card ({size(v.share_bytes)}): {_share_text(v)}; KV for {batch}"
             f" needs {size(v.kv_needed_bytes)}" + ("" if v.concurrent >= v.seqs else
                                                    f", so {v.concurrent} of the {v.seqs} run at once")]
    if "vllm_memory_fraction" not in fixed:
        lower = [f for f in VLLM_FRACTIONS if f < s.vllm_memory_fraction]
        higher = [f for f in VLLM_FRACTIONS if f > s.vllm_memory_fraction]
        if lower:
            parts.append(_neighbour(result, chosen, lower[-1], misfit_text))
        if higher:
            parts.append(_neighbour(result, chosen, higher[0], misfit_text))
    return [Note("; ".join(parts), "generation")]


def _neighbour(result: Result, chosen: Candidate, frac: float, misfit_text: Words) -> str:
    """One other share at the chosen savers and micro-batch, in words."""
    ev = result.search.ev
    c = ev.judge(chosen.setup.replace(vllm_memory_fraction=frac))
    v = vllm_share(result.search.space.model, c.setup, result.search.target.gpu)
    if not v.starts:
        return f"{frac:.2f} leaves no room for one sequence's KV cache (vLLM would not start)"
    misfit = _misfit(ev, c)
    if misfit is not None:
        return f"{frac:.2f} leaves the trainer too little ({misfit_text(misfit)})"
    if v.concurrent < v.seqs:
        return (f"{frac:.2f} holds {v.concurrent} of the {v.seqs} sequences at once ({c.tokens_per_s:,.0f} tokens/s "
                f"vs {chosen.tokens_per_s:,.0f})")
    if frac < chosen.setup.vllm_memory_fraction:
        return f"{frac:.2f} holds the whole batch too ({c.tokens_per_s:,.0f} tokens/s at this micro-batch)"
    return f"{frac:.2f} is no faster (the KV cache holds the whole batch already) and leaves the trainer less"


def _misfit(ev, c: Candidate) -> Misfit | None:
    """The candidate's own misfit, estimated when the search answered it from a lower rank."""
    if c.breakdown is not None or c.misfit is None:
        return c.misfit
    return ev.misfit(c.setup, ev.estimate(c.setup))


def _why_not_vllm(result: Result, chosen: Candidate, misfit_text: Words) -> str:
    """HF generate chosen: why not vLLM colocated (the family's best vLLM plan, else its smallest
    share that starts at the smallest micro-batch, with the chosen savers)."""
    search = result.search
    s, ev, gpu = chosen.setup, search.ev, search.target.gpu
    least = smallest_fraction(search.space.model, s.replace(generation="vllm-colocate"), gpu)
    head = ("generation: HF generate; vLLM colocated needs at least "
            f"{math.ceil(least * 100) / 100:.2f} of the card to start")
    found = [c for c in result.bests if family_key(c.setup) == family_key(s) and c.setup.generation == "vllm-colocate"]
    if found:
        best = max(found, key=lambda c: c.tokens_per_s)
        return (head + f"; at {best.setup.vllm_memory_fraction:.2f} (micro-batch {best.setup.batch}) it gives "
                f"{best.tokens_per_s:,.0f} tokens/s vs HF generate's {chosen.tokens_per_s:,.0f} at micro-batch "
                f"{s.batch}, under the {LIGER_MIN_GAIN:.0%} an extra engine must buy")
    mb = search.shape.micro_batches[0]
    tried = [ev.judge(ev.at_micro(s.replace(generation="vllm-colocate", vllm_memory_fraction=f), mb))
             for f in VLLM_FRACTIONS]
    starting = [c for c in tried if vllm_share(search.space.model, c.setup, gpu).starts]
    if not starting:
        return head + f", more than the {VLLM_FRACTIONS[-1]:.2f} tried"
    first = starting[0]
    misfit = _misfit(ev, first)
    text = misfit_text(misfit) if misfit is not None else "fits, but is slower"
    return (head + f"; at {first.setup.vllm_memory_fraction:.2f} with micro-batch {mb} the trainer beside it {text}"
            " (larger shares leave it less)")


def reference_notes(result: Result, chosen: Candidate) -> list[Note]:
    """DPO: the reference chosen and what the other legal ones would cost at the chosen savers."""
    s, ev = chosen.setup, result.search.ev
    ref = reference(s)
    what = {"adapter": "peft's adapter-disabled base (no extra weights)", "copy": "a frozen copy of the base",
            "precomputed": "log-probs precomputed before training (precompute_ref_log_probs)"}[ref]
    if "ref_model" in result.search.space.fixed:
        return [Note(f"reference: {what} (fixed)", "reference")]
    parts = [f"reference: {what}"]
    for k in result.search.space.objective_knobs(s):
        other = k.get("ref_model")
        if other is None or other == ref:
            continue
        c = ev.judge(s.replace(ref_model=other))
        diff = (c.device_total_bytes - chosen.device_total_bytes) if c.breakdown is not None else 0
        verdict = "fits" if c.fits else "does not fit"
        parts.append(f"{other} at this micro-batch {verdict} ({diff / 2**30:+.1f} GiB, {c.tokens_per_s:,.0f} tokens/s)")
    if ref == "precomputed":
        parts.append("precomputing needs a forward over the data before training; taken for the memory it saves")
    return [Note("; ".join(parts), "reference")]
