"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


def vramplan_cmd() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m vramplan``."""
    script = os.path.join(os.path.dirname(sys.executable), "vramplan")
    if os.path.exists(script):
        return [script]
    found = shutil.which("vramplan")
    return [found] if found else [sys.executable, "-m", "vramplan"]


def time_command(argv: list[str], n: int) -> list[float]:
    """Wall seconds of ``n`` runs of ``argv`` (output discarded), after one warm-up run."""
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times


def print_rank_rows(compared, world: int, name, width: int, errors: list[float]) -> None:
    """One line per rank of each (run, estimate) of an N-process truth (ZeRO, FSDP): device bytes
    measured and estimated, error, phases, host bytes; appends each device error to ``errors``."""
    for run, est in compared:
        for r in run.ranks:
            err = est.tensor_peak_bytes / r.device_bytes - 1
            errors.append(err)
            herr = f"{est.host_bytes / r.host_bytes - 1:+.1%}" if r.host_bytes else "-"
            print(f"{name(run.setup):{width}s} {world:2d} {r.rank:4d} {r.device_bytes:10,d} "
                  f"{est.tensor_peak_bytes:10,d} "
                  f"{err:+7.1%} {r.phase + '/' + est.phase:>19s} {r.host_bytes:11,d} {est.host_bytes:9,d} {herr:>8s}")


def print_error_summary(errors: list[float], started: float) -> None:
    """The rank rows' count, median |error| and worst error, and the total time since ``started``."""
    worst = max(errors, key=abs)
    print(f"\n{len(errors)} rank rows; median |error| {sorted(abs(e) for e in errors)[len(errors) // 2]:.2%}, "
          f"worst {worst:+.2%}; total {time.perf_counter() - started:.1f} s")
