#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 1 GPU
# qlora r=64 alpha=128 on q_proj,v_proj · nf4 base (double quant) · bf16 · paged-adamw-8bit · batch 1 x seq 2048 · checkpointing
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): python train.py
#        or: accelerate launch --config_file accelerate_config.yaml train.py
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
"""Fine-tune the planned model with the Hugging Face Trainer, exactly as the plan in PLAN says.

The model is built from config.json (next to this file) with random weights: nothing is
downloaded, so the memory of the plan can be checked before any real run. ``--model ID_OR_PATH``
loads real weights instead. The dataset is random tokens unless ``--dataset`` names a local
.jsonl/.json file (rows with "input_ids" or a text field), a .txt file (one example per line) or a
Hugging Face dataset id (needs the ``datasets`` package). Every sequence is ``--seq`` tokens long,
so each step has the shape the plan was estimated for.

Other code can import this file and reuse its pieces: ``parse_args(argv)``,
``build_trainer(args, callbacks)`` (adds your TrainerCallbacks) and ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, Trainer,
                          TrainerCallback, TrainingArguments, default_data_collator)

HERE = Path(__file__).resolve().parent

# The plan (edit here to change what is trained; vramplan.json holds the plan and its estimate).
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'qlora',
    'lora_r': 64,
    'lora_alpha': 128,
    'lora_dropout': 0.0,
    'lora_targets': 'q_proj,v_proj',
    'quant': 'nf4',
    'double_quant': True,
    'precision': 'bf16',
    'optim': 'paged_adamw_8bit',
    'lr': 0.0002,
    'checkpointing': True,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': False,
}
