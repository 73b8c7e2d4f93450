"""`vramplan measure`: the emitted train.py run for real, its live-tensor peak against the estimate.

Every real run of this file happens in the ``runs`` fixture: the setups of the bars, an OOM and
a timeout share one forking worker (torch and transformers imported once, each run still in fresh
processes, one per rank), while `vramplan measure --json` and `vramplan sweep` run as commands in
parallel with it. Models are a shipped profile scaled down (2 layers, hidden 256, vocab 4096),
random weights, 128 tokens.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import selected_params

from vramplan.calibration import measure as m
from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.model.profiles import load_gpu, load_model
from vramplan.specs import Plan, Setup

MODEL = "meta-llama/Llama-3.2-1B"
SEQ = 128

#: name -> setup of the CPU runs (the bars of issue 6)
SETUPS = {
    "full": Setup(seq=SEQ),
    "lora": Setup(method="lora", seq=SEQ),
    "qlora": Setup(method="qlora", seq=SEQ),
    "zero2": Setup(seq=SEQ, zero_stage=2),
    "zero3": Setup(seq=SEQ, zero_stage=3),
    "zero2-2ranks": Setup(seq=SEQ, zero_stage=2, gpus=2),
    "zero3-2ranks": Setup(seq=SEQ, zero_stage=3, gpus=2),
    # the Trainer keeps nn.Embedding states 32-bit under 8-bit optimizers (a 1M-parameter
    # embedding here: +6 MB, -20 % if missed); paged states are ordinary tensors on the CPU
    "adamw-8bit": Setup(seq=SEQ, optimizer="adamw-8bit"),
    "paged-adamw-8bit": Setup(seq=SEQ, optimizer="paged-adamw-8bit"),
    "zero2-offload": Setup(seq=SEQ, zero_stage=2, offload_optimizer="cpu"),
}
#: the runs of the fast tier (the others run in the full tier, `pytest -m slow`; the emitted train.py's
#: QLoRA step runs in the fast tier in tests/test_train_script.py)
FAST = ("full", "lora", "zero3-2ranks")


def _tiered(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


def _plan(tmp_path, name: str) -> tuple[Plan, str, dict]:
    scale = dict(m.DEFAULT_SCALE)
    path = m.scaled_model_path(MODEL, scale, tmp_path / name)
    setup = SETUPS[name]
    return Plan(model=path, setup=setup, breakdown=estimate(load_model(path), setup)), MODEL, scale


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """Every real run of this file: the SETUPS this session's tests read (the fast tier's FAST, the
    full tier's others), an OOM under a CPU cap and a timeout in one forking worker; the `measure`
    command (JSON, record) and a one-run `sweep` whose run times out, in parallel."""
    tmp = tmp_path_factory.mktemp("measure")
    shm_before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    wanted = {"full", *selected_params(request, "test_cpu_run_records_measured_peaks", "name"),
              *selected_params(request, "test_tensor_peak_estimate_within_5_percent", "name")}
    if any(item.originalname == "test_cpu_offload_run_is_recorded_but_not_compared" for item in request.session.items):
        wanted |= {"zero2", "zero2-offload"}
    plans = {name: _plan(tmp, name) for name in SETUPS if name in wanted}
    full_peak = plans["full"][0].breakdown.tensor_peak_bytes
    capped = m.MeasureOptions(device="cpu", steps=3, cpu_memory_cap_bytes=int(full_peak * 0.8))
    records = tmp / "records"

    def batch():
        options = m.MeasureOptions(device="cpu", steps=3, timeout_s=240)
        requests = [m.prepare(p, options, tmp / f"emit-{name}") for name, (p, _, _) in plans.items()]
        requests.append(m.prepare(plans["full"][0], capped, tmp / "emit-oom"))
        requests.append({**m.prepare(plans["full"][0], options, tmp / "emit-timeout"), "timeout_s": 0.5})
        from vramplan.run.launch import run_many

        results = run_many(requests, tmp / "batch", timeout_s=240)
        out = {name: m.to_measurement(p, options, r, ref, sc, "cpu")
               for (name, (p, ref, sc)), r in zip(plans.items(), results, strict=False)}
        out["oom"] = m.to_measurement(plans["full"][0], capped, results[len(plans)], MODEL, None, "cpu")
        out["timeout"] = results[-1]
        return out

    def vramplan(*args: str) -> subprocess.CompletedProcess:  # CliRunner's capture is not thread-safe
        return subprocess.run([sys.executable, "-m", "vramplan", *args], capture_output=True, text=True, timeout=300,
                              check=False)

    def cli():
        return vramplan("measure", "llama-3.2-1b", "--scale-down", "--device", "cpu", "--seq", str(SEQ),
                        "--steps", "2", "--json", "--records", str(records))

    matrix = tmp / "matrix.yaml"
    matrix.write_text(CPU_MATRIX)
    sweep_records = tmp / "sweep-records"

    def sweep():
        return vramplan("sweep", str(matrix), "--budget", "2m", "--records", str(sweep_records), "--json")

    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(fn) for name, fn in (("batch", batch), ("cli", cli), ("sweep", sweep))}
        out = futures["batch"].result()
        out["cli"] = futures["cli"].result()
        out["sweep"] = futures["sweep"].result()
    out.update(records=records, matrix=matrix, sweep_records=sweep_records)
    out["shm_leaked"] = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - shm_before
    return out


CPU_MATRIX = """
device: cpu
steps: 2
timeout: 1
defaults: {seq: 128}
runs:
  - {name: tiny-lora-ckpt, model: llama-3.2-1b, scale_down: true, setup: {method: lora, checkpointing: true}}
