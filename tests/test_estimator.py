"""The analytic tier's own contract: pure, torch-free, and every knob of Setup moves the numbers
the way the memory it models moves (the knobs issue 3 makes exact are first-order here)."""

import dataclasses

import pytest

from vramplan.estimator import estimate, lora_params, trainable_params
from vramplan.model.profiles import load_gpu, load_model
from vramplan.specs import PHASES, Setup, SpecError

MODEL = load_model("llama-3.1-8b")
BASE = Setup(method="lora", checkpointing=True, seq=2048)


def peak(**changes) -> int:
    return estimate(MODEL, BASE.replace(**changes)).tensor_peak_bytes


def component(name: str, **changes) -> int:
    return estimate(MODEL, BASE.replace(**changes)).component(name)


def test_phases_are_a_max_not_a_sum():
    bd = estimate(MODEL, Setup())
    assert bd.tensor_peak_bytes == max(bd.phase_peaks_bytes.values())
    assert bd.phase in PHASES and bd.phase_peaks_bytes[bd.phase] == bd.tensor_peak_bytes
    gpu_sum = sum(c.bytes for c in bd.components if c.where == "gpu")
    assert bd.device_total_bytes < gpu_sum  # activations and the optimizer transient never coexist
    assert bd.tensor_peak_bytes < bd.peak_allocated_bytes < bd.peak_reserved_bytes < bd.device_total_bytes


def test_known_counts():
    assert MODEL.params_total == 8_030_261_248
    assert lora_params(MODEL, Setup(method="lora", lora_rank=16)) == 41_943_040  # r=16, all-linear
    assert trainable_params(MODEL, Setup()) == MODEL.params_total


def test_estimate_is_pure():
    setup = Setup(method="qlora", zero_stage=2, gpus=2)
    before = dataclasses.asdict(setup)
    a, b = estimate(MODEL, setup), estimate(MODEL, setup)
    assert a == b and dataclasses.asdict(setup) == before


@pytest.mark.parametrize(
    "smaller, larger",
    [
        ({"quant": "nf4", "method": "qlora"}, {}),  # a 4-bit base
        ({"quant": "int8", "checkpointing": False}, {"checkpointing": False}),  # an 8-bit base
        ({"double_quant": True, "method": "qlora"}, {"double_quant": False, "method": "qlora"}),
        ({}, {"method": "full"}),
        ({"lora_rank": 8}, {"lora_rank": 128}),
        ({"lora_targets": "q_proj,v_proj"}, {}),
        ({"checkpointing": False}, {"checkpointing": False, "lora_dropout": 0.1}),
        ({}, {"precision": "fp32"}),
        ({}, {"precision": "bf16-mixed"}),
        ({"optimizer": "adamw-8bit", "method": "full"}, {"method": "full"}),
        ({"optimizer": "sgd", "method": "full"}, {"method": "full"}),
        ({"optimizer": "adamw-fused", "method": "full"}, {"method": "full"}),
        ({"optimizer": "adafactor", "method": "full"}, {"method": "full"}),
        ({}, {"checkpointing": False}),
        ({}, {"attn": "eager", "seq": 4096}),
        ({"seq": 1024}, {"seq": 4096}),
        ({"batch": 1}, {"batch": 4}),
        ({"loss": "chunked", "seq": 8192}, {"seq": 8192}),
        ({"method": "full", "zero_stage": 3, "gpus": 8}, {"method": "full", "zero_stage": 1, "gpus": 8}),
        ({"method": "full", "zero_stage": 2, "gpus": 8, "offload_optimizer": "cpu"},
         {"method": "full", "zero_stage": 2, "gpus": 8}),
    ],
)
def test_every_knob_moves_memory_the_right_way(smaller, larger):
    assert peak(**smaller) < peak(**larger)


def test_grad_accumulation_keeps_gradients_through_later_forwards():
    one = estimate(MODEL, Setup(checkpointing=True))
    four = estimate(MODEL, Setup(checkpointing=True, grad_accum=4))
    assert four.phase_peaks_bytes["forward"] - one.phase_peaks_bytes["forward"] == one.component("gradients")


def test_offload_moves_memory_to_the_host():
    on_gpu = estimate(MODEL, Setup(zero_stage=3, gpus=4))
    off = estimate(MODEL, Setup(zero_stage=3, gpus=4, offload_optimizer="cpu", offload_params="cpu"))
    assert off.host_bytes > on_gpu.host_bytes == 0
    assert off.tensor_peak_bytes < on_gpu.tensor_peak_bytes


def test_more_gpus_never_cost_more_per_gpu_under_zero():
    peaks = [estimate(MODEL, Setup(zero_stage=3, gpus=n)).tensor_peak_bytes for n in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True)


def test_fit_is_judged_on_device_total():
    gpu = load_gpu("rtx-4090")
    bd = estimate(MODEL, BASE, gpu)
    assert bd.fits == (bd.device_total_bytes <= gpu.usable_memory_bytes)
    assert bd.headroom_bytes == gpu.usable_memory_bytes - bd.device_total_bytes
    assert estimate(MODEL, Setup(), gpu).fits is False


