"""Speed of `vramplan plan`: the search alone (bar 100 ms) and the whole command (bar 0.5 s).

    python benchmarks/plan_speed.py [-n 5]

For each case: the median wall and CPU time of ``vramplan.plan(...)`` in this process after one
warm-up (the model profile is cached, as it is after the command's first load), how many estimates
it ran (the "what would fit" re-searches included), and the median wall time of the command as a
user runs it (a fresh process, `--json` to a pipe). On a shared machine the CPU time is the
steadier figure for the search.
Printed, not asserted: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import time_command, vramplan_cmd  # benchmarks/_common.py (scripts run from this folder)

SEARCH_BAR_S = 0.100
COMMAND_BAR_S = 0.5

#: (model, gpu, plan keyword arguments, the same as CLI flags)
CASES = [
    ("llama-3.1-8b", "rtx-4090", {}, []),
    ("llama-3.1-8b", "rtx-4090", {"global_batch": 16}, ["--global-batch", "16"]),
    ("qwen2-0.5b", "a100-80gb", {"global_batch": 32}, ["--global-batch", "32"]),
    ("llama-3.1-70b", "rtx-4090", {}, []),
    ("llama-3.1-70b", "rtx-3060-12gb", {"host_ram": "64GiB"}, ["--host-ram", "64GiB"]),
    # nothing fits (the card's default host RAM is too small for the offload): the "what would fit" re-searches
    ("llama-3.1-70b", "rtx-3060-12gb", {}, []),
    ("qwen3-30b-a3b", "rtx-4090", {"nvme": True}, ["--nvme"]),
    ("mixtral-8x7b", "a100-80gb", {"gpus": 4, "global_batch": 32}, ["--gpus", "4", "--global-batch", "32"]),
    ("llama-3.1-8b", "h100-sxm", {"gpus": 8, "global_batch": 64}, ["--gpus", "8", "--global-batch", "64"]),
    ("llama-3.1-70b", "h100-sxm", {"gpus": 16, "nodes": 2, "global_batch": 128, "nvme": True},
     ["--gpus", "16", "--nodes", "2", "--global-batch", "128", "--nvme"]),
    # issue 17: hybrid sharding proposed on several nodes (above), TP x FSDP2 on one node of 8
    ("qwen2.5-7b", "a10", {"gpus": 8, "method": "full", "liger": False},
     ["--gpus", "8", "--method", "full", "--no-liger"]),
    # issue 17: context parallelism taken for a sequence FSDP2 cannot hold on one card's share
    ("llama-3.1-8b", "rtx-4090", {"gpus": 4, "seq": 32768, "method": "lora"},
     ["--gpus", "4", "--seq", "32768", "--method", "lora"]),
    # issue 18: GRPO (HF generate vs vLLM at each share of the card) and DPO (the reference searched)
    ("qwen2.5-7b", "a100-80gb", {"objective": "grpo", "num_generations": 8, "max_completion_length": 1024},
     ["--objective", "grpo", "--num-generations", "8", "--max-completion-length", "1024"]),
    ("qwen2.5-7b", "a100-80gb", {"objective": "dpo"}, ["--objective", "dpo"]),
    # issue 28: the HF recipe offloads on a 12 GB card, so the plan also searches --framework trl for its note;
    # --framework any plans three frameworks
    ("qwen3-8b", "rtx-3060-12gb", {}, []),
    ("qwen3-8b", "rtx-3060-12gb", {"framework": "any"}, ["--framework", "any"]),
    # an 8 GB card: a tight plan (its what-keeps-the-margins notes), and nothing fits anywhere (the closest
    # framework's plan, re-run with its notes, and the same setup at a shorter sequence)
    ("qwen3-8b", "rtx-4060", {}, []),
    ("qwen2.5-7b", "rtx-4060", {"seq": 8192}, ["--seq", "8192"]),
]

#: Absurd but accepted inputs (issue 27): the command still answers within ABSURD_BAR_S.
ABSURD_BAR_S = 2.0
ABSURD = [
    ["llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "65536"],
    ["llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "65536", "--nodes", "8192"],
    ["llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "16", "--seq", "1048576"],
    ["qwen3-30b-a3b", "--gpu", "rtx-3060-12gb", "--gpus", "4096", "--global-batch", "1048576"],
]


def time_search(model: str, gpu: str, kwargs: dict, n: int) -> tuple[float, float, int, object]:
    """Median wall and CPU seconds of ``vramplan.plan``, the estimates of the last run, the plan."""
    import vramplan
    from vramplan.estimator.cache import clear
    from vramplan.search import Evaluator

    vramplan.plan(model, gpu, **kwargs)  # warm-up: profile parsing, caches
    counted = [0]
    real = Evaluator.estimate

    def counting(self, setup):
        if setup not in self.cache:
            counted[0] += 1
        return real(self, setup)

    times, cpu = [], []
    plan = None
    for _ in range(n):
        counted[0] = 0
        Evaluator.estimate = counting
        clear()  # a cold search: the estimator's card-free memo (estimator/cache.py) starts empty each run
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            plan = vramplan.plan(model, gpu, **kwargs)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        finally:
            Evaluator.estimate = real
    return statistics.median(times), statistics.median(cpu), counted[0], plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="timed runs per case")
    args = parser.parse_args()
    from vramplan.search import quality_label

    base = vramplan_cmd()
    print(f"search: vramplan.plan() in-process, median of {args.n} (bar {SEARCH_BAR_S * 1000:.0f} ms); "
          f"command: `{' '.join(base)} plan ... --json` in a fresh process (bar {COMMAND_BAR_S} s)")
    header = (f"{'model':<15} {'gpu':<14} {'options':<42} {'search':>8} {'cpu':>8} {'estimates':>9} "
              f"{'+relax':>8} {'command':>8}  {'chosen':<12} ok")
    print(header)
    print("-" * len(header))
    for model, gpu, kwargs, flags in CASES:
        search_s, cpu_s, estimates, plan = time_search(model, gpu, {**kwargs, "relax": False}, args.n)
        _, relax_cpu_s, _, plan = time_search(model, gpu, kwargs, args.n)
        command_s = statistics.median(time_command(base + ["plan", model, "--gpu", gpu, "--json", *flags], args.n))
        chosen = quality_label(plan.setup) if plan.fits else "no fit"
        ok = "yes" if search_s < SEARCH_BAR_S and command_s < COMMAND_BAR_S else "NO"
        print(f"{model:<15} {gpu:<14} {' '.join(flags) or '-':<42} {search_s * 1000:>6.1f}ms {cpu_s * 1000:>6.1f}ms "
              f"{estimates:>9} {relax_cpu_s * 1000:>6.1f}ms {command_s:>7.3f}s  {chosen:<12} {ok}")
    print(f"absurd inputs: `{' '.join(base)} plan ... --json`, median of {args.n} (bar {ABSURD_BAR_S} s)")
    for flags in ABSURD:
        command_s = statistics.median(time_command(base + ["plan", *flags, "--json"], args.n))
        print(f"  {' '.join(flags):<80} {command_s:>7.3f}s  {'yes' if command_s < ABSURD_BAR_S else 'NO'}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("search/cpu/estimates: the search of the whole space (wall and CPU median); +relax: CPU time of the "
          "whole plan() including the 'what would fit' re-searches run when nothing fits; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
