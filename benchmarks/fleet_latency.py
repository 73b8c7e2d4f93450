"""Wall time of `plan --gpu any|consumer|cloud --dataset-tokens N` (issue 30: under 2 s on 2 cores), a fresh
process each run, and how many card x count plans each answer holds.

    python benchmarks/fleet_latency.py [-n 3]

Besides the wall time, the CPU time of the process (user + system): on a machine shared with other work the
steadier figure, and what the wall time is on an idle one (the command runs on one core). Printed, not
asserted: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time

from _common import vramplan_cmd  # benchmarks/_common.py (scripts run from this folder)

BAR_S = 2.0
COMMANDS = [
    ["plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu", "any", "--json"],
    ["plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu", "consumer", "--json"],
    ["plan", "llama-3.1-8b", "--dataset-tokens", "100M", "--epochs", "2", "--gpu", "cloud", "--json"],
    ["plan", "llama-3.2-1b", "--dataset-tokens", "100M", "--gpu", "rtx-4090,a100-80gb", "--json"],
]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_once(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of ``argv``, output discarded."""
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, _children_cpu() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3, help="timed runs per command")
    args = parser.parse_args()
    base = vramplan_cmd()
    print(f"{' '.join(base)}  (N={args.n}, bar {BAR_S:.1f} s)")
    print(f"{'command':<78} {'rows':>5} {'median':>8} {'min':>8} {'cpu':>8}  under bar")
    for cmd in COMMANDS:
        argv = base + cmd
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout  # warm-up
        rows = len(json.loads(out)["options"])
        runs = [time_once(argv) for _ in range(args.n)]
        walls = [w for w, _ in runs]
        med, cpu = statistics.median(walls), statistics.median(c for _, c in runs)
        label = " ".join(c for c in cmd if c != "--json")
        print(f"{label:<78} {rows:>5} {med:>7.2f}s {min(walls):>7.2f}s {cpu:>7.2f}s  {'yes' if med < BAR_S else 'NO'}")
    print(f"median/min: wall seconds; cpu: median user + system seconds of the process; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
