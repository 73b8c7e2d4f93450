"""The JSON schemas in docs/schema/ hold for what vramplan really writes and reads: estimate --json,
plan files, checks files (the shipped example), baselines and check --json. A schema that drifts
from the code (a new Setup field, a new output key) fails here, naming what to document."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan import specs as S
from vramplan.cli import main
from vramplan.planfile import plan_to_json
from vramplan.specs import Alternative, Plan, Rejected

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "docs" / "schema"
EXAMPLE = ROOT / "examples" / "ci"
NAMES = ("setup", "breakdown", "plan", "checks", "baseline", "check-result")


@pytest.fixture(scope="module")
def schemas() -> dict:
    return {name: json.loads((SCHEMAS / f"{name}.schema.json").read_text()) for name in NAMES}


@pytest.fixture(scope="module")
def validate(schemas):
    resources = [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas.values()]
    registry = referencing.Registry().with_resources(resources)

    def check(name: str, instance) -> None:
        schema = schemas[name]
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema, registry=registry).validate(instance)

    return check


def cli_json(*args: str, code: int = 0):
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def test_setup_schema_lists_every_setup_field_and_choice(schemas):
    props = schemas["setup"]["properties"]
    fields = [f.name for f in dataclasses.fields(Setup)]
    missing, extra = set(fields) - set(props), set(props) - set(fields)
    assert not missing and not extra, f"docs/schema/setup.schema.json: add {sorted(missing)}, remove {sorted(extra)}"
    for key, choices in (("method", S.METHODS), ("quant", S.QUANTS), ("precision", S.PRECISIONS),
                         ("optimizer", S.OPTIMIZERS), ("attn", S.ATTENTIONS), ("offload_optimizer", S.OFFLOADS),
                         ("offload_params", S.OFFLOADS), ("loss", S.LOSSES)):
        assert props[key]["enum"] == list(choices), key


@pytest.mark.parametrize("args", [
    ["llama-3.1-8b", "--gpu", "rtx-4090"],
    ["qwen3-30b-a3b", "--method", "qlora", "--checkpointing"],
    ["llama-3.1-8b", "--method", "lora", "--zero", "3", "--offload-optimizer", "cpu", "--gpus", "2",
     "--gpu-memory", "24GiB"],
], ids=["full-fit", "qlora-no-gpu", "zero3-offload"])
def test_estimate_json(validate, schemas, args):
    data = cli_json("estimate", *args, "--json")
    validate("breakdown", data)
    assert set(data) == set(schemas["breakdown"]["properties"])


def test_schema_rejects_what_the_code_would(validate):
    data = cli_json("estimate", "gpt2", "--json")
    with pytest.raises(jsonschema.ValidationError):
        validate("breakdown", {**data, "setup": {**data["setup"], "method": "dora"}})
    with pytest.raises(jsonschema.ValidationError):
        validate("breakdown", {k: v for k, v in data.items() if k != "device_total_bytes"})
    with pytest.raises(jsonschema.ValidationError):
        validate("checks", {"checks": [{"name": "a", "model": "gpt2", "gpu": "l4", "gpu_memory": "24GiB"}]})


def test_plan_file(validate, schemas):
    model, gpu = load_model("qwen2-0.5b"), load_gpu("rtx-4090")
    setup = Setup(method="lora", lora_rank=32, checkpointing=True, batch=2, grad_accum=4)
    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu, tokens_per_s=1234.5,
                step_time_s=0.5, alternatives=(Alternative(Setup(method="qlora"), 5 * 2**30, 900.0, "qlora r=16"),),
                rejected=(Rejected(Setup(), "full fine-tune: needs 9.9 GiB > 1.0 GiB usable", 10**10),),
                notes=("a note",))
    data = plan_to_json(plan)
    validate("plan", data)
    validate("plan", yaml.safe_load(yaml.safe_dump(data)))
    assert set(data) == set(schemas["plan"]["properties"])
    validate("plan", {"vramplan_plan": 1, "model": "gpt2", "setup": {"method": "lora"}})  # hand-written


def test_example_checks_file_and_baseline(validate):
    validate("checks", yaml.safe_load((EXAMPLE / "vram-checks.yaml").read_text()))
    validate("baseline", json.loads((EXAMPLE / "vram-baseline.json").read_text()))


def test_check_json_and_written_baseline(validate, schemas, tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, setup: {seq: 512}}\n"
                    "  - {name: b, model: llama-3.1-8b, gpu_memory: 24GiB, must_fit: false}\n")
    baseline = tmp_path / "b.json"
    first = cli_json("check", str(spec), "--baseline", str(baseline), "--update", "--json")
    validate("check-result", first)
    validate("baseline", json.loads(baseline.read_text()))
    data = json.loads(baseline.read_text())
    data["checks"]["a"]["device_total_bytes"] //= 2
    baseline.write_text(json.dumps(data))
    failed = cli_json("check", str(spec), "--baseline", str(baseline), "--json", code=1)
    validate("check-result", failed)
    assert failed["results"][0]["status"] == "grew" and failed["results"][0]["diff"]["numbers"]
    assert set(failed["results"][0]) == set(schemas["check-result"]["properties"]["results"]["items"]["properties"])
