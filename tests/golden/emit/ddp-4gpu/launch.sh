#!/usr/bin/env bash
# vramplan plan for meta-llama/Llama-3.1-8B on 4 GPUs
# full · bf16-mixed · adamw-fused · batch 2 x seq 2048 · no checkpointing · 4 GPUs
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): accelerate launch --config_file accelerate_config.yaml train.py
#        or: torchrun --nproc_per_node 4 train.py
# the plan and the estimate it was made from: vramplan.json
set -euo pipefail
cd "$(dirname "$0")"
exec accelerate launch --config_file accelerate_config.yaml train.py "$@"
