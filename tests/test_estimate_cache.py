"""The memos a plan over many cards runs on (issue 30: ``plan --gpu any`` under 2 s): the estimate's
card-free tensor terms (estimator/cache.py, estimator/step.py ``tensor_terms``), the search's saver
configurations and micro-batch setups, and the plans without their words that a comparison of cards
reads (``plan(..., details=False)``). Each answer must be the one the uncached path gives, where every
term is computed on the real card (``cache.disabled()``) and every plan carries its words."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.estimator import cache, estimate
from vramplan.estimator.corrections import calibration_for
from vramplan.model.profiles import load_gpu, load_model
from vramplan.search import plan
from vramplan.specs import Setup, SpecError

CARDS = ("rtx-3090", "t4", "a100-80gb", "h100-sxm", "rtx-4060-ti-16gb")

#: card-free setups (the memo is shared across cards) and those the card enters (a layer split,
#: Unsloth's loss chunks, DPO/GRPO), the one-rank layouts (tp, cp) and the card's own warnings
#: (no bf16 on a T4, no FlashAttention-2 before Ampere)
SETUPS = [
    dict(method="lora"),
    dict(method="qlora", checkpointing=True, batch=4),
    dict(method="lora", attn="flash", optimizer="adamw-8bit"),
    dict(method="full", zero_stage=3, gpus=4, checkpointing=True, offload_optimizer="cpu"),
    dict(method="full", fsdp="full_shard", gpus=2, checkpointing=True),
    dict(method="lora", eval_batch=4, checkpointing=True),
    dict(method="lora", device_map="auto", gpus=2),
    dict(method="qlora", framework="unsloth", loss="unsloth", checkpointing=True, seq=8192, batch=8),  # chunks by card
    dict(method="lora", objective="dpo", checkpointing=True),
    dict(method="lora", objective="grpo", generation="vllm-colocate", checkpointing=True),
    dict(method="full", tp=2, gpus=2, checkpointing=True),
    dict(method="full", cp=2, gpus=2, fsdp="full_shard", fsdp_version=2, checkpointing=True, seq=8192),
    dict(method="full", optimizer="paged-adamw-8bit", checkpointing=True, activation_offload=True),
    dict(method="lora", liger=True, precision="bf16-mixed"),
    dict(method="lora", lora_targets="q_proj,nope"),
]


def _estimate_or_error(model, setup, gpu):
    try:
        return estimate(model, setup, gpu, calibration_for(gpu)[0])
    except SpecError as exc:
        return f"SpecError: {exc}"


def _as_json(bd) -> str:
    return bd if isinstance(bd, str) else json.dumps(bd.to_json(), sort_keys=True)


@pytest.mark.parametrize("knobs", SETUPS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_an_estimate_from_the_memo_is_the_one_computed_on_the_card(knobs):
    model, setup = load_model("llama-3.1-8b"), Setup(**knobs)
    cache.clear()
    before = cache.info()[0]
    for name in CARDS:  # the first card fills the memo, the others read it
        gpu = load_gpu(name)
        kept = _estimate_or_error(model, setup, gpu)
        with cache.disabled():
            fresh = _estimate_or_error(model, setup, gpu)
        assert kept == fresh, name
        assert _as_json(kept) == _as_json(fresh), name
    after = cache.info()[0]
    if not isinstance(kept, str) and setup.device_map == "none" and setup.objective == "sft" \
            and setup.loss != "unsloth":
        assert after.hits > before.hits  # card-free: computed once, read on the other cards


def test_a_breakdown_from_the_memo_is_its_own():
    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-4090")
    cache.clear()
    a = estimate(model, Setup(method="lora"), gpu)
    a.phase_peaks_bytes["forward"] = -1  # a caller changing its Breakdown changes no other
    b = estimate(model, Setup(method="lora"), gpu)
    assert b.phase_peaks_bytes["forward"] > 0 and a.components == b.components


def test_the_memo_keeps_equal_setups_of_other_types_apart():
    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-4090")
    cache.clear()
    estimate(model, Setup(method="lora", lora_dropout=0.0), gpu)
    misses = cache.info()[0].misses
    estimate(model, Setup(method="lora", lora_dropout=0), gpu)  # == the float one, but another value
    assert cache.info()[0].misses == misses + 1
    estimate(model, Setup(method="lora", lora_dropout=0.0), load_gpu("t4"))
    assert cache.info()[0].misses == misses + 1


def _plans(model, cards, max_gpus=2, **fixed):
    out = []
    for name in cards:
        gpu = load_gpu(name)
        for n in (1, 2, 4, 8):
            if n <= max_gpus:
                out.append(plan(model, gpu, gpus=n, corrections=calibration_for(gpu)[0], relax=False, **fixed))
    return out


@pytest.mark.parametrize("model, cards, fixed", [
    ("llama-3.1-8b", ("rtx-3060-12gb", "rtx-4090", "a100-80gb"), {}),
    ("gemma-2-2b", ("t4", "rtx-4090"), {}),  # eager attention: FlashAttention-2 is a saver on Ampere+ only
    ("llama-3.1-70b", ("rtx-4090", "h100-sxm"), {"seq": 4096}),  # tight, offload, or nothing fits
])
def test_plans_from_the_memos_are_the_ones_computed_on_each_card(model, cards, fixed):
    cache.clear()
    kept = _plans(model, cards, **fixed)
    with cache.disabled():
        fresh = _plans(model, cards, **fixed)
    for a, b in zip(kept, fresh, strict=True):
        assert a == b
    from vramplan.plans.planfile import plan_to_json

    assert [plan_to_json(p) for p in kept] == [plan_to_json(p) for p in fresh]


@pytest.mark.parametrize("model, card, gpus, fixed", [
    ("llama-3.1-8b", "rtx-4090", 1, {}),
    ("llama-3.1-8b", "t4", 1, {}),  # the framework switch (TRL's plan) on a small card
    ("llama-3.1-8b", "h100-sxm", 8, {}),
    ("llama-3.1-70b", "rtx-3060-12gb", 1, {}),  # nothing fits
    ("llama-3.1-70b", "rtx-4090", 1, {"seq": 6144}),  # tight: fits only inside the margins
    ("llama-3.1-70b", "l40s", 1, {}),  # tight with TRL's plan (a framework switch)
    ("llama-3.1-8b", "rtx-4090", 2, {"method": "full"}),  # FSDP with CPU offload: no resident plan fits
    ("llama-3.1-8b", "rtx-4090", 1, {"lora_rank": "8..64"}),  # several ranks: hints across families
    ("qwen2.5-7b", "a100-80gb", 1, {"objective": "dpo"}),
])
def test_a_plan_without_its_words_has_the_same_setup_fit_and_speed(model, card, gpus, fixed):
    """``details=False`` (search/fleet.py) skips the words and the classes no choice can take."""
    gpu = load_gpu(card)
    full = plan(model, gpu, gpus=gpus, corrections=calibration_for(gpu)[0], relax=False, **fixed)
    brief = plan(model, gpu, gpus=gpus, corrections=calibration_for(gpu)[0], relax=False, details=False, **fixed)
    assert (brief.setup, brief.breakdown, brief.tokens_per_s, brief.step_time_s, brief.fits, brief.tight) == \
        (full.setup, full.breakdown, full.tokens_per_s, full.step_time_s, full.fits, full.tight)
    assert brief.alternatives == () and brief.rejected == ()
    if (model, card, fixed) == ("llama-3.1-70b", "rtx-4090", {"seq": 6144}):
        assert brief.tight and brief.fits


def _cli(*args: str) -> str:
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return r.stdout


def _uncached_cli(monkeypatch, *args: str) -> str:
    """The command as it ran before the memos: nothing kept, every plan with its words."""
    import vramplan.search as search

    full = search.plan
    with monkeypatch.context() as m:
        m.setattr(search, "plan", lambda *a, details=True, **k: full(*a, **k))
        with cache.disabled():
            return _cli(*args)


FLEET = ("plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2")


@pytest.mark.parametrize("args", [
    ("--gpu", "rtx-3060-12gb,rtx-4090,l40s,a100-80gb", "--max-gpus", "2", "--json"),
    ("--gpu", "t4,h100-sxm", "--max-gpus", "4", "--rank-by", "time"),
])
def test_a_fleet_from_the_memos_prints_what_the_uncached_search_prints(monkeypatch, args):
    cache.clear()
    kept = _cli(*FLEET, *args)
    assert kept == _uncached_cli(monkeypatch, *FLEET, *args)
    # and a one-card plan after it (the memos full of other cards' answers), JSON and text
    for one in (("--gpu", "rtx-4090", "--json"), ("--gpu", "t4"), ("--gpu", "a100-80gb", "--gpus", "2", "--json")):
        assert _cli("plan", "llama-3.1-8b", *one) == _uncached_cli(monkeypatch, "plan", "llama-3.1-8b", *one)


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--gpu", "any", "--json"), ("--gpu", "any"),
                                  ("--gpu", "any", "--price", "rtx-3090=0.001", "--rank-by", "time", "--json")])
def test_gpu_any_from_the_memos_prints_what_the_uncached_search_prints(monkeypatch, args):
    cache.clear()
    assert _cli(*FLEET, *args) == _uncached_cli(monkeypatch, *FLEET, *args)
