"""HF ``TrainingArguments`` (JSON or YAML) and TRL's configs (``trl sft|dpo|grpo --config``).

Defaults, read off the sources of the versions modelled:
- transformers 5.24 ``src/transformers/training_args.py``: ``per_device_train_batch_size=8``,
  ``gradient_accumulation_steps=1``, ``gradient_checkpointing=False``, ``optim="adamw_torch_fused"``,
  ``bf16=False``, ``fp16=False``; ``bf16``/``fp16`` turn on autocast (accelerate's native AMP) over
  whatever dtype the script loaded the model in. ``PreTrainedModel.from_pretrained``'s default
  ``dtype="auto"`` loads the checkpoint's dtype (bf16 for the shipped models).
- TRL (huggingface/trl ``trl/trainer/base_config.py``): ``gradient_checkpointing=True``,
  ``bf16=True`` unless ``fp16``; ``trl/trainer/sft_config.py``: ``max_length=1024``,
  ``packing=False``, ``padding_free=False``, ``activation_offloading=False``;
  ``trl/trainer/model_config.py`` (what ``trl sft`` loads the model with): ``dtype="float32"``,
  ``use_peft=False``, ``lora_r=16``, ``lora_alpha=32``, ``lora_dropout=0.05``,
  ``lora_target_modules=None`` (peft's per-model default), ``load_in_4bit/8bit=False``,
  ``bnb_4bit_quant_type="nf4"``, ``use_bnb_nested_quant=False``.
"""

from __future__ import annotations

from pathlib import Path

from .common import Fields, Mapped, attn_from_name, optimizer_from_name
from .launch import read_deepspeed_file, read_fsdp

__all__ = ["load_precision", "read_hf", "read_trl", "training_arguments"]

_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
           "auto": "auto"}


def load_precision(load: str, amp: str | None, m: Mapped, key: str) -> str:
    """vramplan's precision from the dtype the model is loaded in (fp32/bf16/fp16, or "auto":
    the checkpoint's) and the autocast dtype (``bf16``/``fp16`` flags; None: no autocast).
    fp32 weights under autocast are vramplan's ``-mixed``; 16-bit weights are its pure 16-bit
    (autocast to the weights' own dtype casts nothing)."""
    if load == "auto":
        m.assume(key, "auto", "the checkpoint's dtype: bf16 assumed (the shipped models' torch_dtype)")
        load = "bf16"
    if load == "fp32":
        return f"{amp}-mixed" if amp else "fp32"
    if amp and amp != load:
        m.ignore("fp16" if amp == "fp16" else "bf16", True, f"autocast to {amp} over {load} weights is not modelled: "
                 f"{load} assumed")
    return load


def training_arguments(f: Fields, path: Path, m: Mapped, *, trl: bool) -> str | None:
    """The TrainingArguments fields into ``m.setup``; returns the autocast dtype (or None)."""
    s = m.setup
    s["batch"] = f.int("per_device_train_batch_size", 8)
    s["grad_accum"] = f.int("gradient_accumulation_steps", 1)
    s["checkpointing"] = f.bool("gradient_checkpointing", trl)
    kwargs = f.sub("gradient_checkpointing_kwargs")
    if s["checkpointing"] and kwargs is not None and kwargs.bool("use_reentrant", False):
        m.ignore("gradient_checkpointing_kwargs.use_reentrant", True,
                 "reentrant checkpointing is not modelled: use_reentrant=False assumed")
    s["optimizer"] = optimizer_from_name(f.str("optim", "adamw_torch_fused"), m, "optim")
    fp16 = f.bool("fp16", False)
    bf16 = f.bool("bf16", trl and not fp16)
    if f.has("deepspeed"):
        read_deepspeed_file(f.raw("deepspeed"), path, m)
    if f.has("fsdp") and f.raw("fsdp") not in ("", []):
        read_fsdp(f.raw("fsdp"), f.sub("fsdp_config"), m, "fsdp_config")
    if f.has("per_device_eval_batch_size"):
        m.ignore("per_device_eval_batch_size", f.raw("per_device_eval_batch_size"),
                 "evaluation is not modelled: the training step's peak")
    for key, why in (("torch_compile", "torch.compile is not modelled: eager kernels assumed"),
                     ("use_liger_kernel", "Liger kernels are not modelled: transformers' modules assumed"),
                     ("tf32", None), ("auto_find_batch_size", "the batch is per_device_train_batch_size")):
        if why and f.bool(key, False):
            m.ignore(key, True, why)
    return "bf16" if bf16 else "fp16" if fp16 else m.amp


