"""`plan` for DPO/GRPO: the generation engine and vLLM's share of the card searched, DPO's reference
searched, generation and the reference forward priced (vramplan/cost/objectives.py), and the chosen
split carried into the emitted TRL script. The issue's example: GRPO on Qwen2.5-7B, 8 generations of
1024 tokens, one A100-80GB."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.cost.model import step_cost as sft_step_cost
from vramplan.cost.objectives import objective_cost, step_cost
from vramplan.estimator.objectives import lengths, policy_setup
from vramplan.estimator.vllm_share import kv_bytes_per_token, smallest_fraction, vllm_share
from vramplan.search import plan
from vramplan.search.space import VLLM_FRACTIONS

QWEN, A100 = load_model("qwen2.5-7b"), load_gpu("a100-80gb")
ISSUE = {"objective": "grpo", "num_generations": 8, "max_completion_length": 1024}
GRPO = Setup(method="lora", checkpointing=True, **ISSUE)


def test_issue_example_answers_with_a_batch_and_says_why_not_vllm():
    """Full fine-tuning (the best tier): vLLM colocated starts at 0.2 of the card but then holds 2 of
    the 8 sequences at once, slower than HF generate at the larger micro-batch the card allows."""
    p = plan(QWEN, A100, **ISSUE)
    assert p.fits and p.setup.method == "full" and p.setup.batch >= 1
    note = next(n for n in p.notes if n.kind == "generation")
    if p.setup.generation == "hf":
        assert "vLLM colocated needs at least 0.20 of the card" in note
    speed = next(n for n in p.notes if n.kind == "objective_speed")
    assert "generation" in speed and "TRL's num_tokens" in speed
    assert not any("no reference forward or generation" in n for n in p.notes)


def test_issue_example_with_lora_picks_a_vllm_split_that_fits_and_a_batch():
    p = plan(QWEN, A100, method="lora", **ISSUE)
    s = p.setup
    assert s.generation == "vllm-colocate" and s.vllm_memory_fraction in VLLM_FRACTIONS
    share = vllm_share(QWEN, s, A100)
    # vLLM's arithmetic: its share holds the weights, the profile peak and the whole generation batch's KV
    assert share.starts and share.concurrent == share.seqs == lengths(s).gen_rows
    # the trainer fits beside it: the device total counts the share, and it is under the card
    assert p.breakdown.fits and p.breakdown.component("vllm_reserved") == share.share_bytes
    # the smallest share that does as well: one step less holds fewer sequences (or vLLM would not start)
    lower = [f for f in VLLM_FRACTIONS if f < s.vllm_memory_fraction]
    if lower:
        assert vllm_share(QWEN, s, A100, lower[-1]).concurrent < share.seqs
    note = next(n for n in p.notes if n.kind == "generation")
    assert note.startswith(f"vLLM {s.vllm_memory_fraction:.2f} of the card") and "KV for" in note
    assert s.batch >= 2  # the card leaves room for more than one group of prompts beside vLLM


def test_vllm_shares_that_cannot_start_are_never_chosen():
    """0.1 of an A100 cannot hold Qwen2.5-7B's 16-bit weights: vLLM would refuse to start."""
    assert not vllm_share(QWEN, GRPO.replace(generation="vllm-colocate"), A100, 0.1).starts
    p = plan(QWEN, A100, method="lora", generation="vllm-colocate", **ISSUE)
    assert p.setup.vllm_memory_fraction >= smallest_fraction(QWEN, p.setup, A100)


def test_hf_generate_is_priced_slower_than_vllm():
    hf = objective_cost(QWEN, GRPO, A100)
    vllm = objective_cost(QWEN, GRPO.replace(generation="vllm-colocate", vllm_memory_fraction=0.3), A100)
    assert vllm.waves == 1 and hf.generation_s > 2 * vllm.generation_s
    assert hf.policy_s == vllm.policy_s  # the same policy step: only generation differs


def test_generation_is_priced():
    """Without generation the GRPO step would be the policy's step: 1024 decode steps each reading
    at least the weights once over the card's bandwidth must show in the step time."""
    policy = sft_step_cost(QWEN, policy_setup(GRPO), A100)
    grpo = step_cost(QWEN, GRPO, A100)
    weights_read = 1024 * 2 * QWEN.params_total / (A100.memory_bandwidth_gbps * 1e9)
    assert grpo.generation_s >= weights_read and grpo.step_s >= policy.step_s + weights_read
    assert grpo.tokens_per_step == policy.tokens_per_step  # prompt + completion rows: TRL's num_tokens
    longer = step_cost(QWEN, GRPO.replace(max_completion_length=1536, seq=2560), A100)
    assert longer.generation_s > 1.4 * grpo.generation_s  # decode steps grow with the completion


