"""The eval step (``--eval-batch``, vramplan/estimator/eval_step.py) as its own phase of the run:
off it changes nothing; on, its peak is the resting model states plus the no-grad forward at the
eval batch, checked against the fake-tensor trace of the Trainer's own ``prediction_step``
(vramplan/run/eval_trace.py) and a real ``Trainer.evaluate`` on this CPU (vramplan/truths/eval_truth.py);
the emitted train.py evaluates at that batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.emit.trainer import script_plan
from vramplan.estimator.eval_step import EVAL, eval_forward_bytes
from vramplan.model.architecture import model_spec_from_config, with_layers
from vramplan.specs import Plan
from vramplan.util.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "meta-llama/Llama-3.2-1B"


def test_off_changes_nothing():
    model, gpu = load_model(LLAMA), load_gpu("a100-80gb")
    for s in (Setup(), Setup(method="lora", checkpointing=True, precision="bf16-mixed")):
        assert estimate(model, s, gpu).to_json() == estimate(model, s.replace(eval_batch=0), gpu).to_json()
        assert EVAL not in estimate(model, s, gpu).phase_peaks_bytes


def test_eval_phase_is_resting_states_plus_the_no_grad_forward():
    model = load_model(LLAMA)
    s = Setup(method="lora", seq=2048, eval_batch=8)
    bd = estimate(model, s)
    resting = sum(bd.component(n) for n in ("weights", "adapters", "optimizer_states"))
    assert bd.phase_peaks_bytes[EVAL] == resting + eval_forward_bytes(model, s)
    # 8 x 2048 tokens x 128256 vocabulary: the bf16 logits, their fp32 upcast and log-probs dominate
    assert eval_forward_bytes(model, s) >= 10 * 8 * 2048 * model.vocab_size
    assert bd.phase == EVAL  # the eval step, not the train step, is the peak here
    live = {c.name for c in bd.components if EVAL in c.phases}
    assert "gradients" not in live and {"weights", "optimizer_states", "eval_forward"} <= live
    # the train phases are the same as without eval; a larger eval batch only grows the eval phase
    plain = estimate(model, s.replace(eval_batch=0)).phase_peaks_bytes
    assert {p: b for p, b in bd.phase_peaks_bytes.items() if p != EVAL} == plain
    assert estimate(model, s.replace(eval_batch=16)).phase_peaks_bytes[EVAL] > bd.phase_peaks_bytes[EVAL]


def test_fit_is_judged_on_the_eval_phase():
    model, gpu = load_model(LLAMA), load_gpu("l4-24gb")
    s = Setup(method="lora", seq=2048)
    assert estimate(model, s, gpu).fits
    assert not estimate(model, s.replace(eval_batch=8), gpu).fits
    assert estimate(model, s.replace(eval_batch=2), gpu).fits


@pytest.mark.parametrize("kw", [{"method": "qlora"}, {"zero_stage": 2, "gpus": 2}, {"loss": "chunked"},
                                {"objective": "dpo"}])
def test_unmodelled_eval_setups_are_refused(kw):
    with pytest.raises(SpecError, match="--eval-batch"):
        estimate(load_model(LLAMA), Setup(eval_batch=4, **kw))
    res = CliRunner().invoke(main, ["estimate", LLAMA, "--method", "qlora", "--eval-batch", "4"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "Traceback" not in res.output


def test_breakdown_json_with_an_eval_phase_meets_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schemas = [json.loads((ROOT / "docs" / "schema" / f"{n}.schema.json").read_text()) for n in ("setup", "breakdown")]
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas])
    res = CliRunner().invoke(main, ["estimate", LLAMA, "--method", "lora", "--eval-batch", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["phase"] == EVAL
    jsonschema.Draft202012Validator(schemas[1], registry=registry).validate(data)


def test_traced_eval_step_matches():
    pytest.importorskip("torch")
    from vramplan.run.tracer import trace

    model = with_layers(load_model(LLAMA), 2)
    for s in (Setup(method="lora", seq=512, eval_batch=8), Setup(seq=128, eval_batch=4, precision="bf16-mixed")):
        t, e = trace(model, s).phase_peaks_bytes[EVAL], estimate(model, s).phase_peaks_bytes[EVAL]
        assert abs(e - t) / t < 0.01, (s, t, e)


def test_real_trainer_evaluate_matches():
    """transformers' own Trainer.evaluate on this CPU: full fine-tuning (the loss is the peak) and
    LoRA at narrow widths (the widest LoRA projection inside a layer is the peak)."""
    pytest.importorskip("torch")
    from vramplan.truths.cpu_truth import shrink_config
    from vramplan.truths.eval_truth import eval_run

    m = load_model(LLAMA)
    cfg = shrink_config(m.config, layers=2, hidden=512, heads=8, vocab=2048)
    spec = model_spec_from_config(cfg, name="narrow", source=m.source)
    for s in (Setup(seq=128, eval_batch=8), Setup(method="lora", seq=128, eval_batch=8)):
        t, e = eval_run(cfg, s), estimate(spec, s).phase_peaks_bytes[EVAL]
        assert abs(e - t) / t < 0.01, (s, t, e)


def test_script_plan_carries_the_eval_batch_only_when_set():
    model = load_model(LLAMA)
    plain = Plan(model=model.name, setup=Setup(method="lora"), breakdown=estimate(model, Setup(method="lora")))
    assert "eval_batch" not in script_plan(plain, model)
    s = Setup(method="lora", eval_batch=4)
    assert script_plan(Plan(model=model.name, setup=s, breakdown=estimate(model, s)), model)["eval_batch"] == 4


@pytest.mark.slow  # the full tier
def test_emitted_script_trains_and_evaluates_on_cpu(tmp_path):
    pytest.importorskip("torch")
    from vramplan.emit import emit_to_dir

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
            "max_position_embeddings": 256, "max_window_layers": 2}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("qwen2-0.5b").config, **tiny}))
    model = load_model(str(tmp_path / "tiny" / "config.json"))
    s = Setup(method="lora", lora_rank=4, batch=2, seq=32, eval_batch=3)
    emit_to_dir(Plan(model=model.name, setup=s, breakdown=estimate(model, s)), tmp_path / "out")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "train.py", "--cpu", "--max-steps", "2", "--eval-steps", "1", "--no-save"],
                         cwd=tmp_path / "out", env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("eval_loss") == 2  # one eval after each of the 2 steps


@pytest.mark.parametrize("name,data,eval_batch", [
    ("args.json", {"per_device_train_batch_size": 2, "eval_strategy": "steps"}, 8),  # the Trainer's default 8
    ("args.json", {"per_device_eval_batch_size": 4, "eval_strategy": "steps"}, 4),
    ("args.json", {"per_device_eval_batch_size": 4, "do_eval": True}, 4),
    ("args.json", {"per_device_eval_batch_size": 4}, 0),  # eval_strategy "no": no eval runs
    ("axolotl.yaml", {"adapter": "lora", "micro_batch_size": 2, "val_set_size": 0.05}, 2),
    ("axolotl.yaml", {"adapter": "lora", "micro_batch_size": 2, "val_set_size": 0.05, "eval_batch_size": 6}, 6),
    ("axolotl.yaml", {"adapter": "lora", "micro_batch_size": 2, "eval_batch_size": 6}, 0),
    ("lf.yaml", {"stage": "sft", "finetuning_type": "lora", "val_size": 0.1, "per_device_eval_batch_size": 1,
                 "eval_strategy": "steps"}, 1),
])
def test_readers_map_the_eval_batch(tmp_path, name, data, eval_batch):
    import yaml

    from vramplan.readers import read_config

    key = "base_model" if name.startswith("axolotl") else "model_name_or_path"
    path = tmp_path / name
    data = {key: LLAMA, **data}
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    read = read_config(path, format={"args.json": "hf", "axolotl.yaml": "axolotl", "lf.yaml": "llamafactory"}[name])
    assert read.setup.eval_batch == eval_batch
    assert (eval_batch == 0) == any("eval" in w.field for w in read.warnings)


def test_an_unmodelled_eval_is_read_as_a_warning(tmp_path):
    """A QLoRA config that evaluates: the estimate still answers (the train step), and says why."""
    import yaml

    from vramplan.readers import read_config

    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump({"base_model": LLAMA, "adapter": "qlora", "load_in_4bit": True,
                                    "micro_batch_size": 2, "val_set_size": 0.05}))
    read = read_config(path, format="axolotl")
    assert read.setup.eval_batch == 0 and "eval_batch" not in read.fields
    (w,) = [w for w in read.warnings if w.field == "eval_batch"]
    assert "quantized base" in w.why and "training step's peak only" in w.why
    estimate(load_model(LLAMA), read.setup)


def test_an_eval_batch_too_large_names_the_one_that_fits():
    model, gpu = load_model(LLAMA), load_gpu("l4-24gb")
    bd = estimate(model, Setup(method="lora", seq=2048, eval_batch=8), gpu)
    (note,) = [n for n in bd.notes if n.startswith("eval batch 8 needs")]
    n = int(note.split("--eval-batch ")[1].split()[0])
    assert estimate(model, Setup(method="lora", seq=2048, eval_batch=n), gpu).fits
    assert not estimate(model, Setup(method="lora", seq=2048, eval_batch=n + 1), gpu).fits
    # fits already, or the train step is the problem: no such note
    assert not [n for n in estimate(model, Setup(method="lora", seq=2048, eval_batch=2), gpu).notes
                if n.startswith("eval batch")]
