"""Wall time of the torch-free CLI paths, as a user feels it (a fresh process each run).

    python benchmarks/cli_latency.py [-n 10]

Runs each command N times as a subprocess after one untimed warm-up (page cache, .pyc files) and
prints median/min/max against the 0.3 s bar. Printed, not asserted: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from _common import vramplan_cmd  # benchmarks/_common.py (scripts run from this folder)

BAR_S = 0.3
COMMANDS = [
    ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090"],
    ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--json"],
    ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--cp", "4", "--gpus", "4", "--fsdp", "full_shard",
     "--fsdp-version", "2", "--seq", "32768", "--checkpointing"],
    ["models"],
]




def time_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10, help="timed runs per command")
    args = parser.parse_args()
    base = vramplan_cmd()
    print(f"{' '.join(base)}  (N={args.n}, bar {BAR_S:.1f} s)")
    print(f"{'command':<52} {'median':>8} {'min':>8} {'max':>8}  under bar")
    for cmd in COMMANDS:
        argv = base + cmd
        time_once(argv)  # warm-up
        times = [time_once(argv) for _ in range(args.n)]
        med = statistics.median(times)
        print(f"{'vramplan ' + ' '.join(cmd):<52} {med:>7.3f}s {min(times):>7.3f}s {max(times):>7.3f}s  "
              f"{'yes' if med < BAR_S else 'NO'}")


if __name__ == "__main__":
    main()
