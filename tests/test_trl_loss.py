"""``--loss trl``: TRL 1.16 SFTTrainer's fused, chunked LM head as the SFT step's loss
(estimator/objectives.py ``check_trl_sft`` / ``loss_transients``), its truth (TRL's own SFTTrainer on
the CPU), and its mapping: readers, writers, the plan search, the emitted train.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.estimator.stack import Stack
from vramplan.util.errors import SpecError

MODEL = "llama-3.1-8b"
BASE = Setup(method="lora", precision="bf16", seq=2048, batch=2)


def _logits(bd) -> int:
    return next(c.bytes for c in bd.components if c.name == "logits_loss")


def test_trl_head_is_far_below_the_full_logits_and_cites_trl():
    model = load_model(MODEL)
    hf, chunked, trl = (estimate(model, BASE.replace(loss=loss)) for loss in ("hf", "chunked", "trl"))
    assert _logits(trl) < _logits(chunked) < _logits(hf)
    assert trl.tensor_peak_bytes < hf.tensor_peak_bytes
    assert any("TRL 1.16 SFTTrainer" in n and "add_fused_lm_head" in n for n in trl.notes)
    comp = next(c for c in trl.components if c.name == "logits_loss")
    assert "fused log-prob head" in comp.note
    # the torch fold (CPU, no Triton) holds fp32 tiles the Triton kernels do not
    cpu = estimate(model, BASE.replace(loss="trl"), stack=Stack(trl_triton=False))
    assert cpu.tensor_peak_bytes > trl.tensor_peak_bytes
    # with every knob off nothing moves: the default loss is still transformers'
    assert estimate(model, BASE) == hf


def test_buffer_is_4096_by_32768_whatever_the_vocabulary():
    from vramplan.estimator.objectives import HEAD_TOKEN_CHUNK, HEAD_VOCAB_CHUNK, head_buffer_bytes

    model = load_model(MODEL)
    s = BASE.replace(loss="trl")
    assert head_buffer_bytes(model, s, 8190) == HEAD_TOKEN_CHUNK * HEAD_VOCAB_CHUNK * 2
    long = estimate(model, s.replace(seq=8192)), estimate(model, s.replace(seq=16384))
    # past 4096 tokens the head's buffer no longer grows: only the token-sized terms do
    hf = estimate(model, BASE.replace(seq=8192)), estimate(model, BASE.replace(seq=16384))
    assert (_logits(long[1]) - _logits(long[0])) < (_logits(hf[1]) - _logits(hf[0])) / 10


def test_refusals_and_liger_interplay():
    model = load_model(MODEL)
    with pytest.raises(SpecError, match="--loss trl is modelled with 16-bit or fp32 weights"):
        estimate(model, BASE.replace(loss="trl", precision="bf16-mixed"))
    # TRL keeps its head and turns Liger's fused cross-entropy off: Liger's layer kernels only
    liger = estimate(model, BASE.replace(loss="trl", liger=True))
    assert any("Liger's RMSNorm/SwiGLU/RoPE only" in n for n in liger.notes)
    assert _logits(liger) == _logits(estimate(model, BASE.replace(loss="trl")))
    with pytest.raises(SpecError, match="liger's fused linear cross-entropy replaces the loss"):
        estimate(model, BASE.replace(loss="chunked", liger=True))


def test_cli_loss_trl():
    runner = CliRunner()
    out = runner.invoke(main, ["estimate", MODEL, "--method", "lora", "--precision", "bf16", "--loss", "trl",
                               "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["setup"]["loss"] == "trl"
    bad = runner.invoke(main, ["estimate", MODEL, "--precision", "bf16-mixed", "--loss", "trl"])
    assert bad.exit_code == 2 and "error: " in bad.output and "Traceback" not in bad.output


def test_trl_sft_trainer_cpu_truth_within_5_percent():
    pytest.importorskip("trl")
    from vramplan.validate.matrix import DENSE, Case
    from vramplan.validate.objectives import objective_rows, trl_loss_cases

    [case] = trl_loss_cases(True, Case, DENSE)
    assert case.setup.loss == "trl" and case.truth == "trl-cpu"
    rows = objective_rows(case)
    assert rows and all(abs(r.estimated_bytes / r.traced_bytes - 1) <= 0.05 for r in rows), rows


def test_readers_map_trl_sft_to_loss_trl(tmp_path):
    from vramplan.readers import read_config, read_trl_args

    base = "model_name_or_path: meta-llama/Llama-3.2-1B\nmax_length: 512\nuse_peft: true\n"
    path = tmp_path / "sft.yaml"
    path.write_text(base + "dtype: bfloat16\nbf16: true\n")
    assert read_config(path, format="trl").setup.loss == "trl"
    path.write_text(base + "dtype: bfloat16\nlabel_smoothing_factor: 0.1\n")
    smooth = read_config(path, format="trl")
    assert smooth.setup.loss == "hf" and any(w.field == "label_smoothing_factor" for w in smooth.warnings)
    path.write_text(base + "bf16: true\n")  # ModelConfig.dtype float32 under bf16 autocast: not modelled for trl
    mixed = read_config(path, format="trl")
    assert mixed.setup.precision == "bf16-mixed" and mixed.setup.loss == "hf"
    assert any(w.field == "loss" and "autocast" in w.why for w in mixed.warnings)
    args = read_trl_args("--model_name_or_path Qwen/Qwen2-0.5B --dtype bfloat16 --max_length 256")
    assert args.setup.loss == "trl"


def test_writers_trl_is_loss_trl():
    from vramplan.emit.frameworks import refusal

    model = load_model("llama-3.2-1b")
    assert refusal("trl", BASE.replace(loss="trl"), model) is None
    assert "loss hf" in refusal("trl", BASE, model)
    assert refusal("trl", BASE.replace(precision="bf16-mixed"), model) is None  # reads back hf, said so
    assert "loss trl" in refusal("axolotl", BASE.replace(loss="trl"), model)
    assert "loss trl" in refusal("hf", BASE.replace(loss="trl"), model)


def test_plan_keeps_the_loss_and_never_picks_trl_unasked():
    runner = CliRunner()
    plain = runner.invoke(main, ["plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--json"])
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["setup"]["loss"] == "hf"
    asked = runner.invoke(main, ["plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--loss", "trl", "--json"])
    assert asked.exit_code == 0, asked.output
    assert json.loads(asked.stdout)["setup"]["loss"] == "trl"


@pytest.mark.slow  # the full tier
def test_emitted_train_script_runs_trls_fused_head(tmp_path):
    pytest.importorskip("trl")
    from test_train_script import TINY, run_emitted

    from vramplan.emit import emit_to_dir
    from vramplan.specs import Plan

    config = {**load_model("qwen2-0.5b").config, **TINY}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    setup = Setup(method="lora", lora_rank=4, lora_targets="q_proj,v_proj", batch=2, seq=32, loss="trl")
    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu)
    emit_to_dir(plan, tmp_path / "out")
    folder = tmp_path / "out"
    report = run_emitted(folder)
    assert [row["step"] for row in report["steps"]] == [1, 2] and report["plan"]["loss"] == "trl"
    # the model train.py builds scores through TRL's head: log-probs, no logits
    probe = ("import sys, torch; sys.path.insert(0, '.'); import train; "
             "a = train.parse_args(['--cpu', '--config', sys.argv[1]]); m = train.build_model(a); "
             "ids = torch.randint(0, 256, (1, 8)); out = m(input_ids=ids, labels=ids); "
             "print(type(out).__name__, out.log_probs.shape[-1], getattr(out, 'logits', None) is None)")
    got = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "tiny")], cwd=folder,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split()[-3:] == ["FusedCausalLMOutput", "7", "True"]  # the 7 next-token positions


def test_measure_compares_a_cpu_run_with_the_cpu_code_path():
    """`vramplan measure --device cpu` of a loss-trl plan compares with the estimate of the path the
    run takes there (TRL's torch fold of fp32 tiles), a CUDA run with the Triton path's."""
    from vramplan.calibration.measure import _estimate_json
    from vramplan.specs import Plan

    model = load_model("meta-llama/Llama-3.2-1B")
    setup = Setup(method="lora", loss="trl", seq=1024)
    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup))
    cpu, cuda = _estimate_json(plan, None, "cpu"), _estimate_json(plan, None, "cuda")
    assert cpu["tensor_peak_bytes"] == estimate(model, setup, stack=Stack(trl_triton=False)).tensor_peak_bytes
    assert cuda["tensor_peak_bytes"] == estimate(model, setup).tensor_peak_bytes
    assert cpu["tensor_peak_bytes"] != cuda["tensor_peak_bytes"]
