"""How vramplan names things in its output: one line for a Setup, a parameter count.

Shared by the command line, the HTML report, the emitted files' headers, the validation table
and the pytest plugin, so a setup reads the same everywhere. Pure string functions: no click,
no rich, no torch.
"""

from __future__ import annotations

from ..specs import Setup

__all__ = ["describe", "params"]


def describe(setup: Setup) -> str:
    """One line naming the setup: method, precision, optimizer, shape, memory savers."""
    parts = [setup.method]
    if setup.framework != "hf":  # the framework that runs it (setup/frameworks.py); hf: the default recipe
        parts[0] = f"{setup.framework}: {setup.method}"
    if setup.adapters:
        parts[0] += f" r={setup.lora_rank} alpha={setup.alpha}"
        if setup.lora_targets != "all-linear":
            parts[0] += f" on {setup.lora_targets}"
        if setup.dora:
            parts[0] += " DoRA"
        if setup.modules_to_save.strip():
            parts[0] += f" + trained {setup.modules_to_save.strip()}"
    if setup.quant != "none":
        parts.append(f"{setup.quant} base"
                     + (" (double quant)" if setup.double_quant and setup.quant in ("nf4", "fp4") else "")
                     + (f" ({setup.quant_bits}-bit, group {setup.quant_group_size})"
                        if setup.quant in ("gptq", "awq") else ""))
    parts += [setup.precision, setup.optimizer, f"batch {setup.batch} x seq {setup.seq}"]
    if setup.grad_accum > 1:
        parts.append(f"grad accum {setup.grad_accum}")
    parts.append(("checkpointing" + (f" 1 layer in {setup.checkpoint_every}" if setup.checkpoint_every > 1 else ""))
                 if setup.checkpointing else "no checkpointing")
    if setup.attn != "auto":
        parts.append(f"attn {setup.attn}")
    if setup.pad_mask:
        parts.append("padding mask")
    if setup.loss != "hf":
        parts.append(f"{setup.loss} loss")
    if setup.liger:
        parts.append("Liger kernels")
    if setup.compile:
        parts.append("torch.compile")
    if setup.tiled_mlp:
        parts.append(f"tiled MLP ({setup.tiled_mlp_shards} shards)" if setup.tiled_mlp_shards else "tiled MLP")
    if setup.activation_offload:
        parts.append("activation offload")
    if setup.unsloth_gc:
        parts.append("checkpoints in host RAM (use_unsloth_gc)")
    if setup.padding_free:
        parts.append("padding-free")
    if setup.optimizer_in_backward:
        parts.append("optimizer in backward")
    if setup.eval_batch:
        parts.append(f"eval batch {setup.eval_batch}")
    if setup.objective != "sft":  # DPO/GRPO: the objective, its reference and generation knobs
        parts.append(setup.objective.upper() + (f" x{setup.num_generations}" if setup.objective == "grpo" else "")
                     + (f" ref {setup.ref_model}" if setup.ref_model != "auto" else "")
                     + (f" {setup.generation}" if setup.generation != "hf" else "")
                     + (f" {setup.vllm_memory_fraction:.2f}" if setup.generation == "vllm-colocate" else ""))
    if setup.gpus > 1:
        parts.append(f"{setup.gpus} GPUs")
    if setup.tp > 1:  # transformers' tp_plan: every layer sharded over the GPUs
        parts.append(f"tensor parallel (tp {setup.tp})")
    if setup.ep > 1:  # transformers' ep_plan: the routed experts split over the GPUs, tokens by all-to-all
        parts.append(f"expert parallel (ep {setup.ep})")
    if setup.cp > 1:  # torch's ring attention: the sequence sharded over the GPUs
        parts.append(f"context parallel (cp {setup.cp})")
    if setup.pp > 1:  # torch.distributed.pipelining: one stage per GPU, grad_accum micro-batches
        parts.append(f"pipeline parallel (pp {setup.pp}, {setup.pp_schedule})")
    if setup.device_map != "none":  # one process, the layers over the GPUs
        from .max_memory import caps_text

        caps = f", max_memory {caps_text(setup.max_memory)}" if setup.max_memory else ""
        parts.append(f"layer split (device_map={setup.device_map}{caps})")
    if setup.zero_stage:
        parts.append(f"ZeRO-{setup.zero_stage}")
    if setup.fsdp != "none":
        parts.append(f"FSDP{'2' if setup.fsdp_version == 2 else ''} {setup.fsdp.upper()}" + (
            f" hybrid ({setup.dp_replicate} replicas x {setup.gpus // setup.dp_replicate} GPUs)"
            if setup.dp_replicate > 1 else ""))
    if setup.offload_optimizer != "none":
        parts.append(f"optimizer offload to {setup.offload_optimizer}")
    if setup.offload_params != "none":
        parts.append(f"param offload to {setup.offload_params}")
    return " · ".join(parts)


def params(n: int) -> str:
    """A parameter count for people: ``"8.03 B"`` from a billion on, ``"41.9 M"`` below."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
