"""The tracer: exact accounting on known tensors, and per-layer extrapolation == full trace."""

import pytest

from vramplan.architecture import with_layers
from vramplan.profiles import load_model
from vramplan.run.tracer import NotTraceable, trace, trace_numbers
from vramplan.specs import Setup, SpecError

pytest.importorskip("torch")


@pytest.mark.parametrize("setup", [Setup(seq=256), Setup(method="lora", seq=256),
                                   Setup(seq=256, checkpointing=True, batch=2)],
                         ids=["full", "lora", "full-ckpt-b2"])
@pytest.mark.parametrize("name, seq", [("llama-3.2-1b", 256), ("gpt2", 256), ("qwen3-30b-a3b", 64),
                                       ("gemma-3-1b", 512)])
def test_extrapolation_equals_full_depth_trace(name, seq, setup):
    """Six layers traced whole and traced at two depths (per layer type for Gemma3, whose sixth
    layer is full attention and whose sliding layers are masked at seq 512) agree exactly."""
    model = with_layers(load_model(name), 6)
    setup = setup.replace(seq=seq)
    whole = trace(model, setup, full_depth_max=6)
    extrapolated = trace(model, setup, full_depth_max=4)
    assert "extrapolated" in extrapolated.notes[0] and "full depth" in whole.notes[0]
    assert extrapolated.phase_peaks_bytes == whole.phase_peaks_bytes
    assert extrapolated.params_total == whole.params_total
    assert whole.params_total == model.params_total + (whole.params_trainable if setup.adapters else 0)


def test_weights_states_and_logits_are_counted_exactly():
    model = with_layers(load_model("llama-3.2-1b"), 2)
    setup = Setup(seq=128)
    nums = trace_numbers(model.config, setup)
    opt = nums.phase("optimizer").categories
    P = model.params_total
    assert opt["weights"] == 2 * P  # bf16, tied embeddings counted once
    assert opt["gradients"] == 2 * P
    assert 4 * P <= opt["optimizer_states"] <= 4 * P + 4 * 64  # exp_avg, exp_avg_sq (+ step scalars)
    fwd = nums.phase("forward").categories
    # at the loss: bf16 logits + their fp32 copy are temporaries, the fp32 log-probs are saved
    assert fwd["temporaries"] >= 6 * 128 * model.vocab_size


@pytest.mark.parametrize("name", ["qwen2.5-7b", "mixtral-8x7b", "qwen1.5-moe", "qwen3-30b-a3b", "deepseek-v2-lite",
                                  "gpt2"])
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_trainable_count_matches_peft(name, targets):
    """peft's own count, MoE conversions (ParamWrapper on fused experts and routers) included."""
    from vramplan.estimator import lora_params

    model = with_layers(load_model(name), 2)
    if targets != "all-linear" and model.linear("q_proj") is None:
        targets = "c_attn" if model.family == "gpt2" else "q_b_proj,kv_b_proj"
    setup = Setup(method="lora", lora_rank=8, seq=64, lora_targets=targets)
    assert trace(model, setup).params_trainable == lora_params(model, setup)


def test_setups_peft_would_refuse_are_one_line_errors():
    with pytest.raises(SpecError, match="matches no Linear"):
        trace(with_layers(load_model("gpt2"), 2), Setup(method="lora", lora_targets="q_proj", seq=32))


def test_quantized_setups_are_refused_with_a_reason():
    with pytest.raises(NotTraceable, match="bitsandbytes"):
        trace(load_model("gpt2"), Setup(method="qlora"))
    assert issubclass(NotTraceable, SpecError)
