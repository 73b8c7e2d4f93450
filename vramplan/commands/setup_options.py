"""The setup options, defined once (:data:`SETUP_OPTIONS`): the flag, type and help of every Setup
field, as a setting with the canonical step's default or as a knob that defaults to None
(vramplan/commands/options.py adds them to the commands). Light at import: click and vramplan's
torch-free modules only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click

from ..setup.frameworks import FRAMEWORKS
from ..setup.spec import PP_SCHEDULES
from ..specs import (
    ATTENTIONS,
    DEVICE_MAPS,
    FSDP_MODES,
    GENERATIONS,
    LOSSES,
    METHODS,
    OBJECTIVES,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    QUANTS,
    REF_MODELS,
    Setup,
    SpecError,
)

__all__ = ["BY_FIELD", "FLAG", "Count", "LORA_FIELDS", "MaxMemory", "SETUP_FIELDS", "SETUP_OPTIONS", "SetupOption"]

_DEFAULT = Setup()

# ----------------------------------------------------------------------------------------------
# Setup options: defined once, shared by every command that takes a setup


class Count(click.ParamType):
    """An integer option bounded by :data:`vramplan.setup.inputs.MAX_COUNTS` (``--batch``, ``--gpus``...),
    so an absurd number is one error line, not minutes of search or an overflow below."""

    name = "integer"

    def __init__(self, key: str, minimum: int = 1) -> None:
        self.key = key
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..setup.inputs import MAX_COUNTS, count_shown

        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if len(text) > 40 or not text.lstrip("+-").isdigit():
                shown = text if len(text) <= 40 else text[:37] + "..."
                self.fail(f"{shown!r} is not a whole number", param, ctx)
            number = int(text)
        if number > MAX_COUNTS[self.key]:
            self.fail(f"at most {MAX_COUNTS[self.key]:,}; got {count_shown(number)}", param, ctx)
        if self.minimum == 0 and number < 0:  # a positive count's 0 or less is Setup's to refuse (its message)
            self.fail(f"must be 0 or more; got {number}", param, ctx)
        return number


class MaxMemory(click.ParamType):
    """``--max-memory 0=20GiB,1=24GiB``: accelerate's per-GPU caps (vramplan/setup/max_memory.py)."""

    name = "INDEX=SIZE,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        from ..setup.max_memory import parse_max_memory

        if isinstance(value, tuple):
            return value
        try:
            return parse_max_memory(str(value))
        except SpecError as exc:
            self.fail(str(exc).removeprefix("--max-memory").lstrip(": "), param, ctx)


