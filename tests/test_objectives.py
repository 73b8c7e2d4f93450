"""DPO and GRPO as TRL 1.16 runs them (vramplan/estimator/objectives.py): the estimate's phases and
terms, the knobs it refuses, the CLI, TRL's own trainers and the traced step as truths within 5 %,
the plan, and the emitted TRL script running two steps on the CPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.estimator.objectives import HEAD_VOCAB_CHUNK, lengths, reference
from vramplan.estimator.stack import Stack
from vramplan.specs import PHASES, SpecError

QWEN = load_model("qwen2.5-7b")
A100 = load_gpu("a100-80gb")
DPO = Setup(method="lora", objective="dpo")
GRPO = Setup(method="lora", objective="grpo", num_generations=8, max_completion_length=512)


# ----------------------------------------------------------------------------------------------
# the estimate


def test_sft_is_unchanged_by_the_objective_fields():
    bd = estimate(QWEN, Setup(method="lora"), A100)
    assert tuple(bd.phase_peaks_bytes) == PHASES
    assert not any("objective" in n for n in bd.notes)


def test_dpo_runs_chosen_and_rejected_rows_and_a_reference_phase():
    bd = estimate(QWEN, DPO, A100)
    assert set(bd.phase_peaks_bytes) == {"reference", *PHASES}
    lens = lengths(DPO)
    assert (lens.rows, lens.row_len) == (2, 2048)
    sft = estimate(QWEN, Setup(method="lora", batch=2), A100)
    # the policy's activations are those of 2 x batch rows
    assert bd.component("activations") == sft.component("activations")
    assert "TRL 1.16" in " ".join(bd.notes)
    # the reference forward runs while the policy's activations are alive
    assert bd.phase_peaks_bytes["reference"] > bd.component("activations") + bd.component("weights")


def test_reference_model_choices():
    adapter = estimate(QWEN, DPO, A100)
    copy = estimate(QWEN, DPO.replace(ref_model="copy"), A100)
    pre = estimate(QWEN, DPO.replace(ref_model="precomputed"), A100)
    assert reference(DPO) == "adapter" and reference(Setup(objective="dpo")) == "copy"
    assert copy.component("reference_weights") == copy.component("weights")
    # TRL 1.16 copies a PeftModel's adapter into a frozen "ref" adapter (DPOTrainer.__init__ add_adapter) and
    # runs the reference with it: its forward has the LoRA branches on (tests/test_objectives_pref.py)
    assert adapter.component("reference_adapter") == adapter.component("adapters")
    gap = copy.component("reference_weights") - adapter.component("reference_adapter")
    ref_gap = adapter.component("reference_forward") - copy.component("reference_forward")
    assert copy.phase == adapter.phase == "reference"
    assert copy.tensor_peak_bytes - adapter.tensor_peak_bytes == gap - ref_gap
    assert "reference" not in pre.phase_peaks_bytes and pre.tensor_peak_bytes < adapter.tensor_peak_bytes
    assert reference(GRPO) == "none"  # GRPOConfig.beta defaults to 0.0 in TRL 1.16


def test_fused_head_scores_the_completion_only_with_triton():
    s = DPO.replace(max_prompt_length=1536, max_completion_length=512)
    assert lengths(s).scored == 2 * 512
    assert lengths(s, Stack(trl_triton=False)).scored == 2 * 2047
    cuda, cpu = estimate(QWEN, s, A100), estimate(QWEN, s, A100, stack=Stack(trl_triton=False))
    assert cpu.component("logits_loss") > cuda.component("logits_loss")
    # the head's buffer is 4096 x 32768 whatever the vocabulary (trl/kernels/chunked_logprob.py)
    assert cuda.component("logits_loss") >= min(1024, 4096) * HEAD_VOCAB_CHUNK * 2


def test_grpo_phases_and_generation_kv_cache():
    bd = estimate(QWEN, GRPO, A100)
    assert set(bd.phase_peaks_bytes) == {"generation", *PHASES}
    lens = lengths(GRPO)
    assert (lens.rows, lens.prompt, lens.completion) == (8, 1536, 512)
    kv = bd.component("kv_cache")
    # 2 (k, v) x 28 layers x 8 rows x 4 kv heads x 2048 tokens x 128 x 2 bytes
    assert kv == 2 * 28 * 8 * 4 * 2048 * 128 * 2
    more = estimate(QWEN, GRPO.replace(grad_accum=4), A100)  # steps_per_generation = grad_accum
    assert more.component("kv_cache") == 4 * kv
    beta = estimate(QWEN, GRPO.replace(ref_model="adapter"), A100)
    assert "reference" in beta.phase_peaks_bytes
    # beta != 0 on a PeftModel: GRPOTrainer.__init__ adds the frozen "ref" copy of the adapter
    assert beta.component("reference_adapter") == beta.component("adapters") > 0
    assert bd.component("reference_adapter") == 0  # beta 0: no reference at all


def test_vllm_colocate_takes_its_share_of_the_card_and_server_none():
    fits = GRPO.replace(checkpointing=True)
    colo = estimate(QWEN, fits.replace(generation="vllm-colocate", vllm_memory_fraction=0.4), A100)
    server = estimate(QWEN, fits.replace(generation="vllm-server"), A100)
    share = int(0.4 * A100.usable_memory_bytes)
    assert colo.component("vllm_reserved") == share
    assert colo.device_total_bytes - server.device_total_bytes == pytest.approx(share, rel=0.01)
    assert server.component("kv_cache") == 0 and colo.tensor_peak_bytes == server.tensor_peak_bytes
    assert any("does not run here" in n for n in colo.notes)
    # the split of the card: the largest vLLM share the trainer's peak leaves room for
    room = next(n for n in colo.notes if "leaves up to" in n)
    free = 1 - server.device_total_bytes / A100.usable_memory_bytes
    assert f"{free:.0%}" in room
    with pytest.raises(SpecError, match="give --gpu"):
        estimate(QWEN, GRPO.replace(generation="vllm-colocate"))


@pytest.mark.parametrize("setup, match", [
    (Setup(objective="kto"), "needs --batch 2"),  # ORPO/KTO: tests/test_objectives_pref.py
    (DPO.replace(zero_stage=2), "one GPU"),
    (DPO.replace(loss="chunked"), "fused log-prob head"),
    (DPO.replace(precision="bf16-mixed"), "without autocast"),
])
def test_what_is_not_modelled_is_refused(setup, match):
    with pytest.raises(SpecError, match=match):
        estimate(QWEN, setup, A100)


@pytest.mark.parametrize("kw, match", [
    ({"objective": "dpo", "ref_model": "none"}, "DPO needs a reference"),
    ({"objective": "grpo", "ref_model": "precomputed"}, "cannot be precomputed"),
    ({"objective": "dpo", "ref_model": "adapter"}, "adapter-disabled base"),
    ({"objective": "grpo", "max_prompt_length": 2000, "max_completion_length": 512}, "exceeds seq"),
    ({"objective": "dpo", "num_generations": 4}, "applies to --objective grpo"),
])
def test_setup_refuses_contradictions(kw, match):
    with pytest.raises(SpecError, match=match):
        Setup(**kw)


def test_cli_estimates_answer_with_phases():
    runner = CliRunner()
    dpo = runner.invoke(main, ["estimate", "qwen2.5-7b", "--method", "lora", "--objective", "dpo", "--gpu",
                               "a100-80gb", "--json"])
    assert dpo.exit_code == 0, dpo.output
    assert set(json.loads(dpo.stdout)["phase_peaks_bytes"]) == {"reference", *PHASES}
    grpo = runner.invoke(main, ["estimate", "qwen2.5-7b", "--method", "lora", "--objective", "grpo",
                                "--num-generations", "8", "--max-completion-length", "512", "--gpu", "a100-80gb"])
    assert grpo.exit_code == 0, grpo.output
    assert "generation" in grpo.stdout and "kv_cache" in grpo.stdout
    bad = runner.invoke(main, ["estimate", "qwen2.5-7b", "--objective", "kto"])
    assert bad.exit_code == 2 and bad.output.startswith("error: --objective kto needs --batch 2")


def test_plan_fixes_the_objective_on_one_resident_gpu():
    from vramplan.search import plan

    p = plan("qwen2.5-7b", A100, objective="grpo", num_generations=8, max_completion_length=512, method="lora")
    assert p.setup.objective == "grpo" and p.setup.zero_stage == 0 and p.setup.fsdp == "none"
    assert p.breakdown.fits and "generation" in p.breakdown.phase_peaks_bytes


# ----------------------------------------------------------------------------------------------
# the truths


def _narrow():
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.truths.cpu_truth import shrink_config
    from vramplan.validate.matrix import CPU_SHRINK

    m = load_model("meta-llama/Llama-3.2-1B")
    cfg = shrink_config(m.config, **CPU_SHRINK)
    return cfg, model_spec_from_config(cfg, name="narrow", source=m.source)


def test_dpo_trainer_on_the_cpu_within_five_percent():
    pytest.importorskip("trl")
    from vramplan.truths.objectives import run_dpo

    cfg, spec = _narrow()
    s = Setup(method="lora", objective="dpo", seq=128, batch=2)
    t = run_dpo(cfg, s)
    e = estimate(spec, s, stack=Stack(trl_triton=False))
    assert set(t.phase_peaks_bytes) == {"reference", *PHASES}
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) <= 0.05
    assert abs(e.phase_peaks_bytes["reference"] / t.phase_peaks_bytes["reference"] - 1) <= 0.05
    assert t.params_trainable == e.params_trainable


def test_traced_grpo_step_within_five_percent():
    pytest.importorskip("trl")
    from vramplan.model.architecture import with_layers
    from vramplan.truths.objective_trace import trace_objective

    spec = with_layers(load_model("meta-llama/Llama-3.2-1B"), 2)
    s = Setup(method="lora", objective="grpo", seq=1024, batch=1, num_generations=4, max_completion_length=512)
    t = trace_objective(spec.config, s)
    e = estimate(spec, s, stack=Stack(trl_triton=False))
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) <= 0.05


# the fast tier runs the full fine-tune (the reference copied from the checkpoint); LoRA with the
# "ref" adapter runs in the full tier (the fast tier's LoRA GRPO step: test_traced_grpo_step_within_five_percent)
@pytest.mark.parametrize("kw", [{}, pytest.param({"method": "lora", "ref_model": "adapter"}, marks=pytest.mark.slow)])
def test_grpo_trainer_with_hf_generation_on_the_cpu(kw):
    """Every phase within 5 %: generation (HF generate with the KV cache, as the checkpoint's
    ``use_cache: true`` has it; LoRA: a no-grad prefill with the adapters on) and, with the "ref"
    adapter GRPOTrainer adds for a PeftModel, the reference."""
    pytest.importorskip("trl")
    from vramplan.truths.objectives import run_grpo

    cfg, spec = _narrow()
    s = Setup(objective="grpo", seq=128, batch=1, num_generations=4, max_completion_length=32, **kw)
    t = run_grpo(cfg, s)
    e = estimate(spec, s, stack=Stack(trl_triton=False))
    assert "generation" in t.phase_peaks_bytes
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) <= 0.05
    for phase, truth in t.phase_peaks_bytes.items():
        if phase in e.phase_peaks_bytes:
            assert abs(e.phase_peaks_bytes[phase] / truth - 1) <= 0.05, phase


# ----------------------------------------------------------------------------------------------
# the emitted TRL script


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256, "max_window_layers": 2}


# the emitted TRL scripts (DPO, GRPO, ORPO, KTO, full and LoRA) run in tests/test_objectives_pref.py
