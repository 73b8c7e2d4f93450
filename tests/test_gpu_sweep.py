"""The GPU sweep's plumbing, checked on the CPU: the scripts parse, the carried wheels cover what
DeepSpeed and bitsandbytes need beyond torch/transformers/accelerate/peft, every run of
calibration/gpu-sweep.yaml estimates, emits and fits the time budget, and the CUDA worker's pure
parts (NVML device choice and fallback, the emulated card's memory fraction, the record) hold.

The whole script runs here as a rehearsal (minutes: a fresh venv, the wheels, a CPU slice of the
matrix), not as a test:
    bash calibration/build_wheels.sh && OUT=/tmp/rehearsal REHEARSE=cpu bash calibration/gpu_sweep.sh
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from vramplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
CAL = ROOT / "calibration"
MATRIX = CAL / "gpu-sweep.yaml"
#: What the H200 image's python3 has that the carried wheels may lean on (docs/commands/measure.md).
IMAGE = ("torch", "transformers", "accelerate", "peft")


def wheel_list() -> list[tuple[str, str, str | None]]:
    rows = []
    for line in (CAL / "wheels.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, kind, *version = line.split()
            rows.append((name, kind, version[0] if version else None))
    return rows


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _requires(dist: str) -> set[str]:
    """Names ``dist`` needs on Linux without extras (from its installed metadata)."""
    from packaging.requirements import Requirement

    out = set()
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        env = {"extra": "", "sys_platform": "linux", "platform_system": "Linux"}
        if req.marker is None or req.marker.evaluate(env):
            out.add(_norm(req.name))
    return out


def _closure(names) -> set[str]:
    seen, todo = set(), [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requires(name) - seen)
        except metadata.PackageNotFoundError:
            pass
    return seen


# ----------------------------------------------------------------------------------------------
# the scripts and the wheel list


@pytest.mark.parametrize("script", ["gpu_sweep.sh", "build_wheels.sh"])
def test_scripts_parse(script):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    result = subprocess.run([bash, "-n", str(CAL / script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_gpu_sweep_refuses_a_bad_rehearse_value(tmp_path):
    result = subprocess.run(["bash", str(CAL / "gpu_sweep.sh")], env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path),
                                                                       "REHEARSE": "gpu"},
                            capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 2 and "REHEARSE must be cpu" in result.stderr


def test_wheel_list_covers_deepspeed_and_bitsandbytes():
    """Everything deepspeed, bitsandbytes and nvidia-ml-py need (transitively) is carried or comes
    with torch, transformers, accelerate and peft; every carried package is needed."""
    rows = wheel_list()
    names = {_norm(n) for n, _, _ in rows}
    assert len(names) == len(rows), "a package listed twice"
    assert {kind for _, kind, _ in rows} <= {"build", "py3", "cp", "bnb"}
    assert {"deepspeed", "bitsandbytes", "nvidia-ml-py"} <= names
    for dist in ("deepspeed", "bitsandbytes"):
        pytest.importorskip(dist.replace("-", "_"))
    needed = _closure(["deepspeed", "bitsandbytes", "nvidia-ml-py"])
    image = _closure(IMAGE)
    missing = needed - image - names
    assert not missing, f"add to calibration/wheels.txt: {sorted(missing)}"
    unneeded = names - needed
    assert not unneeded, f"calibration/wheels.txt carries what nothing needs: {sorted(unneeded)}"
    # the package versions left blank are installed here (build_wheels.sh takes them from this venv)
    for name, _, version in rows:
        if version is None:
            metadata.version(name)


def test_built_wheels_match_the_list():
    """calibration/wheels/ (when built) has one wheel per listed package, per-Python ones for this
    Python and the H200's 3.12, and fits the device call's 64 MiB with room."""
    wheels = CAL / "wheels"
    if not wheels.is_dir():
        pytest.skip("calibration/wheels/ not built (bash calibration/build_wheels.sh)")
    files = [p.name for p in wheels.glob("*.whl")]
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for name, kind, _ in wheel_list():
        mine = [f for f in files if _norm(f.split("-")[0]) == _norm(name)]
        assert mine, f"no wheel for {name}"
        assert len({f.split("-")[1] for f in mine}) == 1, f"two versions of {name}: {mine}"
        if kind == "cp":
            assert {here, "cp312"} <= {f.split("-")[2] for f in mine}, mine
        else:
            assert len(mine) == 1 and mine[0].split("-")[2] == "py3", mine
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) < 48 * 2**20


# ----------------------------------------------------------------------------------------------
# the matrix: every run estimates, emits, and the sweep fits its time


def test_every_gpu_sweep_run_estimates_and_emits(tmp_path):
    from vramplan.calibration import sweep as sw
    from vramplan.emit import emit_to_dir
    from vramplan.estimator import estimate
    from vramplan.model.profiles import load_gpu, load_model
    from vramplan.specs import Plan

    spec = sw.load_matrix(str(MATRIX))
    assert len(spec.runs) >= 20
    for i, run in enumerate(spec.runs):
        gpu = load_gpu(run.emulate_gpu) if run.emulate_gpu else load_gpu("h200")
        plan = Plan(model=run.model, setup=run.setup, breakdown=estimate(load_model(run.model), run.setup, gpu),
                    gpu=gpu)
        out = tmp_path / str(i)
        emit_to_dir(plan, out, ("trainer",), force=True)
        assert (out / "train.py").is_file() and (out / "config.json").is_file(), run.name
        assert (out / "ds_config.json").is_file() == bool(run.setup.zero_stage), run.name
        assert 0 < run.predicted_s < 120, run.name


def test_dry_run_predicts_the_sweep_within_its_budget(validate):
    """The shipped matrix on an H200: at least 20 runs predicted within gpu_sweep.sh's 7-minute
    budget and all of them within 8 (the device call allows 10), in the order the sweep takes them."""
    from vramplan.calibration import sweep as sw

    result = CliRunner().invoke(main, ["sweep", str(MATRIX), "--dry-run", "--budget", "7m", "--json",
                                       "--records", "/nonexistent-records"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    validate("sweep", rows)
    assert [r["name"] for r in rows] == [r.name for r in sw.order(sw.load_matrix(str(MATRIX)).runs)]
    cumulative = [r["cumulative_s"] for r in rows]
    assert cumulative == sorted(cumulative) and cumulative[-1] < 8 * 60
    assert sum(r["within_budget"] for r in rows) >= 20
    assert [r["within_budget"] for r in rows] == sorted((r["within_budget"] for r in rows), reverse=True)
    offload = [r for r in rows if "offload" in r["name"]]
    assert offload and all(r["predicted_s"] > 0 for r in offload)
    text = CliRunner().invoke(main, ["sweep", str(MATRIX), "--dry-run", "--budget", "2m", "--records", "/nonexistent"])
    assert text.exit_code == 0 and "past --budget" in text.output and text.output.rstrip().splitlines()[-1].startswith(
        "predicted:")


def test_predicted_time_grows_with_what_a_run_does():
    from vramplan.calibration import sweep as sw
    from vramplan.model.profiles import load_gpu, load_model
    from vramplan.specs import Setup

    h200, small, big = load_gpu("h200"), load_model("smollm2-135m"), load_model("llama-3.2-1b")
    base = sw.predict_seconds(small, Setup(), "cuda", 3, h200)
    assert base >= sw.PROCESS_START_S
    assert sw.predict_seconds(big, Setup(), "cuda", 3, h200) > base
    assert sw.predict_seconds(small, Setup(method="qlora"), "cuda", 3, h200) > sw.predict_seconds(
        small, Setup(method="lora"), "cuda", 3, h200)
    assert sw.predict_seconds(small, Setup(zero_stage=2), "cuda", 3, h200) > base
    assert sw.predict_seconds(small, Setup(), "cuda", 1, h200) < base


@pytest.mark.parametrize(("text", "seconds"), [("6m30s", 390), ("1h 30m", 5400), ("90", 90), ("7m", 420)])
def test_budget_durations(text, seconds):
    from vramplan.calibration.sweep import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["6m30", "m30s", "soon", ""])
def test_bad_budget_durations(text):
    from vramplan.calibration.sweep import parse_duration
    from vramplan.specs import SpecError

    with pytest.raises(SpecError, match="--budget"):
        parse_duration(text)


# ----------------------------------------------------------------------------------------------
# the CUDA worker's pure parts


def test_nvml_device_follows_cuda_visible_devices():
    from vramplan.run.device_memory import nvml_device_ref

    assert nvml_device_ref(0, {}) == ("index", 0)
    assert nvml_device_ref(1, {"CUDA_VISIBLE_DEVICES": ""}) == ("index", 1)
    assert nvml_device_ref(1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ("index", 5)
    assert nvml_device_ref(0, {"CUDA_VISIBLE_DEVICES": "GPU-8a1f"}) == ("uuid", "GPU-8a1f")
    assert nvml_device_ref(0, {"CUDA_VISIBLE_DEVICES": "8a1f"}) == ("uuid", "GPU-8a1f")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_device_ref(2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_emulation_fraction():
    from vramplan.model.profiles import load_gpu
    from vramplan.run.device_memory import emulation_fraction

    total, context = 150_754_820_096, 520 * 2**20
    usable = load_gpu("rtx-4090").usable_memory_bytes
    fraction = emulation_fraction(usable, context, total)
    assert fraction * total + context == pytest.approx(usable, abs=1)
    with pytest.raises(ValueError, match="cannot emulate"):
        emulation_fraction(2 * total, context, total)
    with pytest.raises(ValueError, match="cannot emulate"):
        emulation_fraction(context, context, total)


class FakeNvml:
    """pynvml's calls the worker makes, over a scripted list of device-wide used bytes."""

    def __init__(self, used: list[int], processes=(), fail_init: bool = False) -> None:
        self.used, self.processes, self.fail_init, self.handles = list(used), list(processes), fail_init, []

    def nvmlInit(self):
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handles.append(("index", i))
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.used.pop(0) if len(self.used) > 1 else self.used[0])

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.processes

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04"

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H200"


