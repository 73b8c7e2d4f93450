#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 1 GPU
# qlora r=64 alpha=128 on q_proj,v_proj · nf4 base (double quant) · bf16 · paged-adamw-8bit · batch 1 x seq 2048 · checkpointing
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): python train.py
#        or: accelerate launch --config_file accelerate_config.yaml train.py
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'qlora',
    'lora_r': 64,
    'lora_alpha': 128,
    'lora_dropout': 0.0,
    'lora_targets': 'q_proj,v_proj',
    'quant': 'nf4',
    'double_quant': True,
    'quant_storage': 'uint8',
    'precision': 'bf16',
    'optim': 'paged_adamw_8bit',
    'lr': 0.0002,
    'checkpointing': True,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 1,
    'seq': 2048,
    'grad_accum': 1,
    'sharded': False,
}
