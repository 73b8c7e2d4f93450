"""Measurements: run a plan's emitted files for real, record what the memory was, with provenance.

:func:`measure_plan` writes the plan's files with :func:`vramplan.emit.emit_to_dir` into a
temporary directory and runs that ``train.py`` in a fresh process
(:mod:`vramplan.run.launch` starts :mod:`vramplan.run.worker`): the code path a user launches, not
an imitation. The result is a :class:`Measurement`: the Setup, the estimate made for it (the
analytic Breakdown with the published corrections, the input calibration fits against), the
measured numbers, and provenance.

Records: one JSON object per line in ``calibration/measurements/*.jsonl``. :func:`append_record`
writes a line with one ``write`` on an ``O_APPEND`` descriptor under an exclusive ``flock``, so
concurrent writers never interleave, and a writer killed mid-line (kill -9) leaves at worst a torn
last line: the next writer starts on a fresh line and :func:`read_records` skips what does not
parse. No torch is imported here.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..specs import GpuSpec, Plan, Setup, SpecError
from ..util.numbers import check_numbers
from ..util.versions import library_versions

#: Default directory of measurement records (relative to the working directory).
RECORDS_DIR = Path("calibration") / "measurements"

#: Record format version.
RECORD_VERSION = 1

#: Scale-down of a shipped model for CPU runs (:func:`vramplan.model.modelspec.shrink_config`).
DEFAULT_SCALE = {"layers": 2, "hidden": 256, "heads": 8, "vocab": 4096}


@dataclass(frozen=True)
class Measurement:
    """One real run of a Setup: the estimate made for it and what was measured.

    ``measured`` holds at least ``tensor_peak_bytes`` (live tensor bytes, as the tracer counts),
    ``oom`` and, on CUDA, ``peak_allocated_bytes``, ``peak_reserved_bytes``, ``active_peak_bytes``,
    ``device_total_bytes`` (device memory this process used, as nvidia-smi shows it) and
    ``cuda_context_bytes``; failed runs carry ``failed``/``timeout`` and the phase they were in.
    """

    model: str
    setup: Setup
    device: str
    steps: int
    estimate: dict
    measured: dict
    provenance: dict
    emulate_gpu: str | None = None
    scale: dict | None = None
    plan_estimate: dict | None = None
    key: str = ""

    @property
    def oom(self) -> bool:
        return bool(self.measured.get("oom"))

    @property
    def ok(self) -> bool:
        """A complete run (an OOM is a complete result; a crash or a timeout is not)."""
        return not self.measured.get("failed")

    def to_json(self) -> dict:
        return {
            "vramplan_measurement": RECORD_VERSION,
            "key": self.key,
            "model": self.model,
            "scale": self.scale,
            "setup": self.setup.to_dict(),
            "device": self.device,
            "steps": self.steps,
            "emulate_gpu": self.emulate_gpu,
            "estimate": self.estimate,
            "plan_estimate": self.plan_estimate,
            "measured": self.measured,
            "provenance": self.provenance,
        }

    @classmethod
    def from_json(cls, data: dict) -> Measurement:
        return cls(model=data["model"], setup=Setup.from_dict(data["setup"]), device=data["device"],
                   steps=int(data["steps"]), estimate=data["estimate"], measured=data["measured"],
                   provenance=data.get("provenance") or {}, emulate_gpu=data.get("emulate_gpu"),
                   scale=data.get("scale"), plan_estimate=data.get("plan_estimate"), key=data.get("key", ""))


# ----------------------------------------------------------------------------------------------
# identity and provenance


def setup_identity(setup: Setup) -> dict:
    """The fields of ``setup`` that differ from Setup's defaults: a key built from them stays the
    same when a later version adds a knob (which defaults off), so a sweep does not re-run what it
    has recorded."""
    defaults = Setup().to_dict()
    return {k: v for k, v in setup.to_dict().items() if k not in defaults or v != defaults[k]}


def measurement_key(model: str, setup: Setup, device: str, emulate_gpu: str | None = None,
                    scale: dict | None = None, hardware: str = "") -> str:
    """What makes two measurements the same experiment (the sweep skips recorded keys)."""
    ident = {"model": model, "setup": setup_identity(setup), "device": device, "emulate_gpu": emulate_gpu,
             "scale": scale, "hardware": hardware}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def vramplan_commit() -> str | None:
    """``git describe --always --dirty`` of the checkout vramplan runs from (None outside git);
    ``$VRAMPLAN_COMMIT`` when set (a copy of the tree without its .git, as a device call sends)."""
    if os.environ.get("VRAMPLAN_COMMIT"):
        return os.environ["VRAMPLAN_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cuda_hardware() -> str:
    """The first GPU's name from nvidia-smi (no torch), '' when there is none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""