def test_device_memory_from_nvml():
    import os

    from vramplan.run.device_memory import DeviceMemory

    nvml = FakeNvml([100, 900, 500, 500, 700], processes=[SimpleNamespace(pid=1, usedGpuMemory=7),
                                                           SimpleNamespace(pid=os.getpid(), usedGpuMemory=600)])
    dm = DeviceMemory(1, nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert dm.source == "nvml" and nvml.handles == [("index", 3)]
    # the first read answered the probe; then 900 -> 500 -> 500: settled at 500
    assert dm.settled_used_bytes(interval_s=0) == 500
    assert dm.used_bytes() == 700
    assert dm.process_bytes() == 600 and dm.process_bytes(pid=12345) is None
    assert dm.info() == {"memory_source": "nvml", "driver": "580.159.04", "nvml_name": "NVIDIA H200"}


@pytest.mark.parametrize("nvml", [None, FakeNvml([0], fail_init=True)])
def test_device_memory_without_nvml_falls_back_to_cuda(nvml):
    """No nvidia-ml-py (or no NVML library): cudaMemGetInfo, which needs CUDA initialised first;
    here (torch without CUDA) it has nothing to say, and the run still gets a source to record."""
    pytest.importorskip("torch")
    from vramplan.run.device_memory import DeviceMemory

    dm = DeviceMemory(0, nvml=nvml)
    assert dm.source == "cudaMemGetInfo" and dm.process_bytes() is None
    assert dm.used_bytes() is None  # CUDA not initialised in this process
    info = dm.info()
    assert info["memory_source"] == "cudaMemGetInfo"
    assert "nvml_error" in info


def test_device_memory_with_the_real_nvidia_ml_py_and_no_driver():
    """The real pynvml on a machine without an NVIDIA driver: nvmlInit fails, the worker falls back."""
    pytest.importorskip("pynvml")
    from vramplan.run.device_memory import DeviceMemory

    if shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA driver is here")
    dm = DeviceMemory(0)
    assert dm.source == "cudaMemGetInfo" and dm.error


def test_cuda_result_assembly_and_record(validate, tmp_path):
    """Measure.result() on CUDA: each peak the maximum over phases, device memory the largest
    sample, and the record vramplan.calibration.measure builds from it holds the measurement schema."""
    from vramplan.calibration import measure as m
    from vramplan.estimator import estimate
    from vramplan.model.profiles import load_gpu, load_model
    from vramplan.run.callback import Measure
    from vramplan.specs import Plan, Setup

    request = {"device": "cuda", "steps": 3, "tokens_per_step": 4096}
    meas = Measure(request, None)
    meas.phase_peaks = {"build": {"peak_allocated_bytes": 10, "peak_reserved_bytes": 20, "active_peak_bytes": 10},
                        "forward": {"peak_allocated_bytes": 50, "peak_reserved_bytes": 64, "active_peak_bytes": 49},
                        "backward": {"peak_allocated_bytes": 40, "peak_reserved_bytes": 70, "active_peak_bytes": 40}}
    meas.device_samples, meas.process_samples = [300, 700, 650], [600, 680]
    meas.step_times = [(1.0, True), (1.0, True), (0.25, False)]
    meas.step = 3
    got = meas.result()
    assert (got["peak_allocated_bytes"], got["peak_reserved_bytes"], got["active_peak_bytes"]) == (50, 70, 49)
    assert got["device_used_bytes"] == 700 and got["device_process_bytes"] == 680
    assert got["step_time_s"] == 0.25 and got["tokens_per_s"] == 4096 / 0.25 and not got["timed_with_counter"]
    setup, h200 = Setup(seq=512), load_gpu("h200")
    spec = load_model("smollm2-135m")
    plan = Plan(model="smollm2-135m", setup=setup, breakdown=estimate(spec, setup, h200), gpu=h200)
    result = {"device": "cuda", "oom": False, "world_size": 1, "rank": 0, "gpu_name": "NVIDIA H200",
              "gpu_total_bytes": 150_754_820_096, "compute_capability": "9.0", "cuda": "13.0",
              "cuda_context_bytes": 500 * 2**20, "memory_source": "nvml", "driver": "580.159.04", **got}
    record = m.to_measurement(plan, m.MeasureOptions(device="cuda"), result, "smollm2-135m", None, "NVIDIA H200")
    assert record.measured["device_total_bytes"] == 700
    assert record.provenance["gpu_name"] == "NVIDIA H200"
    validate("measurement", record.to_json())
    path = m.save(record, tmp_path)
    assert path.name == "nvidia-h200.jsonl" and m.read_records(tmp_path)[0]["key"] == record.key


@pytest.fixture(scope="module")
def validate():
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schemas = [json.loads(p.read_text()) for p in (ROOT / "docs" / "schema").glob("*.schema.json")]
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas])
    by_name = {s["$id"].rsplit(":", 1)[-1]: s for s in schemas}

    def check(name: str, instance) -> None:
        jsonschema.Draft202012Validator(by_name[name], registry=registry).validate(instance)

    return check


