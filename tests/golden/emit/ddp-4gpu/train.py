#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 4 GPUs
# full · bf16-mixed · adamw-fused · batch 2 x seq 2048 · no checkpointing · 4 GPUs
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): accelerate launch --config_file accelerate_config.yaml train.py
#        or: torchrun --nproc_per_node 4 train.py
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
    'method': 'full',
    'quant': 'none',
    'precision': 'bf16-mixed',
    'optim': 'adamw_torch_fused',
    'lr': 2e-05,
    'checkpointing': False,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 2,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': False,
}
