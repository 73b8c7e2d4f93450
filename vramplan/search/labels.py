"""How the planner names things in words: a method's family, a setup's memory savers, a byte
count, a duration. Pure functions of a Setup or a number; no search state."""

from __future__ import annotations

from ..estimator.objectives import reference
from ..specs import Setup
from ..util.units import GiB


def size(n: float) -> str:
    """A byte count in GiB with one decimal and no thousands separator ("12.3 GiB")."""
    return f"{n / GiB:.1f} GiB"


def quality_label(setup: Setup) -> str:
    """A method's quality in a few characters ("full", "lora r=64", "qlora r=16", "lora r=16 int8")."""
    if setup.method == "full":
        return "full"
    if setup.quant == "none":
        return f"lora r={setup.lora_rank}"
    if setup.method == "qlora" and setup.quant == "nf4":
        return f"qlora r={setup.lora_rank}"
    return f"lora r={setup.lora_rank} {setup.quant}"


def method_name(setup: Setup) -> str:
    """How a why-not line names a family: "full fine-tune", "LoRA r=64", "QLoRA r=16"."""
    if setup.method == "full":
        return "full fine-tune"
    if setup.quant == "none":
        return f"LoRA r={setup.lora_rank}"
    if setup.quant in ("nf4", "fp4") and setup.method == "qlora":
        return f"QLoRA r={setup.lora_rank}" + ("" if setup.quant == "nf4" else f" ({setup.quant})")
    return f"LoRA r={setup.lora_rank} on a {setup.quant} base"


def savers_text(setup: Setup) -> str:
    """The memory savers of a setup in words ("checkpointing, 8-bit AdamW, ZeRO-3, CPU offload")."""
    parts = []
    if setup.checkpointing:
        every = setup.checkpoint_every
        parts.append("checkpointing" + (f" (1 layer in {every})" if every > 1 else ""))
    if setup.optimizer != "adamw-fused":
        parts.append({"adamw-8bit": "8-bit AdamW", "paged-adamw-8bit": "paged 8-bit AdamW"}.get(setup.optimizer,
                                                                                              setup.optimizer))
    if setup.device_map != "none":
        parts.append(f"the layers split over {setup.gpus} GPUs")
    if setup.tp > 1:
        parts.append(f"tensor parallelism over {setup.tp} GPUs")
    if setup.cp > 1:
        parts.append(f"context parallelism over {setup.cp} GPUs (seq/{setup.cp} each)")
    if setup.zero_stage:
        parts.append(f"ZeRO-{setup.zero_stage}")
    if setup.fsdp != "none":  # hybrid sharding (HSDP): FSDP within groups of gpus / dp_replicate, replicated
        r = setup.dp_replicate
        hybrid = f" hybrid ({r} replicas x {setup.gpus // r} GPUs)" if r > 1 else ""
        parts.append(f"FSDP{'2' if setup.fsdp_version == 2 else ''} {setup.fsdp.upper()}{hybrid}")
    offloaded = [w for w, v in (("optimizer", setup.offload_optimizer), ("params", setup.offload_params))
                 if v != "none"]
    if offloaded:
        kind = setup.offload_params if setup.offload_params != "none" else setup.offload_optimizer
        parts.append(f"{kind.upper() if kind == 'nvme' else 'CPU'} offload of {' and '.join(offloaded)}")
    if setup.attn != "auto":
        parts.append(f"{setup.attn} attention")
    if setup.liger:
        parts.append("Liger kernels")
    if setup.compile:  # torchtune's compile: True (its compiled loss: estimator/torchtune.py)
        parts.append("torch.compile")
    if setup.tiled_mlp:  # Unsloth's unsloth_tiled_mlp=True, axolotl's tiled_mlp (estimator/tiled_mlp.py)
        parts.append("tiled MLP")
    if setup.activation_offload:  # TRL's OffloadActivations (estimator/act_offload.py)
        parts.append("activation offload to host RAM")
    if setup.unsloth_gc:  # LLaMA-Factory's use_unsloth_gc (estimator/unsloth.py llamafactory_gc)
        parts.append("checkpoints in host RAM (use_unsloth_gc)")
    if setup.optimizer_in_backward:  # one optimizer per parameter, stepped in backward (estimator/knobs.py)
        parts.append("optimizer in backward")
    return ", ".join(parts + objective_parts(setup)) or "no memory savers"


def objective_parts(setup: Setup) -> list[str]:
    """DPO's reference and GRPO's generation in words (not savers, but what a plan of them chose)."""
    if setup.objective == "dpo":
        return [{"adapter": "reference: adapter-disabled base", "copy": "reference: frozen copy",
                 "precomputed": "reference log-probs precomputed"}[reference(setup)]]
    if setup.objective != "grpo":
        return []
    gen = {"hf": "HF generate", "vllm-server": "vLLM server"}.get(setup.generation)
    return [gen or f"vLLM colocated at {setup.vllm_memory_fraction:.2f} of the card"]


def describe(setup: Setup) -> str:
    """A setup as a why-not line names it: family, micro-batch, grad accumulation, savers."""
    parts = [method_name(setup), f"micro-batch {setup.batch}"]
    if setup.grad_accum > 1:
        parts.append(f"grad accum {setup.grad_accum}")
    parts.append(savers_text(setup))
    return ", ".join(parts)


def duration(seconds: float) -> str:
    """A run's length in the unit that reads best ("45 s", "12 min", "3.5 h", "2.1 days")."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
