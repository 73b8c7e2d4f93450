"""The runtime knobs of issue 16: Liger kernels (``--liger``) and padding-free batches (``--padding-free``).

Liger: estimator terms against traces of the tracer's Liger stand-ins (vramplan/run/liger.py, which
keep what liger-kernel 0.8.5's Triton kernels keep), the refusals, the CLI answer, the published
Liger chart's per-token slope, the plan dimension, the emitter and the config readers.
Padding-free: the flattened row traced with per-sequence position ids, the refusals (no flash
attention, a padding mask), the emitter's collator and the readers.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

import vramplan
from vramplan import Setup, SpecError, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.estimator import liger as est_liger
from vramplan.model.architecture import with_layers
from vramplan.readers import read_config

LLAMA = "meta-llama/Llama-3.2-1B"


# ----------------------------------------------------------------------------------------------
# estimator terms


def test_liger_drops_the_logits_and_the_activation_outputs():
    """LoRA on Llama-3.1-8B, 4 x 2048: no N x V logits (fp32 log-probs, their gradients), no fp32 norm
    inputs, no SiLU output; the head input's gradient (N x h) appears from the forward on."""
    model = load_model("meta-llama/Llama-3.1-8B")
    s = Setup(method="lora", batch=4, seq=2048)
    plain, fused = estimate(model, s), estimate(model, s.replace(liger=True))
    N, V, h, i, L = s.tokens, model.vocab_size, model.hidden_size, model.intermediate_size, model.num_layers
    assert plain.component("logits_loss") >= 8 * N * V
    assert fused.component("logits_loss") < N * V // 4  # one chunk of rows and a few N-vectors
    # per layer: 2 norms x (4h fp32 input - 2h input) and the SiLU output (2 i)
    saved = plain.component("activations") - fused.component("activations")
    assert saved == pytest.approx(L * N * (2 * 2 * h + 2 * i), rel=0.01)
    io = plain.component("model_io_activations") - fused.component("model_io_activations")
    assert io == pytest.approx(N * (4 * V + 8 + 2 * h - 2 * h), rel=0.01)  # log-probs, labels; norm input = grad_input
    assert fused.tensor_peak_bytes < 0.8 * plain.tensor_peak_bytes
    assert fused.phase_peaks_bytes["optimizer"] == plain.phase_peaks_bytes["optimizer"]


def test_full_fine_tuning_keeps_the_head_gradient_from_the_forward():
    model = with_layers(load_model(LLAMA), 2)
    s = Setup(batch=2, seq=512, liger=True)
    fwd, bwd = est_liger.loss_transients(model, s)
    head_grad = model.vocab_size * model.hidden_size * 2
    assert fwd > head_grad and bwd == head_grad
    assert est_liger.loss_transients(model, s.replace(method="lora"))[1] == 0


@pytest.mark.parametrize("tokens,vocab,hidden", [(4096, 128256, 2048), (8192, 152064, 3584), (512, 256000, 2048),
                                                 (100, 32000, 4096), (1, 128256, 4096)])
def test_chunk_rows_match_the_stand_in(tokens, vocab, hidden):
    from vramplan.run.liger import flce_chunk_rows

    rows = est_liger.chunk_rows(tokens, vocab, hidden)
    assert rows == flce_chunk_rows(tokens, vocab, hidden)
    assert 1 <= rows <= tokens and rows & (rows - 1) == 0 or rows == tokens


def test_refusals_name_the_reason():
    with pytest.raises(SpecError, match="--loss hf"):
        Setup(liger=True, loss="chunked")
    with pytest.raises(SpecError, match="ZeRO-3"):
        Setup(liger=True, zero_stage=3, gpus=2)
    with pytest.raises(SpecError, match="gemma2.*not modelled"):
        estimate(load_model("gemma-2-9b"), Setup(method="lora", liger=True))
    with pytest.raises(SpecError, match="GPTQ base is not modelled"):
        estimate(load_model(LLAMA), Setup(method="lora", quant="gptq", liger=True))
    with pytest.raises(SpecError, match="no kernels"):
        estimate(load_model("gpt2"), Setup(liger=True))
    with pytest.raises(SpecError, match="objective dpo"):
        estimate(load_model(LLAMA), Setup(method="lora", liger=True, objective="dpo"))


def test_cli_answers_with_liger():
    runner = CliRunner()
    args = ["estimate", "meta-llama/Llama-3.1-8B", "--method", "lora", "--gpu", "rtx-4090", "--json"]
    plain = runner.invoke(main, args)
    fused = runner.invoke(main, [*args, "--liger"])
    assert plain.exit_code == 0 and fused.exit_code == 0, fused.output
    p, f = json.loads(plain.stdout), json.loads(fused.stdout)
    assert f["setup"]["liger"] is True and p["setup"]["liger"] is False
    assert f["tensor_peak_bytes"] < p["tensor_peak_bytes"]
    text = runner.invoke(main, args[:-1] + ["--liger"])
    assert text.exit_code == 0 and "Liger kernels" in text.output
    bad = runner.invoke(main, ["estimate", "gemma-2-9b", "--method", "lora", "--liger"])
    assert_user_error(bad, "--liger", "gemma2")


