"""ORPO and KTO as TRL 1.16 runs them (vramplan/estimator/objectives_pref.py, objectives.py): the
estimate's rows, phases and terms, the knobs it refuses, the CLI, TRL's own ORPOTrainer / KTOTrainer
on the CPU and the traced step as truths within 5 %, and the emitted TRL script running two steps
on the CPU (ORPO, KTO, and DPO/GRPO with LoRA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.estimator.objectives import lengths, phases_of, reference
from vramplan.estimator.stack import Stack
from vramplan.specs import PHASES, SpecError

QWEN = load_model("qwen2.5-7b")
A100 = load_gpu("a100-80gb")
ORPO = Setup(method="lora", objective="orpo", seq=1024, batch=2)
KTO = Setup(method="lora", objective="kto", seq=1024, batch=2)
CPU = Stack(trl_triton=False)


# ----------------------------------------------------------------------------------------------
# ORPO


def test_orpo_runs_chosen_and_rejected_rows_through_the_models_logits_without_a_reference():
    bd = estimate(QWEN, ORPO, A100)
    assert tuple(bd.phase_peaks_bytes) == PHASES and reference(ORPO) == "none"
    lens = lengths(ORPO)
    assert (lens.rows, lens.row_len) == (4, 1024)
    sft = estimate(QWEN, Setup(method="lora", batch=4, seq=1024), A100)
    assert bd.component("activations") == sft.component("activations")
    assert bd.component("reference_weights") == 0 and bd.component("reference_adapter") == 0
    notes = " ".join(bd.notes)
    assert "ORPOTrainer" in notes and "TRL 1.16" in notes
    # the loss holds (tokens, vocab) tensors, unlike DPO's fused head over the same rows
    dpo = estimate(QWEN, Setup(method="lora", objective="dpo", seq=1024, batch=2, ref_model="precomputed"), A100)
    assert bd.component("logits_loss") > 10 * dpo.component("logits_loss")
    assert bd.tensor_peak_bytes > dpo.tensor_peak_bytes


def test_orpo_logits_terms_follow_the_path():
    """16-bit torch loop: each row's log_softmax saved (more saved than Triton's, which keeps the
    logits); fp32: logsumexp keeps the logits; all scale with rows x length x vocab."""
    v, n = QWEN.vocab_size, 4 * 1024
    cuda, cpu = estimate(QWEN, ORPO, A100), estimate(QWEN, ORPO, A100, stack=CPU)
    assert cpu.component("model_io_activations") - cuda.component("model_io_activations") == 2 * v * (4 * 1023 - n)
    # the backward's gradients of the logits, in units of the rows' logits (read off the traced step)
    assert cpu.component("logits_loss") == int(1.5 * 2 * n * v)
    fp32 = estimate(QWEN, ORPO.replace(precision="fp32"), stack=CPU)
    assert fp32.component("logits_loss") == 3 * 4 * n * v
    longer = estimate(QWEN, ORPO.replace(seq=2048), A100)
    assert longer.component("logits_loss") == pytest.approx(2 * cuda.component("logits_loss"), rel=1e-3)


@pytest.mark.parametrize("setup, match", [
    (ORPO.replace(ref_model="copy"), "ORPO has no reference"),
    (ORPO.replace(loss="chunked"), "the model's logits"),
    (KTO.replace(batch=1), "needs --batch 2"),
    (KTO.replace(zero_stage=2), "one GPU"),
    (Setup(objective="kto", batch=2, ref_model="none"), "KTO needs a reference"),
])
def test_what_is_not_modelled_is_refused(setup, match):
    with pytest.raises(SpecError, match=match):
        estimate(QWEN, setup, A100)


# ----------------------------------------------------------------------------------------------
# KTO


def test_kto_runs_unpaired_rows_a_kl_forward_and_the_reference():
    bd = estimate(QWEN, KTO, A100)
    assert tuple(bd.phase_peaks_bytes)[:2] == ("kl", "reference") and set(bd.phase_peaks_bytes) == {
        "kl", "reference", *PHASES}
    lens = lengths(KTO)
    assert (lens.rows, lens.row_len) == (2, 1024)  # batch rows, not pairs
    sft = estimate(QWEN, Setup(method="lora", batch=2, seq=1024), A100)
    assert bd.component("activations") == sft.component("activations")
    # the KL rows go through the policy before its forward; the reference runs beside its activations
    assert bd.phase_peaks_bytes["kl"] < bd.phase_peaks_bytes["forward"] < bd.phase_peaks_bytes["reference"]
    assert bd.component("kl_forward") > 0 and "KTOTrainer" in " ".join(bd.notes)
    # a PeftModel handed to KTOTrainer: a frozen "ref" copy of its adapter (add_adapter("ref"))
    assert bd.component("reference_adapter") == bd.component("adapters")


def test_kto_reference_choices():
    adapter = estimate(QWEN, KTO, A100)
    copy = estimate(QWEN, KTO.replace(ref_model="copy"), A100)
    pre = estimate(QWEN, KTO.replace(ref_model="precomputed"), A100)
    assert reference(KTO) == "adapter" and reference(Setup(objective="kto", batch=2)) == "copy"
    assert copy.component("reference_weights") == copy.component("weights")
    assert copy.tensor_peak_bytes > adapter.tensor_peak_bytes
    # precomputed: no reference at train time, but the policy's KL forward stays
    assert phases_of(KTO.replace(ref_model="precomputed"))[0] == "kl" and "reference" not in pre.phase_peaks_bytes
    assert pre.tensor_peak_bytes < adapter.tensor_peak_bytes
    # TRL adds the "ref" adapter in __init__ whether or not the log-probs are precomputed
    assert pre.component("reference_adapter") == pre.component("adapters") > 0
    full = estimate(QWEN, Setup(objective="kto", batch=2, seq=1024, ref_model="precomputed"), A100)
    assert full.component("reference_adapter") == 0 and full.component("reference_weights") == 0


def test_cli_estimates_orpo_and_kto_with_phases():
    runner = CliRunner()
    orpo = runner.invoke(main, ["estimate", "qwen2.5-7b", "--method", "lora", "--objective", "orpo", "--gpu",
                                "a100-80gb", "--json"])
    assert orpo.exit_code == 0, orpo.output
    assert set(json.loads(orpo.stdout)["phase_peaks_bytes"]) == set(PHASES)
    kto = runner.invoke(main, ["estimate", "qwen2.5-7b", "--method", "lora", "--objective", "kto", "--batch", "2",
                               "--gpu", "a100-80gb"])
    assert kto.exit_code == 0, kto.output
    assert "kl_forward" in kto.stdout and "reference" in kto.stdout
    bad = runner.invoke(main, ["estimate", "qwen2.5-7b", "--objective", "orpo", "--ref-model", "copy"])
    assert bad.exit_code == 2 and bad.output.startswith("error: ORPO has no reference")


def test_plan_keeps_orpo_and_kto():
    from vramplan.search import plan

    for objective in ("orpo", "kto"):
        p = plan("qwen2.5-7b", A100, objective=objective, method="lora", seq=1024)
        assert p.setup.objective == objective and p.breakdown.fits
        assert objective != "kto" or p.setup.batch >= 2


# ----------------------------------------------------------------------------------------------
# the truths


def _narrow():
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.truths.cpu_truth import shrink_config
    from vramplan.validate.matrix import CPU_SHRINK

    m = load_model("meta-llama/Llama-3.2-1B")
    cfg = shrink_config(m.config, **CPU_SHRINK)
    return cfg, model_spec_from_config(cfg, name="narrow", source=m.source)


def _within(e, t, phases=()):
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) <= 0.05, (e.phase_peaks_bytes, t.phase_peaks_bytes)
    for ph in phases:
        assert abs(e.phase_peaks_bytes[ph] / t.phase_peaks_bytes[ph] - 1) <= 0.05, ph


def test_orpo_trainer_on_the_cpu_within_five_percent():
    pytest.importorskip("trl")
    from vramplan.truths.objectives import run_orpo

    cfg, spec = _narrow()
    s = Setup(method="lora", objective="orpo", seq=128, batch=2)
    t = run_orpo(cfg, s)
    e = estimate(spec, s, stack=CPU)
    assert set(t.phase_peaks_bytes) == set(PHASES)
    _within(e, t, ("forward", "backward"))
    assert t.params_trainable == e.params_trainable


def test_kto_trainer_on_the_cpu_within_five_percent():
    pytest.importorskip("trl")
    from vramplan.truths.objectives import run_kto

    cfg, spec = _narrow()
    s = Setup(method="lora", objective="kto", seq=128, batch=2, grad_accum=2)
    t = run_kto(cfg, s)
    e = estimate(spec, s, stack=CPU)
    assert set(t.phase_peaks_bytes) == {"kl", "reference", *PHASES}
    _within(e, t, ("kl", "reference", "forward", "backward"))


@pytest.mark.parametrize("setup", [
    Setup(objective="orpo", seq=512, batch=2),
    Setup(objective="orpo", seq=512, batch=2, method="lora", precision="fp32"),
    Setup(objective="kto", seq=512, batch=2, method="lora"),
    Setup(objective="kto", seq=512, batch=2, ref_model="copy", method="lora", checkpointing=True),
], ids=["orpo-full", "orpo-lora-fp32", "kto-lora", "kto-copy-ckpt"])
def test_traced_steps_within_five_percent(setup):
    pytest.importorskip("trl")
    from vramplan.model.architecture import with_layers
    from vramplan.truths.objective_trace import trace_objective

    spec = with_layers(load_model("meta-llama/Llama-3.2-1B"), 2)
    t = trace_objective(spec.config, setup)
    e = estimate(spec, setup, stack=CPU)
    assert t.phase == e.phase
    _within(e, t, [p for p in t.phase_peaks_bytes if p != "optimizer"])


def test_validate_has_orpo_and_kto_cases():
    from vramplan.validate.matrix import DENSE, KNOBS, Case
    from vramplan.validate.objectives import objective_cases

    assert {"orpo", "kto"} <= set(KNOBS)
    cases = objective_cases(False, Case, DENSE)
    for knob in ("orpo", "kto"):
        truths = {c.truth for c in cases if c.knob == knob}
        assert truths == {"trl-cpu", "trl-trace"}


# ----------------------------------------------------------------------------------------------
# the emitted TRL script


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256, "max_window_layers": 2}


SLOW = pytest.mark.slow  # a subprocess of 5-15 s each: one (dpo) runs in the fast tier


@pytest.mark.parametrize("setup", [
    Setup(objective="dpo", batch=2, seq=32),
    pytest.param(Setup(objective="grpo", batch=1, num_generations=4, seq=32, max_completion_length=8), marks=SLOW),
    pytest.param(Setup(objective="orpo", batch=2, seq=32), marks=SLOW),
    pytest.param(Setup(objective="kto", batch=2, seq=32), marks=SLOW),
    pytest.param(Setup(objective="kto", batch=2, seq=32, method="lora"), marks=SLOW),
    pytest.param(Setup(objective="dpo", batch=2, seq=32, method="lora"), marks=SLOW),
    pytest.param(Setup(objective="grpo", batch=1, num_generations=4, seq=32, max_completion_length=8, method="lora"),
                 marks=SLOW),
], ids=["dpo", "grpo", "orpo", "kto", "kto-lora", "dpo-lora", "grpo-lora"])
def test_emitted_trl_script_runs_two_steps(tmp_path, setup):
    """train.py + trl_objective.py as emitted, launched as the header says (plus --cpu and two
    steps), on a tiny Qwen2; LoRA runs now that torchao is not installed."""
    pytest.importorskip("trl")
    from vramplan.emit import emit_to_dir
    from vramplan.specs import Plan

    config = {**load_model("qwen2-0.5b").config, **TINY}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, gpu = load_model(str(tmp_path / "config.json")), load_gpu("rtx-4090")
    out = tmp_path / "emitted"
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), out)
    assert f"'objective': '{setup.objective}'" in (out / "train.py").read_text()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "train.py", "--cpu", "--max-steps", "2", "--memory-report", "memory.json"],
                         cwd=out, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "memory.json").read_text())
    assert [row["step"] for row in report["steps"]] == [1, 2]
    saved = out / "output"
    assert (saved / "model.safetensors").is_file() or (saved / "adapter_model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------
# the readers


@pytest.mark.parametrize("name, text, objective", [
    ("run.sh", "trl kto --model_name_or_path Qwen/Qwen2.5-7B --dtype bfloat16 --use_peft --lora_r 16 "
               "--per_device_train_batch_size 4 --max_length 1024\n", "kto"),
    ("run.sh", "trl dpo --model_name_or_path Qwen/Qwen2.5-7B --dtype bfloat16 --use_peft --lora_r 16 "
               "--per_device_train_batch_size 2 --max_length 1024\n", "dpo"),
    ("axolotl.yaml", "base_model: Qwen/Qwen2.5-7B\nrl: orpo\nadapter: lora\nlora_r: 16\nlora_target_linear: true\n"
                     "sequence_len: 1024\nmicro_batch_size: 2\nbf16: true\n", "orpo"),
    ("axolotl.yaml", "base_model: Qwen/Qwen2.5-7B\nrl: kto\nadapter: lora\nlora_r: 16\nlora_target_linear: true\n"
                     "sequence_len: 1024\nmicro_batch_size: 2\nbf16: true\n", "kto"),
], ids=["trl-kto", "trl-dpo", "axolotl-orpo", "axolotl-kto"])
def test_readers_map_the_trainer_to_the_objective(tmp_path, name, text, objective):
    path = tmp_path / name
    path.write_text(text)
    out = CliRunner().invoke(main, ["estimate", str(path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["setup"]["objective"] == objective
    assert set(data["phase_peaks_bytes"]) == set(phases_of(Setup(objective=objective, batch=2)))


def test_axolotl_rl_modes_not_read_are_said(tmp_path):
    from vramplan.readers import read_config

    path = tmp_path / "axolotl.yaml"
    path.write_text("base_model: Qwen/Qwen2.5-7B\nrl: simpo\nadapter: lora\nsequence_len: 1024\nmicro_batch_size: 2\n")
    read = read_config(path)
    assert read.format == "axolotl" and read.setup.objective == "sft"
    assert any("rl" in str(w) and "SFT step" in str(w) for w in read.warnings)


def test_trl_grpo_command_line_reads_grpoconfig_fields(tmp_path):
    """``trl grpo``: per_device_train_batch_size counts completions (16 / 8 generations = 2 prompts),
    beta's default 0.0 loads no reference, use_vllm colocate carries its share; prompts are not
    truncated by GRPOConfig 1.16, so their length is an assumption the reader states."""
    from vramplan.readers import read_config

    path = tmp_path / "run.sh"
    path.write_text("trl grpo --model_name_or_path Qwen/Qwen2.5-7B --dtype bfloat16 --use_peft --lora_r 16 \\\n"
                    "  --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 1024 \\\n"
                    "  --use_vllm true --vllm_gpu_memory_utilization 0.4\n")
    read = read_config(path)
    s = read.setup
    assert (s.objective, s.batch, s.num_generations, s.max_completion_length) == ("grpo", 2, 8, 1024)
    assert (s.max_prompt_length, s.seq, s.ref_model) == (512, 1536, "none")
    assert (s.generation, s.vllm_memory_fraction) == ("vllm-colocate", 0.4)
    assert any(w.field == "max_prompt_length" and w.kind == "assumed" for w in read.warnings)
    path.write_text(path.read_text().replace("--use_vllm true --vllm_gpu_memory_utilization 0.4", "--beta 0.04"))
    s = read_config(path).setup
    assert (s.generation, s.ref_model) == ("hf", "auto")
    path.write_text(path.read_text().replace("batch_size 16", "batch_size 12"))
    out = CliRunner().invoke(main, ["estimate", str(path)])
    assert out.exit_code == 2 and "not a multiple of num_generations 8" in out.output


def test_trl_dpo_precomputed_reference_is_read(tmp_path):
    from vramplan.readers import read_config

    path = tmp_path / "run.sh"
    path.write_text("trl dpo --model_name_or_path Qwen/Qwen2.5-7B --dtype bfloat16 --per_device_train_batch_size 2 "
                    "--max_length 1024 --precompute_ref_log_probs true\n")
    assert read_config(path).setup.ref_model == "precomputed"