"""


@pytest.mark.parametrize("name", _tiered(SETUPS))
def test_cpu_run_records_measured_peaks(runs, name):
    meas = runs[name]
    assert meas.ok and not meas.oom, meas.measured.get("error")
    got = meas.measured
    assert got["steps_done"] == 3 and got["counted_steps"] == 2
    assert got["world_size"] == meas.setup.gpus
    if meas.setup.gpus > 1:
        assert [r["rank"] for r in got["ranks"]] == [0, 1]
        assert got["tensor_peak_bytes"] == max(r["tensor_peak_bytes"] for r in got["ranks"])
    assert got["tensor_peak_bytes"] > meas.estimate["params_total"] * 2  # at least the bf16 weights
    assert set(got["tensor_phase_peaks_bytes"]) >= {"forward", "backward", "optimizer"}
    assert got["peak_rss_bytes"] > got["tensor_peak_bytes"]
    assert got["tokens_per_s"] > 0 and got["timed_with_counter"] is False
    assert meas.provenance["versions"]["torch"] and meas.provenance["date"]


@pytest.mark.parametrize("name", _tiered(n for n in SETUPS if n != "zero2-offload"))
def test_tensor_peak_estimate_within_5_percent(runs, name):
    meas = runs[name]
    row = m.comparison(meas)["tensor_peak_bytes"]
    est, got = row["estimate"], row["measured"]
    assert got == meas.measured["tensor_peak_bytes"]
    paged = sum(c["bytes"] for c in meas.estimate["components"] if c["name"] == "paged_optimizer_states")
    assert est == meas.estimate["tensor_peak_bytes"] + paged and (paged > 0) == (name == "paged-adamw-8bit")
    assert abs(est / got - 1) <= 0.05, f"estimate {est} vs measured {got} ({est / got - 1:+.1%})"


def test_deepspeed_runs_leave_no_shared_memory_behind(runs):
    """DeepSpeed's CPU ranks each create a ~64 MiB all-reduce buffer in /dev/shm (RAM) and never
    unlink it; the launchers release the ones of their port after the ranks exit."""
    assert any(s.zero_stage for s in SETUPS.values())
    assert not runs["shm_leaked"]


def test_release_deepspeed_shm_removes_only_its_launch(tmp_path):
    from vramplan.run import release_deepspeed_shm

    mine = [Path(f"/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_1_{r}") for r in range(2)]
    other = Path("/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_11_0")
    for p in (*mine, other):
        p.write_bytes(b"x")
    try:
        assert release_deepspeed_shm(1) == 2 and not any(p.exists() for p in mine) and other.exists()
    finally:
        for p in (*mine, other):
            p.unlink(missing_ok=True)


@pytest.mark.slow
def test_cpu_offload_run_is_recorded_but_not_compared(runs):
    """Offloaded states share the CPU's memory: the record has its live-tensor peak, the
    comparison leaves it out (the distributed truth splits device and host)."""
    meas = runs["zero2-offload"]
    assert meas.ok and meas.measured["tensor_peak_bytes"] > meas.estimate["tensor_peak_bytes"]
    assert "tensor_peak_bytes" not in m.comparison(meas)
    assert "no device/host split" in m.cpu_comparable(meas.setup)
    assert m.cpu_comparable(runs["zero2"].setup) is None


def test_cpu_cap_is_a_recorded_oom(runs):
    meas = runs["oom"]
    assert meas.ok and meas.oom
    assert meas.measured["oom_phase"] in ("forward", "backward", "optimizer")
    assert "cap" in meas.measured["error"]
    assert meas.measured["tensor_peak_bytes"] > int(runs["full"].estimate["tensor_peak_bytes"] * 0.8)


def test_timeout_is_a_recorded_failure(runs):
    got = runs["timeout"]
    assert got["failed"] and got["timeout"] and not got["oom"]
    assert "timeout" in got["error"]
    assert got["phase"] is not None  # the status file said where the run was


def test_cli_measure_json_and_record(runs):
    result = runs["cli"]
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["estimate"]["tensor_peak_bytes"] > 0
    measured = data["measured"]
    for key in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "oom"):
        assert key in measured
    assert measured["oom"] is False and measured["peak_allocated_bytes"] is None  # CPU: no allocator
    assert abs(data["comparison"]["tensor_peak_bytes"]["error"]) <= 0.05
    (record,) = m.read_records(runs["records"])
    assert record["key"] == data["key"] and record["model"] == "llama-3.2-1b"
    assert record["provenance"]["vramplan_commit"]
    # the real output holds the documented schemas (docs/schema/)
    _schema_check("measure-result", data)
    _schema_check("measurement", record)


def _schema_check(name: str, instance) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    folder = Path(__file__).resolve().parents[1] / "docs" / "schema"
    schemas = {p.name.removesuffix(".schema.json"): json.loads(p.read_text()) for p in folder.glob("*.schema.json")}
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas.values()])
    jsonschema.Draft202012Validator(schemas[name], registry=registry).validate(instance)


def test_sweep_records_a_run_killed_at_its_timeout_and_retries_it(runs):
    """The sweep's run path (measure_plan in a fresh interpreter, the record appended) with a
    1 s timeout: the worker is killed while it imports, the record says so, and a failed run
    does not count as recorded, so the next sweep tries it again."""
    result = runs["sweep"]
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["measured"] == 1 and summary["failed"] == 1 and summary["left"] == 0
    (record,) = m.read_records(runs["sweep_records"])
    assert record["measured"]["timeout"] and record["measured"]["failed"] and record["measured"]["returncode"]
    assert record["setup"]["checkpointing"] is True and record["scale"] == m.DEFAULT_SCALE
    assert record["estimate"]["tensor_peak_bytes"] > 0
    again = CliRunner().invoke(main, ["sweep", str(runs["matrix"]), "--records", str(runs["sweep_records"]),
                                      "--dry-run", "--json"])
    assert json.loads(again.output)[0]["recorded"] is False


def test_sweep_order_and_budget_without_running(tmp_path):
    from vramplan.calibration import sweep as sw

    matrix = tmp_path / "m.yaml"
    matrix.write_text(CPU_MATRIX + """
  - {name: tiny-full, model: llama-3.2-1b, scale_down: true}
  - {name: tiny-full-again, model: llama-3.2-1b, scale_down: true, setup: {batch: 1}}
  - {name: tiny-zero2-offload, model: llama-3.2-1b, scale_down: true, setup: {zero_stage: 2, offload_optimizer: cpu}}
