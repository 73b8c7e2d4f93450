"""The JSON schemas in docs/schema/ hold for what vramplan really writes and reads: estimate --json,
plan files, checks files (the shipped example), baselines, check --json, models/gpus --json,
validate --json, measurement records (and measure --json), sweep --json and calibrate's
coefficients. A schema that drifts from the code (a new Setup field, a new output key) fails here,
naming what to document.

Measurement records are made by vramplan.calibration.measure.to_measurement from worker results of the shape
vramplan/run/worker.py returns (no run here: a real training step belongs to tests/test_measure.py);
the failure and multi-rank results come from vramplan.run.launch's own functions."""

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
from vramplan.plans.planfile import plan_to_json
from vramplan.specs import Alternative, Plan, Rejected

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "docs" / "schema"
EXAMPLE = ROOT / "examples" / "ci"
NAMES = ("setup", "breakdown", "plan", "checks", "baseline", "check-result", "models", "gpus", "validate",
         "measurement", "measure-result", "coefficients", "sweep")


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
    ["llama-3.1-70b", "--method", "qlora", "--checkpointing", "--gpus", "2", "--device-map", "auto", "--gpu",
     "rtx-3090"],
    ["llama-3.1-8b", "--gpus", "2", "--pp", "2", "--grad-accum", "2", "--gpu", "a100-80gb"],
    ["mixtral-8x7b", "--gpus", "4", "--tp", "4", "--ep", "4", "--gpu", "h100-sxm"],
], ids=["full-fit", "qlora-no-gpu", "zero3-offload", "layer-split", "pipeline", "expert-parallel"])
def test_estimate_json(validate, schemas, args):
    data = cli_json("estimate", *args, "--json")
    validate("breakdown", data)
    # per_rank only where the GPUs differ (a layer split, pipeline stages; fullest_stage with --pp)
    split = {"per_rank"} if "--device-map" in args else {"per_rank", "fullest_stage"} if "--pp" in args else set()
    assert set(data) == set(schemas["breakdown"]["properties"]) - ({"per_rank", "fullest_stage"} - split)


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


def test_models_and_gpus_json(validate, schemas):
    models = cli_json("models", "--json")
    validate("models", models)
    items = schemas["models"]["items"]
    assert len(models) > 10 and all(set(items["required"]) <= set(m) <= set(items["properties"]) for m in models)
    assert any("warning" in m for m in models)  # the optional field, where an estimate assumes something
    gpus = cli_json("gpus", "--json")
    validate("gpus", gpus)
    fields = {f.name for f in dataclasses.fields(S.GpuSpec)}
    props = set(schemas["gpus"]["items"]["properties"])
    assert fields == props, (f"docs/schema/gpus.schema.json: add {sorted(fields - props)}, "
                             f"remove {sorted(props - fields)}")
    with pytest.raises(jsonschema.ValidationError):
        validate("gpus", [{**gpus[0], "usable_memory_bytes": "24GiB"}])


def test_validate_json(validate, schemas):
    """One traced case (grad_accum: a 2-layer Llama-3.2-1B, about 2 s) and two knobs with no truth here."""
    pytest.importorskip("torch")
    data = cli_json("validate", "--quick", "--knob", "grad_accum", "--knob", "gptq_awq", "--knob", "device_overheads",
                    "--json")
    validate("validate", data)
    rows = data["rows"]
    assert {r["verified"] for r in rows} == {True, False}
    assert {r["quantity"] for r in rows if r["verified"]} == {"tensor_peak_bytes", "forward_peak_bytes"}
    assert all(set(r) == set(schemas["validate"]["properties"]["rows"]["items"]["properties"]) for r in rows)
    with pytest.raises(jsonschema.ValidationError):
        validate("validate", {**data, "rows": [{**rows[0], "knob": "lora_rank"}]})


MiB = 2**20
MODEL = "llama-3.2-1b"