def test_skip_unavailable_leaves_out_runs_whose_library_is_missing(monkeypatch, validate):
    """A GPU machine where deepspeed did not install: --skip-unavailable runs the rest (here: a
    budget too short for any run) instead of stopping at the missing library; without it, one line."""
    from vramplan.commands import measure as cmd

    def missing(setups):
        return ["deepspeed"] if any(s.zero_stage for s in setups) else []

    monkeypatch.setattr(cmd, "_missing_libraries", missing)
    args = ["sweep", str(MATRIX), "--device", "cuda", "--budget", "1s", "--records", "/nonexistent-records", "--json"]
    result = CliRunner().invoke(main, [*args, "--skip-unavailable"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    validate("sweep", summary)
    assert sorted(summary["skipped_unavailable"]) == sorted(r for r in summary_names() if "zero" in r)
    assert summary["measured"] == 0 and summary["skipped_recorded"] == 0
    assert summary["left"] == len(summary_names()) - len(summary["skipped_unavailable"])
    stopped = CliRunner().invoke(main, args)
    assert stopped.exit_code == 2 and "deepspeed is missing" in stopped.output


def summary_names() -> list[str]:
    import yaml

    return [r["name"] for r in yaml.safe_load(MATRIX.read_text())["runs"]]


def test_commit_from_the_environment(monkeypatch):
    from vramplan.calibration import measure as m

    monkeypatch.setenv("VRAMPLAN_COMMIT", "e53e082abcde-dirty")
    assert m.vramplan_commit() == "e53e082abcde-dirty"
    assert m.provenance()["vramplan_commit"] == "e53e082abcde-dirty"


GPU_PROBE = r"""
import json, torch
from vramplan.run.device_memory import DeviceMemory, emulation_fraction
from vramplan.run.worker import is_oom

GiB = 2**30
dm = DeviceMemory(0)
before = dm.settled_used_bytes() if dm.source == "nvml" else 0
torch.cuda.set_device(0)
torch.cuda.init()
torch.cuda.mem_get_info(0)
context = (dm.used_bytes() or 0) - (before or 0)
total = torch.cuda.get_device_properties(0).total_memory
fraction = emulation_fraction(8 * GiB, context, total)
torch.cuda.set_per_process_memory_fraction(fraction, 0)
fits = torch.empty(6 * GiB, dtype=torch.uint8, device="cuda")
try:
    torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    oom = False
except BaseException as exc:
    oom = is_oom(exc)
torch.cuda.synchronize()
print(json.dumps({"source": dm.source, "error": dm.error, "context": context, "fraction": fraction,
                  "oom": oom, "used": (dm.used_bytes() or 0) - (before or 0), "process": dm.process_bytes(),
                  "reserved": torch.cuda.max_memory_reserved(), "info": dm.info()}))
"""


@pytest.mark.gpu
def test_nvml_and_the_emulated_card_on_a_real_gpu():
    """On a CUDA machine (calibration/gpu_sweep.sh runs this after its sweep): NVML answers for
    this process's device, the CUDA context is measured, and an 8 GiB card emulated with the
    memory fraction takes 6 GiB and refuses 4 GiB more as an out-of-memory error."""
    out = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(got)
    assert got["oom"], got
    assert 100 * 2**20 < got["context"] < 4 * 2**30, got
    assert 6 * 2**30 <= got["reserved"] <= 8 * 2**30 - got["context"], got
    if got["source"] == "nvml":
        assert got["used"] >= 6 * 2**30 and "driver" in got["info"], got
        assert got["process"] is None or got["process"] >= 6 * 2**30, got


def test_a_run_starts_only_if_its_expected_time_is_left():
    """The budget guard: before any run, MIN_RUN_S; then the run's prediction scaled by the median
    measured/predicted ratio so far (+25 %), so one slow run (a compile, a timeout) does not stop
    the sweep with minutes left."""
    from vramplan.calibration import sweep as sw
    from vramplan.specs import Setup

    run = sw.Run(name="r", model="smollm2-135m", setup=Setup(), predicted_s=20.0)
    assert sw._expected_s(run, 0.0, []) == sw.MIN_RUN_S
    assert sw._expected_s(run, 95.0, []) == 95.0  # no ratio yet: the slowest run so far
    assert sw._expected_s(run, 95.0, [1.0, 1.2, 4.5]) == pytest.approx(1.25 * 1.2 * 20)
    assert sw._expected_s(sw.Run(name="x", model="m", setup=Setup()), 30.0, [1.0]) == 30.0  # no prediction
    assert sw._expected_s(sw.Run(name="t", model="m", setup=Setup(), predicted_s=1.0), 0.0, [1.0]) == sw.MIN_RUN_S