""")
    spec = sw.load_matrix(str(matrix))
    ordered = sw.order(spec.runs)
    assert len(ordered) == 4 and ordered[-1].name in ("tiny-full", "tiny-full-again")  # adds nothing new
    assert ordered[0].score >= ordered[-1].score
    summary = sw.run_sweep(spec, ordered, budget_s=sw.MIN_RUN_S / 2, records_dir=str(tmp_path), progress=False)
    assert summary["measured"] == 0 and summary["left"] == 4
    assert sw.parse_duration("8m") == 480 and sw.parse_duration("90s") == 90 and sw.parse_duration("1.5h") == 5400
    result = CliRunner().invoke(main, ["sweep", str(matrix), "--budget", "soon"])
    assert result.exit_code == 2 and result.output.startswith("error: --budget")
    gptq = tmp_path / "gptq.yaml"
    gptq.write_text(CPU_MATRIX.replace(
        "runs:", "runs:\n  - {name: q, model: llama-3.2-1b, setup: {method: lora, quant: gptq}}", 1))
    result = CliRunner().invoke(main, ["sweep", str(gptq), "--dry-run"])
    assert result.exit_code == 2 and "(q): --quant gptq cannot be measured" in result.output, result.output


def test_shipped_gpu_sweep_matrix_loads():
    from pathlib import Path

    from vramplan.calibration import sweep as sw

    spec = sw.load_matrix(str(Path(__file__).parents[1] / "calibration" / "gpu-sweep.yaml"))
    assert spec.device == "cuda" and len(spec.runs) >= 20
    setups = [r.setup for r in spec.runs]
    assert {"full", "lora", "qlora"} <= {s.method for s in setups}
    assert any(s.checkpointing for s in setups) and any(s.zero_stage == 3 and s.offload_params == "cpu" for s in setups)
    assert {"adamw-8bit", "paged-adamw-8bit"} <= {s.optimizer for s in setups}
    assert {"rtx-4090", "l40s", "a100-80gb"} <= {r.emulate_gpu for r in spec.runs}


# ----------------------------------------------------------------------------------------------
# records


def _record(i: int, pad: int = 0) -> dict:
    return {"vramplan_measurement": m.RECORD_VERSION, "i": i, "pad": "x" * pad}


def test_records_survive_kill_9_mid_append(tmp_path):
    path = tmp_path / "r.jsonl"
    code = textwrap.dedent(f"""
        from vramplan.calibration.measure import append_record
        i = 0
        while True:
            append_record({str(path)!r}, {{"vramplan_measurement": 1, "i": i, "pad": "x" * 2_000_000}})
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 3 * 2_000_000):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines = path.read_bytes().split(b"\n")
    complete = [json.loads(line) for line in lines[:-1]]  # every newline-terminated line parses
    assert len(complete) >= 3 and [r["i"] for r in complete] == list(range(len(complete)))
    assert len(m.read_records(path)) == len(complete)
    m.append_record(path, _record(-1))
    assert m.read_records(path)[-1]["i"] == -1


