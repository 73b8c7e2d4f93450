"""Published real-GPU peaks -> vramplan records (calibration/published/records.jsonl).

    python calibration/published/build.py          # /work/shared/published-peaks/*.jsonl + added.jsonl + consumer.jsonl
    python calibration/published/build.py A.jsonl B.jsonl --out DIR

Reads every source row (README.md in this folder says where they come from), normalises it to a
vramplan model reference, GPU name, ``Setup`` dict, quantity and bytes, and decides whether it is
comparable (HF modelling code, exact lengths, every knob expressible, a config we hold, a quantity
we predict) or excluded with a one-line reason. Deterministic: the same inputs give the same
bytes (rows sorted by id, keys sorted). Needs no torch; validates each comparable Setup with
``vramplan.specs.Setup`` so a record never holds a setup vramplan would refuse.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_INPUTS = "/work/shared/published-peaks"
RECORD_VERSION = 1

sys.path.insert(0, str(ROOT))
from vramplan.specs import Setup, SpecError  # noqa: E402

# ----------------------------------------------------------------------------------------------
# models: published id -> (vramplan reference, note). A reference is a shipped name (vramplan
# models) or the HF id of a config added under profiles/models/ (org--name.json).

MODEL_MAP = {
    "mistralai/Mistral-7B-v0.1": ("mistralai/Mistral-7B-v0.1",
                                  "profiles/models/mistralai--Mistral-7B-v0.1.json (the HF config.json: vocab 32000, "
                                  "sliding_window 4096, rope_theta 1e4; 7,241,732,096 parameters)"),
    "NousResearch/Llama-2-70b-hf": ("meta-llama/Llama-2-70b-hf", "NousResearch's re-upload of "
                                    "meta-llama/Llama-2-70b-hf (same config.json)"),
    "meta-llama/Llama-2-70b-hf": ("meta-llama/Llama-2-70b-hf", ""),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("mistralai/Mixtral-8x7B-v0.1", "the Instruct v0.1 config.json has "
                                             "the base v0.1 architecture (vocab 32000, rope_theta 1e6)"),
    "meta-llama/Llama-2-7b-hf": ("meta-llama/Llama-2-7b-hf", ""),
    # configs the catalogue added (issue 29) after these rows were first excluded for want of one
    "bigcode/gpt_bigcode-santacoder": ("bigcode/gpt_bigcode-santacoder", ""),
    "01-ai/Yi-34B": ("01-ai/Yi-34B", "the doc says 'Yi 34B': the base 01-ai/Yi-34B config"),
    "01-ai/Yi-34B-Chat": ("01-ai/Yi-34B", "the Chat config has the base's architecture (Llama: 60 layers, hidden "
                                          "7168, 56/8 heads, vocab 64000)"),
    "01-ai/Yi-6B-Chat": ("01-ai/Yi-6B", "the Chat config has the base's architecture (Llama: 32 layers, hidden "
                                        "4096, 32/4 heads, vocab 64000)"),
    "google/gemma-7b": ("google/gemma-7b", ""),
    "google/gemma-7b-it": ("google/gemma-7b", "the -it config has the base's architecture"),
    "Mistral 7B v0.2 Base": ("mistralai/Mistral-7B-Instruct-v0.2",
                             "the Instruct v0.2 config.json has the v0.2 base's architecture (vocab 32000, rope_theta "
                             "1e6, no sliding window, 32k positions; the community conversions of the base, e.g. "
                             "alpindale/Mistral-7B-v0.2-hf, carry the same numbers)"),
    "meta-llama/Llama-2-13b-hf": ("meta-llama/Llama-2-13b-hf", ""),
    "meta-llama/Meta-Llama-3-8B": ("meta-llama/Meta-Llama-3-8B", ""),
    "meta-llama/Llama-3.2-1B": ("meta-llama/Llama-3.2-1B", ""),
    "meta-llama/Llama-3.2-3B": ("meta-llama/Llama-3.2-3B", ""),
    "meta-llama/Llama-3.2-3B-Instruct": ("meta-llama/Llama-3.2-3B", "Instruct has the base config"),
    "meta-llama/Llama-3.1-8B-Instruct": ("meta-llama/Llama-3.1-8B", "Instruct has the base config"),
    "meta-llama/Llama-3.1-70B-Instruct": ("meta-llama/Llama-3.1-70B", "Instruct has the base config"),
    "Qwen/Qwen2-7B": ("Qwen/Qwen2-7B", ""),
    "google/gemma-2b": ("google/gemma-2b", ""),
    # consumer.jsonl (issue 28): Unsloth's uploads (4-bit or 16-bit) of configs we hold, and TRL's GRPO base
    "unsloth/llama-3-8b-bnb-4bit": ("meta-llama/Meta-Llama-3-8B", "Unsloth's nf4 upload of meta-llama/Meta-Llama-3-8B "
                                    "(same architecture)"),
    "unsloth/llama-3-8b-Instruct-bnb-4bit": ("meta-llama/Meta-Llama-3-8B", "Unsloth's nf4 upload of "
                                             "Meta-Llama-3-8B-Instruct (Instruct has the base config)"),
    "unsloth/Meta-Llama-3.1-8B": ("meta-llama/Llama-3.1-8B", "Unsloth's upload of meta-llama/Llama-3.1-8B"),
    "unsloth/Llama-3.2-3B-Instruct": ("meta-llama/Llama-3.2-3B", "Unsloth's upload of Llama-3.2-3B-Instruct "
                                      "(Instruct has the base config)"),
    "unsloth/Llama-3.2-1B-Instruct": ("meta-llama/Llama-3.2-1B", "Unsloth's upload of Llama-3.2-1B-Instruct "
                                      "(Instruct has the base config)"),
    "unsloth/mistral-7b-v0.3": ("mistralai/Mistral-7B-v0.3", "Unsloth's upload of mistralai/Mistral-7B-v0.3"),
    "unsloth/mistral-7b-instruct-v0.3-bnb-4bit": ("mistralai/Mistral-7B-v0.3", "Unsloth's nf4 upload of "
                                                  "Mistral-7B-Instruct-v0.3 (Instruct has the base config)"),
    "unsloth/Qwen2-7B": ("Qwen/Qwen2-7B", "Unsloth's upload of Qwen/Qwen2-7B"),
    "unsloth/Qwen2.5-7B": ("Qwen/Qwen2.5-7B", "Unsloth's upload of Qwen/Qwen2.5-7B"),
    "unsloth/gemma-2-9b": ("google/gemma-2-9b", "Unsloth's upload of google/gemma-2-9b"),
    "unsloth/gemma-2-2b": ("google/gemma-2-2b", "Unsloth's upload of google/gemma-2-2b"),
    "unsloth/tinyllama-bnb-4bit": ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Unsloth's nf4 upload of the TinyLlama-1.1B "
                                   "base (the Chat-v1.0 config has its architecture: 22 layers, hidden 2048, 4 KV "
                                   "heads, vocab 32000)"),
    "Qwen/Qwen2-7B-Instruct": ("Qwen/Qwen2-7B", "Instruct has the base config"),
}

#: models whose modelling code is remote code (trust_remote_code), not transformers'
REMOTE_CODE = {
    "Qwen/Qwen-": "Qwen v1 remote code (QWenLMHeadModel, model_type qwen): its own attention/flash-attn path and a "
                  "fused c_attn whose LoRA is one r x 3h adapter, not q/k/v (parameters map onto qwen2, the step "
                  "does not)",
    "THUDM/chatglm3": "ChatGLM3 remote code (model_type chatglm)",
    "baichuan-inc/Baichuan2": "Baichuan2 remote code (fused W_pack; 13B uses ALiBi)",
}

#: models we hold no config for (and do not add: every row of theirs is excluded for another reason too,
#: or their family has no analytic recipe)
NO_CONFIG = {
    "ibm/PowerLM-3b": "model_type granite (PowerLM) has no analytic family: llama-like, but logits_scaling divides the "
                      "logits (one more N x V tensor) and embedding/residual/attention multipliers",
    "OpenBuddy/": "no config held (openbuddy-zephyr: mistral architecture)",
    "microsoft/phi-": "no config held (phi-1_5/phi-2)",
    "stabilityai/stablelm-base-alpha": "no config held (stablelm-alpha: gpt_neox)",
}

GPU_MAP = [
    (r"A100-SXM4-40GB|A100 40GB", "a100-40gb"),
    (r"A100", "a100-80gb"),
    (r"A10G", "a10g"),
    (r"Tesla T4|\bT4\b", "t4"),
    (r"\bL4\b", "l4"),  # not L40 / L40S
    (r"RTX 3090 Ti", "rtx-3090-ti"),
    (r"RTX 3090", "rtx-3090"),
    (r"RTX 4090", "rtx-4090"),
    (r"RTX A6000", "rtx-a6000"),
]

#: library versions a source states outside the row text, or that its date implies
SOURCE_VERSIONS = {
    ("foundation-model-stack/fms-acceleration", "scripts/benchmarks/refs/a100_80gb.csv"): (
        {"torch": "2.4.1", "transformers": "4.48.1", "peft": "0.13.2", "accelerate": "1.0.1", "trl": "0.13.0",
         "bitsandbytes": "0.43.3", "flash-attn": "2.7.3"},
        "stated: scripts/benchmarks/refs/requirements.txt at HEAD (verified in the repository)"),
    ("foundation-model-stack/fms-acceleration", "scripts/benchmarks/refs/a100_80gb_granite.csv"): (
        {"torch": "2.4.1", "transformers": "4.45.2", "peft": "0.12.0", "accelerate": "0.34.2",
         "bitsandbytes": "0.43.3", "flash-attn": "2.6.3"},
        "stated: scripts/benchmarks/refs/requirements_granite.txt"),
}
DATE_VERSIONS = {  # (repo, marker in source.commit or None) -> versions implied by the table's date
    "modelscope/ms-swift": ({"transformers": "4.36"}, "inferred from date (2024-01-04)"),
    "QwenLM/Qwen": ({"transformers": "4.32-4.35"},
                    "inferred from date (2023-11-30; Qwen requirements.txt transformers>=4.32)"),
    "linkedin/Liger-Kernel": ({"transformers": "4.43-4.44"}, "inferred from date (Liger-Kernel 0.1, 2024-08)"),
    "AnswerDotAI/fsdp_qlora": ({"transformers": "4.38-4.39"},
                               "inferred from date (runs of 2024-03; README at 8a89266 installs transformers via "
                               "llama-recipes; 4.38/4.39 were excluded only on 2024-04-18)"),
}
VERSION_RE = re.compile(r"\b(PyTorch|torch|transformers|peft|accelerate|trl|flash[-_]attn|bitsandbytes|auto[-_]gptq|"
                        r"deepspeed)\s*(?:==\s*)?v?(\d+\.\d+(?:\.\d+)?(?:\.post\d+|[+][\w.]+)?)", re.I)


def _canon_lib(name: str) -> str:
    n = name.lower().replace("_", "-")
    return "torch" if n == "pytorch" else n


# ----------------------------------------------------------------------------------------------
# normalisation


def _gpu(text: str) -> str | None:
    for pat, name in GPU_MAP:
        if re.search(pat, text or ""):
            return name
    return None


def _versions(row: dict) -> dict:
    src = row["source"]
    out: dict[str, dict] = {}
    texts = [str(src.get("config") or ""), str(row.get("notes") or ""), str(src.get("commit") or "")]
    for text in texts:
        for lib, ver in VERSION_RE.findall(text):
            out.setdefault(_canon_lib(lib), {"version": ver, "how": "stated by the source (row notes/config)"})
    stated = SOURCE_VERSIONS.get((src.get("repo"), src.get("path")))
    if stated:
        for lib, ver in stated[0].items():
            out[lib] = {"version": ver, "how": stated[1]}
    implied = DATE_VERSIONS.get(src.get("repo"))
    if implied:
        for lib, ver in implied[0].items():
            out.setdefault(lib, {"version": ver, "how": implied[1]})
    return dict(sorted(out.items()))


def _quantity(row: dict) -> tuple[str, str]:
    q = (row.get("quantity") or "").lower()
    if "unspecified" in q:
        return "unspecified", "the source does not say what it measured"
    if "active" in q:
        return "active", "torch.cuda.memory_stats active_bytes.all.peak"
    if "reserved" in q:
        return "reserved", "torch.cuda.max_memory_reserved"
    if "allocated" in q:
        return "allocated", "torch.cuda.max_memory_allocated (the HF Trainer's memory tracker where stated)"
    if "nvidia-smi" in q or "nvidia_smi" in q:
        return "device_total", "nvidia-smi memory used"
    return "unspecified", "quantity not recognised: " + q[:60]


def _bytes(row: dict) -> tuple[int | None, str]:
    v, unit = row.get("measured_value"), row.get("unit")
    if v is None:
        return None, "no value published"
    if unit == "bytes":
        return int(round(v)), "bytes as published"
    if unit == "GiB":
        return int(round(v * 2**30)), "GiB = 2**30 bytes"
    if unit == "MiB":
        return int(round(v * 2**20)), "MiB = 2**20 bytes (the source's 'MB' is its EfficiencyCallback's 2**20)"
    if unit == "GB":
        return int(round(v * 1e9)), "GB = 1e9 bytes (the source divides bytes by 1e9)"
    if unit == "GB_ambiguous":
        return int(round(v * 1e9)), "'GB' read as 1e9 bytes as the dataset does; were it GiB the value is 7.4 % larger"
    raise ValueError(f"{row['id']}: unknown unit {unit!r}")


def _lora_dropout(row: dict) -> float:
    src = row["source"]
    if src.get("repo") == "foundation-model-stack/fms-acceleration" and row["method"] != "full":
        return 0.1  # scenarios.yaml standard-peft / baseline-peft-bnb: lora_dropout 0.1 (the CSV's column)
    m = re.search(r"lora[_ ]dropout\s*(\d*\.\d+)", row.get("notes") or "", re.I)
    return float(m.group(1)) if m else 0.0


def normalise(row: dict) -> dict:
    """One source row -> one record (see docs/schema/published-record.schema.json)."""
    src = row["source"]
    repo = src.get("repo")
    pub_model = row["model"]
    base_model = pub_model.split(" (")[0].strip()
    unexpressible: list[str] = []
    approximations: list[str] = []
    notes: list[str] = []

    # --- model
    model_ref, model_note = MODEL_MAP.get(base_model, (None, ""))
    model_problem = None
    for prefix, why in REMOTE_CODE.items():
        if base_model.startswith(prefix):
            model_ref, model_problem = None, "remote-code model: " + why
    if model_ref is None and model_problem is None:
        for prefix, why in NO_CONFIG.items():
            if base_model.startswith(prefix):
                model_problem = why
        model_problem = model_problem or f"no config held for {base_model}"
    if model_note:
        notes.append(model_note)

    # --- what was trained
    method_raw = row["method"]
    quant_raw = (row.get("quantization") or "").lower()
    method = {"full": "full", "lora": "lora", "qlora": "qlora"}.get(method_raw, "lora")
    quant, double_quant = "none", True
    # peft modules_to_save (estimator/knobs.py): the fully trained embedding and head beside LoRA
    modules_to_save = ("embed_tokens,lm_head" if "modules_to_save" in json.dumps(row.get("trainable_extra"))
                       or "embedding and lm_head" in method_raw else "")
    if "gptq" in quant_raw:
        method, quant = "lora", "gptq"
        if "int8" in quant_raw:
            unexpressible.append("GPTQ through auto-gptq (vramplan models gptqmodel's TorchLinear)")
        else:
            unexpressible.append("GPTQ through auto-gptq (vramplan models gptqmodel's TorchLinear)")
    elif "torchao" in quant_raw:
        unexpressible.append("torchao NF4 base weights (torchtune)")
        quant = "nf4"
    elif "nf4" in quant_raw:
        quant = "nf4"
        double_quant = "double quant" in quant_raw and "no double quant" not in quant_raw
    targets = row.get("lora_target_modules")
    lora_targets = "all-linear"
    if targets:
        if any("(" in t or "," in t for t in targets):
            unexpressible.append("LoRA targets in the framework's own module names: " + ", ".join(targets))
        else:
            lora_targets = ",".join(targets)

    # --- precision
    prec_raw = (row.get("precision") or "").lower()
    precision = "bf16"
    fw_raw = (row.get("framework") or "").lower()
    unsloth = fw_raw.startswith("unsloth")
    if "fp16" in prec_raw:
        precision = "fp16-mixed"
        if repo == "QwenLM/Qwen":
            unexpressible.append("fp16 autocast on a 16-bit-loaded or quantized base through DeepSpeed (Qwen "
                                 "finetune.py)")
    elif "--bf16" in prec_raw or "bf16 amp" in prec_raw:
        if quant in ("nf4", "fp4"):
            precision = "bf16-mixed"  # a 4-bit base: prepare_model_for_kbit_training upcasts the rest to fp32 anyway
        elif method == "full" or quant == "none":
            unexpressible.append("bf16-loaded weights under autocast (torch_dtype bf16 + --bf16): vramplan's "
                                 "bf16-mixed loads fp32 weights")
    elif "fp32 master" in prec_raw:
        precision = "bf16-mixed"
    elif unsloth and "bf16" in prec_raw and quant in ("nf4", "fp4"):
        precision = "bf16-mixed"
    if "not stated" in prec_raw:
        unexpressible.append("autocast dtype not stated (the trainer config sets neither fp16 nor bf16)")

    # --- optimizer
    opt_raw = (row.get("optimizer") or "").lower()
    optimizer = "adamw"
    in_backward = "optimizer_in_bwd" in opt_raw and "optimizer_in_bwd=false" not in opt_raw  # --optimizer-in-backward
    if "pagedadamw8bit" in opt_raw or "paged_adamw_8bit" in opt_raw:
        optimizer = "paged-adamw-8bit"
    elif "pagedadamw" in opt_raw:
        unexpressible.append("bitsandbytes PagedAdamW (32-bit paged states)")
    elif "adamw8bit" in opt_raw or "adamw_8bit" in opt_raw:
        optimizer = "adamw-8bit"  # bitsandbytes AdamW8bit (HF optim="adamw_8bit")
    elif "fused=true" in opt_raw:
        optimizer = "adamw-fused"
    elif "8-bit" in opt_raw:
        unexpressible.append("8-bit AdamW, exact class not stated")
    elif "not stated" in opt_raw:
        unexpressible.append("optimizer not stated")
    elif "deepspeed" in opt_raw:
        notes.append("DeepSpeed's own AdamW (FusedAdam) stands for adamw")

    # --- the step
    attn_raw = (row.get("attention_impl") or "").lower()
    attn = "flash" if "flash" in attn_raw else "sdpa" if "sdpa" in attn_raw else "auto"
    ckpt = bool(row.get("gradient_checkpointing"))
    if row.get("gradient_checkpointing") is None:
        unexpressible.append("gradient checkpointing not stated")
    other = [str(o) for o in (row.get("other_memory_optimizations") or [])]
    liger = act_offload = False
    for o in other:
        ol = o.lower()
        if ol.startswith("compile=true") or "torch.compile" in ol:
            unexpressible.append("torch.compile")
        elif "activation_offloading=true" in ol or "activation offload" in ol:
            act_offload = True  # --activation-offload (TRL's OffloadActivations; torchtune's is refused)
        elif "chunked" in ol and "loss" in ol:
            unexpressible.append("torchtune CEWithChunkedOutputLoss")
        elif "liger" in ol:
            liger = True
        elif "=false" in ol or "full logits" in ol:
            continue
        elif ol == "fsdp cpu param offload":  # fsdp_qlora --use_cpu_offload: the offload field says it (below)
            continue
        else:
            unexpressible.append(o)
    notes_l = (row.get("notes") or "").lower() + " " + (row.get("framework") or "").lower()
    if "compile enabled" in notes_l and "torch.compile" not in unexpressible:
        unexpressible.append("torch.compile")
    # Liger's kernels patched onto transformers' modelling code: modelled (vramplan/estimator/liger.py)
    liger = liger or "liger" in (row.get("framework") or "").lower()

    # --- distribution
    dist_raw = (row.get("distributed") or "").lower()
    gpus = int(row.get("num_gpus") or 1)
    zero_stage, fsdp, offload_params, offload_optimizer = 0, "none", "none", "none"
    device_map = "auto" if "device_map" in dist_raw or "model parallel" in dist_raw else "none"  # --device-map
    gpus_setup = gpus
    if "deepspeed" in dist_raw:
        zero_stage = int(row.get("zero_stage") or 0)
    if "fsdp" in dist_raw:
        fsdp = "full_shard"
        if "cpu_offload=true" in dist_raw:
            offload_params = "cpu"
        if "mixed_precision 'no'" in dist_raw:
            mp_on = "--bf16" in prec_raw or (repo == "foundation-model-stack/fms-acceleration" and method == "qlora")
            if mp_on:
                notes.append("accelerate.yaml says mixed_precision 'no', but the run passes --bf16 (scenarios.yaml "
                             "baseline-peft-bnb: bf16 True, the CSV's bf16 column), which turns on FSDP's bf16 "
                             "MixedPrecision")
                approximations.append("sharded QLoRA under FSDP's bf16 MixedPrecision (TRL 0.13 calls get_peft_model("
                                      "autocast_adapter_dtype=False): bf16 adapters; accelerate 1.0.1); vramplan "
                                      "refuses a -mixed QLoRA under FSDP and models --precision bf16 --fsdp: no "
                                      "policy, peft's fp32 adapters run in fp32 (adapter bytes and their fp32 input "
                                      "copies only)")
            else:
                notes.append("FSDP without MixedPrecision (accelerate mixed_precision 'no') on the bf16-loaded model: "
                             "vramplan's --precision bf16 --fsdp (bf16 shards, gradients and AdamW states; LoRA: "
                             "peft's fp32 adapters run in fp32)")
        if "no_shard" in dist_raw:  # fsdp_qlora's sharding_strategy 'ddp'
            fsdp = "no_shard"
        if "distributed" in (row.get("framework") or "") or "torchtune" in (row.get("framework") or ""):
            pass
    offload_raw = str(row.get("offload") or "")
    if fsdp != "none" and "cpuoffload(offload_params=true)" in offload_raw.lower():
        offload_params = "cpu"  # FSDP CPUOffload: the sharded parameters and their gradients in host RAM
    elif row.get("offload") not in (None, "none"):
        unexpressible.append(f"offload {row.get('offload')}")
    if repo == "AnswerDotAI/fsdp_qlora" and row.get("lora_rank"):
        approximations.append("fsdp_qlora's precision 'bf16' casts the LoRA weights to bf16 and keeps bf16 AdamW "
                              "states; vramplan models peft's fp32 adapters under --precision bf16 --fsdp (the "
                              "adapters, their gradients and states counted at twice their bytes: for Llama-2-7B "
                              "r64 about 0.5 GiB per GPU more)")

    # --- model-specific knobs
    if base_model.startswith("mistralai/Mixtral") and repo == "foundation-model-stack/fms-acceleration":
        # the record's versions choose the Stack (transformers 4.48.1): per-expert nn.Linear experts, quantized by
        # bitsandbytes on a 4-bit base, and MixtralSparseMoeBlock's routing loop (vramplan/estimator/moe_4x.py,
        # checked against the real 4.48.1 + peft 0.13.2 step: calibration/published/moe_4x_probe.py)
        notes.append("transformers 4.48.1's per-expert nn.Linear experts and routing loop: estimated with "
                     "Stack(transformers='4.48.1') (vramplan/estimator/moe_4x.py)")
        if quant == "nf4":
            notes.append("bitsandbytes 0.43.3's MatMul4Bit keeps what 0.50's does for the backward (only the packed "
                         "weight: ctx.tensors = (None, B), read off both), and dequantizes like it in the backward")
    if base_model.startswith("bigcode/gpt_bigcode") and repo == "foundation-model-stack/fms-acceleration":
        # read off the 4.48.1 wheel: GPTBigCodeForCausalLM.forward computes its own loss (lines 1177-1186)
        unexpressible.append("transformers 4.48.1 GPTBigCodeForCausalLM computes its own loss in the logits' bf16 "
                             "(lm_logits[..., :-1, :].contiguous(), CrossEntropyLoss; modeling_gpt_bigcode.py "
                             "1177-1186), where vramplan models transformers 5's loss_function (fp32 logits and "
                             "log-probs): per-token slope measured 479 KB/token, estimated 798")
    if fsdp != "none" and quant in ("nf4", "fp4"):
        precision = "bf16"  # the bf16 packed base (a -mixed QLoRA under FSDP is refused: see above)
    if repo == "foundation-model-stack/fms-acceleration" and quant == "nf4" and fsdp == "none":
        # baseline-peft-bnb passes bf16: True (scenarios.yaml; the CSV's bf16 column is TRUE)
        unexpressible.append("TRL 0.13 with --bf16 on an unsharded 4-bit base: prepare_model_for_kbit_training, then "
                             "peft_module_casting_to_bf16 casts the embeddings and head back to bf16 under autocast "
                             "(vramplan's QLoRA keeps them fp32, bf16-mixed loads fp32)")

    # --- the framework that prepared the model (Setup.framework; vramplan/setup/frameworks.py)
    framework_knob = "hf"
    if unsloth:
        framework_knob = "unsloth"  # Unsloth 2026.8's step (estimator/unsloth.py); these rows ran 2024-2025 kernels
    elif repo == "huggingface/trl":
        unexpressible.append("TRL of late 2025 (about 0.24-0.26, by the run date; not printed): vramplan's "
                             "framework 'trl' is TRL 1.16's SFTTrainer (bf16 trainables, fused LM head), 'hf' peft's "
                             "recipe; which one TRL 0.2x matches is not established")

    # --- lengths
    seq_exact = row.get("seq_len_exact")
    seq = int(row.get("seq_len") or 0)
    batch = int(row.get("micro_batch_size") or 1)
    grad_accum = int(row.get("grad_accum") or 1)

    setup = {
        "method": method, "lora_rank": int(row.get("lora_rank") or 16), "lora_alpha": row.get("lora_alpha"),
        "lora_dropout": _lora_dropout(row) if method != "full" else 0.0, "lora_targets": lora_targets,
        "quant": quant, "double_quant": double_quant, "precision": precision, "optimizer": optimizer,
        "checkpointing": ckpt, "attn": attn, "batch": batch, "seq": max(seq, 1), "grad_accum": grad_accum,
        "zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "offload_params": offload_params,
        "gpus": gpus_setup, "loss": "unsloth" if framework_knob == "unsloth" else "hf", "pad_mask": False,
        "fsdp": fsdp, "liger": liger,
        "modules_to_save": modules_to_save, "optimizer_in_backward": in_backward, "activation_offload": act_offload,
        "device_map": device_map, "framework": framework_knob,
    }
    if method == "full":
        setup["lora_alpha"] = None
    setup_error = None
    try:
        setup = Setup.from_dict({k: v for k, v in setup.items() if k in Setup.__dataclass_fields__}).to_dict()
    except SpecError as exc:
        setup_error = str(exc)

    quantity, quantity_note = _quantity(row)
    measured_bytes, unit_note = _bytes(row)

    # --- comparable?
    reasons: list[str] = []
    if row.get("oom") or measured_bytes is None:
        reasons.append("OOM: no peak published (the run did not fit), a lower bound only")
    if not row.get("hf_modeling_code") and not liger:  # Liger patches transformers' code: modelled
        fw = row.get("framework") or "?"
        reasons.append(f"not HF modelling code ({fw.split(' (')[0]}'s own model code)")
    if model_problem:
        reasons.append(model_problem)
    if seq_exact is not True:
        reasons.append("sequence lengths not exact (unpacked, padded to the longest in each batch: the max is an "
                       "upper bound)" if seq_exact is False else "sequence lengths not stated as exact")
    if unexpressible:
        reasons.append("knobs vramplan cannot express: " + "; ".join(unexpressible))
    if quantity not in ("allocated", "reserved", "device_total"):
        reasons.append(f"quantity {quantity} is not one vramplan predicts" if quantity != "unspecified" else
                       "quantity unspecified by the source")
    if row.get("approximate"):
        reasons.append("value read off a chart (approximate)")
    if setup_error:
        reasons.append("setup vramplan refuses: " + setup_error)
    if gpus > 1 and fsdp == "none" and zero_stage == 0 and device_map == "none":
        notes.append("several GPUs without ZeRO/FSDP: plain data parallel (DDP)")
    comparable = not reasons
    gpu = _gpu(row.get("gpu") or "")
    if comparable and gpu is None:
        comparable, reasons = False, ["GPU not stated"]

    return {
        "vramplan_published_record": RECORD_VERSION,
        "id": row["id"],
        "source": {k: src.get(k) for k in ("repo", "path", "commit", "url", "section", "row", "config", "added_by")
                   if src.get(k) is not None},
        "framework": row.get("framework"),
        "hf_modeling_code": bool(row.get("hf_modeling_code")),
        "published_model": pub_model,
        "model": model_ref,
        "gpu": gpu,
        "published_gpu": row.get("gpu"),
        "setup": setup if setup_error is None else None,
        "quantity": quantity,
        "quantity_note": quantity_note + " (published: " + (row.get("quantity") or "") + ")",
        "measured_bytes": measured_bytes,
        "measured": {"value": row.get("measured_value"), "unit": row.get("unit"), "conversion": unit_note},
        "secondary_measurements": row.get("secondary_measurements"),
        "per_gpu": bool(row.get("per_gpu")),
        "oom": bool(row.get("oom")),
        "approximate": bool(row.get("approximate")),
        "versions": _versions(row),
        "unexpressible": unexpressible,
        "approximations": approximations,
        "notes": notes + ([row["notes"]] if row.get("notes") else [])
        + ([row["seq_len_note"]] if row.get("seq_len_note") else []),
        "comparable": comparable,
        "exclusion": None if comparable else reasons[0],
        "all_exclusions": [] if comparable else reasons,
    }


# ----------------------------------------------------------------------------------------------


def read_rows(paths: list[str]) -> list[dict]:
    rows: list[dict] = []
    for p in paths:
        with open(p) as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
    ids = [r["id"] for r in rows]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SystemExit(f"duplicate row ids: {dup[:5]}")
    return rows


def default_inputs() -> list[str]:
    found = sorted(glob.glob(os.path.join(DEFAULT_INPUTS, "*.jsonl")))
    return found + [str(HERE / "added.jsonl"), str(HERE / "consumer.jsonl")]


def build(paths: list[str]) -> list[dict]:
    return sorted((normalise(r) for r in read_rows(paths)), key=lambda r: r["id"])


def dumps(records: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", help="source JSONL files (default: the shared peaks + added.jsonl + "
                                              "consumer.jsonl)")
    ap.add_argument("--out", default=str(HERE), help="folder for records.jsonl")
    args = ap.parse_args(argv)
    records = build(args.inputs or default_inputs())
    out = Path(args.out) / "records.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(records))
    n = sum(r["comparable"] for r in records)
    print(f"{len(records)} records, {n} comparable, {len(records) - n} excluded -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
