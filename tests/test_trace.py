"""The tracer: exact accounting on known tensors, and per-layer extrapolation == full trace."""

import pytest

from vramplan.model.architecture import with_layers
from vramplan.model.profiles import load_model
from vramplan.run.tracer import NotTraceable, trace, trace_numbers
from vramplan.specs import Setup, SpecError

pytest.importorskip("torch")


@pytest.mark.sample(3)
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


@pytest.mark.sample(2)
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


def test_steps_the_tracer_does_not_run_are_refused_not_mislabelled():
    """Unsloth's and torchtune's own steps, and TRL's or Unsloth's fused losses, are not what the tracer
    runs (transformers' model and loss): a trace of them would be another step under their name."""
    m = with_layers(load_model("llama-3.2-1b"), 2)
    for kw, match in (({"framework": "unsloth", "loss": "unsloth"}, "--framework unsloth runs its own step"),
                      ({"framework": "torchtune", "precision": "bf16"}, "--framework torchtune runs its own step"),
                      ({"framework": "trl", "loss": "trl"}, "--loss trl is traced by `vramplan validate --knob loss`")):
        with pytest.raises(NotTraceable, match=match):
            trace(m, Setup(method="lora", seq=64, **kw))
    # TRL's step with transformers' loss is the one traced
    assert trace(m, Setup(method="lora", seq=64, framework="trl", loss="hf")).tensor_peak_bytes > 0


def test_boolean_sdpa_mask_becomes_an_additive_one_per_call():
    """torch 2.13's SDPA turns a boolean mask into a new additive one in the query's dtype at every
    call (convert_boolean_attn_mask; checked on the installed torch), which CUDA's memory-efficient
    kernel saves: an expanded view of (b, 1, s, s), padded over every head when s is not a multiple
    of 16 (preprocess_mask)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from vramplan.run.real_paths import efficient_attn_bias

    class Ops(TorchDispatchMode):
        made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 4:
                self.made.append((func, out.dtype))
            return out

    q = torch.zeros(1, 2, 32, 8, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).tril()
    with Ops():
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert (torch.ops.aten.where.self, torch.bfloat16) in Ops.made  # torch's own conversion
    bias = efficient_attn_bias(mask, q, q)
    assert bias.dtype == torch.bfloat16 and bias.shape == (1, 2, 32, 32)
    assert bias.untyped_storage().nbytes() == 2 * 32 * 32  # a view over one (1, 1, s, s) mask
    odd = efficient_attn_bias(torch.ones(1, 1, 30, 30, dtype=torch.bool), q[:, :, :30], q[:, :, :30])
    assert odd.shape == (1, 2, 30, 30) and odd.untyped_storage().nbytes() == 2 * 2 * 30 * 32  # padded


@pytest.mark.parametrize("setup", [Setup(seq=4096), Setup(seq=4096, method="lora"),
                                   Setup(seq=4096, method="lora", checkpointing=True)],
                         ids=["full", "lora", "lora-ckpt"])
def test_sliding_window_mask_at_the_window_within_1_percent(setup):
    """Mistral's sliding window (4096) at seq 4096: every layer's SDPA gets an explicit boolean
    mask and keeps its own bf16 additive copy (1 GiB over 32 layers at batch 1)."""
    from pathlib import Path

    from vramplan.estimator import estimate

    model = load_model(str(Path(__file__).parents[1] / "profiles/models/mistralai--Mistral-7B-v0.1.json"))
    assert model.traits.sliding_window == 4096
    traced, est = trace(model, setup), estimate(model, setup)
    assert abs(est.tensor_peak_bytes / traced.tensor_peak_bytes - 1) <= 0.01
