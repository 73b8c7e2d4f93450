"""Plan files: round trip through JSON and YAML, one-line errors for bad files."""

import json

import pytest

from vramplan import Setup, SpecError, estimate, load_gpu, load_model
from vramplan.plans.planfile import load_plan, plan_to_json, save_plan
from vramplan.specs import GpuSpec, Plan, Rejected


def _plan(gpu=None):
    model = load_model("qwen2-0.5b")
    setup = Setup(method="lora", lora_rank=32, checkpointing=True, batch=2, grad_accum=4)
    gpu = gpu or load_gpu("rtx-4090")
    return Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu, tokens_per_s=1234.5,
                rejected=(Rejected(Setup(), "full fine-tune: needs 9.9 GiB > 1.0 GiB usable", 10**10),))


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_round_trip(tmp_path, suffix):
    plan = _plan()
    path = save_plan(plan, tmp_path / f"plan{suffix}")
    back = load_plan(path)
    assert back.setup == plan.setup and back.gpu == plan.gpu and back.model == plan.model
    assert back.breakdown == plan.breakdown
    assert back.recorded_estimate == plan.breakdown.to_json()
    assert back.rejected == plan.rejected and back.tokens_per_s == 1234.5
    assert back.global_batch == 2 * 4 * 1


def test_custom_gpu_round_trip(tmp_path):
    plan = _plan(GpuSpec.custom(20 * 1024**3))
    back = load_plan(save_plan(plan, tmp_path / "p.json"))
    assert back.gpu.usable_memory_bytes == 20 * 1024**3


def test_json_has_the_promised_keys():
    data = plan_to_json(_plan())
    for key in ("fits", "setup", "breakdown", "tokens_per_s", "alternatives", "rejected"):
        assert key in data
    for key in ("method", "lora_rank", "quant", "checkpointing", "optimizer", "zero_stage",
                "offload_optimizer", "offload_params", "batch", "grad_accum", "gpus"):
        assert key in data["setup"]


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1, 2]", "holds one mapping"),
    ('{"model": "gpt2", "setup": {}}', "not a vramplan plan file"),
    ('{"vramplan_plan": 1, "setup": {}}', "has no 'model'"),
    ('{"vramplan_plan": 1, "model": "gpt2", "setup": {"batch": 0}}', "batch"),
    ('{"vramplan_plan": 1, "model": "gpt2", "setup": {"bogus": 1}}', "unknown setup key 'bogus'"),
    ('{"vramplan_plan": 1, "model": "no-such-model-xyz", "setup": {}}', "no-such-model-xyz"),
    ('{"vramplan_plan": 1, "model": "gpt2", "setup": {}, "nodes": 0}', "nodes"),
])
def test_bad_plan_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=message) as info:
        load_plan(path)
    assert "\n" not in str(info.value)


def test_bad_extension_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="ends in .json"):
        save_plan(_plan(), tmp_path / "plan.txt")
    with pytest.raises(SpecError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")


def test_save_is_atomic_and_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(_plan(), path)
    before = path.read_text()
    import vramplan.util.fileio as fileio

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "fsync", boom)
    with pytest.raises(OSError):
        save_plan(_plan(), path)
    assert path.read_text() == before
    assert json.loads(before)["vramplan_plan"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