def test_torn_line_is_skipped_and_the_next_record_stays_whole(tmp_path):
    path = tmp_path / "r.jsonl"
    m.append_record(path, _record(0))
    with open(path, "ab") as fh:
        fh.write(b'{"vramplan_measurement": 1, "i": 1, "pa')  # a writer killed mid-line
    m.append_record(path, _record(2))
    assert [r["i"] for r in m.read_records(path)] == [0, 2]


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "r.jsonl"
    code = textwrap.dedent(f"""
        import sys
        from vramplan.calibration.measure import append_record
        for i in range(40):
            append_record({str(path)!r}, {{"vramplan_measurement": 1, "i": i, "w": sys.argv[1], "pad": "y" * 100_000}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, w]) for w in "ab"]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 80 and len(m.read_records(path)) == 80


def test_measurement_round_trips_and_keys_are_stable():
    setup = Setup(method="lora", seq=SEQ)
    meas = m.Measurement(model=MODEL, setup=setup, device="cpu", steps=3, estimate={"tensor_peak_bytes": 1},
                         measured={"tensor_peak_bytes": 1, "oom": False}, provenance={}, key="k")
    assert m.Measurement.from_json(json.loads(json.dumps(meas.to_json()))) == meas
    assert m.measurement_key(MODEL, setup, "cpu") == m.measurement_key(MODEL, Setup(method="lora", seq=SEQ), "cpu")
    assert m.measurement_key(MODEL, setup, "cpu") != m.measurement_key(MODEL, setup, "cuda", "rtx-4090")
    # a key is the knobs set, not every field Setup has today: a knob added later (default off)
    # leaves the keys of recorded experiments as they were
    assert m.setup_identity(setup) == {"method": "lora", "seq": SEQ}
    assert m.setup_identity(Setup()) == {}


# ----------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing run


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--emulate-gpu", "rtx-4090"], "--emulate-gpu caps a CUDA device"),
    (["--device", "cuda", "--cpu-memory-cap", "1GiB"], "--cpu-memory-cap applies to --device cpu"),
    (["--device", "cpu", "--cpu-memory-cap", "lots"], "--cpu-memory-cap"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--emulate-gpu", "no-such-gpu"], "no-such-gpu"),
    (["--device", "cpu", "--method", "lora", "--quant", "gptq"], "--quant gptq cannot be measured"),
    (["--device", "cpu", "--method", "lora", "--quant", "awq"], "needs a pre-quantized checkpoint"),
])
def test_cli_bad_options_are_one_line(args, message):
    result = CliRunner().invoke(main, ["measure", "llama-3.2-1b", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_cli_plan_file_refuses_setup_options(tmp_path):
    from vramplan.plans.planfile import save_plan

    spec = load_model("llama-3.2-1b")
    plan = Plan(model=spec.name, setup=Setup(), breakdown=estimate(spec, Setup(), load_gpu("h100-80gb")))
    path = save_plan(plan, tmp_path / "plan.json")
    result = CliRunner().invoke(main, ["measure", str(path), "--method", "lora", "--device", "cpu"])
    assert result.exit_code == 2 and "a plan file fixes its setup" in result.output


# ----------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cuda_measure_records_allocator_and_device_numbers(tmp_path):
    plan, ref, scale = _plan(tmp_path, "lora")
    meas = m.measure_plan(plan, m.MeasureOptions(device="cuda", steps=3, timeout_s=300), model_ref=ref, scale=scale)
    got = meas.measured
    assert meas.ok and not meas.oom, got.get("error")
    assert got["peak_allocated_bytes"] >= got["tensor_peak_bytes"] * 0.95
    assert got["peak_reserved_bytes"] >= got["peak_allocated_bytes"]
    assert got["active_peak_bytes"] > 0 and got["cuda_context_bytes"] > 0
    assert got["device_total_bytes"] >= got["peak_reserved_bytes"]
    assert meas.provenance["gpu_name"] and meas.provenance["cuda"]


@pytest.mark.gpu
def test_cuda_emulated_card_oom_and_fit_follow_the_estimate(tmp_path):
    """One big GPU measures smaller cards: Llama-3.2-1B full, batch 8 x 2048 with checkpointing
    (estimated about 34 GiB) is an OOM on an emulated RTX 4090 and fits an emulated A100 80GB."""
    setup = Setup(batch=8, seq=2048, checkpointing=True)
    spec = load_model("llama-3.2-1b")
    plan = Plan(model=spec.name, setup=setup, breakdown=estimate(spec, setup))
    small = m.measure_plan(plan, m.MeasureOptions(device="cuda", steps=2, emulate_gpu=load_gpu("rtx-4090"),
                                                  timeout_s=300))
    assert small.ok and small.oom and small.measured["oom_phase"] in ("forward", "backward", "optimizer")
    big = m.measure_plan(plan, m.MeasureOptions(device="cuda", steps=2, emulate_gpu=load_gpu("a100-80gb"),
                                                timeout_s=300))
    assert big.ok and not big.oom
    assert big.measured["peak_reserved_bytes"] <= big.measured["memory_fraction"] * big.measured["gpu_total_bytes"]
