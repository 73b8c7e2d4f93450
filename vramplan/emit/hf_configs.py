"""axolotl, LLaMA-Factory and TRL configs of a Setup: the three that run the HF Trainer, so the
optimizer is a ``TrainingArguments.optim`` string and ZeRO is a DeepSpeed JSON with HF ``"auto"``.

Each function is the inverse of its reader (``vramplan/readers/axolotl.py``, ``llamafactory.py``,
``trainer.py``), at the framework commits the readers cite; the key names are checked against the
frameworks' own argument definitions (``tests/data/framework_fields.json``, with their commits).
:func:`refusal` says which Setup value a framework cannot express.
"""

from __future__ import annotations

import dataclasses

from ..specs import ModelSpec, Setup
from .common import DS_CONFIG
from .trainer import TRAINER_OPTIM

__all__ = ["FIELD_KEYS", "axolotl_config", "llamafactory_config", "refusal", "trl_config", "unmapped"]

#: the Setup fields the writers map; a knob added to Setup later is refused unless at its default
MAPPED = frozenset({"method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "quant", "double_quant",
                    "quant_bits", "quant_group_size", "precision", "optimizer", "checkpointing", "attn", "batch",
                    "seq", "grad_accum", "zero_stage", "offload_optimizer", "offload_params", "gpus", "loss",
                    "pad_mask", "fsdp", "liger", "dora", "modules_to_save", "optimizer_in_backward",
                    "padding_free", "activation_offload", "fsdp_version", "framework",
                    # axolotl's tiled_mlp, LLaMA-Factory's use_unsloth_gc only (setup/checks.py refuses them under any
                    # other framework a writer writes)
                    "tiled_mlp", "tiled_mlp_shards", "unsloth_gc"})

#: Setup field -> the config keys that carry it, per format (``plan --from FILE --emit`` rewrites
#: these keys of the user's file for each field the plan changes; a dotted key is nested)
FIELD_KEYS = {
    "axolotl": {
        "method": ("adapter", "load_in_4bit", "load_in_8bit"), "quant": ("load_in_4bit", "load_in_8bit"),
        "lora_rank": ("lora_r",), "lora_alpha": ("lora_alpha",), "lora_dropout": ("lora_dropout",),
        "lora_targets": ("lora_target_linear", "lora_target_modules"), "precision": ("bf16", "fp16"),
        "optimizer": ("optimizer",), "checkpointing": ("gradient_checkpointing",),
        "attn": ("attn_implementation", "flash_attention", "sdp_attention", "eager_attention"),
        "batch": ("micro_batch_size",), "seq": ("sequence_len",), "grad_accum": ("gradient_accumulation_steps",),
        "zero_stage": ("deepspeed",), "offload_optimizer": ("deepspeed",),
        "offload_params": ("deepspeed", "fsdp_config.offload_params"),
        "fsdp": ("fsdp_version", "fsdp_config"), "fsdp_version": ("fsdp_version", "fsdp_config"),
        "liger": ("plugins", "liger_rope", "liger_rms_norm", "liger_glu_activation",
                  "liger_fused_linear_cross_entropy"),
        "dora": ("peft_use_dora",), "modules_to_save": ("lora_modules_to_save",), "padding_free": ("sample_packing",),
        "activation_offload": ("activation_offloading",),
        "tiled_mlp": ("tiled_mlp", "tiled_mlp_use_original_mlp"), "tiled_mlp_shards": ("tiled_mlp_num_shards",),
    },
    "llamafactory": {
        "method": ("finetuning_type", "quantization_bit"), "quant": ("quantization_bit", "quantization_type"),
        "double_quant": ("double_quantization",), "lora_rank": ("lora_rank",), "lora_alpha": ("lora_alpha",),
        "lora_dropout": ("lora_dropout",), "lora_targets": ("lora_target",), "precision": ("bf16", "fp16", "pure_bf16"),
        "optimizer": ("optim",), "checkpointing": ("disable_gradient_checkpointing",), "attn": ("flash_attn",),
        "batch": ("per_device_train_batch_size",), "seq": ("cutoff_len",),
        "grad_accum": ("gradient_accumulation_steps",), "zero_stage": ("deepspeed",),
        "offload_optimizer": ("deepspeed",), "offload_params": ("deepspeed",), "liger": ("enable_liger_kernel",),
        "fsdp": ("fsdp", "fsdp_config"),  # FSDP is the accelerate file's: an inline one is commented out
        "fsdp_version": ("fsdp", "fsdp_config"),
        "dora": ("use_dora",), "modules_to_save": ("additional_target",), "unsloth_gc": ("use_unsloth_gc",),
    },
    "trl": {
        "method": ("use_peft", "load_in_4bit", "load_in_8bit"), "quant": ("load_in_4bit", "load_in_8bit",
                                                                          "bnb_4bit_quant_type"),
        "double_quant": ("use_bnb_nested_quant",), "lora_rank": ("lora_r",), "lora_alpha": ("lora_alpha",),
        "lora_dropout": ("lora_dropout",), "lora_targets": ("lora_target_modules",),
        "precision": ("dtype", "torch_dtype", "bf16", "fp16"), "optimizer": ("optim",),
        "checkpointing": ("gradient_checkpointing", "activation_checkpointing"), "attn": ("attn_implementation",),
        "batch": ("per_device_train_batch_size",), "seq": ("max_length", "max_seq_length"),
        "grad_accum": ("gradient_accumulation_steps",), "zero_stage": ("deepspeed",),
        "offload_optimizer": ("deepspeed",), "offload_params": ("deepspeed",), "liger": ("use_liger_kernel",),
        "fsdp": ("fsdp", "fsdp_config"), "fsdp_version": ("fsdp", "fsdp_config"),
        "dora": ("use_dora",), "modules_to_save": ("lora_modules_to_save",), "padding_free": ("padding_free",
                                                                                              "packing"),
        "activation_offload": ("activation_offloading",),
    },
}

