"""``--framework torchtune`` (estimator/torchtune.py): torchtune 0.6.1's single-device recipes, their own
model, chunked loss and torchao NF4, against the real step on the CPU (vramplan/truths/torchtune_truth.py)."""

from __future__ import annotations

import pytest

from vramplan import Setup, estimate, load_model
from vramplan.estimator import torchtune as tt
from vramplan.util.errors import SpecError

TT = Setup(framework="torchtune", precision="bf16", optimizer="adamw-fused", seq=2048,
           lora_targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


def _c(bd, name):
    return next((c.bytes for c in bd.components if c.name == name), 0)


def test_the_step_is_torchtunes_own():
    m = load_model("llama-3.1-8b")
    q = estimate(m, TT.replace(method="qlora", checkpointing=True))
    # torchao NF4 on every layer Linear, the head and embeddings bf16, the RoPE cache fp32
    lin = [l.weight_params for l in m.linears if l.role != "head" for _ in range(l.count)]
    assert _c(q, "weights") == 2 * (m.params_total - sum(lin)) + sum(tt.nf4_bytes(n) for n in lin) \
        + tt.rope_cache_bytes(m, q.setup)
    assert tt.nf4_bytes(4096 * 4096) == 4096 * 4096 // 2 + 4096 * 4096 // 64 + 2 * 1024 + 2 + 32
    # bf16 adapters, gradients, fused AdamW states
    assert _c(q, "adapters") == _c(q, "gradients") == _c(q, "optimizer_states") // 2
    # the chunked loss keeps every chunk's fp32 log-probs: 6 N V and one chunk's upcast at its last chunk
    N, V = 2048, m.vocab_size
    assert _c(q, "logits_loss") == 2 * N * V + 4 * N * V + 4 * 256 * V
    assert q.phase == "forward"
    # pinned (CPU truth: -0.7 % .. +1.1 % on the narrow models, validate --knob framework)
    assert q.tensor_peak_bytes == 8_282_267_328


def test_saved_per_layer_is_what_its_modules_keep():
    m = load_model("llama-3.1-8b")
    lora = TT.replace(method="lora", lora_rank=8)
    h, q, i, r = m.hidden_size, m.q_dim, m.intermediate_size, lora.lora_rank
    # norms (fp32 input + rstd, bf16 output), q after RoPE, the expanded K/V, SDPA's output and lse,
    # the MLP's three c i and w2's input, six lora_a outputs
    expect = (4 * h + 4 + 2 * h) * 2 + 2 * q + 2 * 2 * q + 2 * q + 4 * m.num_heads + 8 * i + 6 * 2 * r
    assert tt.layer_saved_per_token(m, lora, 1) == expect
    assert tt.layer_saved_per_token(m, lora, 0) == expect - (4 * h + 4)  # frozen embeddings
    full = tt.layer_saved_per_token(m, TT.replace(method="full"), 0)
    assert full == expect - 6 * 2 * r + 8 * h


@pytest.mark.parametrize("kw, fragment", [
    ({"precision": "bf16-mixed"}, "bf16"),
    ({"method": "lora", "quant": "int8"}, "torchao NF4"),
    ({"method": "lora", "checkpointing": True, "activation_offload": True}, "OffloadActivations"),
    ({"gpus": 2}, "several GPUs"),
    ({"method": "lora", "lora_targets": "q_proj,lm_head"}, "head"),
])
def test_what_is_not_modelled_is_refused(kw, fragment):
    with pytest.raises(SpecError, match=fragment):
        estimate(load_model("llama-3.1-8b"), TT.replace(**kw))


def test_qwen2_qlora_and_other_families_are_refused():
    with pytest.raises(SpecError, match="no qlora_qwen2"):
        estimate(load_model("qwen2.5-7b"), TT.replace(method="qlora"))
    with pytest.raises(SpecError, match="family"):
        estimate(load_model("gemma-2b"), TT.replace(method="lora"))


def test_the_reader_sets_the_framework():
    from pathlib import Path

    from vramplan.readers import read_config

    d = Path(__file__).parent / "data/configs/torchtune"
    assert read_config(d / "llama3_2_1B_qlora_single_device.yaml").setup.framework == "torchtune"
    assert read_config(d / "llama3_1_8B_full.yaml").setup.framework == "hf"  # distributed: FSDP2
    assert read_config(d / "gemma2_2B_lora_single_device.yaml").setup.framework == "hf"


@pytest.mark.slow
def test_estimate_within_5_percent_of_torchtunes_real_step():
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.truths import torchtune_truth as truth
    from vramplan.validate.accuracy import Row

    if truth.torchtune_python() is None:
        pytest.skip("torchtune 0.6.1 is not importable here (a venv sharing this torch: VRAMPLAN_TORCHTUNE_PYTHON)")
    rows = truth.torchtune_rows(quick=True, row_type=Row)
    assert len(rows) == 2 and all(r.verified for r in rows)  # the tensor peak and the loaded weights
    # QLoRA with checkpointing and full fine-tuning with the paged 8-bit AdamW stepped in backward
    for (m, s), t in zip([truth.CASES[3], truth.CASES[8]], truth.run_cases([truth.CASES[3], truth.CASES[8]]),
                         strict=True):
        e = estimate(model_spec_from_config(truth.narrow_config(m), name=m), s)
        rows.append(Row(m, "-", s, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase))
        rows.append(Row(m, "-", s, t.weights_bytes, e.component("weights") + e.component("adapters"), "-", "-"))
    for r in rows:
        assert abs(r.estimated_bytes / r.traced_bytes - 1) <= 0.05, r