def provenance(measured: dict | None = None) -> dict:
    """Where a number came from: library versions, allocator settings, date, vramplan commit,
    and (from the worker) the GPU name, driver and CUDA version."""
    from .. import __version__

    measured = measured or {}
    prov = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "vramplan_version": __version__,
        "vramplan_commit": vramplan_commit(),
        "versions": library_versions(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "python": ".".join(map(str, __import__("sys").version_info[:3])),
        "host": os.uname().nodename,
    }
    for key in ("gpu_name", "driver", "cuda", "compute_capability", "gpu_total_bytes", "memory_source"):
        if measured.get(key) is not None:
            prov[key] = measured[key]
    return prov


# ----------------------------------------------------------------------------------------------
# models scaled down for CPU runs


def scaled_model_path(model: str, scale: dict, workdir: str | os.PathLike) -> str:
    """Write ``model``'s config scaled down (:func:`vramplan.model.modelspec.shrink_config`) as
    ``workdir/config.json``; return its path (a model reference ``load_model`` resolves)."""
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model

    spec = load_model(model)
    unknown = set(scale) - set(DEFAULT_SCALE)
    if unknown:
        raise SpecError(f"unknown scale key {min(unknown)!r}; use {', '.join(DEFAULT_SCALE)}")
    path = Path(workdir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(shrink_config(spec.config, **scale), indent=2))
    return str(path)


# ----------------------------------------------------------------------------------------------
# running


@dataclass(frozen=True)
class MeasureOptions:
    """How to run a measurement (not part of what is measured, except the emulated card)."""

    device: str = "cuda"
    steps: int = 3
    emulate_gpu: GpuSpec | None = None
    timeout_s: float = 600.0
    cpu_memory_cap_bytes: int | None = None
    keep_dir: str | None = None  # keep the emitted files and worker logs here

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise SpecError(f"--device must be cuda or cpu; got {self.device!r}")
        if self.steps < 1:
            raise SpecError(f"--steps must be at least 1; got {self.steps}")
        if not self.timeout_s > 0:
            raise SpecError(f"--timeout must be positive; got {self.timeout_s}")
        if self.emulate_gpu is not None and self.device != "cuda":
            raise SpecError("--emulate-gpu caps a CUDA device; on CPU use --cpu-memory-cap")
        if self.cpu_memory_cap_bytes is not None and self.device != "cpu":
            raise SpecError("--cpu-memory-cap applies to --device cpu; on CUDA use --emulate-gpu")


def _estimate_json(plan: Plan, gpu: GpuSpec | None, device: str = "cuda") -> dict:
    """The analytic estimate for the plan's setup on ``gpu`` with the published corrections, for
    the code path the run takes on ``device`` (TRL's fused head folds fp32 tiles in torch off CUDA:
    ``Stack.trl_triton``)."""
    from ..estimator import estimate
    from ..estimator.corrections import DEFAULT_CORRECTIONS
    from ..estimator.stack import Stack
    from ..model.profiles import load_model

    return estimate(load_model(plan.model), plan.setup, gpu, DEFAULT_CORRECTIONS,
                    stack=Stack(trl_triton=device == "cuda")).to_json()


def check_measurable(setup) -> None:
    """Raise SpecError for a setup a measurement cannot build: runs start from random weights made
    from the config, and a GPTQ/AWQ base only exists as a pre-quantized checkpoint (loaded by
    gptqmodel's kernels), so those plans are estimate-only."""
    if setup.quant in ("gptq", "awq"):
        raise SpecError(f"--quant {setup.quant} cannot be measured: runs build random weights from the config, and a "
                        f"{setup.quant.upper()} base needs a pre-quantized checkpoint; run the emitted train.py "
                        "with --model instead")
    if setup.pp > 1:  # the emitted train.py runs no pipeline schedule (emit refuses it): estimate-only
        raise SpecError(f"--pp {setup.pp} cannot be measured yet: the emitted train.py runs no pipeline schedule; "
                        "`vramplan validate --knob pp` runs torch.distributed.pipelining on CPU ranks")
    if setup.ep > 1:  # the emitted train.py loads no ep_size (emit refuses it): estimate-only
        raise SpecError(f"--ep {setup.ep} cannot be measured yet: the emitted train.py does not load with "
                        "DistributedConfig(ep_size); `vramplan validate --knob ep` runs transformers' ep_plan on "
                        "CPU ranks")


