"""Knob by knob: the estimator's terms against what the real libraries allocate.

bitsandbytes' layers and optimizers run for real on this CPU (vramplan.truths.cpu_truth); torch's and
transformers' optimizers, autocast, accumulation and the chunked loss run on fake tensors
(vramplan.run.tracer). Models are narrow two-layer copies of shipped profiles, so each test takes
about a second. The full matrix is `vramplan validate` (benchmarks/accuracy.py --validate).
"""

from __future__ import annotations

import pytest

from vramplan.estimator import estimate, optimizer_state_bytes
from vramplan.model.architecture import model_spec_from_config, with_layers
from vramplan.model.profiles import load_model
from vramplan.specs import Setup

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from vramplan.truths.cpu_truth import (  # noqa: E402 (after the importorskips)
    build_model,
    make_optimizer,
    quant_state_tensors,
    run_step,
    shrink_config,
)

SMALL = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024}


@pytest.fixture(scope="module")
def llama():
    cfg = shrink_config(load_model("llama-3.2-1b").config, **SMALL)
    return cfg, model_spec_from_config(cfg, name="llama-narrow")


@pytest.mark.parametrize("setup", [Setup(method="qlora", seq=64),
                                   Setup(method="qlora", quant="fp4", double_quant=False, seq=64),
                                   Setup(method="lora", quant="int8", seq=64)], ids=["nf4-dq", "fp4", "int8"])
def test_quantized_weights_are_counted_exactly(llama, setup):
    """Weights as loaded (4-bit packs, absmax, nested double-quant state, LLM.int8 row scales, the
    fp32 upcasts of prepare_model_for_kbit_training) against the estimate's weights + adapters."""
    cfg, spec = llama
    model = build_model(cfg, setup)
    extra = quant_state_tensors(model)
    assert extra, "the quantization state (absmax / SCB) must be found and counted"
    from vramplan.run.live import LiveTensorCounter

    counter = LiveTensorCounter()
    counter.track(model, extra)
    est = estimate(spec, setup)
    truth = counter.current_bytes
    assert abs(est.component("weights") + est.component("adapters") - truth) <= 0.002 * truth
    # prepare_model_for_kbit_training: embeddings, norms and head are fp32, the linears quantized
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and "proj" not in n}
    assert dtypes == {torch.float32}


# the fast tier: QLoRA with and without checkpointing (the int8 base's step: int8-dropout below; this one in
# the full tier)
@pytest.mark.sample(2)
@pytest.mark.parametrize("setup", [Setup(method="qlora", seq=128), Setup(method="lora", quant="int8", seq=128),
                                   Setup(method="qlora", checkpointing=True, batch=2, seq=128)],
                         ids=["qlora", "int8", "qlora-ckpt"])
def test_quantized_step_within_5_percent_of_a_real_cpu_run(llama, setup):
    cfg, spec = llama
    truth = run_step(cfg, setup)
    est = estimate(spec, setup)
    assert abs(est.tensor_peak_bytes / truth.tensor_peak_bytes - 1) <= 0.05, (truth.phase_peaks_bytes,
                                                                               est.phase_peaks_bytes)


@pytest.mark.sample(2)  # the fast tier: the 16-bit stream and int8 with dropout (QLoRA dropout: the full tier)
@pytest.mark.parametrize("setup", [Setup(method="lora", quant="int8", framework="axolotl", batch=2, seq=256),
                                   Setup(method="qlora", lora_dropout=0.05, batch=2, seq=256),
                                   Setup(method="lora", quant="int8", lora_dropout=0.05, batch=2, seq=256)],
                         ids=["int8-16bit-stream", "qlora-dropout", "int8-dropout"])
def test_int8_inputs_and_lora_dropout_within_5_percent_of_a_real_cpu_run(llama, setup):
    """axolotl's LLM.int8 base (a 16-bit stream, fp32 adapters): MatMul8bitLt keeps each distinct 16-bit
    input beside the adapters' fp32 casts; LoRA dropout keeps CUDA's 1-byte mask (cuda_kernels)."""
    cfg, spec = llama
    truth = run_step(cfg, setup)
    est = estimate(spec, setup)
    assert abs(est.tensor_peak_bytes / truth.tensor_peak_bytes - 1) <= 0.05, (truth.phase_peaks_bytes,
                                                                               est.phase_peaks_bytes)