def test_hopper_uses_the_larger_cublas_workspace():
    assert (estimate(MODEL, BASE, load_gpu("h100-sxm")).component("cublas_workspace")
            > estimate(MODEL, BASE, load_gpu("a100-80gb")).component("cublas_workspace"))


def test_setups_peft_would_refuse_raise_from_estimate_too():
    with pytest.raises(SpecError, match="larger than the smallest targeted layer"):
        estimate(load_model("smollm2-135m"), Setup(method="lora", lora_rank=4096))


@pytest.mark.parametrize("quant, warned", [("nf4", True), ("int8", True), ("none", False)])
def test_quantized_moe_warns_that_fused_experts_stay_fp32(quant, warned):
    """transformers 5's fused 3-D experts are not Linears: bitsandbytes leaves them alone and
    prepare_model_for_kbit_training upcasts them, so a quantized Mixtral says so."""
    spec = load_model("mixtral-8x7b")
    bd = estimate(spec, Setup(method="lora", quant=quant))
    notes = [n for n in bd.notes if "fused 3-D" in n]
    assert bool(notes) is warned
    if warned:
        assert "45.1B expert parameters" in notes[0] and f"--quant {quant}" in notes[0]
    dense = estimate(load_model("llama-3.1-8b"), Setup(method="lora", quant=quant))
    assert not [n for n in dense.notes if "fused 3-D" in n]


def test_an_int8_base_keeps_its_linear_inputs_through_checkpointing():
    """bitsandbytes' MatMul8bitLt keeps its input as a ctx attribute, which checkpointing's hooks never see:
    a checkpointed layer on an LLM.int8 base keeps, besides its input, each norm output once, the attention
    output and the MLP's product, in the residual stream's dtype (fp32 after the HF recipe's k-bit upcast).
    For Llama-3.1-8B at 2048 tokens that is 7 GiB, about what the int8 weights save: checkpointing an int8
    base costs as much as a bf16 base (verified by validate --knob quantization's cpu-run rows, within 1.4 %)."""
    h, i, L, N = MODEL.hidden_size, MODEL.intermediate_size, MODEL.num_layers, 2048
    ck = component("checkpointed_inputs", quant="int8")
    assert ck == L * N * 4 * (h + 3 * h + i)  # the layer input and the four held inputs, fp32
    assert component("checkpointed_inputs", quant="int8", framework="trl") == L * N * 2 * (4 * h + i)  # bf16
    assert component("checkpointed_inputs", method="qlora", quant="nf4") == L * N * 4 * h  # MatMul4Bit saves


@pytest.mark.parametrize("name", ["mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B"])
def test_moe_lora_on_attention_only_keeps_no_expert_training_saves(name):
    """With q/k/v/o targets peft wraps none of the 3-D expert parameters: the experts run on their own frozen
    weights and keep neither the gathered input nor the product down_proj reads (their weights' gradients'
    inputs), nor the router's input (was +4.4 % above the fake-tensor trace on Mixtral, batch 4 x 512)."""
    from vramplan.estimator.activations import moe_layer_bytes_per_token
    from vramplan.model.architecture import with_layers

    model = with_layers(load_model(name), 2)
    attn = Setup(method="lora", seq=512, batch=4, lora_targets="q_proj,k_proj,v_proj,o_proj")
    moe, h, ei = model.moe, model.hidden_size, model.moe.expert_intermediate_size
    full_lora = moe_layer_bytes_per_token(model, attn.replace(lora_targets="all-linear"))
    assert full_lora - moe_layer_bytes_per_token(model, attn) == 2 * (moe.top_k * (h + ei) + h)


@pytest.mark.slow
def test_moe_lora_on_attention_only_within_1_percent_of_the_trace():
    from vramplan.model.architecture import with_layers
    from vramplan.run.tracer import trace

    model = with_layers(load_model("mistralai/Mixtral-8x7B-v0.1"), 2)
    s = Setup(method="lora", seq=512, batch=4, lora_targets="q_proj,k_proj,v_proj,o_proj")
    assert estimate(model, s).tensor_peak_bytes == pytest.approx(trace(model, s).tensor_peak_bytes, rel=0.01)


@pytest.mark.slow
def test_a_sliding_window_past_its_length_keeps_the_mask_through_the_layers_backward():
    """Mistral v0.1 (window 4096) at 4096 tokens, LoRA with checkpointing, the real CPU step: the peak is the top
    layer's recompute, beside the bool mask every checkpoint holds and RoPE's cos/sin (layers_inputs). Without
    them the estimate was -12 % on this narrow 2-layer model."""
    pytest.importorskip("torch")
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.model.modelspec import shrink_config
    from vramplan.truths.cpu_truth import run_step

    base = load_model("mistralai/Mistral-7B-v0.1")
    cfg = shrink_config(base.config, layers=2, hidden=256, heads=4, vocab=2048)
    spec = model_spec_from_config(cfg, name="narrow", source=base.source)
    s = Setup(method="lora", checkpointing=True, seq=4096)
    truth = run_step(cfg, s)
    assert estimate(spec, s).tensor_peak_bytes == pytest.approx(truth.tensor_peak_bytes, rel=0.03)
