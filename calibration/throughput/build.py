"""Build calibration/throughput/records.jsonl from the published tables copied under sources/.

    python calibration/throughput/build.py            # rewrite records.jsonl
    python calibration/throughput/build.py --check    # exit 1 when records.jsonl is not what the sources give

Deterministic: the same sources give the same bytes (no clock, no network, rows in source order).
One record per published row, including rows vramplan cannot compare (fused kernels, padding-free
attention, models it does not ship, OOM rows): `comparable` and `exclusion` say which and why.
The sources, their commits and what every field means are in README.md next to this file.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "sources"
RECORDS = HERE / "records.jsonl"

FMS_REPO = "foundation-model-stack/fms-acceleration"
#: the snapshot the files were copied from (github.com/foundation-model-stack/fms-acceleration, HEAD)
FMS_SNAPSHOT = "876e2ed6fc4e966785e3f4315f5ee3cdf8e3d097"
#: per published CSV: the commit that last changed it, its pip freeze, and what its runs share
FMS_TABLES = {
    "scripts/benchmarks/refs/a100_80gb.csv": {
        "commit": "24bdadb228e2d55bc0c69deec034b86a73da6917",
        "requirements": "scripts/benchmarks/refs/requirements.txt", "max_steps": 100, "seq": 4096, "packed": True},
    "scripts/benchmarks/refs/a100_80gb_granite.csv": {
        "commit": "fc78b55b65446fbade0306ac2e619a6182bfea47",
        "requirements": "scripts/benchmarks/refs/requirements_granite.txt",
        "max_steps": 100, "seq": 4096, "packed": True},
    "scripts/benchmarks/refs/a100_80gb_liger.csv": {
        "commit": "733992ae7355567805de92eacf4a9973c8fd4164",
        "requirements": "scripts/benchmarks/refs/requirements_liger.txt",
        "max_steps": 100, "seq": 4096, "packed": True},
    "scripts/benchmarks/refs/a100_80gb_moe.csv": {
        "commit": "9122a76e6ea3003e78102ef39f0a712683ff2cef",
        "requirements": "scripts/benchmarks/refs/requirements_moe.txt", "max_steps": None, "seq": 4096, "packed": True},
    "scripts/benchmarks/refs_orca/a100_80gb_pf.csv": {
        "commit": "3cf092a656c94bac36917f228868403e9e9955b9",
        "requirements": "scripts/benchmarks/refs_orca/requirements_pf.txt",
        "max_steps": None, "seq": None, "packed": False},
    # deleted from the repository in 2f98563a ("update benches (remove l40)"); copied at the last commit that
    # has it, with that commit's scenarios.yaml / defaults.yaml / accelerate.yaml (sources/fms-acceleration/
    # at-8af8fa7d/): torch_dtype float16 for every scenario; no requirements file (fms-hf-tuning from a fork
    # branch); 20 steps (train_runtime x train_steps_per_second; defaults.yaml says max_steps 100)
    "scripts/benchmarks/refs/l40_40gb.csv": {
        "commit": "8af8fa7de2b2065302455b4552b85d515b8ff814", "snapshot": "8af8fa7de2b2065302455b4552b85d515b8ff814",
        "requirements": None, "max_steps": 20, "seq": 4096, "packed": True, "torch_dtype": "float16",
        "gpu": "l40", "gpu_note": "refs/l40_40gb.csv, linked as 'L40-40GB' in the README at 8af8fa7d: NVIDIA L40 "
                                  "(a 48 GB PCIe card; not the L40S), 1-2 cards, GPU link not stated",
        "no_profile": "NVIDIA L40 has no vramplan GPU profile (profiles/gpus.json ships the L40S, the same chip at "
                      "twice the dense 16-bit tensor rate)"},
}
A100_NOTE = "refs/a100_80gb*.csv: NVIDIA A100 80GB; SXM or PCIe and the GPU-to-GPU link are not stated"
FMS_PINNED = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "flash-attn", "flash_attn", "trl",
              "fms-hf-tuning")

MISTRAL_V01 = ("mistralai/Mistral-7B-v0.1 mapped to the shipped mistral-7b (v0.3): v0.3 differs only in its "
               "vocabulary (32768 vs 32000 rows of embedding and head, +0.04 % of the parameters) and "
               "sliding_window (null vs 4096; at seq 4096 the window covers the whole sequence), which matters "
               "little for throughput")
#: published model id -> (vramplan model reference, note); None: not shipped
MODELS = {
    "mistralai/Mistral-7B-v0.1": ("mistral-7b", MISTRAL_V01),
    "TheBloke/Mistral-7B-v0.1-GPTQ": ("mistral-7b", MISTRAL_V01 + "; a GPTQ 4-bit checkpoint of it"),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (
        "mixtral-8x7b", "the Instruct fine-tune of the shipped mixtral-8x7b (Mixtral-8x7B-v0.1): same config.json "
                        "architecture (a chat fine-tune; max_position_embeddings and rope_theta equal)"),
    "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ": ("mixtral-8x7b", "a GPTQ 4-bit checkpoint of Mixtral-8x7B-Instruct"),
    "NousResearch/Llama-2-70b-hf": ("llama-2-70b", "NousResearch's ungated copy of meta-llama/Llama-2-70b-hf"),
    "TheBloke/Llama-2-70B-GPTQ": ("llama-2-70b", "a GPTQ 4-bit checkpoint of Llama-2-70b"),
    "meta-llama/Meta-Llama-3-8B": ("llama-3-8b", None),
    "TechxGenus/Meta-Llama-3-8B-GPTQ": ("llama-3-8b", "a GPTQ 4-bit checkpoint of Meta-Llama-3-8B"),
}
LORA_ATTN = "q_proj,k_proj,v_proj,o_proj"

FMS_SHARED_UNEXPRESSIBLE = [
    "HF Trainer max_grad_norm=1.0 (a gradient-norm clip every step)",
    "train_runtime covers all 100 steps including the first (allocation, CUDA graphs of nothing: warm-up) "
    "and logging every 10 steps",
]


def _fms_framework(cfg: str, peft: str, model: str, gpus: int, torch_dtype: str) -> tuple[dict, list[str], str | None]:
    """(Setup keyword arguments, what vramplan cannot express, exclusion reason or None) of one
    fms framework_config (sample-configurations/CONTENTS.yaml)."""
    kw: dict = {}
    unexp: list[str] = []
    why = None
    if "foak" in cfg:
        why = ("fms fused-ops-and-kernels (Triton fused LoRA/QLoRA MLP and attention projections, RoPE, RMSNorm, "
               "cross-entropy): kernels vramplan's Setup does not describe")
    if "liger" in cfg:
        why = "Liger kernels (fused RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): not a Setup choice"
    if cfg.startswith("aadp-padding-free") or "padding-free" in cfg:
        why = "padding-free attention (flash-attn varlen over unpadded tokens): not a Setup choice"
    if cfg.startswith("moe-scattermoe"):
        why = "ScatterMoE kernels with expert parallelism: not a Setup choice"
    if cfg == "accelerated-peft-bnb":
        why = ("fms accelerated-peft bnb plugin: its own k-bit preparation (no fp32 upcast of the non-quantized "
               "parameters, unlike peft's prepare_model_for_kbit_training that vramplan's QLoRA step follows)")
    if cfg.startswith("accelerated-peft-autogptq"):
        why = ("fms accelerated-peft GPTQ: AutoGPTQ's Triton v2 QuantLinear extracted into the plugin, not "
               "gptqmodel's torch path that vramplan's GPTQ base models")
    if peft == "lora":
        kw.update(method="lora", lora_rank=16, lora_alpha=16, lora_dropout=0.1, lora_targets=LORA_ATTN)
    if cfg in ("baseline-peft-bnb", "accelerated-peft-bnb") or cfg.startswith("accelerated-peft-bnb"):
        kw.update(method="qlora", quant="nf4", double_quant=True)
        if gpus > 1 and why is None:
            unexp.append("FSDP-sharded QLoRA: TRL's SFTTrainer skips peft's prepare_model_for_kbit_training "
                         "(is_sharded_qlora) so the non-quantized parameters stay bf16; bnb_4bit_quant_storage=bf16")
    if kw.get("method") == "qlora" and "Mixtral" in model:
        unexp.append("transformers 4.x Mixtral: the experts are nn.Linear modules bitsandbytes quantizes to 4 bits "
                     "(vramplan's estimator follows transformers 5, whose 3-D expert tensors stay unquantized)")
    if cfg.startswith("accelerated-peft-autogptq"):
        kw.update(quant="gptq", quant_bits=4, quant_group_size=128)
    if "gptq" in model.lower() and gpus > 1:
        why = (why or "") + "; a GPTQ base under FSDP is not a Setup vramplan models"
    kw["precision"] = "fp16" if torch_dtype == "float16" else "bf16"
    return kw, unexp, why


def _pins(path: str | None) -> dict[str, str]:
    pins: dict[str, str] = {}
    if path is None:
        return pins
    for line in (SOURCES / "fms-acceleration" / path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)$", line.strip())
        if m and m.group(1) in FMS_PINNED:
            pins[m.group(1).replace("_", "-")] = m.group(2)
    return dict(sorted(pins.items()))


def _num(s: str | None) -> float | None:
    s = (s or "").strip()
    return float(s) if s else None


def _setup_dict(kw: dict) -> dict:
    from vramplan.specs import Setup

    return Setup(**kw).to_dict()


def fms_records() -> list[dict]:
    out = []
    for path, meta in FMS_TABLES.items():
        table = path.rsplit("/", 1)[-1].removesuffix(".csv")
        pins = _pins(meta["requirements"])
        with open(SOURCES / "fms-acceleration" / path, newline="") as f:
            rows = list(csv.DictReader(f))
        for i, r in enumerate(rows):
            cfg = (r.get("framework_config") or "none").strip() or "none"
            published_model = (r.get("model_name_or_path") or "").strip()
            gpus = int(float(r["num_gpus"]))
            bs = int(float(r["per_device_train_batch_size"]))
            ga = int(float(r.get("gradient_accumulation_steps") or 1))
            peft = (r.get("peft_method") or "").strip()
            dtype = (r.get("torch_dtype") or "").strip() or meta.get("torch_dtype", "")
            tps = _num(r.get("train_tokens_per_second"))
            runtime = _num(r.get("train_runtime"))
            model_ref, model_note = MODELS.get(published_model, (None, None))
            kw, unexp, why = _fms_framework(cfg, peft, published_model, gpus, dtype)
            unexp = list(FMS_SHARED_UNEXPRESSIBLE) + unexp
            seq = meta["seq"]
            if published_model == "bigcode/gpt_bigcode-santacoder":
                seq = 2048  # its n_positions; train_tokens_per_second x train_runtime / (100 x bs) = 2048
            tokens_per_seq = None
            if tps is not None and runtime and meta["max_steps"]:
                tokens_per_seq = round(tps * runtime / (meta["max_steps"] * bs * ga), 1)
            if not published_model:
                why = "the CSV does not name the model"
            elif model_ref is None:
                why = f"{published_model} is not a shipped vramplan profile" + (f"; {why}" if why else "")
            if not meta["packed"]:
                why = ("padded batches (orca-math-word-problems, each batch padded to its longest sequence): the "
                       "per-batch lengths are not published, so tokens per micro-batch are unknown") + (
                    f"; {why}" if why else "")
            if meta.get("no_profile"):
                why = meta["no_profile"] + (f"; {why}" if why else "")
            if tps is None:
                why = "no throughput published (the run ran out of memory or was not run)" + (f"; {why}" if why else "")
            setup = None
            if model_ref is not None and seq is not None and not ("gptq" in published_model.lower() and gpus > 1):
                kw.update(checkpointing=True, attn="flash", batch=bs, seq=seq, grad_accum=ga, gpus=gpus,
                          optimizer="adamw")
                if gpus > 1:
                    kw["fsdp"] = "full_shard"
                setup = _setup_dict(kw)
            out.append({
                "id": f"fms-{table}-r{i:03d}",
                "source": {"repo": FMS_REPO, "path": path, "commit": meta["commit"],
                           "snapshot": meta.get("snapshot", FMS_SNAPSHOT),
                           "line": i + 2, "row": i,
                           "url": f"https://github.com/{FMS_REPO}/blob/{meta['commit']}/{path}#L{i + 2}"},
                "framework": "fms-hf-tuning sft_trainer (HF Trainer via TRL SFTTrainer) + fms-acceleration "
                             f"framework_config={cfg}; accelerate FSDP FULL_SHARD when num_gpus > 1",
                "software": pins,
                "published_model": published_model,
                "model": model_ref,
                "model_note": model_note,
                "gpu": meta.get("gpu", "a100-80gb"),
                "gpu_note": meta.get("gpu_note", A100_NOTE),
                "gpu_count": gpus,
                "config": {"framework_config": cfg, "peft_method": peft or None, "r": _num(r.get("r")),
                           "lora_alpha": _num(r.get("lora_alpha")), "lora_dropout": 0.1 if peft else None,
                           "target_modules": (r.get("target_modules") or "").strip() or None,
                           "torch_dtype": dtype, "bf16": (r.get("bf16") or "").strip() == "True",
                           "fp16": (r.get("fp16") or "").strip() == "True",
                           "per_device_train_batch_size": bs, "gradient_accumulation_steps": ga,
                           "max_seq_len": seq, "packing": meta["packed"], "gradient_checkpointing": True,
                           "attention": "flash_attention_2 (use_flash_attn: true)", "optimizer": "adamw_torch",
                           "max_steps": meta["max_steps"]},
                "setup": setup,
                "published": {"value": tps, "unit": "train_tokens_per_second",
                              "meaning": "HF Trainer's train_tokens_per_second (include_tokens_per_second): tokens "
                                         "of one device's dataloader over train_runtime, i.e. per GPU",
                              "train_runtime_s": runtime,
                              "train_steps_per_second": _num(r.get("train_steps_per_second")),
                              "tokens_per_sequence_check": tokens_per_seq},
                "tokens_per_s_per_gpu": tps,
                "unexpressible": unexp,
                "comparable": why is None and setup is not None,
                "exclusion": why if why is not None else (None if setup is not None else "no Setup expresses it"),
            })
    return out


TORCHTUNE_REPO = "pytorch/torchtune"
TORCHTUNE_COMMIT = "0031bfb080bd35ec533c412df883cf2bf7bf7fe4"
TORCHTUNE_MODELS = {"Llama 3.1 8B": "llama-3.1-8b", "Llama 3.1 70B": "llama-3.1-70b", "Llama 3.1 405B": None}
TORCHTUNE_GPUS = {"4090": "rtx-4090", "A6000": "rtx-a6000", "A100": "a100-80gb"}


def torchtune_records() -> list[dict]:
    path = SOURCES / "torchtune" / "README-memory-and-training-speed.md"
    out = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        m = re.match(r"^\|\s*(Llama 3\.1 \w+)\s*\|\s*([^|]+?)\s*\|\s*(\d+)x (\w+)\s*\|"
                     r"\s*([^|]+?)\s*\|\s*(\d+)\s*\|$", line)
        if not m:
            continue
        model, method, count, gpu, peak, tps = m.groups()
        count, tps = int(count), float(tps)
        readme_line = n - 2  # the excerpt's 3-line header comment; README.md line numbers are not kept
        out.append({
            "id": f"torchtune-readme-speed-{len(out)}",
            "source": {"repo": TORCHTUNE_REPO, "path": "README.md", "commit": TORCHTUNE_COMMIT,
                       "snapshot": TORCHTUNE_COMMIT, "line": None, "row": len(out), "excerpt_line": readme_line,
                       "url": f"https://github.com/{TORCHTUNE_REPO}/blob/{TORCHTUNE_COMMIT}/README.md#memory-and-training-speed"},
            "framework": "torchtune recipes (torchtune's own model code), torch.compile",
            "software": {},
            "published_model": f"meta-llama/{model.replace(' ', '-')}-Instruct (README: {model})",
            "model": TORCHTUNE_MODELS[model],
            "model_note": ("the Instruct model; same architecture as the shipped base"
                           if TORCHTUNE_MODELS[model] else None),
            "gpu": TORCHTUNE_GPUS[gpu],
            "gpu_note": "A100: 80GB assumed" if gpu == "A100" else None,
            "gpu_count": count,
            "config": {"method": method, "batch_size": 2, "gradient_accumulation_steps": 1, "max_seq_len": 2048,
                       "packing": True, "compile": True, "peak_memory_per_gpu": peak,
                       "note": "** rows: CPU offload with a fused optimizer"},
            "setup": None,
            "published": {"value": tps, "unit": "Tokens/sec",
                          "meaning": "tokens/s measured over one full epoch; per GPU on 1 GPU, per GPU or aggregate "
                                     "over 8 GPUs not stated",
                          "train_runtime_s": None, "train_steps_per_second": None, "tokens_per_sequence_check": None},
            "tokens_per_s_per_gpu": tps if count == 1 else None,
            "unexpressible": ["torchtune's own modelling code (not transformers)", "torch.compile",
                              "the table states neither activation checkpointing, optimizer nor loss per row"],
            "comparable": False,
            "exclusion": "torchtune's own model code under torch.compile, with per-row recipe settings the table "
                         "does not state (vramplan's cost model is of the HF transformers step)",
        })
    return out


FSDP_QLORA_REPO = "AnswerDotAI/fsdp_qlora"
FSDP_QLORA_PATH = "benchmarks_03_2024.md"
#: the commit that last changed benchmarks_03_2024.md (its only commit); sources/fsdp_qlora/ is a copy of it
FSDP_QLORA_COMMIT = "e877dda5026dfd964cccdb92a4532da587cbdae0"
#: the repository's HEAD when the copy was checked (the file is unchanged there)
FSDP_QLORA_SNAPSHOT = "05ed9f2a60f96a0795cb082bceab70a9b19fd213"
FSDP_QLORA_MODELS = {
    "Llama-2 7B": ("meta-llama/Llama-2-7b-hf", "llama-2-7b", None),
    "Yi 34B": ("01-ai/Yi-34B", "yi-34b", None),
    "Llama-2 70B": ("meta-llama/Llama-2-70b-hf", "llama-2-70b", None),
    "Mistral 7B v0.2 Base": ("mistral-community/Mistral-7B-v0.2", "mistral-7b-v0.2",
                             "the base model of the shipped mistral-7b-v0.2 (Mistral-7B-Instruct-v0.2): the same "
                             "config.json architecture (vocabulary 32000, rope_theta 1e6, no sliding window)"),
}
#: accelerator as written -> (vramplan GPU or None, note)
FSDP_QLORA_GPUS = {
    "3090": ("rtx-3090", "2x RTX 3090 without NVLink, power-limited to 280 W, 'an older motherboard' with slow PCIe "
                         "lanes (the case study's words): the GPU link is slower than the profile's PCIe 4.0 x16"),
    "4090": ("rtx-4090", "2x RTX 4090 without NVLink, full PCIe 4.0 x16 lanes each, up to 400 W"),
    "A5000 24GB": (None, "NVIDIA RTX A5000: no vramplan GPU profile"),
    "A6000 Ada 48GB": ("rtx-6000-ada", "written 'A6000 Ada 48GB': the NVIDIA RTX 6000 Ada Generation (48 GB)"),
    "A100 40GB SMX": ("a100-40gb", "written 'A100 40GB SMX': A100 40GB SXM"),
    "H100 80GB SXM": ("h100-sxm", None),
}
TEMPLATE = ("case-study template: python train.py --model_name <model> --batch_size 1 --context_length 512 "
            "--train_type qlora --use_gradient_checkpointing True --reentrant_checkpointing True "
            "--use_cpu_offload False --dataset dummy --dataset_samples 1024 (lines 26-28)")
#: source line -> the run: gpu as written, GPUs, model, train type, batch, gradient accumulation, context,
#: sharding (full_shard / ddp), CPU offload, what the row's table states (checked against the copy)
FSDP_QLORA_ROWS: dict[int, dict] = {}


def _fq(lines, gpu, gpus, model, ga=1, ctx=2048, how=TEMPLATE, **over):
    for line, (train, batch, ddp, offload) in lines.items():
        FSDP_QLORA_ROWS[line] = {"gpu": gpu, "gpus": gpus, "model": model, "train": train, "batch": batch, "ga": ga,
                                 "ctx": over.get("ctxs", {}).get(line, ctx), "ddp": ddp, "offload": offload,
                                 "how": how, "note": over.get("notes", {}).get(line)}


_fq({34: ("QLoRA", 1, False, False)}, "3090", 2, "Llama-2 7B", ctx=512)
_fq({35: ("QLoRA", 1, False, False)}, "3090", 2, "Llama-2 7B", notes={
    35: "the prose beside the table says 'Training also takes longer: 800 seconds vs 550', contradicting the "
        "table's 1,082 / 1,564 s; the table is used"})
_fq({44: ("LoRA", 1, False, False)}, "3090", 2, "Llama-2 7B", ctx=512)
_fq({45: ("LoRA", 1, False, False), 57: ("QLoRA", 4, False, False), 58: ("QLoRA", 10, False, False),
     59: ("LoRA", 4, False, False), 60: ("LoRA", 6, False, False), 72: ("QLoRA", 8, True, False),
     73: ("LoRA", 4, True, False)}, "3090", 2, "Llama-2 7B")
_fq({89: ("QLoRA", 2, False, False), 90: ("QLoRA", 4, False, True)}, "3090", 2, "Yi 34B")
_fq({104: ("QLoRA", 2, False, True)}, "3090", 2, "Llama-2 70B")
FOUR = "the 4090 case study ran 'a subset of the tests': the 3090 template with the table's settings assumed"
_fq({125: ("LoRA", 4, True, False), 126: ("LoRA", 6, False, False), 127: ("LoRA", 10, False, True),
     128: ("QLoRA", 8, True, False), 129: ("QLoRA", 10, False, False), 130: ("QLoRA", 12, False, True)},
    "4090", 2, "Llama-2 7B", how=FOUR)
_fq({142: ("QLoRA", 2, False, False), 143: ("QLoRA", 4, False, True)}, "4090", 2, "Yi 34B", how=FOUR)
_fq({153: ("QLoRA", 2, False, True)}, "4090", 2, "Llama-2 70B", how=FOUR)
_fq({163: ("QLoRA", 12, False, True), 164: ("QLoRA", 1, False, True)}, "4090", 2, "Mistral 7B v0.2 Base", how=FOUR,
    ctxs={164: 24576})
HW = ("hardware table: 'the fastest possible combination of settings capable of training on context length 2048 "
      "with an effective batch size of 32 (or the closest we could get)': gradient accumulation = 32 / (GPUs x batch)")
for _line, _gpu, _n, _b, _off in ((184, "A5000 24GB", 2, 2, True), (185, "A5000 24GB", 4, 1, False),
                                  (186, "A5000 24GB", 8, 1, False), (187, "A6000 Ada 48GB", 2, 2, False),
                                  (188, "A6000 Ada 48GB", 4, 3, False), (189, "A100 40GB SMX", 2, 1, False),
                                  (190, "A100 40GB SMX", 4, 4, False), (191, "A100 40GB SMX", 8, 4, False),
                                  (192, "H100 80GB SXM", 4, 8, False)):
    _fq({_line: ("QLoRA", _b, False, _off)}, _gpu, _n, "Llama-2 70B", ga=max(1, round(32 / (_n * _b))), how=HW,
        notes={188: "32 / (4 x 3) is not an integer: gradient accumulation 3 (effective batch 36, the closest to 32) "
                    "assumed; it changes the token count by < 0.5 %"})

FSDP_QLORA_UNEXPRESSIBLE = [
    "fsdp_qlora's own training loop (not the HF Trainer / accelerate): PyTorch FSDP1 with its wrapping policy (LoRA "
    "modules wrapped as their own units), no gradient clipping, a CUDA-event time over the whole loop (first step, "
    "wandb logging and the DistributedSampler's padding included)",
    "peft of February-March 2024 (0.9-0.10; versions not stated): peft < 0.12 moves each adapter to its base "
    "layer's dtype (bfloat16 here, and the bf16 quant_storage of the 4-bit base), so the adapters run in 16 bits; "
    "vramplan's Setup models peft 0.21 (autocast_adapter_dtype: fp32 adapters). config.adapter_dtype says so and "
    "vramplan.cost.throughput prices the adapter path for it",
    "reentrant activation checkpointing (torch checkpoint_wrapper) instead of transformers' gradient_checkpointing",
]


def _md_table_row(lines: list[str], n: int) -> tuple[dict[str, str], str | None]:
    """The 1-based line ``n`` of a markdown table as {header: cell}, and the table's caption (the italic line
    after it)."""
    def cells(s: str) -> list[str]:
        return [c.strip() for c in s.strip().strip("|").split("|")]

    i = n - 1
    while not re.match(r"^\|\s*:?-", lines[i - 1]):
        i -= 1
    header = cells(lines[i - 2])
    j = n
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    caption = next((s.strip().strip("*") for s in lines[j:j + 3] if s.startswith("*")), None)
    return dict(zip(header, cells(lines[n - 1]), strict=True)), caption


def fsdp_qlora_records() -> list[dict]:
    lines = (SOURCES / "fsdp_qlora" / FSDP_QLORA_PATH).read_text().splitlines()
    out = []
    for row, (n, run) in enumerate(sorted(FSDP_QLORA_ROWS.items())):
        cells, caption = _md_table_row(lines, n)
        # what the table states must be what the run above says (a wrong line number fails here)
        assert cells.get("Train Type", run["train"]) == run["train"], (n, cells)
        assert (caption or "").startswith(run["model"]), (n, caption)
        assert "Train Type" in cells or f"{run['model']} {run['train']}" in caption, (n, caption)
        if "Batch Size" in cells:
            assert int(cells["Batch Size"]) == run["batch"], (n, cells)
        else:  # "*Llama-2 7B with a batch size of one*"
            assert "batch size of one" in (caption or "") and run["batch"] == 1, (n, caption)
        if "Context Length" in cells:
            assert int(cells["Context Length"].replace(",", "")) == run["ctx"], (n, cells)
        else:  # the caption, or the case study's template (512) for the first table
            assert f"Context Length of {run['ctx']}" in (caption or "") or run["ctx"] == 512, (n, caption)
        if "DDP" in cells:
            assert (cells["DDP"] == "True") == run["ddp"], (n, cells)
        offload = cells.get("CPU Offload", cells.get("CPU+Activation Offload", "False"))
        assert (offload == "True") == run["offload"], (n, cells)
        if "GPUs" in cells:
            assert (cells["Accelerator"], int(cells["GPUs"])) == (run["gpu"], run["gpus"]), (n, cells)
        seconds = float(cells["Time (s)"].replace(",", ""))
        published_model, model_ref, model_note = FSDP_QLORA_MODELS[run["model"]]
        gpu_ref, gpu_note = FSDP_QLORA_GPUS[run["gpu"]]
        gpus, batch, ga, ctx = run["gpus"], run["batch"], run["ga"], run["ctx"]
        # train.py: the dummy dataset's 1024 samples, cut to a multiple of batch x GA; DistributedSampler pads
        # each rank to ceil(samples / GPUs); every sample is exactly ctx tokens (a longer text, truncated)
        samples = 1024 - 1024 % (batch * ga)
        per_rank = -(-samples // gpus)
        tps = round(per_rank * ctx / seconds, 1)
        qlora = run["train"] == "QLoRA"
        kw = dict(method="qlora" if qlora else "lora", lora_rank=64, lora_alpha=16, lora_dropout=0.1,
                  lora_targets="k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj", precision="bf16",
                  optimizer="adamw", checkpointing=True, attn="sdpa", batch=batch, seq=ctx, grad_accum=ga, gpus=gpus,
                  fsdp="no_shard" if run["ddp"] else "full_shard", offload_params="cpu" if run["offload"] else "none")
        if qlora:
            kw.update(quant="nf4", double_quant=True)
        why = None
        if gpu_ref is None:
            why = gpu_note
        if run["offload"] and "CPU+Activation Offload" in cells:
            why = (why + "; " if why else "") + ("fsdp_qlora's activation offloading to the CPU "
                                                 "(--use_activation_cpu_offload): not TRL's OffloadActivations")
        setup = _setup_dict(kw)
        out.append({
            "id": f"fsdp-qlora-bench-l{n:03d}",
            "source": {"repo": FSDP_QLORA_REPO, "path": FSDP_QLORA_PATH, "commit": FSDP_QLORA_COMMIT,
                       "snapshot": FSDP_QLORA_SNAPSHOT, "line": n, "row": row,
                       "url": f"https://github.com/{FSDP_QLORA_REPO}/blob/{FSDP_QLORA_COMMIT}/{FSDP_QLORA_PATH}#L{n}"},
            "framework": "AnswerDotAI fsdp_qlora train.py (own FSDP loop; HF transformers AutoModelForCausalLM + "
                         "peft LoRA + bitsandbytes Linear4bit)",
            "software": {},
            "published_model": published_model,
            "model": model_ref,
            "model_note": model_note,
            "gpu": gpu_ref or "rtx-a5000",
            "gpu_note": gpu_note,
            "gpu_count": gpus,
            "config": {"table": caption, "train_type": run["train"].lower(), "lora_rank": 64, "lora_alpha": 16,
                       "lora_dropout": 0.1, "lora_target_modules": "train.py 'all': k,q,v,up,down,gate (no o_proj)",
                       "precision": "bf16 (train.py default: parameters cast to bfloat16, no autocast)",
                       "adapter_dtype": "bf16", "quant": "bnb NF4 Linear4bit, quant_storage bf16" if qlora else None,
                       "batch_size": batch, "gradient_accumulation_steps": ga, "context_length": ctx,
                       "dataset": "dummy, 1024 samples truncated to context_length (no padding)",
                       "sharding_strategy": "ddp (FSDP NO_SHARD)" if run["ddp"] else "full_shard",
                       "use_cpu_offload": run["offload"], "gradient_checkpointing": "reentrant",
                       "attention": "sdpa", "optimizer": "torch AdamW (train.py default)", "how": run["how"],
                       "note": run["note"]},
            "setup": setup,
            "published": {"value": seconds, "unit": "Time (s)",
                          "meaning": "CUDA-event time of the whole training loop (one epoch of the dummy dataset) on "
                                     "rank 0; tokens_per_s_per_gpu = ceil(S / GPUs) x context_length / time, "
                                     "S = 1024 - 1024 mod (batch x GA) samples",
                          "train_runtime_s": seconds, "train_steps_per_second": None,
                          "tokens_per_sequence_check": None},
            "tokens_per_s_per_gpu": tps,
            "unexpressible": list(FSDP_QLORA_UNEXPRESSIBLE),
            "comparable": why is None,
            "exclusion": why,
        })
    return out


def build_records() -> list[dict]:
    return fms_records() + torchtune_records() + fsdp_qlora_records()


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RECORDS)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    text = render(build_records())
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the sources'}")
        return 0 if same else 1
    args.out.write_text(text)
    recs = [json.loads(l) for l in text.splitlines()]
    print(f"{len(recs)} records, {sum(r['comparable'] for r in recs)} comparable -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
