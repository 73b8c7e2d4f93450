"""One measurement, in its own process: the emitted train.py, run in-process with a measuring callback.

    python -m vramplan.run.worker REQUEST.json

The parent (:mod:`vramplan.run.launch`, which never imports torch) writes REQUEST.json and reads
the result file this process writes (atomically) when it ends; a status file says which step and
phase it is in, so that a run killed at the timeout still tells where it was.

The run is the plan's own code path: the directory ``vramplan emit`` wrote is imported
(``train.py``'s ``parse_args`` and ``build_trainer``, as its ``main`` does) and trained for
``steps`` optimizer steps on its synthetic tokens, with :class:`vramplan.run.callback.Measure`
added to the Trainer's callbacks. What is measured:

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
SDPA runs the stand-in for CUDA's fused kernels (:func:`vramplan.run.cuda_paths.cuda_kernels`; the
CPU math kernel would keep s^2 scores) and torch optimizers use their ``foreach`` kernels (torch's
default on CUDA, not on CPU).

Out of memory is a result: ``torch.OutOfMemoryError`` (or, on CPU, live tensor bytes passing
``cpu_memory_cap_bytes``: the CPU emulation of a card of that size) ends the run with
``oom: true`` and the phase it happened in. ``emulate_bytes`` caps the CUDA caching allocator with
``torch.cuda.set_per_process_memory_fraction`` so that one big GPU measures smaller cards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ..util.fileio import atomic_write_text
from . import free_port, release_deepspeed_shm
from .callback import Measure, make_callback
from .device_memory import DeviceMemory, emulation_fraction


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
        port = str(free_port())
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def is_oom(exc: BaseException) -> bool:
    import torch

    # torch.OutOfMemoryError since torch 2.5; torch.cuda.OutOfMemoryError before (an alias after)
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, (*oom_types, MemoryError)):
        return True
    cause = exc.__cause__ or exc.__context__
    return "out of memory" in str(exc).lower() or (cause is not None and cause is not exc and is_oom(cause))


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
        from .cuda_paths import cuda_kernels

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
        if isinstance(exc, KeyboardInterrupt) or not is_oom(exc):
            raise
        result.update(oom=True, oom_phase=measure.phase, oom_step=measure.step,
                      error=" ".join(str(exc).split())[:500])
    finally:
        measure.stop_counting()
        if request["device"] == "cuda" and measure.phase is not None:
            with contextlib.suppress(Exception):
                measure.close_cuda_phase()
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
    from .launch import die_with_parent

    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: one measurement, then leave without running the parent's atexit
        code = 1
        try:
            die_with_parent(parent)()  # a worker killed outright (OOM killer, kill -9) takes its children along
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
    port = str(free_port())
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
        for (req, _), pid in zip(ranks, pids, strict=True):
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
