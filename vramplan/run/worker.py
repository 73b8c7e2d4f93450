"""One measurement, in its own process: the emitted train.py, run in-process with a measuring callback.

    python -m vramplan.run.worker REQUEST.json

The parent (:mod:`vramplan.run.launch`, which never imports torch) writes REQUEST.json and reads
the result file this process writes (atomically) when it ends; a status file says which step and
phase it is in, so that a run killed at the timeout still tells where it was.

The run is the plan's own code path: the directory ``vramplan emit`` wrote is imported
(``train.py``'s ``parse_args`` and ``build_trainer``, as its ``main`` does) and trained for
``steps`` optimizer steps on its synthetic tokens, with :class:`Measure` added to the Trainer's
callbacks. What is measured:

- ``tensor_peak_bytes``: live tensor storage bytes, counted by
  :class:`vramplan.run.live.LiveTensorCounter` as the tracer counts fake ones, over the first
  ``counted_steps`` steps (two: the first allocates the optimizer state). Every tensor alive when
  training starts is registered first (the model, quantization state, and whatever DeepSpeed or
  the Trainer hold: found by a scan of the garbage collector's objects). On CUDA the counter
  watches CUDA storages; later steps run without it and time the step.
- CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and the active peak
  (``memory_stats()["active_bytes.all.peak"]``), per phase and overall; the device memory this
  process uses (NVML via nvidia-ml-py when importable, else ``torch.cuda.mem_get_info``), sampled
  at every phase change; the CUDA context (device memory used right after CUDA initialises,
  before the model exists).
- CPU: the peak resident set size (``getrusage``).
- step time and tokens/s from the steps after the counted ones (or the counted ones, flagged).

CPU runs take the code path a CUDA run takes where the two differ in memory, as the tracer does:
SDPA runs the stand-in for CUDA's fused kernels (:func:`vramplan.run.cpu_truth.cuda_kernels`; the
CPU math kernel would keep s^2 scores) and torch optimizers use their ``foreach`` kernels (torch's
default on CUDA, not on CPU).

Out of memory is a result: ``torch.OutOfMemoryError`` (or, on CPU, live tensor bytes passing
``cpu_memory_cap_bytes``: the CPU emulation of a card of that size) ends the run with
``oom: true`` and the phase it happened in. ``emulate_bytes`` caps the CUDA caching allocator with
``torch.cuda.set_per_process_memory_fraction`` so that one big GPU measures smaller cards.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import resource
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_text
from . import release_deepspeed_shm
from .live import LiveTensorCounter

#: Steps whose live tensors are counted (the canonical step's peak is over two steps).
COUNTED_STEPS = 2


class CpuMemoryCapExceeded(MemoryError):
    """Live tensor bytes passed the CPU cap: the CPU emulation of CUDA's out-of-memory error."""


class CappedCounter(LiveTensorCounter):
    """A :class:`LiveTensorCounter` that raises :class:`CpuMemoryCapExceeded` when the live bytes
    pass ``cap_bytes`` (None: no cap), as the CUDA allocator raises when a card is full."""

    def __init__(self, device: str | None, cap_bytes: int | None = None) -> None:
        super().__init__(device)
        self.cap_bytes = cap_bytes

    def _observe(self) -> None:
        super()._observe()
        if self.cap_bytes is not None and self.current_bytes > self.cap_bytes:
            raise CpuMemoryCapExceeded(
                f"live tensors {self.current_bytes} bytes > cap {self.cap_bytes} bytes in {self._phase or 'setup'}")


# ----------------------------------------------------------------------------------------------
# device memory (CUDA)


