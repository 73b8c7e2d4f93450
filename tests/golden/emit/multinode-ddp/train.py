#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 16 GPUs on 2 nodes (8 per node)
# lora r=16 alpha=32 · bf16 · adamw · batch 1 x seq 2048 · no checkpointing · 16 GPUs
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): accelerate launch --config_file accelerate_config.yaml --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" train.py
#        or: torchrun --nnodes 2 --nproc_per_node 8 --node_rank "$NODE_RANK" --master_addr "$MAIN_IP" --master_port 29500 train.py
# multi-node: set MAIN_IP to node 0's address, NODE_RANK to each node's rank (0..1)
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'lora',
    'lora_r': 16,
    'lora_alpha': 32,
    'lora_dropout': 0.0,
    'lora_targets': 'all-linear',
    'quant': 'none',
    'precision': 'bf16',
    'optim': 'adamw_torch',
    'lr': 0.0002,
    'checkpointing': False,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': False,
}