#: Setup.attn -> transformers' ``attn_implementation`` (auto: not written, transformers picks)
_ATTN_IMPL = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}
#: Setup.attn -> LLaMA-Factory's ``flash_attn`` (``hparams/model_args.py``)
_LF_ATTN = {"auto": "auto", "eager": "disabled", "sdpa": "sdpa", "flash": "fa2"}
_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def unmapped(setup: Setup) -> str | None:
    """A Setup field no writer maps yet, set off its default (knobs added after the writers)."""
    for f in dataclasses.fields(Setup):
        if f.name in MAPPED or f.default is dataclasses.MISSING:
            continue
        if getattr(setup, f.name) != f.default:
            return f"{f.name} {getattr(setup, f.name)!r} (vramplan's writer does not map it)"
    return None


def common_refusal(setup: Setup) -> str | None:
    """What none of the four frameworks expresses (as their readers map them)."""
    if setup.loss == "chunked":
        return f"loss {setup.loss} (vramplan's own chunked loss, vramplan/run/chunked_loss.py)"
    if setup.pad_mask:
        return "pad_mask (a padded attention mask is not a config field vramplan reads)"
    if setup.quant in ("gptq", "awq"):
        return f"quant {setup.quant} (a pre-quantized {setup.quant.upper()} base is not a config field vramplan reads)"
    if setup.checkpointing and setup.checkpoint_every > 1:  # estimator/selective.py
        # (torchtune 0.6.1 would need full_finetune_distributed's ac_mode/ac_option, which checkpoint layers
        # k-1, 2k-1, ... where transformers checkpoints 0, k, ...: readers/torchtune.py)
        return (f"checkpoint_every {setup.checkpoint_every} (selective checkpointing: the framework writers do not "
                "write it yet; --format trainer's train.py passes transformers' every_n_layers)")
    return unmapped(setup)


