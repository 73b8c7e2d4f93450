"""PyTorch FSDP and DDP: per-rank estimate vs the real N-process run. Prints; asserts nothing.

    python benchmarks/fsdp_accuracy.py            # the validate matrix: N in {1, 2, 4}, every strategy, offload, LoRA,
                                                  # QLoRA, 8-bit AdamW, fp16, checkpointing, accumulation, DDP;
                                                  # two other shapes on 2 ranks, NO_SHARD LoRA on the untied one
                                                  # (about 4 min)
    python benchmarks/fsdp_accuracy.py --quick    # the `vramplan validate --quick` subset

The truth is vramplan/truths/fsdp.py: N CPU processes (gloo), the tiny Llama-3.2 the ZeRO truth uses,
wrapped by accelerate's own FSDP1 preparation with the emitted plugin values (or torch DDP with
accelerate's defaults), the canonical step twice, each rank's live tensors counted with FSDP's
CPU-offloaded ones apart. One launch per (shape, world size).
"""

from __future__ import annotations

import argparse
import time

from _common import print_error_summary, print_rank_rows  # benchmarks/_common.py (scripts run from this folder)

from vramplan.specs import Setup
from vramplan.truths.fsdp import UNVERIFIED, compare_setups, launches
from vramplan.truths.tiny import TINY_SEQ, tiny_model


def _name(s: Setup) -> str:
    kind = f"FSDP {s.fsdp.upper()}" if s.fsdp != "none" else ("DDP" if s.gpus > 1 else "1 GPU")
    extra = (" QLoRA" if s.method == "qlora" else " LoRA" if s.adapters else "") + (" ckpt" if s.checkpointing else "")
    extra += (f" {s.precision}" if s.precision != "bf16" else "")
    extra += " 8-bit AdamW" if s.optimizer == "adamw-8bit" else ""
    extra += f" accum {s.grad_accum}" if s.grad_accum > 1 else ""
    return kind + extra + (" CPU offload" if s.offload_params == "cpu" else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"{'setup':34s} {'N':>2s} {'rank':>4s} {'truth':>10s} {'estimate':>10s} {'error':>7s} "
          f"{'phase t/e':>19s} {'host truth':>11s} {'host est':>9s} {'host err':>8s}")
    errors: list[float] = []
    t_all = time.perf_counter()
    last_base = None
    for base, world, matrix in launches(args.quick):
        t0 = time.perf_counter()
        if base != last_base:
            m = tiny_model(base=base)
            print(f"model: {m.name} ({m.params_total:,} params, tied head: {m.tie_word_embeddings}, seq {TINY_SEQ})")
            last_base = base
        setups = [Setup(**kw, gpus=world, seq=TINY_SEQ) for kw in matrix]
        print_rank_rows(compare_setups(setups, world, base), world, _name, 34, errors)
        print(f"  ({world} rank{'s' if world > 1 else ''}: {time.perf_counter() - t0:.1f} s for {len(setups)} setups)")
    print_error_summary(errors, t_all)
    for knob, kw, gpus, why in UNVERIFIED:
        print(f"not verified ({knob}, {kw}, {gpus} GPUs): {why}")


if __name__ == "__main__":
    main()
