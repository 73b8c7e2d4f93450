#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 4 GPUs
# full · bf16-mixed · adamw-fused · batch 2 x seq 2048 · no checkpointing · 4 GPUs
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): accelerate launch --config_file accelerate_config.yaml train.py
#        or: torchrun --nproc_per_node 4 train.py
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
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
