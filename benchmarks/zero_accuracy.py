"""DeepSpeed ZeRO: per-rank estimate vs the real N-process run. Prints; asserts nothing.

    python benchmarks/zero_accuracy.py              # N in {1, 2, 4} x stages 1-3 x CPU/NVMe offload, LoRA,
                                                    # QLoRA/int8, bf16-mixed (28 setups)
    python benchmarks/zero_accuracy.py --worlds 1 2 # fewer world sizes
    python benchmarks/zero_accuracy.py --timing     # also the estimator's time per ZeRO estimate

Then the same 7-setup matrix on 2 ranks for two other shapes: an untied head (Llama-3.1-8B scaled
down) and q/k/v biases kept gathered by stage 3 as persistent parameters (Qwen2.5-7B scaled down),
and the MoE matrix (fused 3-D experts: Mixtral and Qwen3-MoE scaled down to 4 experts) on 1 and 2 ranks.

The truth is vramplan/truths/distributed.py: N CPU processes (DeepSpeed's CPU accelerator, gloo), a
tiny Llama-3.2 with random weights, the canonical step twice, each rank's live tensors counted with
the offloaded (host) ones apart. One launch per world size runs the whole matrix.
"""

from __future__ import annotations

import argparse
import time

from _common import print_error_summary, print_rank_rows  # benchmarks/_common.py (scripts run from this folder)

from vramplan.specs import Setup
from vramplan.truths.distributed import (
    LORA_MATRIX,
    MIXED_MATRIX,
    MOE_MATRIX,
    NVME_MATRIX,
    QUANT_MATRIX,
    UNVERIFIED,
    ZERO_MATRIX,
    compare_setups,
    nvme_available,
)
from vramplan.truths.tiny import MOE_BASES, OTHER_BASES, TINY_BASE, TINY_SEQ, tiny_model


def _name(s: Setup) -> str:
    off = []
    if s.offload_optimizer != "none":
        off.append(f"opt->{s.offload_optimizer}")
    if s.offload_params != "none":
        off.append(f"params->{s.offload_params}")
    method = {"lora": " LoRA", "qlora": " QLoRA"}.get(s.method, "")
    if s.method == "lora" and s.quant != "none":
        method += f"-{s.quant}"
    extra = method + (" mixed" if s.precision.endswith("-mixed") else "") + (" ckpt" if s.checkpointing else "")
    return f"ZeRO-{s.zero_stage}{extra} {' '.join(off) or 'no offload'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--no-other-shapes", action="store_true",
                    help="skip the untied (Llama-3.1) and biased (Qwen2.5) shapes")
    ap.add_argument("--matrices", nargs="+", default=["zero", "lora", "quant", "mixed", "moe"],
                    choices=["zero", "lora", "quant", "mixed", "moe"],
                    help="which matrices to run (zero: stages x offload, with the NVMe cases and the other shapes)")
    args = ap.parse_args()
    model = tiny_model()
    print(f"model: {model.name} ({model.params_total:,} params, seq {TINY_SEQ}); bytes per rank")
    print(f"{'setup':44s} {'N':>2s} {'rank':>4s} {'truth':>10s} {'estimate':>10s} {'error':>7s} "
          f"{'phase t/e':>19s} {'host truth':>11s} {'host est':>9s} {'host err':>8s}")
    errors: list[float] = []
    nvme = nvme_available()
    if not nvme:
        print("NVMe offload not run: DeepSpeed's async_io op does not build here (it needs libaio-dev)")
    t_all = time.perf_counter()
    # one launch per matrix and world size (each launch has its own time limit)
    chosen = {"zero": ZERO_MATRIX + (NVME_MATRIX if nvme else ()), "lora": LORA_MATRIX, "quant": QUANT_MATRIX,
              "mixed": MIXED_MATRIX}
    launches = [(TINY_BASE, w, chosen[m]) for m in chosen if m in args.matrices for w in args.worlds]
    if not args.no_other_shapes and "zero" in args.matrices:
        launches += [(base, 2, ZERO_MATRIX) for base in OTHER_BASES]
    if "moe" in args.matrices:
        launches += [(base, w, MOE_MATRIX) for base in MOE_BASES for w in args.worlds if w <= 2]
    for base, world, matrix in launches:
        t0 = time.perf_counter()
        if base != TINY_BASE:
            m = tiny_model(base=base)
            print(f"model: {m.name} ({m.params_total:,} params, tied head: {m.tie_word_embeddings}), {world} rank(s)")
        setups = [Setup(**kw, gpus=world, seq=TINY_SEQ) for kw in matrix]
        print_rank_rows(compare_setups(setups, world, base), world, _name, 44, errors)
        print(f"  ({world} rank{'s' if world > 1 else ''}: {time.perf_counter() - t0:.1f} s for {len(setups)} setups)")
    print_error_summary(errors, t_all)
    for kw, why in UNVERIFIED:
        print(f"not verified: {kw}: {why}")
    if args.timing:
        from vramplan.estimator import estimate
        from vramplan.model.profiles import load_model

        big = load_model("meta-llama/Llama-3.1-8B")
        setups = [Setup(**kw, gpus=8, seq=2048) for kw in ZERO_MATRIX]
        n = 2000
        t0 = time.perf_counter()
        for i in range(n):
            estimate(big, setups[i % len(setups)])
        print(f"estimate() under ZeRO: {(time.perf_counter() - t0) / n * 1e3:.3f} ms per call (Llama-3.1-8B, 8 GPUs)")


if __name__ == "__main__":
    main()