def _stage(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else int(value)


@dataclasses.dataclass(frozen=True)
class SetupOption:
    """The option that sets one Setup field: its flag (``--name/--no-name`` for a switch), type,
    and help as a setting whose default is the canonical step's."""

    field: str
    flag: str
    type: Any = None
    help: str | None = None
    show_default: bool = True
    callback: Callable | None = None

    @property
    def name(self) -> str:
        """The flag a user types to set it (what messages name)."""
        return self.flag.split("/", 1)[0]

    def setting(self, help_text: str | None = None) -> Callable:
        """The click option with the canonical step's value as its default (and ``help_text``,
        when given, instead of the usual help)."""
        default = getattr(_DEFAULT, self.field)
        if self.callback is not None:  # a choice of strings converted back (the ZeRO stage)
            default = str(default)
        return click.option(self.flag, self.field, type=self.type, default=default, show_default=self.show_default,
                            help=help_text or self.help, callback=self.callback)

    def knob(self, help_text: str | None) -> Callable:
        """The click option defaulting to None (not given), with ``help_text`` for that use."""
        return click.option(self.flag, self.field, type=self.type, default=None, help=help_text,
                            callback=self.callback)


#: Every setup option, in the order ``--help`` lists them.
SETUP_OPTIONS: tuple[SetupOption, ...] = (
    SetupOption("method", "--method", click.Choice(METHODS),
                "Full fine-tuning, LoRA adapters, or LoRA on a 4-bit base."),
    SetupOption("lora_rank", "--lora-rank", Count("lora_rank"), "LoRA rank r."),
    SetupOption("lora_alpha", "--lora-alpha", Count("lora_alpha"), "LoRA alpha  [default: 2 x rank]",
                show_default=False),
    SetupOption("lora_dropout", "--lora-dropout", float),
    SetupOption("lora_targets", "--lora-targets", None,
                "'all-linear' or comma-separated module names (q_proj,v_proj)."),
    SetupOption("quant", "--quant", click.Choice(QUANTS),
                "Base-weight quantization (qlora implies nf4; gptq/awq: a pre-quantized checkpoint, --method lora)."),
    SetupOption("quant_bits", "--quant-bits", int, "GPTQ/AWQ bits per weight (gptq: 2, 3, 4, 8; awq: 4)."),
    SetupOption("quant_group_size", "--quant-group-size", int,
                "GPTQ/AWQ input channels per scale group (-1: per output channel)."),
    SetupOption("double_quant", "--double-quant/--no-double-quant", None,
                "Quantize the 4-bit scales too (bitsandbytes bnb_4bit_use_double_quant)."),
    SetupOption("precision", "--precision", click.Choice(PRECISIONS)),
    SetupOption("optimizer", "--optimizer", click.Choice(OPTIMIZERS)),
    SetupOption("checkpointing", "--checkpointing/--no-checkpointing", None,
                "HF gradient checkpointing (use_reentrant=False)."),
    SetupOption("checkpoint_every", "--checkpoint-every", Count("checkpoint_every"),
                "With --checkpointing: checkpoint every k-th layer only (transformers every_n_layers)."),
    SetupOption("attn", "--attn", click.Choice(ATTENTIONS),
                "Attention implementation; auto is what transformers picks for the family."),
    SetupOption("batch", "--batch", Count("batch"), "Micro-batch size per GPU."),
    SetupOption("seq", "--seq", Count("seq"), "Sequence length in tokens."),
    SetupOption("grad_accum", "--grad-accum", Count("grad_accum"), "Gradient accumulation steps."),
    SetupOption("zero_stage", "--zero", click.Choice(["0", "1", "2", "3"]), "DeepSpeed ZeRO stage.",
                callback=_stage),
    SetupOption("offload_optimizer", "--offload-optimizer", click.Choice(OFFLOADS),
                "ZeRO optimizer offload (needs --zero 1/2/3)."),
    SetupOption("offload_params", "--offload-params", click.Choice(OFFLOADS),
                "ZeRO parameter offload (needs --zero 3); with --fsdp, FSDP's CPU offload."),
    SetupOption("fsdp", "--fsdp", click.Choice(FSDP_MODES),
                "PyTorch FSDP sharding (accelerate's FSDP1) instead of ZeRO."),
    SetupOption("gpus", "--gpus", Count("gpus"), "Number of GPUs (data parallel)."),
    SetupOption("loss", "--loss", click.Choice(LOSSES),
                "hf: logits then cross-entropy; chunked: the head and loss per 1024-token chunk; trl: TRL 1.16 "
                "SFTTrainer's fused LM head (4096 x 32768 tiles); unsloth: Unsloth's fused chunked cross-entropy."),
    SetupOption("framework", "--framework", click.Choice((*FRAMEWORKS, "any")),
                "The framework that runs the step: hf (the HF Trainer with peft's QLoRA recipe, what emit writes), "
                "trl (TRL 1.16 SFTTrainer: no fp32 upcast of a quantized base, bf16 QLoRA adapters, its fused "
                "LM head unless --loss), axolotl, llamafactory (no upcast), unsloth (its kernels, fused loss and "
                "offloaded checkpointing), torchtune (its recipes); any (plan only): plan each and take the best."),
    SetupOption("pad_mask", "--pad-mask/--no-pad-mask", None,
                "Batches carry a padded attention_mask (SDPA gets an explicit mask)."),
    SetupOption("modules_to_save", "--modules-to-save", None,
                "Modules trained in full beside the adapters (peft modules_to_save), e.g. embed_tokens,lm_head."),
    SetupOption("dora", "--dora/--no-dora", None, "DoRA adapters (peft use_dora)."),
    SetupOption("activation_offload", "--activation-offload/--no-activation-offload", None,
                "Offload saved activations to host memory (TRL's OffloadActivations: SFTConfig/axolotl "
                "activation_offloading), with --checkpointing."),
    SetupOption("liger", "--liger/--no-liger", None,
                "Liger kernels (use_liger_kernel): fused linear cross-entropy, RMSNorm, SwiGLU, RoPE."),
    SetupOption("optimizer_in_backward", "--optimizer-in-backward/--no-optimizer-in-backward", None,
                "Step each parameter in backward as its gradient is ready (torchtune optimizer_in_bwd)."),
    SetupOption("padding_free", "--padding-free/--no-padding-free", None,
                "Padding-free batches: batch x seq tokens in one row (TRL padding_free, flash varlen)."),
    SetupOption("compile", "--compile/--no-compile", None,
                "torch.compile as the framework applies it: torchtune's compile: True (its compiled loss; the "
                "layers' recompute kept eager, an upper bound). Other frameworks: refused."),
    SetupOption("tiled_mlp", "--tiled-mlp/--no-tiled-mlp", None,
                "The MLP run in sequence tiles: Unsloth's unsloth_tiled_mlp=True (tiles of hidden-size tokens) or "
                "axolotl's tiled_mlp (a shard per 32,768 tokens): less memory at long context, one more MLP "
                "forward per layer; --framework unsloth or axolotl."),
    SetupOption("unsloth_gc", "--unsloth-gc/--no-unsloth-gc", None,
                "LLaMA-Factory's use_unsloth_gc: the checkpointed layer inputs kept in host RAM (copied out in the "
                "forward, back for each layer's backward; --framework llamafactory with --checkpointing)."),
    SetupOption("eval_batch", "--eval-batch", Count("eval_batch", minimum=0),
                "Per-device eval batch when the run evaluates (0: no eval step)."),
    SetupOption("device_map", "--device-map", click.Choice(DEVICE_MAPS),
                "Split the layers over --gpus GPUs in one process (accelerate device_map)."),
    SetupOption("max_memory", "--max-memory", MaxMemory(),
                "With --device-map: accelerate's max_memory per GPU, e.g. 0=20GiB,1=24GiB  [default: each GPU's "
                "free memory]", show_default=False),
    SetupOption("tp", "--tp", Count("tp"), "Tensor-parallel degree (transformers tp_plan=auto; --gpus equal to it)."),
    SetupOption("cp", "--cp", Count("cp"), "Context-parallel degree (accelerate cp_size, with FSDP2 on --gpus)."),
    SetupOption("ep", "--ep", Count("ep"),
                "Expert-parallel degree of an MoE model's routed experts (transformers ep_size; with --tp and "
                "--gpus equal to it)."),
    SetupOption("pp", "--pp", Count("pp"),
                "Pipeline stages (torch.distributed.pipelining, one stage per GPU; --grad-accum micro-batches)."),
    SetupOption("pp_schedule", "--pp-schedule", click.Choice(PP_SCHEDULES),
                "Pipeline schedule with --pp (gpipe, 1f1b modelled; the others not yet)."),
    SetupOption("fsdp_version", "--fsdp-version", click.Choice(["1", "2"]),
                "accelerate fsdp_version: 1 (FlatParameter) or 2 (fully_shard).", callback=_stage),
    SetupOption("dp_replicate", "--dp-replicate", Count("dp_replicate"),
                "Hybrid sharding (HSDP): FSDP shards within --gpus/N GPUs, replicated N times (accelerate "
                "dp_replicate_size; FSDP1 HYBRID_SHARD, N = nodes)."),
    SetupOption("objective", "--objective", click.Choice(OBJECTIVES), "Training objective (TRL's trainers)."),
    SetupOption("max_prompt_length", "--max-prompt-length", Count("max_prompt_length", minimum=0),
                "DPO/GRPO prompt tokens (0: from --seq)."),
    SetupOption("max_completion_length", "--max-completion-length", Count("max_completion_length", minimum=0),
                "DPO/GRPO completion tokens (0: from --seq)."),
    SetupOption("num_generations", "--num-generations", Count("num_generations"), "GRPO completions per prompt."),
    SetupOption("ref_model", "--ref-model", click.Choice(REF_MODELS),
                "Reference model: auto (adapter-disabled base with LoRA, else a frozen copy), copy, adapter, "
                "precomputed, none."),
    SetupOption("generation", "--generation", click.Choice(GENERATIONS), "GRPO generation engine."),
    SetupOption("vllm_memory_fraction", "--vllm-memory-fraction", float,
                "GRPO with vLLM colocated: the share of each GPU vLLM takes (vllm_gpu_memory_utilization)."),
)

BY_FIELD = {o.field: o for o in SETUP_OPTIONS}

#: Setup field -> the option that sets it, so validation messages name what the user typed.
FLAG: dict[str, str] = {o.field: o.name for o in SETUP_OPTIONS}

#: The Setup's fields (every one has an option).
SETUP_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Setup))

#: The options that only LoRA reads.
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
