"""Sweeps: a matrix of measurements, the most informative first, within a time budget.

A matrix is YAML (``calibration/gpu-sweep.yaml`` is the shipped one)::

    device: cuda            # or cpu
    steps: 3
    timeout: 120            # seconds per run
    defaults: {seq: 1024}   # setup keys every run starts from
    runs:
      - {name: llama1b-lora, model: llama-3.2-1b, setup: {method: lora}}
      - {name: llama8b-qlora-4090, model: llama-3.1-8b, setup: {method: qlora}, emulate_gpu: rtx-4090}
      - {name: tiny-zero2, model: llama-3.2-1b, scale_down: true, setup: {zero_stage: 2}}

Order (:func:`order`): greedily, the run that adds the most setup features not yet covered
(method, quantization, optimizer, checkpointing, ZeRO stage and offload, emulated card, model,
shape) per unit of its expected cost (:attr:`Run.cost`), ties broken by the smaller estimated
memory; runs estimated within 10 % of an emulated card's limit get a bonus, since they test the
fit verdict itself. Runs whose key is
already in the records directory are skipped, so a sweep cut short by its budget resumes where
it stopped. No torch here: each run is :func:`vramplan.calibration.measure.measure_plan` (a fresh process).

Time (:func:`predict_seconds`, shown by ``vramplan sweep --dry-run``): each run is a fresh
interpreter that imports torch and transformers, builds the model's random weights on the CPU,
and runs ``steps`` steps; the steps come from the cost model (:func:`vramplan.cost.model.step_cost`) on
the machine's GPU, the rest from the constants below (leads for an H200 host with 16 cores, to
be replaced by the ``seconds`` the first GPU sweep records).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import Any

from ..specs import Setup, SpecError
from ..util.fileio import TempDir
from .measure import check_measurable

#: Seconds the first run of a sweep needs at least (imports, model, a few steps).
MIN_RUN_S = 10.0

# What a run costs besides its steps (seconds), for :func:`predict_seconds`.
#: A fresh interpreter: imports of torch, transformers, accelerate, peft (and bitsandbytes), CUDA's
#: context, the Trainer and its data; plus the parent's emit, nvidia-smi and record.
PROCESS_START_S = 8.0
#: DeepSpeed: its import, the process group, the engine and ZeRO's buffers.
DEEPSPEED_START_S = 6.0
#: Random weights built on the CPU (``from_config``, bf16), per billion parameters.
BUILD_S_PER_BPARAM = 8.0
#: QLoRA: a second random build, ``save_pretrained`` and the quantizing load, per billion parameters.
QUANT_S_PER_BPARAM = 12.0
#: DeepSpeed's CPU Adam is compiled on first use (ZeRO-Offload); calibration/gpu_sweep.sh builds it
#: in the background while the first runs go, so a sweep pays it at most once.
CPU_ADAM_BUILD_S = 60.0
#: The first step: cuBLAS handles, lazily loaded kernels, the allocator's first segments.
FIRST_STEP_S = 2.0
#: The counted steps run under the live-tensor counter (a Python dispatch mode): this much slower.
COUNTED_STEP_FACTOR = 2.0
#: CPU runs (``device: cpu``, scaled down): matmul FLOP/s of a two-core machine.
CPU_FLOPS = 2e10

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?\s*$", re.IGNORECASE)
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(sec|min|s|m|h)", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """``"90s"``, ``"8m"``, ``"1.5h"``, ``"6m30s"`` or a number of seconds -> seconds."""
    m = _DURATION.match(str(text))
    if m:
        unit = (m.group(2) or "s").lower()[0]
        return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[unit]
    compact = re.sub(r"\s+", "", str(text))
    parts = _DURATION_PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts).lower() != compact.lower():
        raise SpecError(f"--budget: cannot read {text!r}; write e.g. 90s, 8m, 6m30s or 1h")
    return sum(float(n) * {"s": 1, "m": 60, "h": 3600}[u.lower()[0]] for n, u in parts)


@dataclass(frozen=True)
class Run:
    name: str
    model: str
    setup: Setup
    emulate_gpu: str | None = None
    scale_down: bool = False
    estimate_bytes: int = 0
    near_limit: bool = False
    params: int = 0
    score: float = 0.0
    predicted_s: float = 0.0

    @property
    def cost(self) -> float:
        """Expected seconds (:func:`predict_seconds`); relative ones for a Run made without."""
        if self.predicted_s > 0:
            return self.predicted_s
        s = self.setup
        return (1.0 + self.params / 1e9 + (1.0 if s.quant != "none" else 0.0)
                + (2.0 if "cpu" in (s.offload_optimizer, s.offload_params) else 0.0))

    def features(self) -> set[str]:
        s = self.setup
        return {f"method={s.method}", f"quant={s.quant}", f"optimizer={s.optimizer}",
                f"checkpointing={s.checkpointing}", f"zero={s.zero_stage}", f"offload={s.offload_optimizer}",
                f"offload_params={s.offload_params}", f"card={self.emulate_gpu}", f"model={self.model}",
                f"batch={s.batch}", f"seq={s.seq}", f"precision={s.precision}", f"gpus={s.gpus}"}

    def key(self, spec: Matrix) -> str:
        from .measure import DEFAULT_SCALE, measurement_key

        return measurement_key(self.model, self.setup, spec.device, self.emulate_gpu,
                               dict(DEFAULT_SCALE) if self.scale_down else None, spec.hardware)


@dataclass(frozen=True)
class Matrix:
    device: str
    steps: int
    timeout_s: float
    runs: tuple[Run, ...]
    hardware: str = ""  # what the records key on: the GPU's name (nvidia-smi) or "cpu"
    path: str = ""


def predict_seconds(model, setup: Setup, device: str, steps: int, gpu=None) -> float:
    """Wall seconds of one sweep run of ``model`` (a ModelSpec) with ``setup``: process start,
    the weights built on the CPU, QLoRA's reload, DeepSpeed's start (CPU Adam's build is
    :func:`predicted_schedule`'s), and ``steps`` steps from the cost
    model on ``gpu`` (the real card: emulation only caps memory), the counted ones slowed by the
    live-tensor counter. ``device="cpu"``: the steps at :data:`CPU_FLOPS`."""
    from ..cost.model import step_cost, train_flops_per_token

    n = model.params_total
    seconds = PROCESS_START_S + BUILD_S_PER_BPARAM * n / 1e9
    if setup.quant != "none":
        seconds += QUANT_S_PER_BPARAM * n / 1e9
    if setup.zero_stage:
        seconds += DEEPSPEED_START_S
    counted = min(2, steps)
    step_weight = counted * COUNTED_STEP_FACTOR + (steps - counted)
    if device == "cpu":
        tokens = setup.batch * setup.seq * setup.grad_accum
        return seconds + step_weight * tokens * train_flops_per_token(model, setup) / CPU_FLOPS
    return seconds + FIRST_STEP_S + step_weight * step_cost(model, setup, gpu).step_s


def load_matrix(path: str, device: str | None = None) -> Matrix:
    """Read and check a matrix file; every run's setup is validated and estimated (no torch)."""
    from ..estimator import estimate
    from ..model.profiles import load_gpu, load_model
    from ..setup.inputs import loads_yaml, read_text
    from .measure import cuda_hardware

    data = loads_yaml(read_text(path, "matrix file"), str(path))
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise SpecError(f"{path}: a matrix is a mapping with a non-empty 'runs' list")
    device = device or data.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise SpecError(f"{path}: device must be cuda or cpu; got {device!r}")
    defaults = data.get("defaults") or {}
    steps = int(data.get("steps", 3))
    hardware = "cpu" if device == "cpu" else cuda_hardware()
    card = _card(hardware) if device == "cuda" else None
    runs, names = [], set()
    for i, entry in enumerate(data["runs"]):
        where = f"{path}: runs[{i}]"
        if not isinstance(entry, dict) or "model" not in entry:
            raise SpecError(f"{where} needs a 'model'")
        name = str(entry.get("name") or f"run{i}")
        if name in names:
            raise SpecError(f"{where}: duplicate name {name!r}")
        names.add(name)
        try:
            setup = Setup.from_dict({**defaults, **(entry.get("setup") or {})})
            check_measurable(setup)
        except (SpecError, TypeError) as exc:
            raise SpecError(f"{where} ({name}): {exc}") from None
        emulate = entry.get("emulate_gpu")
        gpu = load_gpu(emulate) if emulate else None
        if emulate and device != "cuda":
            raise SpecError(f"{where} ({name}): emulate_gpu needs device cuda")
        spec = load_model(entry["model"])
        bd = estimate(spec, setup, gpu)
        near = gpu is not None and abs(bd.device_total_bytes / gpu.usable_memory_bytes - 1) < 0.10
        scale_down = bool(entry.get("scale_down", False))
        timed = _scaled_spec(str(entry["model"])) if scale_down else spec
        oom = gpu is not None and bd.device_total_bytes > 1.10 * gpu.usable_memory_bytes  # stops at step 1
        runs.append(Run(name=name, model=str(entry["model"]), setup=setup, emulate_gpu=emulate,
                        scale_down=scale_down, estimate_bytes=bd.device_total_bytes,
                        near_limit=near, params=0 if scale_down else spec.params_total,
                        predicted_s=predict_seconds(timed, setup, device, 1 if oom else steps, card)))
    return Matrix(device=device, steps=steps, timeout_s=float(data.get("timeout", 600)),
                  runs=tuple(runs), hardware=hardware, path=str(path))


def _card(hardware: str):
    """The GpuSpec of the machine's GPU (nvidia-smi's name), else an H200 (what the shipped
    matrix is sized for)."""
    from ..model.profiles import load_gpu

    try:
        return load_gpu(hardware or "h200")
    except SpecError:
        return load_gpu("h200")


def _scaled_spec(model: str):
    """The ModelSpec of ``model`` scaled down as ``scale_down`` runs are."""
    from ..model.profiles import load_model
    from .measure import DEFAULT_SCALE, scaled_model_path

    with TempDir("scaled") as tmp:  # pid-named: one a kill -9 left is removed by the next run
        return load_model(scaled_model_path(model, dict(DEFAULT_SCALE), tmp))


def predicted_schedule(runs: list[Run] | tuple[Run, ...], budget_s: float | None = None) -> list[dict[str, Any]]:
    """Per run in order: its predicted seconds, the cumulative seconds, and whether it ends
    within ``budget_s``. DeepSpeed's CPU Adam build is taken to start with the sweep, in the
    background (calibration/gpu_sweep.sh does that): the first offload run waits for what is
    left of :data:`CPU_ADAM_BUILD_S`. A run estimated past its emulated card by more than 10 %
    is taken to stop at its first step (out of memory)."""
    out, total, compiled = [], 0.0, False
    for run in runs:
        seconds = run.predicted_s
        offload = run.setup.zero_stage and "cpu" in (run.setup.offload_optimizer, run.setup.offload_params)
        if offload and not compiled:
            seconds += max(0.0, CPU_ADAM_BUILD_S - total)
            compiled = True
        total += seconds
        out.append({"name": run.name, "predicted_s": round(seconds, 1), "cumulative_s": round(total, 1),
                    "within_budget": budget_s is None or total <= budget_s})
    return out


def order(runs: tuple[Run, ...] | list[Run]) -> list[Run]:
    """Most informative first (see the module docstring); each run carries its ``score``."""
    left = list(runs)
    covered: set[str] = set()
    out = []
    while left:
        def value(r: Run, covered: set[str] = covered) -> tuple[float, int]:
            return ((len(r.features() - covered) + (2 if r.near_limit else 0)) / r.cost, -r.estimate_bytes)

        best = max(left, key=value)
        left.remove(best)
        out.append(replace(best, score=float(value(best)[0])))
        covered |= best.features()
    return out


def recorded_keys(records_dir: str) -> set[str]:
    from .measure import read_records

    return {r.get("key") for r in read_records(records_dir) if not (r.get("measured") or {}).get("failed")}


def run_sweep(spec: Matrix, runs: list[Run], budget_s: float, records_dir: str,
              progress: bool = True) -> dict[str, Any]:
    """Measure ``runs`` in order until the budget would be passed; append each record. A run
    starts only if the time left covers what it is expected to take (:func:`_expected_s`:
    :data:`MIN_RUN_S` before any run ended), and its timeout never reaches past the budget."""
    from ..estimator import estimate
    from ..model.profiles import load_gpu, load_model
    from ..specs import Plan
    from . import measure as m

    t0 = time.monotonic()
    summary: dict[str, Any] = {"measured": 0, "oom": 0, "failed": 0, "left": 0, "runs": []}
    slowest, ratios = 0.0, []  # of the runs that did not fail: a timeout says little of the next run
    bar = _Progress(len(runs), enabled=progress)
    with bar:
        for i, run in enumerate(runs):
            left_s = budget_s - (time.monotonic() - t0)
            if left_s < _expected_s(run, slowest, ratios):
                summary["left"] = len(runs) - i
                break
            bar.describe(run.name)
            gpu = load_gpu(run.emulate_gpu) if run.emulate_gpu else None
            options = m.MeasureOptions(device=spec.device, steps=spec.steps, emulate_gpu=gpu,
                                       timeout_s=max(1.0, min(spec.timeout_s, left_s)))
            started = time.monotonic()
            with TempDir("sweep") as tmp:
                model = m.scaled_model_path(run.model, dict(m.DEFAULT_SCALE), tmp) if run.scale_down else run.model
                plan = Plan(model=model, setup=run.setup, breakdown=estimate(load_model(model), run.setup, gpu),
                            gpu=gpu)
                result = m.measure_plan(plan, options, model_ref=run.model,
                                        scale=dict(m.DEFAULT_SCALE) if run.scale_down else None)
            m.save(result, records_dir)
            got = result.measured
            if not got.get("failed"):
                slowest = max(slowest, time.monotonic() - started)
                if run.predicted_s > 0:
                    ratios.append((time.monotonic() - started) / run.predicted_s)
            summary["measured"] += 1
            summary["oom"] += bool(got.get("oom"))
            summary["failed"] += bool(got.get("failed"))
            summary["runs"].append({"name": run.name, "oom": bool(got.get("oom")), "failed": bool(got.get("failed")),
                                    "seconds": round(time.monotonic() - started, 1),
                                    "comparison": m.comparison(result)})
            bar.advance()
    summary["seconds"] = time.monotonic() - t0
    return summary


def _expected_s(run: Run, slowest: float, ratios: list[float]) -> float:
    """Seconds ``run`` is expected to take: its prediction times the median measured/predicted
    ratio of the runs so far, with a 25 % margin (the slowest run so far without predictions;
    :data:`MIN_RUN_S` at least)."""
    if ratios and run.predicted_s > 0:
        median = sorted(ratios)[len(ratios) // 2]
        return max(MIN_RUN_S, 1.25 * median * run.predicted_s)
    return max(MIN_RUN_S, slowest)


class _Progress:
    """A rich progress bar on stderr (nothing when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self._bar, self._task = total, enabled, None, None

    def __enter__(self) -> _Progress:  # noqa: PYI034 - Self needs Python 3.11
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True))
            self._bar.__enter__()
            self._task = self._bar.add_task("sweep", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
