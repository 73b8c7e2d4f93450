"""modules_to_save, DoRA and the optimizer in backward (estimator/knobs.py): the estimate against
the fake-tensor trace of the real peft 0.21 / torchtune 0.6.1 step, the refusals, the CLI, the
emitted train.py and the framework readers. Traces are two layers at the real widths (about a
second each); the full matrix is ``vramplan validate --knob modules_to_save|dora|optimizer_in_backward``.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.model.architecture import with_layers
from vramplan.model.profiles import load_gpu, load_model
from vramplan.setup.wording import describe
from vramplan.specs import Plan, Setup, SpecError

LLAMA = "meta-llama/Llama-3.2-1B"  # tied embeddings
QWEN = "Qwen/Qwen2.5-7B"  # untied head, vocab 152064


@pytest.fixture(scope="module")
def llama2():
    return with_layers(load_model(LLAMA), 2)


# ----------------------------------------------------------------------------------------------
# the estimate alone (no torch)


def test_modules_to_save_adds_trainable_copies_in_the_model_dtype():
    m = load_model("meta-llama/Llama-3.1-8B")  # untied: embed_tokens and lm_head are 128256 x 4096 each
    base, both = Setup(method="lora"), Setup(method="lora", modules_to_save="embed_tokens,lm_head")
    e0, e1 = estimate(m, base), estimate(m, both)
    copies = 2 * 128256 * 4096
    assert e1.params_trainable - e0.params_trainable == copies
    assert e1.component("trained_modules") == 2 * copies  # bf16 copies
    assert e1.component("gradients") - e0.component("gradients") == 2 * copies
    assert e1.component("optimizer_states") - e0.component("optimizer_states") == 4 * copies  # AdamW, bf16
    # a 4-bit base was prepared for k-bit training: the copies are fp32
    q = estimate(m, both.replace(method="qlora"))
    assert q.component("trained_modules") == 4 * copies


def test_dora_adds_magnitudes_saved_results_and_the_weight_norm():
    m = load_model("meta-llama/Llama-3.1-8B")
    e0, e1 = estimate(m, Setup(method="lora")), estimate(m, Setup(method="lora", dora=True))
    outs = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert e1.params_trainable - e0.params_trainable == outs
    assert e1.component("trained_modules") == 4 * outs
    # the base result (bf16) and the fp32 LoRA result of every adapted Linear, per token
    assert e1.component("activations") - e0.component("activations") >= 6 * outs * 2048
    # down_proj (in 14336): the fp32 eye(in) alone is 822 MB
    assert e1.component("dora_weight_norm") > 4 * 14336 ** 2


def test_optimizer_in_backward_drops_the_gradients_phase():
    m = load_model("meta-llama/Llama-3.1-8B")
    s = Setup(seq=512)
    e0, e1 = estimate(m, s), estimate(m, s.replace(optimizer_in_backward=True))
    assert e1.phase_peaks_bytes["optimizer"] < e0.phase_peaks_bytes["optimizer"]
    assert e1.tensor_peak_bytes < e0.tensor_peak_bytes - 10 * 2**30  # 16 GB of bf16 gradients never coexist
    # the gradient alive is one tensor's: the embedding's (and its step's transient)
    assert e1.component("gradients") == 2 * 2 * 128256 * 4096


@pytest.mark.parametrize("setup, words", [
    (Setup(method="lora", dora=True, lora_dropout=0.1), "lora-dropout"),
    (Setup(method="lora", modules_to_save="score"), "only embed_tokens and lm_head"),
])
def test_what_is_not_modelled_is_refused(setup, words):
    with pytest.raises(SpecError, match=words):
        estimate(load_model(LLAMA), setup)


@pytest.mark.parametrize("knobs", [
    {"method": "lora", "dora": True, "gpus": 2},
    {"optimizer_in_backward": True, "fsdp": "full_shard", "gpus": 2},
    {"method": "lora", "dora": True, "zero_stage": 2},  # ZeRO on one GPU too
])
def test_sharded_steps_with_the_knobs_are_refused(knobs):
    with pytest.raises(SpecError, match="one GPU without ZeRO/FSDP/DDP"):
        Setup(**knobs)


def test_modules_to_save_on_ranks_is_modelled_where_verified():  # tests/test_knobs_distributed.py
    Setup(method="lora", modules_to_save="lm_head", zero_stage=2, gpus=2)
    Setup(method="lora", modules_to_save="lm_head", fsdp="full_shard", gpus=2)
    with pytest.raises(SpecError, match="FSDP1 full_shard"):
        Setup(method="lora", modules_to_save="lm_head", fsdp="shard_grad_op", gpus=2)


def test_dora_on_fused_experts_is_refused():
    with pytest.raises(SpecError, match="ParamWrapper"):
        estimate(load_model("mistralai/Mixtral-8x7B-v0.1"), Setup(method="lora", dora=True))
    # the attention projections are plain Linears: DoRA applies there
    estimate(load_model("mistralai/Mixtral-8x7B-v0.1"), Setup(method="lora", dora=True, lora_targets="q_proj,v_proj"))


def test_setup_refuses_the_combinations_the_libraries_refuse():
    with pytest.raises(SpecError, match="grad-accum 1"):
        Setup(optimizer_in_backward=True, grad_accum=4)
    with pytest.raises(SpecError, match="lora or qlora"):
        Setup(dora=True)


def test_wording_names_the_knobs():
    text = describe(Setup(method="lora", dora=True, modules_to_save="embed_tokens,lm_head"))
    assert "DoRA" in text and "trained embed_tokens,lm_head" in text
    assert "optimizer in backward" in describe(Setup(optimizer_in_backward=True))


def test_cli_estimate_shows_the_trained_copies():
    result = CliRunner().invoke(main, ["estimate", "meta-llama/Llama-3.1-8B", "--method", "lora", "--modules-to-save",
                                       "embed_tokens,lm_head", "--gpu", "rtx-4090", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    comps = {c["name"]: c["bytes"] for c in data["components"]}
    assert comps["trained_modules"] == 4 * 128256 * 4096
    assert data["params_trainable"] > 1.0e9
    text = CliRunner().invoke(main, ["estimate", "meta-llama/Llama-3.1-8B", "--method", "lora", "--modules-to-save",
                                     "embed_tokens,lm_head", "--gpu", "rtx-4090"])
    assert text.exit_code == 0 and "trained_modules" in text.stdout and "embed_tokens,lm_head" in text.stdout
    bad = CliRunner().invoke(main, ["estimate", LLAMA, "--method", "lora", "--modules-to-save", "mlp"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines()[-1].startswith("error: ")


# ----------------------------------------------------------------------------------------------
# the emitted train.py


def _plan(setup: Setup) -> Plan:
    model, gpu = load_model(LLAMA), load_gpu("a100-80gb")
    return Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu, nodes=1,
                tokens_per_s=1000.0)


def test_emitted_lora_config_carries_modules_to_save_and_dora():
    from vramplan.emit.trainer import script_plan, train_script

    plan = _plan(Setup(method="lora", dora=True, modules_to_save="embed_tokens,lm_head"))
    data = script_plan(plan)
    assert data["modules_to_save"] == ["embed_tokens", "lm_head"] and data["dora"] is True
    text = train_script(plan)
    assert 'modules_to_save=PLAN.get("modules_to_save"), use_dora=PLAN.get("dora", False)' in text
    assert "'modules_to_save': ['embed_tokens', 'lm_head']" in text
    plain = script_plan(_plan(Setup(method="lora")))
    assert "modules_to_save" not in plain and "dora" not in plain  # defaults: PLAN unchanged


def test_optimizer_in_backward_is_refused_for_the_trainer_in_one_line():
    """train.py runs it with torch's optimizers (tests/test_optimizer_in_backward_hf.py); others refused."""
    from vramplan.emit import render

    with pytest.raises(SpecError, match="torch's optimizers only") as err:
        render(_plan(Setup(seq=512, optimizer="adamw-8bit", optimizer_in_backward=True)), ("trainer",))
    assert "\n" not in str(err.value)
    assert "'optimizer_in_backward': True" in render(_plan(Setup(seq=512, optimizer_in_backward=True)),
                                                     ("trainer",))["train.py"]
    # the path that runs it: torchtune's recipe (emit/torchtune.py)
    tune = render(_plan(Setup(seq=512, optimizer_in_backward=True)), ("torchtune",))
    assert "optimizer_in_bwd: true" in tune["torchtune.yaml"]