def test_liger_on_a_quantized_base_saves_what_each_recipe_keeps():
    """NF4 and LLM.int8 bases take --liger: the HF recipe and axolotl through Liger's fused linear
    cross-entropy (no N x V log-probs), TRL through the layer kernels beside its own fused head (the
    same head with or without --liger); each saves the activation function's output."""
    model = load_model("meta-llama/Llama-3.1-8B")
    for kw in ({"method": "qlora"}, {"method": "lora", "quant": "int8"}, {"method": "qlora", "framework": "axolotl"},
               {"method": "qlora", "framework": "trl", "loss": "trl"}):
        s = Setup(batch=2, seq=2048, **kw)
        plain, fused = estimate(model, s), estimate(model, s.replace(liger=True))
        assert fused.tensor_peak_bytes < plain.tensor_peak_bytes, kw
        assert fused.component("activations") < plain.component("activations"), kw
        if kw.get("framework") == "trl":  # TRL turns Liger's fused cross-entropy off: its head is the same
            assert fused.component("logits_loss") == plain.component("logits_loss")
            assert any("Liger's RMSNorm/SwiGLU/RoPE only" in n for n in fused.notes)
        else:
            assert fused.component("logits_loss") < plain.component("logits_loss") / 4, kw


def test_validate_knob_liger_has_real_bitsandbytes_rows():
    from vramplan.validate.matrix import LIGER_QUANT_SETUPS, LIGER_TRL_SETUPS, matrix

    cases = [c for c in matrix() if c.knob == "liger" and c.setup.quant != "none"]
    assert {c.truth for c in cases} == {"cpu-run", "trl-cpu"}
    assert {c.setup for c in cases} == set(LIGER_QUANT_SETUPS) | set(LIGER_TRL_SETUPS)
    assert {c.setup.quant for c in cases} == {"nf4", "int8"} and all(c.shrink["layers"] == 12 for c in cases)


def test_the_stand_ins_keep_real_values_finite():
    """On real tensors (the CPU truth on a bitsandbytes base) the stand-ins pass values through:
    nothing they return is uninitialised memory, so LLM.int8's outlier columns see real activations."""
    import torch

    from vramplan.run.liger import _functions

    rmsnorm, gated, _rope, _flce = _functions()
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = rmsnorm.apply(x, w, True)
    assert torch.equal(y.detach(), x.detach())
    y.sum().backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()
    a, b = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    assert torch.equal(gated.apply(a, b).detach(), b.detach())


@pytest.mark.slow
@pytest.mark.parametrize("which", [1, 4])
def test_liger_on_a_quantized_base_within_5_percent_of_the_real_step(which):
    """The real bitsandbytes step with the kernels' stand-ins: the HF recipe's NF4 with checkpointing and
    axolotl's LLM.int8 base (validate --knob liger's cpu-run rows)."""
    from vramplan.validate.matrix import liger_quant_cases, run_case

    case = [c for c in liger_quant_cases() if c.truth == "cpu-run"][which]
    row = run_case(case)[0]
    assert row.estimated_bytes == pytest.approx(row.traced_bytes, rel=0.05), case.setup


@pytest.mark.slow
def test_liger_under_trl_within_2_percent_of_sfttrainer():
    from vramplan.validate.matrix import liger_quant_cases, run_case

    case = next(c for c in liger_quant_cases() if c.truth == "trl-cpu" and c.setup.checkpointing)
    row = run_case(case)[0]
    assert row.estimated_bytes == pytest.approx(row.traced_bytes, rel=0.02), case.setup


# ----------------------------------------------------------------------------------------------
# the truth: traces of the stand-ins


def test_trace_of_the_stand_ins_matches_the_estimate():
    from vramplan.run.tracer import trace, trace_numbers

    model = with_layers(load_model(LLAMA), 2)
    s = Setup(method="lora", batch=2, seq=512, liger=True)
    t, e = trace(model, s), estimate(model, s)
    assert e.tensor_peak_bytes == pytest.approx(t.tensor_peak_bytes, rel=0.05)
    nums = trace_numbers(model.config, s, 2)
    shapes = [shape for _mod, shape, _dtype, _n in nums.saved_detail]
    assert not any(shape and shape[-1] == model.vocab_size for shape in shapes)  # no logits saved
    N, h = s.tokens, model.hidden_size
    assert (N, h) in shapes  # the fused loss's grad_input
    rstd = [d for d in nums.saved_detail if d[1] == (N,) and d[2] == "float32"]
    # one fp32 rstd per LigerRMSNorm (2 per layer and the final norm) but the first: under LoRA it normalises
    # the frozen embedding's output with a frozen weight, so no graph is recorded and nothing is saved
    assert len(rstd) == 2 * 2 + 1 - 1
    plain = trace_numbers(model.config, s.replace(liger=False), 2)
    assert max(p.bytes for p in nums.phase_peaks.values()) < max(p.bytes for p in plain.phase_peaks.values())