def test_dropout_keeps_cudas_bool_mask():
    """On CPU, ``F.dropout`` multiplies by a mask of the input's dtype and MulBackward keeps it; CUDA's fused
    kernel keeps a bool mask. Inside cuda_kernels() the CPU truth runs the fused one."""
    import torch.nn.functional as F

    from vramplan.run.cuda_paths import cuda_kernels

    x = torch.randn(4, 64, requires_grad=True)
    assert type(F.dropout(x, 0.1, True).grad_fn).__name__ == "MulBackward0"
    with cuda_kernels():
        y = F.dropout(x, 0.1, True)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool
        assert F.dropout(x, 0.1, False) is x  # eval: untouched
    assert type(F.dropout(x, 0.1, True).grad_fn).__name__ == "MulBackward0"  # restored


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "paged-adamw-8bit", "lion", "adafactor", "sgd"])
def test_optimizer_states_match_the_real_optimizer(llama, optimizer):
    """States after one real step (bitsandbytes' 8-bit blocks, fp32 states under 4096 elements and
    for the embeddings the Trainer registers 32-bit, Lion's fp32 state; Adafactor's factored moments; SGD's
    momentum) equal the estimate, paged states excepted (they are managed memory on CUDA: paged_optimizer_states)."""
    cfg, spec = llama
    setup = Setup(optimizer=optimizer, seq=32)
    model = build_model(cfg, setup)
    opt = make_optimizer(setup, [p for p in model.parameters() if p.requires_grad], model)  # as the Trainer
    ids = torch.randint(0, cfg["vocab_size"], (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    states = [v for st in opt.state.values() for k, v in st.items()
              if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2", "step")]
    total = sum(v.untyped_storage().nbytes() for v in states)
    est = estimate(spec, setup)
    paged = est.component("paged_optimizer_states")
    assert optimizer_state_bytes(spec, setup) + paged == pytest.approx(total, rel=0.002, abs=64)
    if optimizer == "paged-adamw-8bit":
        assert paged > 0 and est.device_total_bytes > est.peak_reserved_bytes + paged


def test_paged_states_leave_the_tensor_peak_but_not_the_device(llama):
    cfg, spec = llama
    plain, paged = Setup(optimizer="adamw-8bit", seq=64), Setup(optimizer="paged-adamw-8bit", seq=64)
    t_plain, t_paged = run_step(cfg, plain), run_step(cfg, paged)
    e_plain, e_paged = estimate(spec, plain), estimate(spec, paged)
    assert t_paged.paged_bytes == e_paged.component("paged_optimizer_states") > 0
    assert t_plain.tensor_peak_bytes - t_paged.tensor_peak_bytes == pytest.approx(t_paged.paged_bytes, rel=0.01)
    assert e_plain.device_total_bytes == pytest.approx(e_paged.device_total_bytes, rel=0.01)
    assert e_paged.tensor_peak_bytes < e_plain.tensor_peak_bytes


@pytest.mark.parametrize("setup", [Setup(seq=256, optimizer="adafactor"), Setup(seq=256, optimizer="adamw-fused"),
                                   Setup(seq=256, precision="bf16-mixed"),
                                   Setup(seq=256, method="lora", precision="fp16-mixed"),
                                   Setup(seq=256, grad_accum=3), Setup(seq=512, batch=4, loss="chunked"),
                                   Setup(seq=512, batch=4, method="lora", loss="chunked")],
                         ids=["adafactor", "fused", "bf16-mixed", "lora-fp16-mixed", "accum", "chunked",
                              "lora-chunked"])
def test_traced_knobs_within_2_percent(setup):
    """Real widths (Llama-3.2-1B, two layers, tied embeddings): every phase within 2 %."""
    from vramplan.run.tracer import trace

    model = with_layers(load_model("llama-3.2-1b"), 2)
    t, e = trace(model, setup), estimate(model, setup)
    for phase, truth in t.phase_peaks_bytes.items():
        assert abs(e.phase_peaks_bytes[phase] / truth - 1) <= 0.02, (phase, e.phase_peaks_bytes, t.phase_peaks_bytes)


def test_padding_mask_reaches_sdpa_and_the_estimate_follows():
    """A padded batch gives every SDPA call a boolean mask (kept for backward, K/V repeated to
    all heads); the traced forward grows by exactly that and the estimate follows it."""
    from vramplan.run.tracer import trace

    model = with_layers(load_model("qwen2.5-7b"), 2)
    plain, padded = Setup(seq=1024), Setup(seq=1024, pad_mask=True)
    t0, t1 = trace(model, plain), trace(model, padded)
    e0, e1 = estimate(model, plain), estimate(model, padded)
    grown = t1.phase_peaks_bytes["forward"] - t0.phase_peaks_bytes["forward"]
    assert grown >= 1024 * 1024  # at least the (1, 1, s, s) bool mask
    assert e1.phase_peaks_bytes["forward"] - e0.phase_peaks_bytes["forward"] == pytest.approx(grown, rel=0.01)


def test_chunked_loss_is_the_same_loss_as_transformers():
    """The chunked loss is a memory layout, not another objective: same value, same gradients."""
    import transformers

    from vramplan.run.chunked_loss import patch_chunked_loss

    cfg = shrink_config(load_model("llama-3.2-1b").config, layers=1, hidden=64, heads=4, vocab=300)
    from vramplan.run.models import hf_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg, None), dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 40))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    import vramplan.run.chunked_loss as cl

    old = cl.LOSS_CHUNK_TOKENS
    with patch_chunked_loss(model):
        loss = cl.chunked_cross_entropy(model.model(input_ids=ids)[0], model.lm_head.weight, ids, chunk=16)
        assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward()
    assert cl.LOSS_CHUNK_TOKENS == old
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(model.lm_head.weight.grad, ref_grad, atol=1e-6)


def test_bitsandbytes_optimizers_are_not_traced():
    from vramplan.run.tracer import NotTraceable, trace

    with pytest.raises(NotTraceable, match="real run"):
        trace(with_layers(load_model("llama-3.2-1b"), 2), Setup(optimizer="adamw-8bit", seq=32))
