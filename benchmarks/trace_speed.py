"""Wall time of `trace` on the largest shipped models (bar: a 70B model in under a minute on a
2-core machine). Prints a table; asserts nothing.

    python benchmarks/trace_speed.py
"""

from __future__ import annotations

import time

from vramplan.estimator import estimate
from vramplan.model.profiles import load_model
from vramplan.run.tracer import trace
from vramplan.specs import Setup

CASES = [
    ("meta-llama/Llama-3.1-70B", Setup(method="lora", checkpointing=True, seq=4096)),
    ("meta-llama/Llama-3.1-70B", Setup(seq=2048)),
    ("Qwen/Qwen2.5-72B", Setup(method="lora", seq=2048)),
    ("mistralai/Mixtral-8x7B-v0.1", Setup(method="lora", checkpointing=True, seq=4096)),
]


def main() -> None:
    trace(load_model("smollm2-135m"), Setup(seq=64))  # import torch/transformers once, outside the clock
    print(f"{'model':30s} {'setup':28s} {'trace s':>8s} {'trace GiB':>10s} {'estimate GiB':>12s} {'under 60 s':>10s}")
    for name, setup in CASES:
        model = load_model(name)
        t0 = time.perf_counter()
        bd = trace(model, setup)
        dt = time.perf_counter() - t0
        est = estimate(model, setup)
        label = f"{setup.method} ckpt={int(setup.checkpointing)} {setup.batch}x{setup.seq}"
        print(f"{name:30s} {label:28s} {dt:8.1f} {bd.tensor_peak_bytes / 2**30:10.2f} "
              f"{est.tensor_peak_bytes / 2**30:12.2f} {'yes' if dt < 60 else 'NO':>10s}", flush=True)


if __name__ == "__main__":
    main()