# ----------------------------------------------------------------------------------------------
# the framework readers


def _read(tmp_path, name: str, text: str):
    from vramplan.readers import read_config

    path = tmp_path / name
    path.write_text(text)
    return read_config(path)


def test_axolotl_maps_dora_and_modules_to_save(tmp_path):
    read = _read(tmp_path, "axolotl.yml", "base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\n"
                 "lora_target_linear: true\npeft_use_dora: true\nlora_modules_to_save: [embed_tokens, lm_head]\n"
                 "sequence_len: 1024\n")
    assert read.setup.dora and read.setup.modules_to_save == "embed_tokens,lm_head"
    assert not {w.field for w in read.warnings} & {"peft_use_dora", "lora_modules_to_save"}


def test_llamafactory_maps_use_dora_and_additional_target(tmp_path):
    read = _read(tmp_path, "lf.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\ndo_train: true\n"
                 "finetuning_type: lora\nlora_target: all\nuse_dora: true\nadditional_target: embed_tokens,lm_head\n"
                 "cutoff_len: 1024\nbf16: true\n")
    assert read.setup.dora and read.setup.modules_to_save == "embed_tokens,lm_head"
    assert not {w.field for w in read.warnings} & {"use_dora", "additional_target"}


# ----------------------------------------------------------------------------------------------
# against the trace of the real step