def test_a_kv_cache_short_of_the_batch_decodes_in_waves():
    s = GRPO.replace(generation="vllm-colocate", vllm_memory_fraction=0.2, batch=2)
    share = vllm_share(QWEN, s, A100)
    assert 0 < share.concurrent < share.seqs
    assert share.kv_per_seq_bytes == 2048 * kv_bytes_per_token(QWEN, s)
    c = objective_cost(QWEN, s, A100)
    assert c.waves == -(-share.seqs // share.concurrent)
    assert c.step_s > objective_cost(QWEN, s.replace(vllm_memory_fraction=0.4), A100).step_s


def test_dpo_picks_a_sensible_reference():
    lora = plan(QWEN, A100, method="lora", objective="dpo")
    assert lora.setup.ref_model == "adapter"  # peft's adapter-disabled base: no weights, no extra pass
    full = plan(QWEN, A100, method="full", objective="dpo")
    # a frozen copy of a 7B base is 14 GiB: full fine-tuning precomputes the log-probs when that buys room
    assert full.setup.ref_model in ("copy", "precomputed")
    if full.setup.ref_model == "precomputed":
        copy = estimate(QWEN, full.setup.replace(ref_model="copy"), A100)
        assert copy.device_total_bytes > full.breakdown.device_total_bytes
    note = next(n for n in full.notes if n.kind == "reference")
    assert note.startswith("reference: ")
    dpo = objective_cost(QWEN, lora.setup, A100)
    assert dpo.reference_s > 0 and dpo.generation_s == 0


def test_a_fixed_reference_or_engine_is_kept():
    p = plan(QWEN, A100, method="lora", objective="dpo", ref_model="precomputed")
    assert p.setup.ref_model == "precomputed"
    p = plan(QWEN, A100, method="lora", generation="hf", **ISSUE)
    assert p.setup.generation == "hf"
    p = plan(QWEN, A100, method="lora", vllm_memory_fraction=0.5, **ISSUE)
    assert p.setup.generation == "vllm-colocate" and p.setup.vllm_memory_fraction == 0.5


def test_vllm_server_is_never_chosen_on_one_gpu():
    p = plan(QWEN, A100, method="lora", **ISSUE)
    assert p.setup.generation != "vllm-server"
    assert all(a.setup.generation != "vllm-server" for a in p.alternatives)


def test_sft_plans_are_unchanged_by_the_objective_search():
    p = plan(QWEN, A100, method="lora")
    assert p.setup.objective == "sft" and p.setup.generation == "hf" and p.setup.ref_model == "auto"
    assert p.step_time_s == pytest.approx(sft_step_cost(QWEN, p.setup, A100).step_s, abs=1e-3)


def test_cli_plan_speed_line_names_the_rows(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["plan", "qwen2.5-7b", "--objective", "grpo", "--num-generations", "8",
                               "--max-completion-length", "1024", "--gpu", "a100-80gb", "--method", "lora"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert re.search(r"\d+ prompts? x 8 completions of 1024 \+ 1024 tokens", text)
    assert "no reference forward or generation" not in text


def test_plan_to_emit_round_trips_generation_and_vllm_share(tmp_path):
    from vramplan.emit import emit_to_dir
    from vramplan.plans.planfile import load_plan, save_plan

    p = plan(QWEN, A100, method="lora", generation="vllm-colocate", **ISSUE)
    path = save_plan(p, tmp_path / "plan.yaml")
    back = load_plan(path)
    assert back.setup.generation == "vllm-colocate"
    assert back.setup.vllm_memory_fraction == p.setup.vllm_memory_fraction
    out = tmp_path / "emitted"
    emit_to_dir(back, out, ["trainer"])
    script = (out / "train.py").read_text()
    assert "'generation': 'vllm-colocate'" in script
    assert f"'vllm_memory_fraction': {p.setup.vllm_memory_fraction}" in script
    trl = (out / "trl_objective.py").read_text()
    assert 'vllm["vllm_gpu_memory_utilization"] = plan["vllm_memory_fraction"]' in trl
    assert 'vllm["vllm_max_model_length"]' in trl


def test_emitted_vllm_knobs_are_grpo_config_fields(tmp_path):
    """The keys trl_objective.py passes for vLLM colocated are TRL 1.16 GRPOConfig fields (vLLM itself
    is not installed here: the trainer is not built)."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    s = plan(QWEN, A100, method="lora", generation="vllm-colocate", **ISSUE).setup
    lens = lengths(s)
    cfg = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True, report_to=[],
                     vllm_gpu_memory_utilization=s.vllm_memory_fraction,
                     vllm_max_model_length=lens.prompt + lens.completion,
                     per_device_train_batch_size=s.batch * s.num_generations, num_generations=s.num_generations,
                     max_completion_length=lens.completion)
    assert cfg.vllm_gpu_memory_utilization == s.vllm_memory_fraction and cfg.vllm_max_model_length == 2048


def test_estimate_says_when_vllm_would_not_start():
    s = GRPO.replace(generation="vllm-colocate", vllm_memory_fraction=0.15)
    notes = " ".join(estimate(QWEN, s, A100).notes)
    assert "vLLM refuses to start; raise --vllm-memory-fraction to 0.20 or more" in notes
    ok = " ".join(estimate(QWEN, s.replace(vllm_memory_fraction=0.3), A100).notes)
    assert "holds 8 of the 8 sequences of 2048 tokens at once" in ok
