#!/usr/bin/env bash
# vramplan plan for meta-llama/Llama-3.1-8B on 1 GPU
# lora r=16 alpha=32 · gptq base (4-bit, group 128) · fp16 · adamw · batch 1 x seq 2048 · checkpointing
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): python train.py
#        or: accelerate launch --config_file accelerate_config.yaml train.py
# the plan and the estimate it was made from: vramplan.json
set -euo pipefail
cd "$(dirname "$0")"
exec python train.py "$@"
