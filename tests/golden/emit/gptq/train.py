#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 1 GPU
# lora r=16 alpha=32 · gptq base (4-bit, group 128) · fp16 · adamw · batch 1 x seq 2048 · checkpointing
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): python train.py
#        or: accelerate launch --config_file accelerate_config.yaml train.py
# needs --model: a pre-quantized 4-bit GPTQ checkpoint of meta-llama/Llama-3.1-8B (random weights cannot be GPTQ-quantized here)
# the plan and the estimate it was made from: vramplan.json
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'lora',
    'lora_r': 16,
    'lora_alpha': 32,
    'lora_dropout': 0.0,
    'lora_targets': 'all-linear',
    'quant': 'gptq',
    'quant_bits': 4,
    'quant_group_size': 128,
    'precision': 'fp16',
    'optim': 'adamw_torch',
    'lr': 0.0002,
    'checkpointing': True,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': False,
}
