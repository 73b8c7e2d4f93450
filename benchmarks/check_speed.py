"""Wall time of `vramplan check` over 20 checks on the analytic tier, against the 1 s bar.

    python benchmarks/check_speed.py [-n 5]

Writes 20 checks (11 shipped models, full/LoRA/QLoRA, checkpointing, ZeRO, several GPUs) to a
temporary checks file, records a baseline, then times: the whole command in a fresh process
(interpreter start, imports, checks, output) in each output format, and the checks alone in this
process (load_specs + run_checks, first call cold: config parsing; then warm). Printed, not
asserted: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import time_command, vramplan_cmd  # benchmarks/_common.py (scripts run from this folder)

BAR_S = 1.0
MODELS = ["llama-3.1-8b", "llama-3.2-1b", "qwen2-0.5b", "qwen3-8b", "qwen3-30b-a3b", "mistral-7b", "gemma-2-9b",
          "phi-3.5-mini", "smollm2-135m", "gpt2", "mixtral-8x7b"]
SETUPS = [
    "{method: lora, checkpointing: true}",
    "{method: qlora, checkpointing: true, seq: 1024}",
    "{method: full, checkpointing: true, optimizer: adamw-8bit}",
    "{method: lora, zero_stage: 3, gpus: 4, batch: 2}",
]
GPUS = ["rtx-4090", "a100-80gb", "l4", "h100-sxm"]


def checks_yaml(n: int = 20) -> str:
    lines = ["checks:"]
    for i in range(n):
        lines += [f"  - name: check-{i:02d}", f"    model: {MODELS[i % len(MODELS)]}",
                  f"    gpu: {GPUS[i % len(GPUS)]}", f"    setup: {SETUPS[i % len(SETUPS)]}", "    must_fit: false"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="timed runs per row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec, baseline = Path(tmp, "checks.yaml"), Path(tmp, "vram-baseline.json")
        spec.write_text(checks_yaml())
        base = vramplan_cmd() + ["check", str(spec), "--baseline", str(baseline)]
        subprocess.run(base + ["--update"], check=True, stdout=subprocess.DEVNULL)

        rows = []
        for label, extra in (("CLI, table", []), ("CLI, --json", ["--json"]),
                             ("CLI, --format github", ["--format", "github", "--summary", ""])):
            rows.append((f"{label} (fresh process)", time_command(base + extra, args.n)))

        from vramplan.budget import load_specs, read_baseline, run_checks

        t0 = time.perf_counter()
        run_checks(load_specs([spec]), read_baseline(baseline))
        rows.append(("in-process, first call (cold)", [time.perf_counter() - t0]))
        warm = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            run = run_checks(load_specs([spec]), read_baseline(baseline))
            warm.append(time.perf_counter() - t0)
        rows.append(("in-process, warm", warm))
        assert len(run.results) == 20 and run.exit_code() == 0

    print(f"vramplan check over 20 checks, analytic tier (N={args.n}, bar {BAR_S:.1f} s)")
    print(f"{'':<40} {'median':>8} {'min':>8} {'max':>8}  under bar")
    for label, times in rows:
        med = statistics.median(times)
        print(f"{label:<40} {med:>7.3f}s {min(times):>7.3f}s {max(times):>7.3f}s  {'yes' if med < BAR_S else 'NO'}")


if __name__ == "__main__":
    main()
