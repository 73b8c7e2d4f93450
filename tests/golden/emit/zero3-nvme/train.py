#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 2 GPUs
# full · bf16 · adamw · batch 1 x seq 2048 · no checkpointing · 2 GPUs · ZeRO-3 · optimizer offload to nvme · param offload to nvme
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB), 5.00 GiB host RAM on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): deepspeed --num_gpus 2 train.py --deepspeed ds_config.json
#        or: accelerate launch --config_file accelerate_config.yaml train.py --deepspeed ds_config.json
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'full',
    'quant': 'none',
    'precision': 'bf16',
    'optim': 'adamw_torch',
    'lr': 2e-05,
    'checkpointing': False,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': True,
}
