"""The gaps the published real-GPU peaks showed (issue 13, item 2), each modelled as a term with
its source: the library version boundaries an estimate states (estimator/stack.py) and the terms
they switch. The published rows themselves are in calibration/published/records.jsonl."""

from __future__ import annotations

import pytest

from vramplan.estimator import estimate
from vramplan.estimator.stack import (
    DEFAULT_STACK,
    MODELLED_VERSIONS,
    Stack,
    moe_experts_4x_saving_bytes,
    stack_from_versions,
)
from vramplan.profiles import load_model
from vramplan.published import compare, estimate_record, load_records, resolve_model, token_slopes
from vramplan.specs import Setup
from vramplan.units import bnb_4bit_tensor_bytes

MISTRAL = "mistralai/Mistral-7B-v0.1"


@pytest.mark.parametrize("version, shift, linear_experts", [
    ("4.45.2", False, True), ("4.46.0", True, True), ("4.48.1", True, True), ("4.49.0", False, True),
    ("5", False, False), ("5.24.0", False, False),
])
def test_transformers_version_boundaries(version, shift, linear_experts):
    """4.46-4.48's ForCausalLMLoss copies the shifted fp32 logits; 4.49 pads the labels instead
    (read off the wheels); 4.x experts are nn.Linear, 5's are fused 3-D parameters."""
    stack = Stack(transformers=version)
    assert stack.loss_shift_copy is shift
    assert stack.moe_experts_linear is linear_experts
    assert stack.is_default is (version.split(".")[0] == "5")


def test_a_stack_is_read_from_a_records_versions():
    assert stack_from_versions({"transformers": {"version": "4.48.1", "how": "stated"}}) == Stack("4.48.1")
    assert stack_from_versions({}) == DEFAULT_STACK
    assert stack_from_versions({"transformers": {"version": "unknown"}}) == DEFAULT_STACK
    with pytest.raises(ValueError):
        Stack(transformers="main")


def test_the_shifted_logits_copy_is_b_s_minus_1_v_fp32_at_the_forward_loss():
    model, setup = resolve_model(MISTRAL), Setup(method="lora", checkpointing=True, batch=4, seq=4096)
    five, four = estimate(model, setup), estimate(model, setup, stack=Stack("4.48.1"))
    copy = 4 * setup.batch * (setup.seq - 1) * model.vocab_size
    assert four.phase == "forward"
    assert four.phase_peaks_bytes["forward"] - five.phase_peaks_bytes["forward"] == copy
    assert four.phase_peaks_bytes["backward"] == five.phase_peaks_bytes["backward"]
    assert any("models transformers 4.48.1" in n and "shifted fp32 logits" in n for n in four.notes)
    assert not any(n.startswith("models transformers") for n in five.notes)


def test_at_micro_batch_one_the_shifted_slice_is_contiguous_and_not_copied():
    """``logits[..., :-1, :]`` of a [1, s, V] tensor is contiguous, so 4.46-4.48's ``.contiguous()``
    returns it as is (the 4.48.1 loss on the CPU counter: +321,260 B/token at batch 1, +450,992
    at batch 2, vocab 32000): the forward equals transformers 5's."""
    model = resolve_model(MISTRAL)
    one, two = (Setup(method="lora", checkpointing=True, batch=b, seq=4096) for b in (1, 2))
    four = Stack("4.48.1")
    assert estimate(model, one, stack=four).phase_peaks_bytes == estimate(model, one).phase_peaks_bytes
    forward = [estimate(model, two, stack=s).phase_peaks_bytes["forward"] for s in (four, DEFAULT_STACK)]
    assert forward[0] - forward[1] == 4 * 2 * 4095 * model.vocab_size


def test_the_default_stack_states_the_versions_it_models():
    assert Stack().describe().startswith("transformers 5, torch 2.13")
    assert set(MODELLED_VERSIONS) >= {"transformers", "torch", "peft", "accelerate", "bitsandbytes", "flash-attn"}


EXACT_MISTRAL_LORA = ["fms-a100_80gb-16-Mistral-7B-v0.1-lora-g1-bs4", "fms-a100_80gb-csv34-Mistral-7B-v0.1-lora-g1-bs8"]


