#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 16 GPUs on 2 nodes (8 per node)
# full · bf16 · adamw · batch 1 x seq 2048 · checkpointing · 16 GPUs · ZeRO-3
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 --master_addr "$MAIN_IP" --master_port 29500 train.py --deepspeed ds_config.json
#        or: accelerate launch --config_file accelerate_config.yaml --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP" train.py --deepspeed ds_config.json
# multi-node: set MAIN_IP to node 0's address, NODE_RANK to each node's rank (0..1) for the per-node command; list the nodes in hostfile
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'full',
    'quant': 'none',
    'precision': 'bf16',
    'optim': 'adamw_torch',
    'lr': 2e-05,
    'checkpointing': True,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': True,
}
