"""Expert parallelism (``--ep N``): one rank's share of an MoE model as transformers 5.24's
``DistributedConfig(tp_size=N, ep_size=N)`` runs it (estimator/expert_parallel.py) against the real
step on N gloo ranks (vramplan/truths/ep_truth.py), the refusals, the Setup field and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_model
from vramplan.cli import main as cli
from vramplan.estimator.expert_parallel import (
    EP_LORA_TARGETS,
    comm_bytes_per_micro_step,
    embedding_grad_extra_bytes,
    moe_extra_per_token,
    moe_saved_per_token,
    optimizer_groups,
    rank_model,
    rank_setup,
    router_state_extra_bytes,
)
from vramplan.estimator.optimizers import trainable_tensors
from vramplan.estimator.stack import Stack
from vramplan.specs import SpecError

QKV = ",".join(EP_LORA_TARGETS)


def _bytes(b, name):
    return next((c.bytes for c in b.components if c.name == name), 0)


@pytest.mark.parametrize("name,ep", [("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 4), ("mixtral-8x7b", 2),
                                     ("mixtral-8x7b", 8)])
def test_rank_model_splits_the_experts_and_keeps_routers_whole(name, ep):
    model = load_model(name)
    rank = rank_model(model, ep)
    other, mine = dict(model.other_params), dict(rank.other_params)
    assert mine["experts"] * ep == other["experts"]
    assert mine["router"] == other["router"] and mine["norms"] == other["norms"]
    assert mine["embed_tokens"] * ep == other["embed_tokens"]  # vocab-parallel
    assert rank.moe.num_experts * ep == model.moe.num_experts
    assert rank.moe.top_k * ep == pytest.approx(model.moe.top_k)  # the rows a rank's experts run per token
    assert rank.num_heads * ep == model.num_heads and rank.num_kv_heads * ep == model.num_kv_heads


def test_estimate_is_one_ranks_share():
    model = load_model("mixtral-8x7b")
    one, four = estimate(model, Setup(seq=1024)), estimate(model, Setup(seq=1024, ep=4, tp=4, gpus=4))
    experts = dict(model.other_params)["experts"] * 2  # bf16
    w1, w4 = _bytes(one, "weights"), _bytes(four, "weights")
    assert w4 < w1 / 3
    assert w1 - w4 >= experts * 3 / 4  # three quarters of the experts are elsewhere
    assert four.tensor_peak_bytes < one.tensor_peak_bytes
    # the loss sees the gathered logits (as under --tp): the same logits term as one GPU
    assert _bytes(one, "logits_loss") == _bytes(four, "logits_loss")
    assert four.setup.ep == 4 and four.params_total == model.params_total and four.per_rank == ()
    assert any(c.name == "nccl" for c in four.components)
    assert any("--ep 4" in n and "balanced routing" in n for n in four.notes)


def test_ep1_is_unchanged():
    model = load_model("qwen3-30b-a3b")
    assert estimate(model, Setup(seq=512)) == estimate(model, Setup(seq=512, ep=1))


def test_optimizer_groups_cover_the_trainable_parameters():
    model = load_model("qwen3-30b-a3b")
    for s in (Setup(ep=2, tp=2, gpus=2), Setup(ep=2, tp=2, gpus=2, method="lora", lora_targets=QKV)):
        rank, one = rank_model(model, 2), rank_setup(s)
        total = sum(n * _numel(shape) for shape, n in trainable_tensors(rank, one))
        # (the rank model's router shapes hold E/ep rows: what router_state_extra_bytes adds back)
        missing = 0 if s.adapters else (model.moe.num_experts - rank.moe.num_experts) * model.hidden_size * \
            model.moe.num_moe_layers
        assert sum(optimizer_groups(rank, one)) == total + missing


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def test_the_moe_saves_follow_the_routed_rows():
    model = load_model("qwen3-30b-a3b")
    two, four = (Setup(seq=2048, ep=n, tp=n, gpus=n) for n in (2, 4))
    router = 4 * model.moe.num_experts + 8 * model.moe.top_k + 4 + 4 * model.moe.top_k
    # past the router (every token, every expert), the saves go with k / ep rows per token
    assert moe_saved_per_token(model, two) - router == pytest.approx(2 * (moe_saved_per_token(model, four) - router))
    # what the rank model does not count is small beside what it does
    assert 0 < moe_extra_per_token(model, two) < 0.05 * moe_saved_per_token(model, two)
    lora = dataclasses.replace(two, method="lora", lora_targets=QKV)
    assert moe_saved_per_token(model, lora) < moe_saved_per_token(model, two)  # frozen experts keep less
    assert embedding_grad_extra_bytes(model, lora) == router_state_extra_bytes(model, lora) == 0
    assert embedding_grad_extra_bytes(model, two) == dict(model.other_params)["embed_tokens"] // 2 * 2


def test_checkpointing_and_accumulation_move_the_right_terms():
    model = load_model("qwen3-30b-a3b")
    base = Setup(seq=4096, ep=4, tp=4, gpus=4)
    plain, ck = estimate(model, base), estimate(model, dataclasses.replace(base, checkpointing=True))
    assert ck.phase_peaks_bytes["forward"] < plain.phase_peaks_bytes["forward"]
    assert _bytes(ck, "ep_dispatch") * model.num_layers == pytest.approx(_bytes(plain, "ep_dispatch"), rel=1e-6)
    accum = estimate(model, dataclasses.replace(base, grad_accum=2))
    # with accumulation the gradients (and the embedding's whole one) are there in the forward
    assert accum.phase_peaks_bytes["forward"] - plain.phase_peaks_bytes["forward"] >= _bytes(plain, "gradients")


@pytest.mark.parametrize("name,kw,fragment", [
    ("llama-3.1-8b", {}, "has none"),
    ("qwen1.5-moe-a2.7b", {}, "shared expert"),
    ("qwen3-30b-a3b", {"tp": 1}, "--tp 2 --gpus 2"),
    ("qwen3-30b-a3b", {"gpus": 4}, "--tp 2 --gpus 2"),
    ("qwen3-30b-a3b", {"method": "lora"}, "--lora-targets q_proj,k_proj,v_proj"),
    ("qwen3-30b-a3b", {"method": "lora", "lora_targets": "q_proj,o_proj"}, "row-parallel"),
    ("qwen3-30b-a3b", {"method": "qlora", "lora_targets": QKV}, "--quant"),
    ("qwen3-30b-a3b", {"fsdp": "full_shard", "fsdp_version": 2}, "--fsdp"),
    ("qwen3-30b-a3b", {"pp": 2, "gpus": 4, "grad_accum": 2}, "--tp 2 --gpus 2"),
    ("qwen3-30b-a3b", {"precision": "bf16-mixed"}, "-mixed"),
    ("qwen3-30b-a3b", {"optimizer": "adamw-8bit"}, "--optimizer"),
    ("qwen3-30b-a3b", {"liger": True}, "--liger"),
    ("qwen3-30b-a3b", {"objective": "dpo"}, "--objective"),
])
def test_refusals(name, kw, fragment):
    kw = {"ep": 2, "tp": 2, "gpus": 2, **kw}
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(")):
        estimate(load_model(name), Setup(**kw))


def test_refuses_what_transformers_cannot_shard():
    with pytest.raises(SpecError, match="heads"):  # Qwen3-30B-A3B has 4 KV heads: tp (= ep) 8 cannot shard them
        estimate(load_model("qwen3-30b-a3b"), Setup(ep=8, tp=8, gpus=8))
    with pytest.raises(SpecError, match="Cannot evenly shard"):  # 8 experts over 16 ranks
        estimate(load_model("mixtral-8x7b"), Setup(ep=16, tp=16, gpus=16))
    with pytest.raises(SpecError, match="transformers 5.24"):
        estimate(load_model("mixtral-8x7b"), Setup(ep=2, tp=2, gpus=2), stack=Stack(transformers="4.57"))


def test_setup_field():
    assert "ep" not in Setup().to_dict()  # records written before the field read back the same
    s = Setup(ep=2, tp=2, gpus=2)
    assert Setup.from_dict(s.to_dict()) == s and s.to_dict()["ep"] == 2
    with pytest.raises(SpecError, match="ep"):
        Setup(ep=0)
    with pytest.raises(SpecError, match="multiple of ep"):
        Setup(ep=2, gpus=3)


def test_cost_counts_the_all_to_alls():
    model = load_model("qwen3-30b-a3b")
    assert comm_bytes_per_micro_step(model, Setup(seq=1024)) == 0
    s = Setup(seq=1024, ep=4, tp=4, gpus=4)
    T, h, k = 1024, model.hidden_size, model.moe.top_k
    # two all-to-alls of T k / ep rows and the T-row all-gather, forward and backward, 3/4 leaving the rank
    per_layer = 2 * (2 * T * k / 4 * h * 2 + T * h * 2) * 3 / 4
    assert comm_bytes_per_micro_step(model, s) == pytest.approx(model.moe.num_moe_layers * per_layer)
    assert comm_bytes_per_micro_step(model, dataclasses.replace(s, checkpointing=True)) > \
        comm_bytes_per_micro_step(model, s)


def test_cli_json_and_one_line_errors():
    from cli_helpers import assert_user_error

    runner = CliRunner()
    r = runner.invoke(cli, ["estimate", "mixtral-8x7b", "--ep", "4", "--tp", "4", "--gpus", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["setup"]["ep"] == 4 and d["tensor_peak_bytes"] > 0
    assert any(c["name"] == "weights" and "2 of 8 experts" in c["note"] for c in d["components"])
    assert_user_error(runner.invoke(cli, ["estimate", "qwen3-30b-a3b", "--ep", "2", "--gpus", "2"]),
                      "DistributedConfig(tp_size=2, ep_size=2)", "--tp 2")
    assert_user_error(runner.invoke(cli, ["estimate", "llama-3.1-8b", "--ep", "2", "--tp", "2", "--gpus", "2"]),
                      "MoE")
    assert_user_error(runner.invoke(cli, ["estimate", "mixtral-8x7b", "--ep", "0"]), "--ep")


def test_emit_and_measure_refuse_an_ep_plan(tmp_path):
    from vramplan import load_gpu
    from vramplan.calibration.measure import check_measurable
    from vramplan.emit import emit_to_dir
    from vramplan.setup.wording import describe
    from vramplan.specs import Plan

    model, gpu = load_model("mixtral-8x7b"), load_gpu("h100-sxm")
    setup = Setup(ep=2, tp=2, gpus=2, seq=512)
    assert "expert parallel (ep 2)" in describe(setup)
    with pytest.raises(SpecError, match="expert-parallel plan"):
        emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), tmp_path / "o")
    with pytest.raises(SpecError, match="--ep 2 cannot be measured"):
        check_measurable(setup)


# ----------------------------------------------------------------------------------------------
# the truth: transformers' ep_plan on gloo ranks


@pytest.mark.slow
def test_truth_two_ranks_within_5_percent():
    """~20 s: the tiny Qwen3-30B-A3B (4 experts, top-2) on 2 gloo ranks, full fine-tuning and
    checkpointed LoRA on q/k/v; the routed rows near balance."""
    from vramplan.truths.ep_truth import compare_setups
    from vramplan.truths.tiny import TINY_SEQ

    setups = [Setup(ep=2, tp=2, gpus=2, seq=TINY_SEQ),
              Setup(ep=2, tp=2, gpus=2, seq=TINY_SEQ, method="lora", lora_targets=QKV, checkpointing=True)]
    for run, est in compare_setups(setups, 2, "Qwen/Qwen3-30B-A3B"):
        assert len(run.ranks) == 2
        truth = run.worst.device_bytes
        assert abs(est.tensor_peak_bytes / truth - 1) <= 0.05, (run.setup, truth, est.tensor_peak_bytes)
        assert run.worst.phase == est.phase
        balanced = TINY_SEQ * 2 / 2
        assert all(0.5 * balanced < r <= 2 * balanced for r in run.routed), run.routed


@pytest.mark.slow
def test_expert_plan_alone_fails_in_transformers():
    """~10 s: why --ep is modelled beside --tp: 5.24's from_pretrained refuses the empty TP plan."""
    from vramplan.truths.ep_truth import ep_config, expert_plan_alone

    assert "has no `tp_plan`" in expert_plan_alone(ep_config("Qwen/Qwen3-30B-A3B"))