def refusal(fmt: str, s: Setup, model: ModelSpec) -> str | None:
    """Why ``fmt`` (axolotl, llamafactory, trl; hf: TrainingArguments, trl's fields with transformers'
    loss) cannot express Setup ``s``, or None."""
    why = common_refusal(s)
    if why:
        return why
    if s.framework not in ("hf", fmt):  # --framework hf is the conservative recipe: any framework runs within it
        return (f"framework {s.framework} (the plan's memory is that framework's preparation, not {fmt}'s: "
                f"plan with --framework {fmt} to write this config)")
    # TRL 1.16's SFTTrainer always installs its fused LM head (trl/trainer/sft_trainer.py add_fused_lm_head):
    # a TRL config is loss trl; under autocast (not modelled for trl) it reads back as loss hf, said so
    if fmt == "trl" and s.loss == "hf" and not s.precision.endswith("-mixed"):
        return ("loss hf (TRL's SFTTrainer always scores through its fused LM head, never the full logits: "
                "estimate/plan with --loss trl to write a TRL config)")
    if fmt != "trl" and s.loss == "trl":
        return f"loss trl (TRL's SFTTrainer fused LM head; {fmt} runs its own loss): use --format trl"
    # fmt "hf" (a TrainingArguments file written back, readers/trainer.py read_hf): as trl's fields below
    if s.optimizer_in_backward:
        return ("optimizer_in_backward (no field of this config steps the optimizer in backward; vramplan's "
                "train.py and torchtune's optimizer_in_bwd run it)")
    if s.padding_free and (fmt == "llamafactory" or s.attn != "flash"):
        return ("padding_free" + (" without attn flash (packed rows need flash-attn's varlen kernel)" if fmt !=
                "llamafactory" else " (LLaMA-Factory's packing is not a field vramplan reads back)"))
    if s.method == "lora" and s.quant in ("nf4", "fp4"):
        return f"method lora on a {s.quant} base (a 4-bit base is method qlora there)"
    if fmt == "axolotl":
        if s.quant == "fp4":
            return "quant fp4 (axolotl's qlora is NF4, src/axolotl/loaders/model.py)"
        if s.quant == "nf4" and not s.double_quant:
            return "double_quant off (axolotl's qlora always double-quantizes)"
        if s.precision.endswith("-mixed"):
            return (f"precision {s.precision} (axolotl loads the model in its bf16/fp16 dtype: pure 16-bit, "
                    "src/axolotl/utils/config/__init__.py resolve_dtype)")
        if s.fsdp not in ("none", "full_shard") and s.fsdp_version == 1:
            return (f"fsdp {s.fsdp} (axolotl's fsdp_config sets reshard_after_forward only when true; FSDP1 "
                    "then shards fully)")
    if fmt == "hf" and s.activation_offload:
        return "activation_offload (TrainingArguments has no such field; TRL's SFTConfig has: use --format trl)"
    if fmt == "llamafactory" and s.activation_offload:
        return "activation_offload (LLaMA-Factory has no field for TRL's OffloadActivations)"
    if fmt == "llamafactory":
        if s.adapters and s.precision not in ("bf16", "fp16"):
            return (f"precision {s.precision} with adapters (LLaMA-Factory loads the base in the checkpoint's "
                    "16-bit dtype, src/llamafactory/model/loader.py)")
        if s.method == "full" and s.precision == "fp16":
            return "precision fp16 for a full fine-tune (LLaMA-Factory's pure_bf16 is bf16 only)"
    return None


def _lora_targets(s: Setup) -> list[str]:
    return [t.strip() for t in s.lora_targets.split(",") if t.strip()]


def _saved(s: Setup) -> list[str]:
    return [t.strip() for t in s.modules_to_save.split(",") if t.strip()]