def test_validate_knob_liger_is_in_the_matrix():
    from vramplan.validate.matrix import KNOB_PHASES, KNOBS, LIGER_SETUPS, matrix

    assert "liger" in KNOBS and KNOB_PHASES["liger"] == ("backward",)
    cases = [c for c in matrix() if c.knob == "liger" and c.setup.quant == "none"]
    assert len(cases) == 3 * len(LIGER_SETUPS) and all(c.truth == "trace" for c in cases)
    assert [c for c in matrix(quick=True) if c.knob == "liger"]


# ----------------------------------------------------------------------------------------------
# the published Liger chart (linkedin/Liger-Kernel README "Memory Reduction", docs/images/e2e-memory.png:
# Meta-Llama-3-8B, full, bf16, AdamW, checkpointing, FSDP1 on 8 A100s, batch 8; peak reserved, MiB,
# read off the chart, ../shared/published-peaks/liger-kernel.jsonl rows liger-e2e-Liger-L*)

LIGER_E2E_RESERVED_MIB = {1024: 19623, 2048: 23396, 4096: 30566, 8192: 47925, 16384: 76981}


def test_the_liger_chart_per_token_slope():
    """The chart's absolute values carry a constant offset vramplan does not model for that run
    (chart-read, transformers 4.43); its growth with the sequence is the Liger activations': the
    estimate's per-token slope from 1k to 16k tokens is within 10 % of the chart's."""
    model, gpu = load_model("meta-llama/Meta-Llama-3-8B"), load_gpu("a100-80gb")
    est = {seq: estimate(model, Setup(checkpointing=True, batch=8, seq=seq, gpus=8, fsdp="full_shard", liger=True),
                         gpu).peak_reserved_bytes for seq in (1024, 16384)}
    measured = (LIGER_E2E_RESERVED_MIB[16384] - LIGER_E2E_RESERVED_MIB[1024]) * 2**20
    assert (est[16384] - est[1024]) / measured == pytest.approx(1.0, abs=0.10)


# ----------------------------------------------------------------------------------------------
# plan, emit, readers


def test_plan_takes_liger_where_it_saves_memory():
    """Liger is a GPU-resident saver: at 8k tokens per sequence the 12 GB card fits full fine-tuning
    with it and nothing without it (the 8 N V bytes of logit gradients); never for a family it
    does not model."""
    p = vramplan.plan("llama-3.2-1b", "rtx-3060-12gb", seq=8192)
    assert p.fits and p.setup.method == "full" and p.setup.liger
    assert p.setup.offload_optimizer == "none" and p.setup.zero_stage == 0  # before offload
    without = vramplan.plan("llama-3.2-1b", "rtx-3060-12gb", seq=8192, liger=False, framework="hf")
    assert not without.setup.liger and not without.fits
    assert not vramplan.plan("gemma-2-9b", "rtx-4090").setup.liger  # gemma2: not modelled, not searched
    from vramplan.cost.model import LIGER_THROUGHPUT, step_cost

    model = load_model("llama-3.2-1b")
    fused, plain = step_cost(model, p.setup, p.gpu), step_cost(model, p.setup.replace(liger=False), p.gpu)
    assert plain.compute_s / fused.compute_s == pytest.approx(LIGER_THROUGHPUT)
    assert "Liger kernels" in vramplan.search.savers_text(p.setup)


def test_emitted_train_script_turns_liger_on():
    from vramplan.emit import render
    from vramplan.emit.common import TRAIN_SCRIPT
    from vramplan.specs import Plan

    model, gpu = load_model("meta-llama/Llama-3.1-8B"), load_gpu("a100-80gb")

    def script(setup):
        plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu, tokens_per_s=1.0)
        return render(plan, ["trainer"])[TRAIN_SCRIPT]

    on, off = script(Setup(method="lora", liger=True)), script(Setup(method="lora"))
    assert "    'liger': True,\n" in on and "'liger'" not in off
    assert 'use_liger_kernel=PLAN.get("liger", False) or PLAN["loss"] == "chunked"' in on