def prepare(plan: Plan, options: MeasureOptions, workdir: str | os.PathLike) -> dict:
    """Emit the plan's files into ``workdir/emitted`` and return the worker request for them."""
    from ..emit import emit_to_dir

    check_measurable(plan.setup)

    emitted = Path(workdir) / "emitted"
    emit_to_dir(plan, emitted, ("trainer",), force=True)
    s = plan.setup
    return {
        "dir": str(emitted),
        "device": options.device,
        "steps": options.steps,
        "tokens_per_step": s.batch * s.seq * s.grad_accum,
        "emulate_bytes": options.emulate_gpu.usable_memory_bytes if options.emulate_gpu else None,
        "cpu_memory_cap_bytes": options.cpu_memory_cap_bytes,
        "world_size": s.gpus,
    }


def to_measurement(plan: Plan, options: MeasureOptions, result: dict, model_ref: str, scale: dict | None,
                   hardware: str) -> Measurement:
    """A worker's result as a Measurement: the estimate for the same setup (on the emulated
    card, else the plan's GPU, else the GPU the run used), provenance, key."""
    gpu = options.emulate_gpu or plan.gpu or _gpu_named(result.get("gpu_name"))
    measured = dict(result)
    measured.setdefault("tensor_peak_bytes", None)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        measured.setdefault(key, None)
    measured["device_total_bytes"] = measured.get("device_used_bytes")
    emulate = options.emulate_gpu.name if options.emulate_gpu else None
    return Measurement(
        model=model_ref, setup=plan.setup, device=options.device, steps=options.steps,
        estimate=_estimate_json(plan, gpu, options.device), measured=measured, provenance=provenance(measured),
        emulate_gpu=emulate, scale=scale, plan_estimate=plan.recorded_estimate,
        key=measurement_key(model_ref, plan.setup, options.device, emulate, scale, hardware))


def _gpu_named(name: str | None) -> GpuSpec | None:
    """The shipped GpuSpec of a CUDA device name ("NVIDIA H200" -> h200), None if unknown."""
    from ..model.profiles import load_gpu

    if not name:
        return None
    try:
        return load_gpu(name)
    except SpecError:
        return None