def _cuda_result(tensor_peak: int, step: int) -> dict:
    """A single-GPU CUDA worker result (vramplan/run/worker.py: run, _cuda_setup, Measure.result)
    with the device numbers an H200 would give: workspace, rounding, allocator slack, context."""
    allocated = 64 * MiB + int(tensor_peak * 1.002)
    reserved = 20 * MiB + int(allocated * 1.07)
    peaks = {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "active_peak_bytes": allocated}
    return {
        "device": "cuda", "oom": False, "world_size": 1, "rank": 0,
        "gpu_name": "NVIDIA H200", "gpu_total_bytes": 150_754_820_096, "compute_capability": "9.0", "cuda": "12.8",
        "cuda_context_bytes": 430 * MiB + step, "memory_source": "nvml", "driver": "570.124.06",
        "nvml_name": "NVIDIA H200",
        "tensor_peak_bytes": tensor_peak,
        "tensor_phase_peaks_bytes": {"build": tensor_peak // 4, "forward": tensor_peak // 2, "backward": tensor_peak,
                                     "optimizer": tensor_peak - 1},
        "steps_done": 3, "counted_steps": 2, "peak_rss_bytes": 3 * 2**30, "step_time_s": 0.21, "tokens_per_s": 9752.4,
        "timed_with_counter": False, **peaks,
        "phase_peaks": {ph: peaks for ph in ("setup", "build", "forward", "backward", "optimizer", "step_end")},
        "device_used_bytes": reserved + 520 * MiB, "seconds": 14.2,
    }


def _cpu_result(tensor_peak: int, rank: int = 0, world: int = 1) -> dict:
    return {"device": "cpu", "oom": False, "world_size": world, "rank": rank, "tensor_peak_bytes": tensor_peak,
            "tensor_phase_peaks_bytes": {"build": tensor_peak // 4, "forward": tensor_peak // 2,
                                         "backward": tensor_peak, "optimizer": tensor_peak - 1},
            "steps_done": 3, "counted_steps": 2, "peak_rss_bytes": 2**30, "step_time_s": 0.5, "tokens_per_s": 256.0,
            "timed_with_counter": False, "seconds": 3.1}


@pytest.fixture(scope="module")
def measurements(tmp_path_factory):
    """Measurements as `vramplan measure` makes them (vramplan.calibration.measure.to_measurement): four CUDA
    runs (one of a plan file on an emulated card), a CPU run, a CPU OOM, a timeout and two ranks."""
    from vramplan.calibration import measure as m
    from vramplan.plans.planfile import load_plan, save_plan
    from vramplan.run.launch import _failure, merge_ranks

    tmp = tmp_path_factory.mktemp("measure")
    spec, h200 = load_model(MODEL), load_gpu("h200")

    def plan(setup: Setup, gpu=h200) -> Plan:
        return Plan(model=MODEL, setup=setup, breakdown=estimate(spec, setup, gpu), gpu=gpu)

    def peak(setup: Setup) -> int:
        return estimate(spec, setup).tensor_peak_bytes

    cuda = m.MeasureOptions(device="cuda", steps=3)
    out = []
    for i, setup in enumerate(Setup(method="lora", batch=b, seq=512) for b in (1, 2, 4)):
        out.append(m.to_measurement(plan(setup), cuda, _cuda_result(peak(setup), i), MODEL, None, "NVIDIA H200"))
    setup = Setup(method="qlora", seq=2048)
    plan_file = save_plan(plan(setup, load_gpu("rtx-4090")), tmp / "plan.json")
    emulated = m.MeasureOptions(device="cuda", steps=3, emulate_gpu=load_gpu("rtx-4090"))
    result = {**_cuda_result(peak(setup), 9), "emulated_bytes": load_gpu("rtx-4090").usable_memory_bytes,
              "memory_fraction": 0.165}
    out.append(m.to_measurement(load_plan(plan_file), emulated, result, MODEL, None, "NVIDIA H200"))
    cpu, scale = m.MeasureOptions(device="cpu", steps=3), dict(m.DEFAULT_SCALE)
    setup = Setup(seq=128)
    out.append(m.to_measurement(plan(setup, None), cpu, _cpu_result(peak(setup)), MODEL, scale, "cpu"))
    oom = {**_cpu_result(peak(setup)), "oom": True, "oom_phase": "backward", "oom_step": 0,
           "error": "live tensors 20983122 bytes > cap 20971520 bytes in backward"}
    out.append(m.to_measurement(plan(setup, None), cpu, oom, MODEL, scale, "cpu"))
    (tmp / "run.status").write_text(json.dumps({"step": 0, "phase": "build"}))
    (tmp / "run.log").write_text("loading train.py\n")
    failed = _failure({"device": "cpu", "status": str(tmp / "run.status")}, tmp / "run.log", timeout=True,
                      returncode=-9, timeout_s=0.5)
    out.append(m.to_measurement(plan(setup, None), cpu, failed, MODEL, scale, "cpu"))
    setup = Setup(seq=128, zero_stage=2, gpus=2)
    ranks = merge_ranks([_cpu_result(peak(setup), r, 2) for r in range(2)])
    out.append(m.to_measurement(plan(setup, None), cpu, ranks, MODEL, scale, "cpu"))
    return out


