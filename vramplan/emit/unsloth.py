"""A plan for ``--framework unsloth`` as files Unsloth runs: ``unsloth.yaml`` (the plan's settings, data) and
``unsloth_train.py`` (a fixed script that reads them: FastLanguageModel.from_pretrained, get_peft_model with
``use_gradient_checkpointing="unsloth"``, TRL's SFTTrainer). Nothing from the plan or the user becomes code:
the script is the same text for every plan, and every value goes through ``yaml.safe_dump``.

Unsloth 2026.8.19's API (unsloth/models/loader.py ``FastLanguageModel.from_pretrained(model_name,
max_seq_length, dtype, load_in_4bit, unsloth_tiled_mlp, ...)``, unsloth/models/llama.py ``get_peft_model(model, r,
target_modules, lora_alpha, lora_dropout, bias, use_gradient_checkpointing, random_state, ...)``) with the
TRL it pins (<= 0.24: ``SFTConfig.max_length``).

QLoRA loads the checkpoint the estimate counts: with ``load_in_4bit=True`` Unsloth swaps a 16-bit name for
its own 4-bit upload (unsloth/models/loader_utils.py ``__get_model_name``), for about half the shipped models a
dynamic ``-unsloth-bnb-4bit`` one that keeps some modules in 16 bits (not counted). So ``model_name`` is
Unsloth's plain ``-bnb-4bit`` upload where its mapper lists one (profiles/unsloth_uploads.json), else the
named checkpoint, and ``use_exact_model_name: true`` loads it as named (a 16-bit one quantized on load)."""

from __future__ import annotations

from ..model.profiles import unsloth_upload
from ..specs import ModelSpec, Setup

__all__ = ["SCRIPT", "TRAIN_FILE", "refusal", "unsloth_config"]

TRAIN_FILE = "unsloth_train.py"

#: Unsloth's all-linear LoRA targets for the Llama-style families it patches
_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_OPTIM = {"adamw-8bit": "adamw_8bit", "paged-adamw-8bit": "paged_adamw_8bit", "adamw-fused": "adamw_torch_fused",
          "adamw": "adamw_torch"}


def refusal(s: Setup, model: ModelSpec) -> str | None:
    """Why an Unsloth config cannot express ``s`` (one clause), or None."""
    if s.framework != "unsloth":
        return (f"framework {s.framework} (the plan's memory is that framework's, not Unsloth's: plan with "
                "--framework unsloth to write this config)")
    if s.optimizer not in _OPTIM:
        return f"optimizer {s.optimizer} (not one of {', '.join(_OPTIM)})"
    if s.padding_free:
        return "padding_free (Unsloth turns it on itself where it applies; the plan's batches are full length)"
    return None


def unsloth_config(s: Setup, model: ModelSpec, *, model_id: str, nodes: int = 1) -> dict:
    """The settings ``unsloth_train.py`` reads (see :data:`SCRIPT`)."""
    targets = _ALL_LINEAR if s.lora_targets == "all-linear" else [t.strip() for t in s.lora_targets.split(",")]
    four_bit = s.quant == "nf4"
    upload = unsloth_upload(model_id) if four_bit else None
    return {
        # the checkpoint the plan counted: plain NF4 (Unsloth's -bnb-4bit upload, or the named one quantized on
        # load), not the dynamic -unsloth-bnb-4bit upload Unsloth would pick, which keeps modules in 16 bits
        "model_name": (upload or {}).get("plain_4bit") or model_id,
        "use_exact_model_name": four_bit,
        "max_seq_length": s.seq,
        "load_in_4bit": four_bit,
        "dtype": "bfloat16" if s.precision == "bf16" else "float16",
        "unsloth_tiled_mlp": s.tiled_mlp,  # unsloth_zoo's TiledMLP (estimator/tiled_mlp.py)
        "lora": {"r": s.lora_rank, "lora_alpha": s.alpha, "lora_dropout": s.lora_dropout,
                 "target_modules": targets},
        "use_gradient_checkpointing": "unsloth" if s.checkpointing else False,
        "training": {"per_device_train_batch_size": s.batch, "gradient_accumulation_steps": s.grad_accum,
                     "optim": _OPTIM[s.optimizer], "bf16": s.precision == "bf16", "fp16": s.precision == "fp16"},
        "dataset_name": None,
        "dataset_text_field": "text",
        "output_dir": "outputs",
    }


SCRIPT = '''"""Fine-tune with Unsloth as vramplan planned it. Every setting is in unsloth.yaml (set dataset_name
there); this script is the same for every plan.

    python unsloth_train.py unsloth.yaml
"""
import sys

import yaml
from unsloth import FastLanguageModel  # first: Unsloth patches transformers and TRL on import

import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

with open(sys.argv[1] if len(sys.argv) > 1 else "unsloth.yaml") as f:
    cfg = yaml.safe_load(f)
if not cfg.get("dataset_name"):
    sys.exit("error: set dataset_name in the config (a dataset with a text column)")

model, tokenizer = FastLanguageModel.from_pretrained(
    model_name=cfg["model_name"], max_seq_length=cfg["max_seq_length"],
    dtype=getattr(torch, cfg["dtype"]), load_in_4bit=cfg["load_in_4bit"],
    use_exact_model_name=cfg.get("use_exact_model_name", False),
    unsloth_tiled_mlp=cfg.get("unsloth_tiled_mlp", False))
model = FastLanguageModel.get_peft_model(
    model, bias="none", random_state=3407, use_gradient_checkpointing=cfg["use_gradient_checkpointing"],
    **cfg["lora"])
dataset = load_dataset(cfg["dataset_name"], split="train")
trainer = SFTTrainer(
    model=model, processing_class=tokenizer, train_dataset=dataset,
    args=SFTConfig(max_length=cfg["max_seq_length"], dataset_text_field=cfg["dataset_text_field"],
                   output_dir=cfg["output_dir"], **cfg["training"]))
trainer.train()
print(f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB, "
      f"allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
'''