def _load_dtype(f: Fields, default: str, m: Mapped) -> str:
    kwargs = f.sub("model_init_kwargs")
    value = f.raw("dtype", f.raw("torch_dtype"))
    key = "dtype"
    if value is None and kwargs is not None:
        value, key = kwargs.raw("dtype", kwargs.raw("torch_dtype")), "model_init_kwargs.dtype"
    if value is None:
        return default
    if value not in _DTYPES:
        raise f.bad(key, "one of " + ", ".join(_DTYPES), value)
    return _DTYPES[value]


def read_hf(data: dict, path: Path, m: Mapped) -> None:
    """Plain TrainingArguments: the setup of a full fine-tune of the model the script loads (no
    model in the file unless ``model_name_or_path`` is there); sequence length from
    ``max_length``/``max_seq_length`` when present."""
    f = Fields(data, str(path))
    m.model = f.str("model_name_or_path")
    amp = training_arguments(f, path, m, trl=False)
    seq = f.int("max_length", None) or f.int("max_seq_length", None)
    if seq is None:
        m.assume("max_length", None, "TrainingArguments has no sequence length: 2048 assumed (pass --seq)")
    else:
        m.setup["seq"] = seq
    load = _load_dtype(f, "auto", m)
    m.setup["precision"] = load_precision(load, amp, m, "dtype")
    m.setup["attn"] = attn_from_name(f.str("attn_implementation"), m, "attn_implementation")


def read_trl(data: dict, path: Path, m: Mapped) -> None:
    """A ``trl sft|dpo|grpo --config`` YAML: ModelConfig + ScriptArguments + the trainer's config."""
    f = Fields(data, str(path))
    m.model = f.str("model_name_or_path")
    amp = training_arguments(f, path, m, trl=True)
    s = m.setup
    s["seq"] = f.int("max_length", None) or f.int("max_seq_length", 1024)
    for key, why in (("packing", "packing is not modelled: sequences of max_length assumed"),
                     ("padding_free", "padding-free batches are not modelled: batch x max_length assumed"),
                     ("activation_offloading", "activation offloading is not modelled: activations stay on the GPU"),
                     ("use_dora", "DoRA is not modelled: plain LoRA assumed"),
                     ("use_rslora", None)):
        if why and f.bool(key, False):
            m.ignore(key, True, why)
    if f.has("lora_modules_to_save"):
        m.ignore("lora_modules_to_save", f.raw("lora_modules_to_save"),
                 "fully trained module copies are not modelled: adapters only")
    s["attn"] = attn_from_name(f.str("attn_implementation"), m, "attn_implementation")
    load = _load_dtype(f, "fp32", m)  # ModelConfig.dtype defaults to float32
    four, eight = f.bool("load_in_4bit", False), f.bool("load_in_8bit", False)
    if f.bool("use_peft", False):
        s["method"] = "qlora" if four else "lora"
        s["lora_rank"] = f.int("lora_r", 16)
        s["lora_alpha"] = f.int("lora_alpha", 32)
        s["lora_dropout"] = f.float("lora_dropout", 0.05)
        targets = f.names("lora_target_modules")
        if targets is None:
            m.assume("lora_target_modules", None, "peft's default for the model: q_proj,v_proj assumed")
            targets = ("q_proj", "v_proj")
        s["lora_targets"] = "all-linear" if targets in (("all-linear",), ("all_linear",)) else ",".join(targets)
        if four:
            quant = f.str("bnb_4bit_quant_type", "nf4")
            if quant not in ("nf4", "fp4"):
                raise f.bad("bnb_4bit_quant_type", "nf4 or fp4", quant)
            s["quant"] = quant
            s["double_quant"] = f.bool("use_bnb_nested_quant", False)
        elif eight:
            s["quant"] = "int8"
    elif four or eight:
        m.ignore("load_in_4bit" if four else "load_in_8bit", True, "a quantized base needs use_peft: full fine-tune "
                 "of the unquantized model assumed")
    s["precision"] = load_precision(load, amp, m, "dtype")
    if f.has("num_processes"):
        m.gpus = f.int("num_processes")