@pytest.mark.parametrize("rid", EXACT_MISTRAL_LORA)
def test_mistral_lora_one_gpu_rows_within_one_percent_under_their_transformers(rid):
    """fms-acceleration's Mistral-7B LoRA rows (transformers 4.48.1, exact lengths, every knob
    expressible): the shifted-logits copy was the whole -4 % / -6 % gap."""
    (record,) = [r for r in load_records() if r["id"] == rid]
    assert record["comparable"] and not record["approximations"]
    measured = record["measured_bytes"]
    assert abs(estimate_record(record).peak_allocated_bytes / measured - 1) < 0.01
    five = estimate(resolve_model(record["model"]), Setup.from_dict(record["setup"]))
    assert five.peak_allocated_bytes / measured - 1 < -0.03  # the stack is what closes it


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_a_quantized_moe_states_what_transformers_4_would_take(quant):
    spec = load_model("mixtral-8x7b")
    setup = Setup(method="lora", quant=quant)
    saving = moe_experts_4x_saving_bytes(spec, setup)
    experts = sum(n for name, n in spec.other_params if name == "experts")
    tensors = 3 * spec.moe.num_experts * spec.moe.num_moe_layers
    if quant == "nf4":
        assert saving == 4 * experts - tensors * bnb_4bit_tensor_bytes(experts // tensors, True)
    assert 0 < saving < 4 * experts
    five = estimate(spec, setup)
    assert any("under transformers 4.x" in n and f"{saving / 2**30:.1f} GiB less" in n for n in five.notes)
    four = estimate(spec, setup, stack=Stack("4.48.1"))
    assert any("transformers 4.48.1 quantizes the per-expert" in n for n in four.notes)
    assert moe_experts_4x_saving_bytes(spec, Setup(method="lora")) == 0
    assert moe_experts_4x_saving_bytes(load_model("llama-3.1-8b"), setup) == 0


FSDP_LORA_PAIR = ("fms-a100_80gb-17-Mistral-7B-v0.1-lora-g2-bs2", "fms-a100_80gb-19-Mistral-7B-v0.1-lora-g2-bs4")
ONE_GPU_LORA_PAIR = tuple(EXACT_MISTRAL_LORA)


def _allocated_slope(ids):
    records = load_records()
    rows = [r for r in compare([r for r in records if r["id"] in ids]) if r.quantity == "allocated"]
    (slope,) = token_slopes(records, rows)
    assert slope.ids == ids
    return slope


def test_one_gpu_mistral_lora_per_token_slope_within_one_percent():
    """What one more token costs on one GPU (bs4 -> bs8, fms-acceleration, transformers 4.48.1):
    734,762 B measured, within 1 % estimated: the per-token terms of the single-GPU step hold."""
    slope = _allocated_slope(ONE_GPU_LORA_PAIR)
    assert abs(slope.error) < 0.01


@pytest.mark.xfail(strict=True, reason=(
    "open (issue 13): on 2 GPUs under FSDP the same LoRA step costs ~100 KB more per token than on "
    "one GPU (831,904 vs 734,762 B measured; Mixtral's FSDP pair shows +141 KB), while 2-rank CPU "
    "truths of FSDP1 (torch 2.13, with transformers 5/peft 0.21/accelerate 1.15 and with the rows' "
    "transformers 4.48.1/peft 0.13.2/accelerate 1.0.1, reentrant checkpointing or not, and through "
    "4.48.1's HF Trainer with and without bf16 AMP: calibration/published/fsdp_trainer_probe.py) show "
    "no such term: it is in torch 2.4.1's CUDA FSDP path, flash-attn or TRL/fms-hf-tuning, not yet "
    "explained (calibration/published/README.md lists what was ruled out)"))
def test_fsdp_mistral_lora_per_token_slope_within_three_percent():
    """The FSDP pair's measured slope against the estimate's (the estimate's per-token terms under
    FSDP are the single-GPU ones). Strict: passes, and so fails here, once the term is modelled."""
    slope = _allocated_slope(FSDP_LORA_PAIR)
    assert abs(slope.error) < 0.03


def test_moe_lora_off_the_experts_builds_no_merged_expert_copy():
    """LoRA on q/k/v/o of Mixtral: peft 0.21 wraps no 3-D expert parameter (no ParamWrapper), so no
    merged copy of the expert stack exists; with all-linear it does. The fake-tensor trace of the
    real step agrees to the MiB at seq 1024 and 2048 (87.86 / 88.57 GiB: `vramplan trace
    mixtral-8x7b --method lora --lora-targets q_proj,k_proj,v_proj,o_proj --checkpointing --seq
    1024`); fms-acceleration's 2-GPU Mixtral LoRA rows moved from +6.7 / +9.5 % to +0.9 / +3.0 %."""
    from vramplan.estimator.activations import moe_lora_weight_bytes

    spec = load_model("mixtral-8x7b")
    attention = Setup(method="lora", lora_targets="q_proj,k_proj,v_proj,o_proj", checkpointing=True)
    assert moe_lora_weight_bytes(spec, attention) == 0
    assert moe_lora_weight_bytes(spec, Setup(method="lora", checkpointing=True)) > 0
    est = estimate(spec, attention)
    assert est.component("recompute") < 2**30 * (attention.tokens / 2048)  # no 2.6 GiB expert stack per layer
