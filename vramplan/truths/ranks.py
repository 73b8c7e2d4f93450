"""N local ranks for the distributed truths (:mod:`vramplan.truths.distributed`, :mod:`vramplan.truths.fsdp`):
the launcher, each rank's peaks, the checkpoint the ranks of a launch share, and the validate rows
of a launch that failed. No torch at import (the workers import it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..run import free_port, release_deepspeed_shm


@dataclass(frozen=True)
class RankPeak:
    """One rank's peaks over the measured step, in bytes."""

    rank: int
    device_bytes: int  # live bytes a GPU would hold (tensor peak)
    phase: str  # phase of the device peak
    phase_peaks: dict = field(default_factory=dict)  # device peak per phase
    host_bytes: int = 0  # peak of the live offloaded (host) bytes
    init_bytes: int = 0  # live bytes (host and device) peak up to the end of deepspeed.initialize


def counter_peak(counter, init_bytes: int = 0) -> dict:
    """This rank's :class:`RankPeak` fields (as JSON) from a SplitCounter that measured its step."""
    return {"rank": int(os.environ["RANK"]), "device_bytes": counter.device_peak, "phase": counter.device_phase,
            "phase_peaks": dict(counter.device_phase_peaks), "host_bytes": counter.host_peak,
            "init_bytes": init_bytes}


def launch_ranks(module: str, job: dict, world: int, timeout_s: float, env: dict, what: str) -> list:
    """Run ``python -m MODULE JOB`` as ``world`` local ranks (RANK/WORLD_SIZE/LOCAL_RANK, a free
    port on 127.0.0.1, ``env`` added) and return each rank's JSON result, which the worker writes
    to ``<job["out"]>/rank<r>.json``. Subprocesses, no fork of the caller: this works from pytest,
    a CLI command or a script alike. Past ``timeout_s`` every rank dumps its stack (SIGUSR1, the
    workers' faulthandler) and RuntimeError carries the logs; a crash raises with the log of the
    rank that crashed first, not of one that lost its peer. DeepSpeed's shared-memory buffers
    are released whatever happened."""
    with tempfile.TemporaryDirectory(prefix=f"vramplan-{what.lower()}-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps({**job, "out": tmp}))
        port = free_port()
        procs = []
        for r in range(world):
            rank_env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env)
            log = open(Path(tmp) / f"rank{r}.log", "w")  # noqa: SIM115 (closed after the wait below)
            procs.append((subprocess.Popen([sys.executable, "-m", module, str(path)],
                                           env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        try:
            for p, _ in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            tails = "".join(f"--- rank {r}:\n" + (Path(tmp) / f"rank{r}.log").read_text()[-2000:]
                            for r in range(world))
            raise RuntimeError(f"{what} workers did not finish within {timeout_s:.0f} s\n{tails}") from None
        finally:
            for p, log in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                log.close()
            release_deepspeed_shm(port)
        results, failed = [], []
        for r, (p, _) in enumerate(procs):
            out = Path(tmp) / f"rank{r}.json"
            if p.returncode != 0 or not out.is_file():
                failed.append((r, p.returncode, (Path(tmp) / f"rank{r}.log").read_text()[-3000:]))
            else:
                results.append(json.loads(out.read_text()))
        if failed:
            r, code, tail = min(failed, key=lambda f: "closed by peer" in f[2])
            raise RuntimeError(f"rank {r} exited with {code}:\n{tail}")
        return results


def saved_checkpoint(config: dict, dtype, work: str) -> str:
    """Random weights of ``config`` saved once per launch under ``work`` by rank 0 (transformers'
    ``save_pretrained`` writes on rank 0 only once a process group exists), read by every rank."""
    import hashlib

    import torch
    import transformers

    from ..run.models import hf_config

    key = hashlib.sha1((json.dumps(config, sort_keys=True) + str(dtype)).encode()).hexdigest()[:12]
    path = Path(work) / f"ckpt-{key}"
    if int(os.environ.get("RANK", "0")) == 0 and not (path / "config.json").is_file():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(hf_config(config, None), dtype=dtype).save_pretrained(path)
    torch.distributed.barrier()
    return str(path)


def one_thread_gloo() -> None:
    """Make every gloo process group created from here on run its collectives on one worker
    thread (torch's default is two: ``ProcessGroupGloo::Options::create``).

    gloo's worker drops a finished collective's work (and with it the last reference to tensors
    the main thread has let go) only after it has woken the main thread
    (``ProcessGroupGloo::runLoop``: ``AsyncWork::execute(work)`` then ``workInProgress_[i].reset()``),
    so such a tensor dies a moment late and a live-tensor counter may see it beside the next ones.
    With one worker, a small collective issued after it on the same group returns only once that
    collective's work is gone: :class:`vramplan.truths.tp_truth.DTensorCounter` drains each one so.
    """
    import datetime

    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_vramplan_one_thread", False):
        return

    class OneThreadGloo(base):
        _vramplan_one_thread = True

        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
            opts = base._Options()
            opts._threads = 1
            opts._timeout = timeout
            opts._devices = [base.create_default_device()]
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = OneThreadGloo


def rank_worker(job_path: str, run_one) -> None:
    """A rank's main (``python -m MODULE JOB`` of :func:`launch_ranks`): gloo, one thread, each of
    the job's setups through ``run_one(config, setup, seq, out)``, the results to ``rank<r>.json``."""
    import warnings

    import torch
    import torch.distributed as dist

    from ..specs import Setup

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    one_thread_gloo()
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    out = [run_one(job["config"], Setup.from_dict(s), job["seq"], job["out"]) for s in job["setups"]]
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    exit_rank()


def exit_rank() -> None:
    """End a rank whose result is written: flush and leave without the interpreter's teardown, where a
    gloo worker thread still joinable (a device mesh's group, an AsyncCollectiveTensor's work) can abort
    the process ("terminate called without an active exception", exit -6) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def failed_launch_rows(setups, world: int, base: str, family: str, exc: Exception, label) -> list:
    """The validate rows of a launch that crashed or timed out: each setup unverified, with the
    first line of the failure; ``label(setup)`` gives its (knob, truth name without ``-N``)."""
    from .row import Row

    why = f"the {world}-process run failed here: {str(exc).splitlines()[0]}"
    return [Row(f"{base}[tiny]", family, s, 0, 0, "", "", truth=f"{label(s)[1]}-{world}", knob=label(s)[0],
                verified=False, why=why) for s in setups]
