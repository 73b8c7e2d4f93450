#!/usr/bin/env bash
# vramplan plan for meta-llama/Llama-3.1-8B on 16 GPUs on 2 nodes (8 per node)
# lora r=16 alpha=32 · bf16 · adamw · batch 1 x seq 2048 · no checkpointing · 16 GPUs
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): accelerate launch --config_file accelerate_config.yaml --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" train.py
#        or: torchrun --nnodes 2 --nproc_per_node 8 --node_rank "$NODE_RANK" --master_addr "$MAIN_IP" --master_port 29500 train.py
# multi-node: set MAIN_IP to node 0's address, NODE_RANK to each node's rank (0..1)
# the plan and the estimate it was made from: vramplan.json
set -euo pipefail
cd "$(dirname "$0")"
: "${MAIN_IP:?set MAIN_IP to the address of node 0}"
: "${NODE_RANK:?set NODE_RANK to this node's rank, 0 to 1}"
exec accelerate launch --config_file accelerate_config.yaml --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" train.py "$@"
