"""Consumer-card plans (issue 28): what `vramplan plan` answers on 8-24 GB cards.

    python benchmarks/consumer_plans.py [--frameworks trl,unsloth] [--seqs 2048,8192] [--list tight,none] [--json]

For every model x card x sequence length x framework: the plan the command prints (in-process,
with the card's shipped calibration, as ``vramplan plan MODEL --gpu CARD --seq S --framework F``),
sorted into "fits" (with the estimate's error band and the allocator allowance as margin), "tight"
(fits only without them) and "no fit", with the headroom, and the properties issue 28's bar asks
of every plan: in VRAM (no ZeRO/FSDP, no parameter/optimizer offload on one GPU) and LoRA rank
<= 64. Prints a summary table per card and per model, then the plans of the classes ``--list``
names. About 2 minutes on 2 cores for the whole grid. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict

MODELS = ["llama-3.2-3b", "qwen2.5-3b", "phi-3.5-mini", "qwen3-4b", "gemma-3-4b", "mistral-7b", "qwen2.5-7b",
          "llama-3.1-8b", "qwen3-8b", "gemma-2-9b", "mistral-nemo", "gemma-3-12b", "phi-4", "qwen2.5-14b",
          "qwen3-14b"]
CARDS = ["rtx-4060", "rtx-3060-ti", "rtx-3080-10gb", "rtx-3060-12gb", "rtx-4070", "rtx-4060-ti-16gb", "t4",
         "rtx-3090", "rtx-4090"]
SEQS = [2048, 4096, 8192, 16384, 32768]
FRAMEWORKS = ["trl", "unsloth"]


def one(model: str, card: str, seq: int, framework: str) -> dict:
    """The plan of one question as a row: its class, headroom and the bar's properties."""
    import vramplan
    from vramplan.estimator.corrections import calibration_for

    corrections, _ = calibration_for(card)  # the card class's, as the command applies it
    p = vramplan.plan(model, card, seq=seq, framework=framework, corrections=corrections)
    s, b = p.setup, p.breakdown
    usable = b.gpu.usable_memory_bytes
    offloaded = s.zero_stage > 0 or s.fsdp != "none" or s.offload_params != "none" or s.offload_optimizer != "none"
    cls = "none" if not p.fits else "tight" if p.tight else "fits"
    return {"model": model, "card": card, "seq": seq, "framework": framework, "class": cls,
            "method": s.method, "quant": s.quant, "rank": s.lora_rank if s.method != "full" else None,
            "batch": s.batch, "checkpointing": s.checkpointing, "tiled_mlp": getattr(s, "tiled_mlp", False),
            "act_offload": getattr(s, "activation_offload", None),
            "need_gib": round(b.device_total_bytes / 2**30, 2), "usable_gib": round(usable / 2**30, 2),
            "free_pct": round(100 * (usable - b.device_total_bytes) / usable, 1),
            "in_vram": not offloaded, "rank_ok": s.method == "full" or s.lora_rank <= 64}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cards", default=",".join(CARDS))
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--list", default="tight", help="classes whose plans to print: fits,tight,none (or '')")
    ap.add_argument("--json", action="store_true", help="print every row as JSON lines instead")
    a = ap.parse_args()
    rows = [one(m, c, int(q), f) for m in a.models.split(",") for c in a.cards.split(",")
            for q in a.seqs.split(",") for f in a.frameworks.split(",")]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    total = Counter(r["class"] for r in rows)
    print(f"{len(rows)} plans: fits {total['fits']}, tight {total['tight']}, no fit {total['none']}; "
          f"not in VRAM {sum(not r['in_vram'] for r in rows if r['class'] != 'none')}, "
          f"rank > 64 {sum(not r['rank_ok'] for r in rows if r['class'] != 'none')}, "
          f"fits with < 10 % free {sum(r['class'] == 'fits' and r['free_pct'] < 10 for r in rows)}")
    for key in ("card", "model", "seq"):
        by = defaultdict(Counter)
        for r in rows:
            by[r[key]][r["class"]] += 1
        print(f"\n{key:<20} {'fits':>5} {'tight':>6} {'none':>5}")
        for k, c in by.items():
            print(f"{k!s:<20} {c['fits']:>5} {c['tight']:>6} {c['none']:>5}")
    wanted = [w for w in a.list.split(",") if w]
    for r in rows:
        if r["class"] in wanted:
            print(f"{r['class']:<5} {r['model']:<13} {r['card']:<20} {r['seq']:>6} {r['framework']:<8} "
                  f"{r['method']}/{r['quant']} r{r['rank']} b{r['batch']} ckpt={r['checkpointing']} "
                  f"tiled={r['tiled_mlp']} {r['need_gib']}/{r['usable_gib']} GiB ({r['free_pct']} % free)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