def _workdir(options: MeasureOptions) -> tuple[Path, bool]:
    """Where the emitted files and worker logs go, and whether to delete it afterwards."""
    if options.keep_dir:
        path = Path(options.keep_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path, False
    from ..util.fileio import make_temp_dir

    return make_temp_dir("measure"), True


def measure_plan(plan: Plan, options: MeasureOptions, *, model_ref: str | None = None,
                 scale: dict | None = None) -> Measurement:
    """Run ``plan`` for real in fresh processes (one per GPU of the plan) and measure it.

    ``model_ref``/``scale`` name the model in the record when the plan's model is a scaled-down
    copy of a shipped one. OOM, timeouts and crashes come back as a Measurement, never raised.
    """
    from ..run.launch import run_one

    workdir, temporary = _workdir(options)
    try:
        request = prepare(plan, options, workdir)
        result = run_one(request, workdir / "run", options.timeout_s)
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
    hardware = cuda_hardware() if options.device == "cuda" else "cpu"
    return to_measurement(plan, options, result, model_ref or plan.model, scale, hardware)


def measure_plans(plans: list[tuple[Plan, str, dict | None]], options: MeasureOptions) -> list[Measurement]:
    """Several CPU plans with one import of torch (:func:`vramplan.run.launch.run_many`): each
    still runs in fresh (forked) processes, one per GPU of the plan. ``plans`` holds
    (plan, model_ref, scale); CUDA plans run one by one through :func:`measure_plan`."""
    from ..run.launch import run_many

    if options.device != "cpu":
        return [measure_plan(p, options, model_ref=ref, scale=sc) for p, ref, sc in plans]
    workdir, temporary = _workdir(options)
    try:
        requests = [prepare(p, options, workdir / f"plan{i}") for i, (p, _, _) in enumerate(plans)]
        results = run_many(requests, workdir / "runs", options.timeout_s)
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
    return [to_measurement(p, options, r, ref, sc, "cpu") for (p, ref, sc), r in zip(plans, results, strict=True)]


# ----------------------------------------------------------------------------------------------
# records


def append_record(path: str | os.PathLike, record: dict) -> Path:
    """Append ``record`` as one JSON line: one write on an O_APPEND descriptor under an exclusive
    flock (concurrent writers never interleave), then fsync. A line left torn by a writer killed
    mid-write is closed with a newline first, so this record stays whole."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and _last_byte(target, size) != b"\n":
            line = b"\n" + line
        view = memoryview(line)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
    return target


def _last_byte(path: Path, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(size - 1)
        return fh.read(1)


def record_files(where: str | os.PathLike) -> list[Path]:
    """The .jsonl files of a records directory (or the one file named)."""
    p = Path(where)
    if p.is_dir():
        return sorted(p.glob("*.jsonl"))
    return [p] if p.is_file() else []


def read_records(where: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict]:
    """Every complete record in a .jsonl file, a directory of them, or several; lines that do
    not parse (a writer killed mid-line) are skipped."""
    paths = [where] if isinstance(where, (str, os.PathLike)) else list(where)
    out = []
    for item in paths:
        for path in record_files(item):
            with open(path, "rb") as fh:
                for line, raw in enumerate(fh, 1):
                    try:
                        data = json.loads(raw)
                    except (ValueError, RecursionError):
                        continue
                    check_numbers(data, f"{path}:{line}")
                    if isinstance(data, dict) and data.get("vramplan_measurement") == RECORD_VERSION:
                        out.append(data)
    return out


def records_path(directory: str | os.PathLike, device: str, hardware: str = "") -> Path:
    """``DIR/<hardware>.jsonl``: one file per kind of machine (cpu, nvidia-h200, ...)."""
    name = (hardware or device).lower()
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-") or device
    while "--" in slug:
        slug = slug.replace("--", "-")
    return Path(directory) / f"{slug}.jsonl"


def save(measurement: Measurement, directory: str | os.PathLike = RECORDS_DIR) -> Path:
    """Append ``measurement`` to its records file in ``directory``; return the file."""
    hardware = measurement.provenance.get("gpu_name") or measurement.device
    return append_record(records_path(directory, measurement.device, hardware), measurement.to_json())


def cpu_comparable(setup: Setup) -> str | None:
    """Why a CPU run's live-tensor peak cannot be compared with the estimate's device peak, or
    None when it can. Offloaded optimizer states and parameters live in the same CPU memory as
    the "device" tensors, and a live-tensor count cannot tell them apart (the distributed truth,
    ``vramplan validate --knob zero``, splits them by owner)."""
    if setup.offload_optimizer != "none" or setup.offload_params != "none":
        return ("offloaded state shares the CPU's memory with the device tensors, so this run has no device/host "
                "split: `vramplan validate --knob zero` (or --knob fsdp) checks offload per rank")
    return None


def comparison(m: Measurement) -> dict[str, dict[str, Any]]:
    """Estimate vs measured per headline quantity: bytes and relative error (estimate/measured - 1).

    On the CPU, bitsandbytes' paged optimizer states are ordinary tensors (on CUDA they are
    managed memory outside torch's counters), so a CPU run's tensor peak is compared with the
    estimate's plus its ``paged_optimizer_states``; a CPU run with offload is not compared
    (:func:`cpu_comparable`)."""
    out = {}
    for key in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        est, got = m.estimate.get(key), m.measured.get(key)
        if est is None or not got:
            continue
        if m.device == "cpu" and key == "tensor_peak_bytes":
            if cpu_comparable(m.setup) is not None:
                continue
            est += sum(c["bytes"] for c in m.estimate.get("components", ()) if c["name"] == "paged_optimizer_states")
        out[key] = {"estimate": est, "measured": got, "error": est / got - 1}
    return out


__all__ = [
    "MeasureOptions",
    "Measurement",
    "append_record",
    "comparison",
    "cpu_comparable",
    "measure_plan",
    "measure_plans",
    "measurement_key",
    "prepare",
    "provenance",
    "read_records",
    "records_path",
    "save",
    "scaled_model_path",
    "to_measurement",
]