def nvml_device_ref(index: int, environ: Mapping[str, str] | None = None) -> tuple[str, int | str]:
    """How NVML names CUDA device ``index`` of this process: ``("index", n)`` or ``("uuid", "GPU-...")``.

    CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` lists, in that order; NVML sees every
    device of the machine. (CUDA's default order is fastest first; NVML's, PCI bus order: the
    same for the identical GPUs of one machine.)"""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return ("index", index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"CUDA device {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[index]
    if entry.isdigit():
        return ("index", int(entry))
    return ("uuid", entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}")


class DeviceMemory:
    """Device memory this process uses, as nvidia-smi shows it (NVML), or device-wide used bytes
    from ``cudaMemGetInfo`` when nvidia-ml-py is not installed or NVML does not answer.

    ``nvml``: the pynvml module to use (default: import it; None: do without)."""

    _IMPORT = object()

    def __init__(self, index: int, nvml: Any = _IMPORT, environ: Mapping[str, str] | None = None) -> None:
        self.index = index
        self.baseline_bytes = 0  # used by others before this process initialised CUDA (NVML only)
        self.source = "cudaMemGetInfo"
        self.error: str | None = None
        self._nvml = None
        self._handle = None
        try:
            if nvml is DeviceMemory._IMPORT:
                import pynvml as nvml
            if nvml is None:
                raise ImportError("nvidia-ml-py not used")
            nvml.nvmlInit()
            kind, ref = nvml_device_ref(index, environ)
            self._handle = (nvml.nvmlDeviceGetHandleByIndex(ref) if kind == "index"
                            else nvml.nvmlDeviceGetHandleByUUID(ref))
            nvml.nvmlDeviceGetMemoryInfo(self._handle)  # answers, or we fall back now
            self._nvml = nvml
            self.source = "nvml"
        except Exception as exc:  # noqa: BLE001 - no nvidia-ml-py, no NVML library, no permission
            self._nvml = None
            self.error = f"{type(exc).__name__}: {exc}"[:200]

    def used_bytes(self) -> int | None:
        """Bytes used on the device (NVML) or None before CUDA is initialised without NVML."""
        if self._nvml is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        import torch

        if not torch.cuda.is_initialized():
            return None
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def settled_used_bytes(self, tries: int = 20, interval_s: float = 0.05) -> int | None:
        """:meth:`used_bytes` once two reads in a row agree (a process that just ended may
        still be giving its memory back), at most ``tries`` reads."""
        last = self.used_bytes()
        for _ in range(tries):
            time.sleep(interval_s)
            now = self.used_bytes()
            if now == last:
                break
            last = now
        return last

    def process_bytes(self, pid: int | None = None) -> int | None:
        """What nvidia-smi lists for process ``pid`` (default: this one) on the device; None
        without NVML, when the process is not listed (another PID namespace) or the driver
        does not say."""
        if self._nvml is None:
            return None
        pid = os.getpid() if pid is None else pid
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - not supported here
            return None
        for proc in procs:
            if getattr(proc, "pid", None) == pid:
                used = getattr(proc, "usedGpuMemory", None)
                return int(used) if isinstance(used, int) and used >= 0 else None
        return None

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_source": self.source}
        if self._nvml is not None:
            nv = self._nvml
            with contextlib.suppress(Exception):
                out["driver"] = _text(nv.nvmlSystemGetDriverVersion())
            with contextlib.suppress(Exception):
                out["nvml_name"] = _text(nv.nvmlDeviceGetName(self._handle))
        elif self.error:
            out["nvml_error"] = self.error
        return out


def emulation_fraction(emulate_bytes: int, context_bytes: int, total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` that caps the caching allocator so that allocator +
    CUDA context fit a card of ``emulate_bytes`` on a GPU of ``total_bytes``."""
    allocator_bytes = int(emulate_bytes) - int(context_bytes)
    fraction = allocator_bytes / total_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"cannot emulate {emulate_bytes} bytes on a {total_bytes}-byte GPU "
                         f"with a {context_bytes}-byte CUDA context")
    return fraction


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_peaks() -> dict[str, int]:
    import torch

    stats = torch.cuda.memory_stats()
    return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "active_peak_bytes": int(stats.get("active_bytes.all.peak", 0))}


# ----------------------------------------------------------------------------------------------
# the callback


class Measure:
    """The events of a TrainerCallback (mixed into one by :func:`make_callback`) that count live
    tensors over the first steps, labels phases, reads CUDA peaks per phase and times steps.

    Phases: ``forward`` (a forward pre-hook on the model), ``backward`` (around the Trainer's
    ``accelerator.backward``), ``optimizer`` (``on_pre_optimizer_step``, after clipping; with
    DeepSpeed, around ``engine.step``, which accelerate calls inside ``backward``).
    """

    def __init__(self, request: dict, status_path: Path | None) -> None:
        self.device = request["device"]
        self.steps_total = int(request["steps"])
        self.counted_steps = min(COUNTED_STEPS, self.steps_total)
        self.tokens_per_step = int(request["tokens_per_step"])
        self.status_path = status_path
        self.counter = CappedCounter("cuda" if self.device == "cuda" else "cpu", request.get("cpu_memory_cap_bytes"))
        self.counting = False
        self.phase: str | None = "setup"
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.device_samples: list[int] = []
        self.process_samples: list[int] = []
        self.device_memory: DeviceMemory | None = None
        self.step_times: list[tuple[float, bool]] = []  # (seconds, counted)
        self.step = 0
        self._t0 = 0.0

    # phases -----------------------------------------------------------------------------------
    def set_phase(self, name: str) -> None:
        if name == self.phase:
            return
        if self.device == "cuda":
            self._close_cuda_phase()
        self.phase = name
        if self.counting:
            self.counter.phase(name)
        if self.counting or not self.step_times:  # the timed steps write nothing (it is fsynced)
            self._status()

    def _close_cuda_phase(self) -> None:
        import torch

        torch.cuda.synchronize()
        peaks = _cuda_peaks()
        into = self.phase_peaks.setdefault(self.phase or "setup", {})
        for k, v in peaks.items():
            into[k] = max(into.get(k, 0), v)
        if self.device_memory is not None:
            try:  # a reading NVML cannot give costs a sample, not the run
                used = self.device_memory.used_bytes()
            except Exception:  # noqa: BLE001
                used = None
            if used is not None:
                self.device_samples.append(max(0, used - self.device_memory.baseline_bytes))
            mine = self.device_memory.process_bytes()
            if mine is not None:
                self.process_samples.append(mine)
        torch.cuda.reset_peak_memory_stats()

    def _status(self) -> None:
        if self.status_path is not None:
            atomic_write_text(self.status_path, json.dumps({"step": self.step, "phase": self.phase}))

    # Trainer events -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch

        if self.device == "cpu" and optimizer is not None:
            for group in optimizer.param_groups:  # torch's default on CUDA
                if "foreach" in group and not group.get("fused"):
                    group["foreach"] = True
        model.register_forward_pre_hook(lambda *_: self.set_phase("forward"))
        trainer_backward = self.accelerator.backward

        def backward(loss, **kw):
            self.set_phase("backward")
            return trainer_backward(loss, **kw)

        self.accelerator.backward = backward
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:  # accelerate runs DeepSpeed's optimizer step inside backward()
            engine_step = wrapped.engine.step

            def step(*a, **kw):
                self.set_phase("optimizer")
                return engine_step(*a, **kw)

            wrapped.engine.step = step
        self.counter.track(model, optimizer, _quant_state_tensors(model), _all_tensors(torch))
        self.counter.__enter__()
        self.counting = True
        self.counter.phase(self.phase)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self._status()
        self._t0 = time.perf_counter()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.set_phase("optimizer")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self.step_times.append((time.perf_counter() - self._t0, self.counting))
        self.step += 1
        self.set_phase("step_end")
        if self.counting and self.step >= self.counted_steps:
            self.stop_counting()
        return control

    def stop_counting(self) -> None:
        if self.counting:
            self.counting = False
            self.counter.__exit__(None, None, None)

    # the result --------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tensor_peak_bytes": self.counter.peak_bytes,
            "tensor_phase_peaks_bytes": {k: v for k, v in self.counter.phase_peaks.items() if k != "step_end"},
            "steps_done": self.step,
            "counted_steps": self.counted_steps,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        timed = [t for t, counted in self.step_times if not counted] or [t for t, _ in self.step_times]
        if timed:
            step_time = sorted(timed)[len(timed) // 2]
            out.update(step_time_s=step_time, tokens_per_s=self.tokens_per_step / step_time,
                       timed_with_counter=all(c for _, c in self.step_times))
        if self.device == "cuda":
            overall: dict[str, int] = {}
            for peaks in self.phase_peaks.values():
                for k, v in peaks.items():
                    overall[k] = max(overall.get(k, 0), v)
            out.update(overall)
            out["phase_peaks"] = self.phase_peaks
            if self.device_samples:
                out["device_used_bytes"] = max(self.device_samples)
            if self.process_samples:
                out["device_process_bytes"] = max(self.process_samples)
        return out


def make_callback(request: dict, status_path: Path | None) -> Measure:
    """A :class:`Measure` that is also a ``transformers.TrainerCallback`` (its other events are
    the base class's no-ops)."""
    from transformers import TrainerCallback

    cls = type("MeasureCallback", (Measure, TrainerCallback), {})
    return cls(request, status_path)


def _all_tensors(torch) -> list:
    """Every tensor the garbage collector can reach: what exists before the counter starts
    (DeepSpeed's flat buffers and fp32 partitions, the Trainer's loss accumulator)."""
    import warnings

    found = []
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
            except ReferenceError:  # a dead weakref proxy
                continue
    return found


def _quant_state_tensors(model) -> list:
    from .cpu_truth import quant_state_tensors

    return quant_state_tensors(model)


# ----------------------------------------------------------------------------------------------
# the run


def load_train_module(directory: Path):
    """The emitted train.py as a module (its PLAN, parse_args, build_trainer)."""
    spec = importlib.util.spec_from_file_location("vramplan_emitted_train", directory / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def train_argv(request: dict, output_dir: str) -> list[str]:
    """The arguments the launch command would give train.py, plus the measuring ones."""
    directory = Path(request["dir"])
    argv = ["--max-steps", str(request["steps"]), "--no-save", "--output-dir", output_dir]
    if request["device"] == "cpu":
        argv.append("--cpu")
    if (directory / "ds_config.json").is_file():
        argv += ["--deepspeed", str(directory / "ds_config.json")]
    return argv


def _single_process_env() -> None:
    """What the deepspeed launcher sets for one process (train.py's ``main`` does the same)."""
    if "RANK" in os.environ:
        return
    port = os.environ.get("MASTER_PORT")  # the launcher's choice, so it can release DeepSpeed's shm after
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def _is_oom(exc: BaseException) -> bool:
    import torch

    # torch.OutOfMemoryError since torch 2.5; torch.cuda.OutOfMemoryError before (an alias after)
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, (*oom_types, MemoryError)):
        return True
    cause = exc.__cause__ or exc.__context__
    return "out of memory" in str(exc).lower() or (cause is not None and cause is not exc and _is_oom(cause))


def _cuda_setup(request: dict, measure: Measure) -> dict[str, Any]:
    """Initialise CUDA, measure its context, cap the allocator for ``emulate_bytes``."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device; measure on the CPU with --device cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    device_memory = DeviceMemory(index)
    # NVML: what the device used before this process's context (the last run's process may
    # still be handing its memory back: wait until the reading settles)
    before = device_memory.settled_used_bytes() if device_memory.source == "nvml" else 0
    device_memory.baseline_bytes = before or 0
    torch.cuda.set_device(index)
    torch.cuda.init()
    torch.cuda.mem_get_info(index)  # forces the context into existence
    after = device_memory.used_bytes() or 0
    props = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {"gpu_name": props.name, "gpu_total_bytes": int(props.total_memory),
                            "compute_capability": f"{props.major}.{props.minor}",
                            "cuda": torch.version.cuda, "cuda_context_bytes": max(0, after - (before or 0)),
                            **device_memory.info()}
    if device_memory.source != "nvml":
        info["cuda_context_note"] = "device-wide used after init (assumes no other process on the GPU)"
    emulate = request.get("emulate_bytes")
    if emulate:
        fraction = emulation_fraction(int(emulate), info["cuda_context_bytes"], int(props.total_memory))
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        info.update(emulated_bytes=int(emulate), memory_fraction=fraction)
    torch.cuda.reset_peak_memory_stats()
    measure.device_memory = device_memory
    return info


def run(request: dict) -> dict[str, Any]:
    """Run the request; return the result mapping (never raises for an OOM)."""
    import torch

    directory = Path(request["dir"])
    status = Path(request["status"]) if request.get("status") else None
    torch.manual_seed(int(request.get("seed", 0)))
    measure = make_callback(request, status)
    result: dict[str, Any] = {"device": request["device"], "oom": False, "world_size": 1, "rank": 0}
    if request["device"] == "cuda":
        result.update(_cuda_setup(request, measure))
    module = load_train_module(directory)
    output_dir = tempfile.mkdtemp(prefix="vramplan-measure-out-")
    args = module.parse_args(train_argv(request, output_dir))
    if args.deepspeed:
        _single_process_env()
    stack = contextlib.ExitStack()
    if request["device"] == "cpu":
        from .cpu_truth import cuda_kernels

        stack.enter_context(cuda_kernels())
    t0 = time.perf_counter()
    try:
        with stack:
            measure.set_phase("build")
            trainer = module.build_trainer(args, callbacks=[measure])
            measure.accelerator = trainer.accelerator
            result["world_size"] = int(trainer.args.world_size)
            result["rank"] = int(trainer.args.process_index)
            trainer.train()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) or not _is_oom(exc):
            raise
        result.update(oom=True, oom_phase=measure.phase, oom_step=measure.step,
                      error=" ".join(str(exc).split())[:500])
    finally:
        measure.stop_counting()
        if request["device"] == "cuda" and measure.phase is not None:
            with contextlib.suppress(Exception):
                measure._close_cuda_phase()
    result.update(measure.result())
    result["seconds"] = time.perf_counter() - t0
    return result


def _run_and_write(request: dict) -> int:
    """Run one request and write its result file (a failure is a result too); the exit code."""
    try:
        result = run(request)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the parent gets the failure as a record
        result = {"device": request.get("device"), "failed": True, "oom": False,
                  "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}",
                  "traceback": traceback.format_exc()[-4000:]}
        code = 1
    atomic_write_text(request["result"], json.dumps(result))
    return code


def _import_heavy() -> None:
    """What every run imports, loaded once before forking (never CUDA: it cannot be forked)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import Trainer  # noqa: F401

    for name in ("peft", "accelerate", "deepspeed", "bitsandbytes"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _fork(request: dict, env: dict[str, str]) -> int:
    """Fork a child that runs ``request`` with ``env`` added to its environment; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: one measurement, then leave without running the parent's atexit
        code = 1
        try:
            os.environ.update(env)
            code = _run_and_write(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _rank_requests(request: dict) -> list[tuple[dict, dict[str, str]]]:
    """One (request, environment) per rank: what ``torchrun``/``deepspeed`` give each process."""
    world = int(request.get("world_size") or 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    if world == 1:  # the port only: a DeepSpeed run takes it (_single_process_env), serve releases its shm
        return [(request, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})]
    return [({**request, "result": f"{request['result']}.rank{r}", "status": f"{request['status']}.rank{r}"},
             {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(world)]


def serve(requests: list[dict]) -> int:
    """Run CPU requests one after another, each in children forked from this process after the
    heavy imports (one per rank of its ``world_size``, concurrently); children past the request's
    ``timeout_s`` are killed and recorded as a timeout."""
    import signal

    from .launch import merge_ranks

    _import_heavy()
    worst = 0
    for request in requests:
        ranks = _rank_requests(request)
        pids = [_fork(req, env) for req, env in ranks]
        deadline = time.monotonic() + float(request.get("timeout_s") or 600)
        timed_out = False
        codes: dict[int, int] = {}
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if len(codes) < len(pids) and time.monotonic() > deadline:
                timed_out = True
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            time.sleep(0.05)
        release_deepspeed_shm(ranks[0][1]["MASTER_PORT"])
        results = []
        for (req, _), pid in zip(ranks, pids):
            if not Path(req["result"]).is_file():
                where = _read_status(req)
                atomic_write_text(req["result"], json.dumps({
                    "device": req.get("device"), "failed": True, "oom": False, "timeout": timed_out,
                    "phase": where.get("phase"), "step": where.get("step"), "returncode": codes[pid],
                    "error": (f"killed after the {req.get('timeout_s')} s timeout" if timed_out
                              else f"worker exited with code {codes[pid]} without a result")}))
            results.append(json.loads(Path(req["result"]).read_text()))
        if len(ranks) > 1:
            atomic_write_text(request["result"], json.dumps(merge_ranks(results)))
        worst = max(worst, *(1 if c else 0 for c in codes.values()))
    return worst


def _read_status(request: dict) -> dict:
    try:
        return json.loads(Path(request["status"]).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m vramplan.run.worker REQUEST.json [REQUEST.json ...]", file=sys.stderr)
        return 2
    requests = [json.loads(Path(a).read_text()) for a in argv]
    if len(requests) == 1:
        code = _run_and_write(requests[0])
        # The result is written (fsynced): skip the interpreter's teardown, where a process group
        # nobody destroyed (NCCL's watchdog) or freeing a large CUDA heap can hold the exit for
        # many seconds, which the parent would wait for, or time out on.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if any(r.get("device") != "cpu" for r in requests):
        print("error: several requests in one worker fork it; CUDA cannot be forked", file=sys.stderr)
        return 2
    return serve(requests)


if __name__ == "__main__":
    raise SystemExit(main())