def axolotl_config(s: Setup, model: ModelSpec, *, model_id: str, nodes: int = 1) -> dict:
    """axolotl YAML (``axolotl train``): the inverse of ``vramplan.readers.axolotl``."""
    cfg: dict = {"base_model": model_id}
    if s.adapters:
        cfg["adapter"] = "qlora" if s.method == "qlora" else "lora"
        if s.method == "qlora":
            cfg["load_in_4bit"] = True
        elif s.quant == "int8":
            cfg["load_in_8bit"] = True
        cfg.update(lora_r=s.lora_rank, lora_alpha=s.alpha, lora_dropout=s.lora_dropout)
        if s.lora_targets == "all-linear":
            cfg["lora_target_linear"] = True
        else:
            cfg["lora_target_modules"] = _lora_targets(s)
        if s.dora:  # loaders/adapter.py: LoraConfig(use_dora=cfg.peft_use_dora)
            cfg["peft_use_dora"] = True
        if s.modules_to_save:
            cfg["lora_modules_to_save"] = _saved(s)
    cfg.update(sequence_len=s.seq, sample_packing=s.padding_free, pad_to_sequence_len=True, micro_batch_size=s.batch,
               gradient_accumulation_steps=s.grad_accum, gradient_checkpointing=s.checkpointing,
               optimizer=TRAINER_OPTIM[s.optimizer], bf16=s.precision == "bf16", fp16=s.precision == "fp16")
    if s.attn != "auto":
        cfg["attn_implementation"] = _ATTN_IMPL[s.attn]
    if s.activation_offload:  # true: TRL's OffloadActivations (legacy/disk/hidden_states are axolotl's own)
        cfg["activation_offloading"] = True
    if s.tiled_mlp:  # monkeypatch/tiled_mlp (estimator/tiled_mlp.py); the model's own MLP per shard, written out:
        cfg.update(tiled_mlp=True, tiled_mlp_use_original_mlp=True)  # the Liger plugin's check reads the raw key
        if s.tiled_mlp_shards:
            cfg["tiled_mlp_num_shards"] = s.tiled_mlp_shards
    if s.liger:  # axolotl/integrations/liger: the norm, the gated MLP and the fused loss (RoPE saves nothing)
        cfg.update(plugins=["axolotl.integrations.liger.LigerPlugin"], liger_rope=True, liger_rms_norm=True,
                   liger_glu_activation=True, liger_fused_linear_cross_entropy=True)
    if s.zero_stage:
        cfg["deepspeed"] = DS_CONFIG
    if s.fsdp != "none":
        cfg["fsdp_version"] = s.fsdp_version  # accelerate's FSDP1 (estimator/fsdp.py) or FSDP2 (fsdp2.py)
        cfg["fsdp_config"] = {"reshard_after_forward": s.fsdp == "full_shard" or s.fsdp_version == 1,
                              "offload_params": s.offload_params == "cpu",
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "SHARDED_STATE_DICT",
                              "cpu_ram_efficient_loading": True, "sync_module_states": True}
        if s.fsdp_version == 1:
            cfg["fsdp_config"]["use_orig_params"] = True
    return cfg