def test_measurement_records_and_measure_json(validate, schemas, measurements, tmp_path):
    from vramplan.calibration import measure as m

    for meas in measurements:
        m.save(meas, tmp_path)
        validate("measure-result", {**meas.to_json(), "comparison": m.comparison(meas)})  # what measure --json prints
    records = m.read_records(tmp_path)
    assert len(records) == len(measurements)
    assert {p.name for p in tmp_path.iterdir()} == {"nvidia-h200.jsonl", "cpu.jsonl"}
    for record in records:
        validate("measurement", record)
    assert set(records[0]) == set(schemas["measurement"]["$defs"]["fields"]["properties"])
    measured_props = set(schemas["measurement"]["$defs"]["rank_result"]["properties"]) | {"device_total_bytes", "ranks"}
    for meas in measurements:
        assert set(meas.measured) <= measured_props, sorted(set(meas.measured) - measured_props)
    # closed where the code's shape is fixed: an unknown measured key, no comparison, a comparison in a record
    with pytest.raises(jsonschema.ValidationError):
        validate("measurement", {**records[0], "measured": {**records[0]["measured"], "vram_bytes": 1}})
    with pytest.raises(jsonschema.ValidationError):
        validate("measure-result", records[0])
    with pytest.raises(jsonschema.ValidationError):
        validate("measurement", {**records[0], "comparison": {}})


def test_calibrate_coefficients(validate, measurements, tmp_path):
    from vramplan.calibration import measure as m

    for meas in measurements:
        m.save(meas, tmp_path / "records")
    out = tmp_path / "coefficients.json"
    printed = cli_json("calibrate", "--records", str(tmp_path / "records"), "--out", str(out), "--json")
    validate("coefficients", printed)
    written = json.loads(out.read_text())
    assert written == printed and written["runs"] == 4 and written["records_seen"] == len(measurements)
    assert "pooled" in written["groups"] and any(g.startswith("sm90/torch-") for g in written["groups"])
    assert written["groups"]["sm80/torch-2.4"]["source"] == "published"  # the published rows fit too
    empty = cli_json("calibrate", "--records", str(tmp_path / "none"), "--out", str(tmp_path / "c.json"), "--json",
                     "--no-published")
    validate("coefficients", empty)
    assert empty["groups"] == {} and empty["flags"]
    validate("coefficients", json.loads((Path(__file__).parents[1] / "calibration" / "coefficients.json").read_text()))


def test_sweep_json_without_running(validate, measurements, tmp_path):
    """--dry-run, and a sweep whose budget starts no run (one run already recorded, one left)."""
    import dataclasses as dc

    from vramplan.calibration import measure as m

    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("device: cpu\nsteps: 2\ndefaults: {seq: 128}\nruns:\n"
                      "  - {name: lora, model: llama-3.2-1b, scale_down: true, setup: {method: lora}}\n"
                      "  - {name: full, model: llama-3.2-1b, scale_down: true}\n")
    records = str(tmp_path / "records")
    dry = cli_json("sweep", str(matrix), "--records", records, "--dry-run", "--json")
    validate("sweep", dry)
    m.save(dc.replace(measurements[4], key=dry[0]["key"]), records)  # a complete CPU run
    dry = cli_json("sweep", str(matrix), "--records", records, "--dry-run", "--json")
    validate("sweep", dry)
    assert [r["recorded"] for r in dry] == [True, False]
    summary = cli_json("sweep", str(matrix), "--records", records, "--budget", "1s", "--json")
    validate("sweep", summary)
    assert (summary["measured"], summary["left"], summary["skipped_recorded"], summary["runs"]) == (0, 1, 1, [])
