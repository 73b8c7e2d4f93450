"""Start measurement workers, enforce their timeout, collect their results. Never imports torch.

Each measurement runs in a fresh process (:mod:`vramplan.run.worker`) so that one run's
allocator state, CUDA context and imported modules never leak into the next one. A request is a
JSON mapping (written next to the result): the emitted directory, device, steps, the emulated
card, the CPU cap. The worker writes its result file atomically when it ends and a status file
(step and phase) as it goes, so a run killed at its timeout still says where it was.

- :func:`run_one`: one request, one process group; at the timeout the group gets SIGTERM, then
  SIGKILL (DeepSpeed and the Trainer start helper processes and threads).
- ``world_size`` > 1: one worker per rank with the environment ``torchrun``/``deepspeed`` give
  (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the result holds every rank's numbers
  under ``ranks`` and the per-GPU maximum of each.
- :func:`run_many`: several CPU requests share one interpreter that imports torch and
  transformers once and forks fresh children per request, one per rank (a fork after import and
  before any thread pool starts is a clean process; CUDA cannot be forked, so CUDA requests
  always get a fresh interpreter each).

A process that dies without a result (killed, crashed, timed out) becomes a record with
``failed: true`` (and ``timeout: true`` when the timeout killed it), never an exception.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..util.fileio import atomic_write_text
from . import free_port, release_deepspeed_shm

#: Seconds between SIGTERM and SIGKILL when a run is stopped.
KILL_GRACE_S = 5.0

#: Extra seconds a forking worker gets for its imports, beyond the sum of its requests' timeouts.
IMPORT_ALLOWANCE_S = 120.0


def worker_command(*request_paths: str | os.PathLike) -> list[str]:
    """The command that runs requests: ``python -m vramplan.run.worker REQUEST.json ...``."""
    return [sys.executable, "-m", "vramplan.run.worker", *map(str, request_paths)]


def _write_request(request: dict, workdir: Path, name: str) -> dict:
    request = dict(request, result=str(workdir / f"{name}.result.json"), status=str(workdir / f"{name}.status.json"))
    atomic_write_text(workdir / f"{name}.request.json", json.dumps(request))
    return request


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL what is left after the grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _failure(request: dict, log: Path, *, timeout: bool, returncode: int | None, timeout_s: float) -> dict:
    status = _read_json(Path(request["status"])) or {}
    out: dict[str, Any] = {"device": request["device"], "failed": True, "oom": False, "timeout": timeout,
                           "phase": status.get("phase"), "step": status.get("step"), "returncode": returncode}
    out["error"] = (f"killed after the {timeout_s:g} s timeout" if timeout
                    else f"worker exited with code {returncode} without a result")
    out["log_tail"] = _tail(log)
    return out


def die_with_parent(parent: int) -> Callable[[], None]:
    """In the child, before exec (or right after the forking worker's fork): ask Linux to SIGKILL
    it when the launching process dies (a ``kill -9`` of ``vramplan measure`` skips every cleanup),
    and exit at once if that already happened. Elsewhere (no prctl) the timeout's process-group kill
    is the only guard."""

    def arm() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)

    return arm


_PR_SET_PDEATHSIG = 1


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    # the worker's own temporary files (its Trainer output dir) go inside the run's directory,
    # which the caller removes, instead of leaking into /tmp on every run
    tmp = log.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**env, "TMPDIR": str(tmp)}
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=die_with_parent(os.getpid()))


def run_one(request: dict, workdir: str | os.PathLike, timeout_s: float) -> dict:
    """Run one request (its ``world_size`` ranks) in fresh processes; return its result mapping."""
    world_size = int(request.get("world_size") or 1)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[tuple[subprocess.Popen, dict, Path]] = []
    port = str(free_port())
    for rank in range(world_size):
        name = "run" if world_size == 1 else f"rank{rank}"
        req = _write_request(request, workdir, name)
        rank_env = dict(base_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # one rank: DeepSpeed takes it
        if world_size > 1:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = workdir / f"{name}.log"
        procs.append((_start(worker_command(workdir / f"{name}.request.json"), log, rank_env), req, log))
    deadline = time.monotonic() + timeout_s
    results = []
    timed_out = False
    for proc, _req, _log in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc, _req, _log in procs:
        if proc.poll() is None:
            _kill_group(proc)
    release_deepspeed_shm(port)
    for proc, req, log in procs:
        result = _read_json(Path(req["result"]))
        if result is None:
            result = _failure(req, log, timeout=timed_out, returncode=proc.returncode, timeout_s=timeout_s)
        results.append(result)
    return results[0] if world_size == 1 else merge_ranks(results)


def merge_ranks(results: list[dict]) -> dict:
    """One result for a multi-rank run: rank 0's fields, each peak the maximum over ranks (the
    GPU that fills first decides the fit), OOM/failure if any rank had one, all ranks kept."""
    merged = dict(results[0])
    for key in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "active_peak_bytes",
                "device_used_bytes", "peak_rss_bytes", "step_time_s"):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            merged[key] = max(values)
    for flag in ("oom", "failed", "timeout"):
        if any(r.get(flag) for r in results):
            merged[flag] = True
            first = next(r for r in results if r.get(flag))
            for key in ("oom_phase", "phase", "error"):
                if key in first:
                    merged[key] = first[key]
    merged["world_size"] = len(results)
    merged["ranks"] = results
    return merged


def run_many(requests: list[dict], workdir: str | os.PathLike, timeout_s: float) -> list[dict]:
    """Run CPU ``requests`` in one forking worker (imports paid once; each request still runs
    in a fresh child process); each request has ``timeout_s`` unless it names its own.
    Returns results in order."""
    if any(r["device"] != "cpu" for r in requests):
        raise ValueError("run_many forks: CUDA requests need run_one each")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    reqs = [_write_request({"timeout_s": timeout_s, **r}, workdir, f"req{i}") for i, r in enumerate(requests)]
    log = workdir / "worker.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = _start(worker_command(*(workdir / f"req{i}.request.json" for i in range(len(reqs)))), log, env)
    try:
        proc.wait(timeout=IMPORT_ALLOWANCE_S + sum(r["timeout_s"] + KILL_GRACE_S for r in reqs))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
    results = []
    for req in reqs:
        result = _read_json(Path(req["result"]))
        if result is None:
            result = _failure(req, log, timeout=False, returncode=proc.returncode, timeout_s=timeout_s)
        results.append(result)
    return results
