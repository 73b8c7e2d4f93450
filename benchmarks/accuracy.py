"""Estimate vs trace: the error table (median and worst per family). Prints; asserts nothing.

    python benchmarks/accuracy.py            # 4-layer truncations, every family, 2 shapes
    python benchmarks/accuracy.py --full     # whole models (traced at 2 and 3 layers, extrapolated)
"""

from __future__ import annotations

import argparse
import statistics
import time

from vramplan.accuracy import FAMILY_MODELS, compare
from vramplan.specs import Setup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="whole models instead of 4-layer truncations")
    ap.add_argument("--shapes", default="1x512,4x4096")
    args = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    layers = None if args.full else 4
    per_family: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    print(f"{'family':12s} {'method':6s} {'ckpt':4s} {'b x s':>9s} {'trace GiB':>10s} {'est GiB':>9s} {'error':>8s}  note")
    for family, model in FAMILY_MODELS.items():
        for method in ("full", "lora"):
            for ckpt in (False, True):
                for b, s in shapes:
                    setup = Setup(method=method, checkpointing=ckpt, batch=b, seq=s)
                    row = compare(model, setup, layers=layers)
                    per_family.setdefault(family, []).append(row.error)
                    flag = "over 5 %" if abs(row.error) > 0.05 else ""
                    print(f"{family:12s} {method:6s} {int(ckpt):4d} {f'{b}x{s}':>9s} {row.traced_bytes / 2**30:10.2f} "
                          f"{row.estimated_bytes / 2**30:9.2f} {row.error:+8.2%}  {flag}", flush=True)
    print()
    print(f"{'family':12s} {'median |err|':>12s} {'worst':>8s}")
    for family, errs in per_family.items():
        worst = max(errs, key=abs)
        print(f"{family:12s} {statistics.median(abs(e) for e in errs):12.2%} {worst:+8.2%}")
    allerr = [abs(e) for errs in per_family.values() for e in errs]
    print(f"{'all':12s} {statistics.median(allerr):12.2%} {max(allerr):8.2%}   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
