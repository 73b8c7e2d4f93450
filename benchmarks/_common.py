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