@pytest.mark.parametrize("name,text,liger", [
    ("axolotl.yaml", "base_model: meta-llama/Llama-3.2-1B\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
     "liger_rms_norm: true\nliger_glu_activation: true\nliger_fused_linear_cross_entropy: true\n", True),
    ("axolotl.yaml", "base_model: meta-llama/Llama-3.2-1B\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
     "liger_rms_norm: true\n", False),
    ("lf.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\nfinetuning_type: lora\n"
     "enable_liger_kernel: true\noutput_dir: out\n", True),
    ("lf.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: dpo\nfinetuning_type: lora\n"
     "enable_liger_kernel: true\noutput_dir: out\n", False),
    ("trl.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nuse_peft: true\nuse_liger_kernel: true\n"
     "output_dir: out\n", True),
])
def test_readers_map_liger(tmp_path, name, text, liger):
    path = tmp_path / name
    path.write_text(text)
    read = read_config(path)
    assert read.setup.liger is liger, read.fields
    kept_or_warned = liger or any("liger" in w.field for w in read.warnings)
    assert kept_or_warned, read.warnings


# ----------------------------------------------------------------------------------------------
# padding-free batches


def test_padding_free_needs_flash_attention_and_no_mask():
    with pytest.raises(SpecError, match="--pad-mask"):
        Setup(padding_free=True, pad_mask=True, attn="flash")
    with pytest.raises(SpecError, match="flash attention"):
        estimate(load_model(LLAMA), Setup(padding_free=True))  # Llama's default: SDPA
    result = CliRunner().invoke(main, ["estimate", LLAMA, "--padding-free", "--attn", "sdpa"])
    assert_user_error(result, "--attn flash")
    ok = CliRunner().invoke(main, ["estimate", LLAMA, "--padding-free", "--attn", "flash", "--batch", "4"])
    assert ok.exit_code == 0, ok.output


def test_padding_free_trace_is_one_row_with_restarting_positions():
    """The tracer flattens the batch into one (1, b s) row with per-sequence position_ids, as
    DataCollatorWithFlattening does; flash varlen keeps what the padded batch's flash keeps, so the
    estimate equals the padded batch's (every sequence s long: an upper bound for real data)."""
    from vramplan.run.tracer import trace, trace_numbers

    model = with_layers(load_model(LLAMA), 2)
    s = Setup(method="lora", batch=4, seq=256, attn="flash", padding_free=True)
    t, e = trace(model, s), estimate(model, s)
    assert e.tensor_peak_bytes == pytest.approx(t.tensor_peak_bytes, rel=0.05)
    assert e.tensor_peak_bytes == estimate(model, s.replace(padding_free=False)).tensor_peak_bytes
    nums = trace_numbers(model.config, s, 2)
    shapes = [shape for _m, shape, _d, _n in nums.saved_detail]
    assert any(shape[:2] == (1, s.tokens) for shape in shapes)  # one row of b s tokens
    assert not any(len(shape) == 4 and shape[-1] == shape[-2] for shape in shapes)  # no (.., N, N) mask kept


def test_padding_free_train_script_flattens_the_batch(tmp_path):
    import importlib.util

    from vramplan.emit import emit_to_dir
    from vramplan.specs import Plan

    model, gpu = load_model(LLAMA), load_gpu("a100-80gb")
    setup = Setup(method="lora", batch=3, seq=16, attn="flash", padding_free=True)
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu),
                tmp_path / "run", model=model)
    text = (tmp_path / "run" / "train.py").read_text()
    assert "    'padding_free': True,\n" in text
    spec = importlib.util.spec_from_file_location("emitted_train", tmp_path / "run" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    rows = train.TokenRows([[5] * 16, [6] * 16, [7] * 16], 16)
    batch = train.DataCollatorWithFlattening()([rows[i] for i in range(3)])
    assert tuple(batch["input_ids"].shape) == (1, 48) and "attention_mask" not in batch
    assert batch["position_ids"][0, 16].item() == 0 and batch["position_ids"][0, 47].item() == 15


@pytest.mark.parametrize("name,text,free", [
    ("axolotl.yaml", "base_model: meta-llama/Llama-3.2-1B\nsample_packing: true\nflash_attention: true\n", True),
    ("axolotl.yaml", "base_model: meta-llama/Llama-3.2-1B\nsample_packing: true\nsdp_attention: true\n", False),
    ("trl.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\npadding_free: true\n"
     "attn_implementation: flash_attention_2\noutput_dir: out\n", True),
    ("trl.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\npacking: true\n"
     "attn_implementation: flash_attention_2\noutput_dir: out\n", True),
    ("trl.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\npadding_free: true\noutput_dir: out\n", False),
])
def test_readers_map_padding_free(tmp_path, name, text, free):
    path = tmp_path / name
    path.write_text(text)
    read = read_config(path)
    assert read.setup.padding_free is free, (read.fields, read.warnings)
    assert free or any(w.field in ("sample_packing", "padding_free", "packing") for w in read.warnings)