torch = pytest.importorskip("torch")
pytest.importorskip("peft")


def _rows(spec, setup):
    from vramplan.run.tracer import trace

    t, e = trace(spec, setup), estimate(spec, setup)
    return t, e


@pytest.mark.parametrize("setup", [
    Setup(method="lora", seq=128, modules_to_save="embed_tokens,lm_head"),
    Setup(method="lora", seq=512, dora=True),
    Setup(seq=128, optimizer_in_backward=True),
])
def test_estimate_matches_the_trace(llama2, setup):
    t, e = _rows(llama2, setup)
    assert t.params_trainable == e.params_trainable  # what peft's print_trainable_parameters counts
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) <= 0.05
    for ph in ("forward", "backward", "optimizer"):
        assert abs(e.phase_peaks_bytes[ph] / t.phase_peaks_bytes[ph] - 1) <= 0.05, ph


def test_the_trace_applies_the_knobs_for_real(llama2):
    """The truth itself: peft's trainable count with modules_to_save and DoRA (tied: two copies, the
    head's original still sharing the frozen embedding), and torchtune's hooks freeing the
    gradients (no optimizer phase with every gradient)."""
    from vramplan.run.tracer import trace

    lora = trace(llama2, Setup(method="lora", seq=128))
    saved = trace(llama2, Setup(method="lora", seq=128, modules_to_save="embed_tokens,lm_head"))
    vh = 128256 * 2048
    assert saved.params_trainable - lora.params_trainable == 2 * vh
    assert saved.params_total - lora.params_total == 2 * vh  # the original stays, tied to the head
    dora = trace(llama2, Setup(method="lora", seq=128, dora=True))
    assert dora.params_trainable - lora.params_trainable == 2 * (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048)
    full = trace(llama2, Setup(seq=128))
    fused = trace(llama2, Setup(seq=128, optimizer_in_backward=True))
    g = full.params_trainable * 2
    assert full.phase_peaks_bytes["optimizer"] - fused.phase_peaks_bytes["optimizer"] >= 2 * g  # grads + foreach


def test_validate_knob_rows_meet_the_bar():
    from vramplan.validate.knobs import knob_cases
    from vramplan.validate.matrix import Case, run_case

    for case in knob_cases(True, Case, (LLAMA,)):
        for row in run_case(case):
            assert row.verified and abs(row.error) <= 0.05, (case.knob, row.quantity, row.error)


def test_cpu_runs_meet_the_bar():
    """A 4-bit base (the copies fp32, DoRA's dequantized weight) and 8-bit AdamW (the embedding
    copy's 32-bit override): real CPU steps of a narrow Llama, every row (weights included)."""
    pytest.importorskip("bitsandbytes")
    from vramplan.validate.knobs import knob_cases
    from vramplan.validate.matrix import Case, run_case

    cases = [c for c in knob_cases(False, Case, (LLAMA,)) if c.truth == "cpu-run"]
    assert {c.knob for c in cases} == {"modules_to_save", "dora"}
    for case in cases:
        rows = run_case(case)
        assert {r.quantity for r in rows} >= {"tensor_peak_bytes", "backward_peak_bytes"}
        for row in rows:
            assert abs(row.error) <= 0.05, (case.knob, describe(case.setup), row.quantity, row.error)


def test_plan_keeps_the_adapter_knobs(tmp_path):
    """DoRA and modules_to_save are quality choices: fixed by the user (or the file), never
    searched; the optimizer in backward is searched for full fine-tuning, taken only where it is needed
    (tests/test_optimizer_in_backward_hf.py), not for a full 8B on an 80 GB card."""
    fixed = CliRunner().invoke(main, ["plan", "meta-llama/Llama-3.1-8B", "--gpu", "rtx-4090", "--dora", "--json"])
    assert fixed.exit_code == 0, fixed.output
    setup = json.loads(fixed.stdout)["setup"]
    assert setup["dora"] is True and setup["method"] in ("lora", "qlora")
    path = tmp_path / "axolotl.yml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
                    "lora_modules_to_save: [embed_tokens, lm_head]\nsequence_len: 1024\n")
    read = CliRunner().invoke(main, ["plan", "--from", str(path), "--gpu", "a100-80gb", "--json"])
    assert read.exit_code == 0, read.output
    assert json.loads(read.stdout)["setup"]["modules_to_save"] == "embed_tokens,lm_head"
    full = CliRunner().invoke(main, ["plan", "meta-llama/Llama-3.1-8B", "--gpu", "h100-80gb", "--method", "full",
                                     "--json"])
    assert full.exit_code == 0 and json.loads(full.stdout)["setup"]["optimizer_in_backward"] is False
