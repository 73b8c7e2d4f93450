"""Cost model vs published fine-tuning throughput, printed as tables. Prints; asserts nothing.

    python benchmarks/throughput_accuracy.py            # the shipped cost model (vramplan/cost/model.py, committed
                                                        # constants), the refit (vramplan/cost/fit.py) and
                                                        # its leave-one-out table
    python benchmarks/throughput_accuracy.py --excluded # also the excluded records, counted by reason

Records: calibration/throughput/records.jsonl (README.md there). Bar (issue 12 item 6): median
predicted/measured within 0.85-1.15 and >= 85 % of same-model pairs ordered as measured.
"""

from __future__ import annotations

import argparse
import collections
import time

from vramplan.cost.throughput import ThroughputRow, comparable, compare, load_records, pairs, summarize


def describe(r: ThroughputRow) -> str:
    s = r.setup
    m = s.method + (f" r{s.lora_rank} {s.lora_targets}" if s.adapters else "")
    fsdp = s.fsdp if s.fsdp != "none" else ""
    return f"{m} {s.precision} {'ckpt ' if s.checkpointing else ''}{s.attn} {fsdp}".strip()


def print_rows(title: str, rows: list[ThroughputRow]) -> None:
    print(title)
    print(f"{'id':20s} {'model':13s} {'gpus':>4s} {'b x s':>7s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}  "
          f"top terms (s/step)  setup")
    for r in rows:
        top = sorted(((v, k) for k, v in r.terms_s.items() if v > 0), reverse=True)[:3]
        terms = " ".join(f"{k} {v:.2f}" for v, k in top)
        print(f"{r.id:20s} {r.model:13s} {r.gpus:4d} {f'{r.setup.batch}x{r.setup.seq}':>7s} "
              f"{r.measured_tokens_per_s:9,.0f} {r.predicted_tokens_per_s:9,.0f} {r.ratio:6.3f}  "
              f"{terms:34s} {describe(r)}")


def print_summary(name: str, rows: list[ThroughputRow]) -> None:
    s = summarize(rows)
    bar = "meets" if 0.85 <= s.median_ratio <= 1.15 and s.pair_share >= 0.85 else "misses"
    print(f"{name:26s} rows {s.rows:3d}  median {s.median_ratio:5.3f}  range {s.min_ratio:5.3f}-{s.max_ratio:5.3f} "
          f"(spread {s.spread:4.2f}x)  pairs ordered {s.pairs_ordered}/{s.pairs} = {s.pair_share:5.1%}  "
          f"-> {bar} the bar")
    wrong = [p for p in pairs(rows) if not p.ordered]
    for p in wrong:
        print(f"    misordered: {p.a.id} {describe(p.a)} b{p.a.setup.batch} "
              f"({p.a.measured_tokens_per_s:,.0f} measured, "
              f"{p.a.predicted_tokens_per_s:,.0f} predicted) vs {p.b.id} {describe(p.b)} b{p.b.setup.batch} "
              f"({p.b.measured_tokens_per_s:,.0f}, {p.b.predicted_tokens_per_s:,.0f})")


def what_if() -> None:
    """The effects the committed model implies for knobs the comparable rows do not vary."""
    from dataclasses import replace

    from vramplan.cost import model as cost
    from vramplan.model.profiles import load_gpu, load_model
    from vramplan.specs import Setup

    gpu, mistral, mixtral = load_gpu("a100-80gb"), load_model("mistral-7b"), load_model("mixtral-8x7b")
    lora = Setup(method="lora", lora_rank=16, lora_alpha=16, lora_dropout=0.1,
                 lora_targets="q_proj,k_proj,v_proj,o_proj", checkpointing=True, attn="flash", batch=4, seq=4096)
    full = Setup(checkpointing=True, attn="flash", batch=4, seq=4096)

    def tps(setup, model=mistral):
        return cost.tokens_per_s(model, setup, gpu)

    print("\nwhat the committed model implies (Mistral-7B, 1x A100-80GB, 4 x 4096 packed, checkpointing):")
    print(f"  all-linear / attention-only LoRA   {tps(replace(lora, lora_targets='all-linear')) / tps(lora):5.3f}")
    print(f"  eager / flash attention, full      {tps(replace(full, attn='eager')) / tps(full):5.3f}"
          "   (EAGER_SCORE_BYTES not fitted: no comparable eager row)")
    print(f"  SDPA with a padding mask / flash   {tps(replace(full, attn='sdpa', pad_mask=True)) / tps(full):5.3f}")
    q = replace(lora, method="qlora", quant="nf4")
    print(f"  QLoRA / full on one GPU            {tps(q) / tps(full):5.3f}   (measured 2904/3063 = 0.948)")
    print(f"  QLoRA / LoRA on one GPU            {tps(q) / tps(lora):5.3f}   (measured 2904/3324 = 0.874)")
    wide = replace(lora, lora_targets="all-linear")
    print(f"  LoRA r256 / r16 (all-linear)       {tps(replace(wide, lora_rank=256)) / tps(wide):5.3f}")
    print(f"  no checkpointing / checkpointing   {tps(replace(full, checkpointing=False)) / tps(full):5.3f} (full)")
    t4 = cost.counts(mixtral, q, cost.Stack(transformers="4.48.1")).dequant_bytes_per_pass
    t5 = cost.counts(mixtral, q).dequant_bytes_per_pass
    print(f"  Mixtral QLoRA dequantized per pass {t4 / 1e9:5.0f} GB (transformers 4.x experts as Linears; 5.x: "
          f"{t5 / 1e9:.0f} GB, 3-D experts stay unquantized); "
          f"Mistral {cost.counts(mistral, q).dequant_bytes_per_pass / 1e9:.0f} GB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--excluded", action="store_true", help="count the excluded records by reason")
    args = ap.parse_args()
    t0 = time.perf_counter()
    records = load_records()
    by_source = collections.Counter((r["source"]["repo"], r["source"]["path"], r["comparable"]) for r in records)
    print(f"{len(records)} published rows, {len(comparable(records))} comparable")
    for (repo, path, comp), n in sorted(by_source.items()):
        print(f"  {n:4d} {'comparable' if comp else 'excluded  '} {repo}/{path}")
    if args.excluded:
        reasons = collections.Counter(r["exclusion"].split(";")[0] for r in records if not r["comparable"])
        print("\nexcluded, by first reason:")
        for why, n in reasons.most_common():
            print(f"  {n:4d} {why}")
    print()
    shipped = compare(records)
    print_rows("committed cost model (vramplan/cost/model.py), tokens/s per GPU:", shipped)
    from vramplan.cost import fit as cost_fit
    from vramplan.cost import model as cost

    fit = cost_fit.fit(records)
    print("\nconstants: committed (vramplan/cost/model.py) vs refit on these rows (vramplan/cost/fit.py):")
    for name, value in cost.CONSTANTS.items():
        print(f"  {name:22s} {value:10.4g}  refit {fit.constants[name]:10.4g}  ({cost.CONSTANT_ROWS[name]}; "
              f"{fit.rows_per_constant.get(name, 0)} rows exercise it)")
    print(f"  -> MFU on A100 (executed FLOPs incl. recompute) {1 / cost.CONSTANTS['inv_mfu:a100']:.3f}; "
          f"other GPU classes {cost.MFU:.2f} (no published row)")
    loo = cost_fit.leave_one_out(records)
    print()
    print_rows("leave-one-out (each row predicted by constants fitted on the others):", loo)
    print()
    print_summary("committed cost model", shipped)
    print_summary("leave-one-out", loo)
    what_if()
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
