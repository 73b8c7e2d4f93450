#!/usr/bin/env bash
# vramplan plan for meta-llama/Llama-3.1-8B on 2 GPUs
# full · bf16 · adamw · batch 1 x seq 2048 · no checkpointing · 2 GPUs · ZeRO-3 · optimizer offload to nvme · param offload to nvme
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB), 5.00 GiB host RAM on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): deepspeed --num_gpus 2 train.py --deepspeed ds_config.json
#        or: accelerate launch --config_file accelerate_config.yaml train.py --deepspeed ds_config.json
# the plan and the estimate it was made from: vramplan.json
set -euo pipefail
cd "$(dirname "$0")"
exec deepspeed --num_gpus 2 train.py --deepspeed ds_config.json "$@"