def llamafactory_config(s: Setup, model: ModelSpec, *, model_id: str, nodes: int = 1) -> dict:
    """LLaMA-Factory YAML (``llamafactory-cli train``): the inverse of ``vramplan.readers.llamafactory``."""
    cfg: dict = {"model_name_or_path": model_id, "stage": "sft", "do_train": True}
    if s.adapters:
        cfg["finetuning_type"] = "lora"
        cfg.update(lora_rank=s.lora_rank, lora_alpha=s.alpha, lora_dropout=s.lora_dropout,
                   lora_target="all" if s.lora_targets == "all-linear" else ",".join(_lora_targets(s)))
        if s.dora:  # model/adapter.py: LoraConfig(use_dora=...)
            cfg["use_dora"] = True
        if s.modules_to_save:  # LoraConfig(modules_to_save=finetuning_args.additional_target)
            cfg["additional_target"] = ",".join(_saved(s))
        if s.quant != "none":
            cfg.update(quantization_bit=4 if s.method == "qlora" else 8, quantization_method="bnb")
            if s.method == "qlora":
                cfg.update(quantization_type=s.quant, double_quantization=s.double_quant)
        cfg.update(bf16=s.precision == "bf16", fp16=s.precision == "fp16")
    else:
        cfg["finetuning_type"] = "full"
        # init_adapter casts the trainable weights to fp32 unless pure_bf16; bf16/fp16 is autocast
        cfg.update(pure_bf16=s.precision == "bf16", bf16=s.precision in ("bf16", "bf16-mixed"),
                   fp16=s.precision == "fp16-mixed")
    cfg.update(cutoff_len=s.seq, packing=False, per_device_train_batch_size=s.batch,
               gradient_accumulation_steps=s.grad_accum, disable_gradient_checkpointing=not s.checkpointing,
               flash_attn=_LF_ATTN[s.attn], optim=TRAINER_OPTIM[s.optimizer])
    if s.liger:  # model/model_utils/liger_kernel.py, with its fused loss at stage sft
        cfg["enable_liger_kernel"] = True
    if s.unsloth_gc:  # model/model_utils/checkpointing.py UnslothGradientCheckpointing (estimator/unsloth.py)
        cfg["use_unsloth_gc"] = True
    if s.zero_stage:
        cfg["deepspeed"] = DS_CONFIG
    return cfg


def trl_config(s: Setup, model: ModelSpec, *, model_id: str, nodes: int = 1) -> dict:
    """TRL config YAML (``trl sft --config``: ModelConfig + SFTConfig): the inverse of
    ``vramplan.readers.trainer.read_trl``."""
    load = "float32" if s.precision.endswith("-mixed") else _DTYPE[s.precision]
    cfg: dict = {"model_name_or_path": model_id, "dtype": load}
    if s.attn != "auto":
        cfg["attn_implementation"] = _ATTN_IMPL[s.attn]
    if s.adapters:
        cfg.update(use_peft=True, lora_r=s.lora_rank, lora_alpha=s.alpha, lora_dropout=s.lora_dropout,
                   lora_target_modules=["all-linear"] if s.lora_targets == "all-linear" else _lora_targets(s))
        if s.dora:
            cfg["use_dora"] = True
        if s.modules_to_save:
            cfg["lora_modules_to_save"] = _saved(s)
        if s.method == "qlora":
            cfg.update(load_in_4bit=True, bnb_4bit_quant_type=s.quant, use_bnb_nested_quant=s.double_quant)
        elif s.quant == "int8":
            cfg["load_in_8bit"] = True
    cfg.update(max_length=s.seq, packing=False, padding_free=s.padding_free, per_device_train_batch_size=s.batch,
               gradient_accumulation_steps=s.grad_accum, gradient_checkpointing=s.checkpointing,
               gradient_checkpointing_kwargs={"use_reentrant": False}, optim=TRAINER_OPTIM[s.optimizer])
    # the flag is autocast over the load dtype; under FSDP it also makes accelerate upcast trainable
    # units to fp32 (vramplan/readers/trainer.py), so a pure 16-bit FSDP plan runs without it
    amp = s.precision.endswith("-mixed") or s.fsdp == "none"
    cfg.update(bf16=amp and s.precision.startswith("bf16"), fp16=amp and s.precision.startswith("fp16"))
    if s.liger:  # the Trainer's integrations/liger.py
        cfg["use_liger_kernel"] = True
    if s.activation_offload:  # SFTConfig.activation_offloading: SFTTrainer.training_step under OffloadActivations
        cfg["activation_offloading"] = True
    if s.zero_stage:
        cfg["deepspeed"] = DS_CONFIG
    return cfg
