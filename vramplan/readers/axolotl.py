"""axolotl YAML (axolotl-ai-cloud/axolotl at the commit in tests/data/configs/axolotl/SOURCES.json).

Defaults and semantics, from its source:
- ``src/axolotl/utils/schemas/training.py``: ``micro_batch_size=1``, ``gradient_accumulation_steps=1``,
  ``optimizer="adamw_torch_fused"``;
- ``src/axolotl/utils/schemas/config.py``: ``sequence_len=512``, ``gradient_checkpointing=False``
  (or ``"offload"``), ``activation_offloading=False``, ``bf16="auto"``, ``sample_packing=None``,
  ``pad_to_sequence_len`` (True with sample packing), ``attn_implementation`` and its deprecated
  ``flash_attention``/``sdp_attention``/``eager_attention`` switches;
- ``src/axolotl/utils/schemas/peft.py``: ``lora_dropout=0.0``;
- ``src/axolotl/utils/config/__init__.py`` ``resolve_dtype``: ``bf16: auto`` is bf16 on a GPU with
  bf16, and the model is *loaded* in ``torch_dtype`` = bf16 (else fp16 with ``fp16``/``load_in_8bit``,
  else fp32): vramplan's pure ``bf16``/``fp16``/``fp32`` (the Trainer's autocast to the weights'
  own dtype casts nothing);
- ``src/axolotl/loaders/model.py``: ``adapter: qlora`` with ``load_in_4bit`` is bitsandbytes NF4
  with double quantization; ``src/axolotl/loaders/adapter.py``: ``lora_target_linear`` adds every
  Linear but the output head (peft's ``all-linear``), ``lora_modules_to_save`` trains full copies
  (``--modules-to-save``) and ``peft_use_dora`` is ``LoraConfig(use_dora=...)`` (``--dora``).
"""

from __future__ import annotations

from pathlib import Path

from .common import TORCH_COMPILE_WHY, Fields, Mapped, attn_from_name, optimizer_from_name
from .launch import read_deepspeed_file, read_fsdp

__all__ = ["read_axolotl"]

_DEPRECATED_ATTN = (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"),
                    ("eager_attention", "eager"), ("flex_attention", "flex_attention"),
                    ("xformers_attention", "xformers"), ("sage_attention", "sage"))

#: keys that change memory in ways vramplan does not model, and why
_UNMODELLED = {
    "torch_compile": TORCH_COMPILE_WHY,
    "flash_attn_cross_entropy": "flash-attn's fused cross-entropy is not modelled: the HF loss assumed",
    "flash_attn_fuse_mlp": "flash-attn's fused MLP is not modelled: transformers' MLP assumed",
    "cut_cross_entropy": "cut cross-entropy is not modelled: the HF loss assumed",
    "unsloth_lora_mlp": "unsloth's LoRA kernels are not modelled",
    "unsloth_lora_qkv": "unsloth's LoRA kernels are not modelled",
    "unsloth_lora_o": "unsloth's LoRA kernels are not modelled",
    "lora_mlp_kernel": "axolotl's LoRA kernels are not modelled",
    "lora_qkv_kernel": "axolotl's LoRA kernels are not modelled",
    "lora_o_kernel": "axolotl's LoRA kernels are not modelled",
    "relora": "ReLoRA is not modelled: plain LoRA assumed",
    "lisa_n_layers": "LISA layer freezing is not modelled",
    "unfrozen_parameters": "partial freezing is not modelled: every parameter trainable",
    "tensor_parallel_size": "tensor parallelism is not modelled",
    "context_parallel_size": "context parallelism is not modelled",
    "sequence_parallel_degree": "sequence parallelism is not modelled",
    # src/axolotl/loaders/model.py _set_device_map_config: with max_memory (or gpu_memory_limit, each GPU
    # capped and a 256GiB CPU budget) axolotl builds its own device_map with accelerate's
    # infer_auto_device_map(dtype=torch_dtype): no no-split decoder layers, no quantizer sizes, no
    # balancing; transformers' placement (--device-map/--max-memory) is not that map
    "max_memory": "axolotl's own device_map from max_memory (accelerate's infer_auto_device_map without "
                  "no-split layers or quantized sizes) is not modelled: one GPU per process assumed",
    "gpu_memory_limit": "axolotl's own device_map from gpu_memory_limit (accelerate's infer_auto_device_map "
                        "without no-split layers or quantized sizes, CPU offload) is not modelled: one GPU per "
                        "process assumed",
}


def read_axolotl(data: dict, path: Path, m: Mapped) -> None:
    f = Fields(data, str(path))
    s = m.setup
    m.model = f.str("base_model")
    _method(f, m)
    s["seq"] = f.int("sequence_len", 512)
    s["batch"] = f.int("micro_batch_size", 1)
    # axolotl evaluates when it has an eval split (val_set_size > 0 or test_datasets), at eval_batch_size
    # (default micro_batch_size), unless eval_strategy is "no": its own phase (estimator/eval_step.py)
    if (f.float("val_set_size", 0.0) or f.has("test_datasets")) and str(f.str("eval_strategy", "steps")) != "no":
        s["eval_batch"] = f.int("eval_batch_size", s["batch"])
    elif f.has("eval_batch_size"):
        m.ignore("eval_batch_size", f.raw("eval_batch_size"), "no evaluation runs (no val_set_size or test_datasets)")
    s["grad_accum"] = f.int("gradient_accumulation_steps", 1)
    _rl(f, m)
    ckpt = f.bool("gradient_checkpointing", False, extra=("offload", "offload_disk"))
    s["checkpointing"] = bool(ckpt)
    if isinstance(ckpt, str):
        m.ignore("gradient_checkpointing", ckpt, "offloaded checkpoints are not modelled: they stay on the GPU")
    kwargs = f.sub("gradient_checkpointing_kwargs")
    if ckpt and kwargs is not None and kwargs.bool("use_reentrant", False):
        m.ignore("gradient_checkpointing_kwargs.use_reentrant", True,
                 "reentrant checkpointing is not modelled: use_reentrant=False assumed")
    offload = f.bool("activation_offloading", False, extra=("legacy", "disk", "hidden_states"))
    if offload is True:  # TRL's OffloadActivations around each training step (estimator/act_offload.py)
        s["activation_offload"] = True
        m.assume("activation_offloading", True, "TRL 1.16's OffloadActivations around each training step, with "
                 "transformers' non-reentrant checkpointing (axolotl wraps the layers with torch's checkpoint "
                 "wrapper: the same saved layer inputs)")
    elif offload:
        m.ignore("activation_offloading", offload, f"axolotl's {offload!r} offloading (not TRL's OffloadActivations) "
                 "is not modelled: activations stay on the GPU")
    s["attn"] = _attn(f, m)
    s["optimizer"] = optimizer_from_name(f.str("optimizer", "adamw_torch_fused"), m, "optimizer")
    s["precision"] = _precision(f, m)
    packing = f.bool("sample_packing", False)
    if packing and s["attn"] == "flash":  # multipack: rows of sequence_len, position_ids per sample, flash varlen
        s["padding_free"] = True
    elif packing:
        m.ignore("sample_packing", True, "packing without flash attention (a block-diagonal mask) is not modelled: "
                 f"sequences of sequence_len ({s['seq']}) assumed")
    elif not f.bool("pad_to_sequence_len", False):
        m.assume("pad_to_sequence_len", False, "batches padded to their longest row: every row of sequence_len "
                 f"({s['seq']}) assumed, an upper bound")
    if f.has("deepspeed"):
        read_deepspeed_file(f.raw("deepspeed"), path, m)
    if (f.has("fsdp") and f.raw("fsdp") not in ("", [])) or f.has("fsdp_config"):
        read_fsdp(f.raw("fsdp", "full_shard"), f.sub("fsdp_config"), m, "fsdp_config")
        if f.int("fsdp_version", None) == 2:  # FSDP2 (fully_shard): estimator/fsdp2.py
            m.setup["fsdp_version"] = 2
    _tiled_mlp(f, m)
    liger = _liger(data, f.names("plugins", ()), m)
    for key in sorted(data):
        if key.startswith("liger_") and data[key] and not liger:
            m.ignore(key, data[key], "only LigerPlugin with liger_rms_norm, liger_glu_activation and "
                     "liger_fused_linear_cross_entropy all on is modelled: transformers' modules assumed")
        elif key in _UNMODELLED and data[key] not in (None, False, [], ""):
            m.ignore(key, data[key], _UNMODELLED[key])
    plugins = f.names("plugins", ())
    for plugin in plugins:
        if "liger" not in plugin.lower():
            m.ignore("plugins", plugin, "axolotl plugins are not modelled")


def _tiled_mlp(f: Fields, m: Mapped) -> None:
    """``tiled_mlp: true`` (axolotl/monkeypatch/tiled_mlp, 0.18.0): the MLP in shards of the sequence,
    ``tiled_mlp_num_shards`` of them or one per 32,768 tokens (estimator/tiled_mlp.py), with adapters on one GPU;
    full fine-tuning and DeepSpeed/FSDP runs keep the untiled MLP, said so (an upper bound)."""
    shards = f.int("tiled_mlp_num_shards", None)
    if shards is not None and shards < 1:
        raise f.bad("tiled_mlp_num_shards", "a positive integer", shards)
    if not f.bool("tiled_mlp", False):
        if shards:
            m.ignore("tiled_mlp_num_shards", shards, "tiled_mlp is off")
        return
    if m.setup.get("method") == "full" or f.has("deepspeed") or f.has("fsdp_config"):
        m.ignore("tiled_mlp", True, "axolotl's tiled MLP with full fine-tuning or DeepSpeed/FSDP (its gradient "
                 "accumulators, DeepSpeed's TiledMLP) is not modelled: the untiled MLP assumed, an upper bound")
        return
    m.setup["tiled_mlp"] = True
    if shards:
        m.setup["tiled_mlp_shards"] = shards
    if not f.bool("tiled_mlp_use_original_mlp", True):
        m.ignore("tiled_mlp_use_original_mlp", False, "axolotl's torch.compile'd generic MLP is not modelled: "
                 "the model's own MLP assumed in each shard")


def _rl(f: Fields, m: Mapped) -> None:
    """``rl: dpo|orpo|kto``: axolotl's AxolotlDPOTrainer / AxolotlORPOTrainer / AxolotlKTOTrainer
    subclass TRL's trainers and hand them the PeftModel axolotl built: TRL 1.16's step is modelled
    (estimator/objectives.py; micro_batch_size is pairs for DPO/ORPO, rows for KTO). Other RL modes
    (ipo, simpo, grpo, ...) are not read: the SFT step, said so."""
    rl = f.raw("rl", None)
    if rl in (None, False, ""):
        return
    if rl in ("dpo", "orpo", "kto"):
        m.setup["objective"] = rl
        m.assume("rl", rl, f"axolotl's {rl.upper()} trainer subclasses TRL's: TRL 1.16's step modelled, with its "
                 "default reference (ref_model auto)")
    else:
        m.ignore("rl", rl, "only rl dpo, orpo and kto are read: the SFT step assumed")


def _liger(data: dict, plugins, m: Mapped) -> bool:
    """axolotl's LigerPlugin (axolotl/integrations/liger: ``liger_rope``, ``liger_rms_norm``,
    ``liger_glu_activation`` (``liger_swiglu`` its old name), ``liger_fused_linear_cross_entropy``,
    each None by default) applies liger-kernel's ``apply_liger_kernel_to_<model_type>`` with them:
    ``--liger`` when the norm, the gated MLP and the fused loss are all on (RoPE changes no saved
    tensor)."""
    if not any("liger" in str(p).lower() for p in plugins):
        return False
    glu = data.get("liger_glu_activation", data.get("liger_swiglu"))
    if data.get("liger_rms_norm") and glu and data.get("liger_fused_linear_cross_entropy"):
        m.setup["liger"] = True
        return True
    return False


def _method(f: Fields, m: Mapped) -> None:
    s = m.setup
    adapter = f.str("adapter")
    four, eight = f.bool("load_in_4bit", False), f.bool("load_in_8bit", False)
    if not adapter:
        s["method"] = "full"
        if four or eight:
            m.ignore("load_in_4bit" if four else "load_in_8bit", True, "no adapter: axolotl trains the full model")
        for key in ("peft_use_dora", "lora_modules_to_save"):
            if f.raw(key) not in (None, False, [], ""):
                m.ignore(key, f.raw(key), "no adapter: axolotl trains the full model")
        return
    if adapter not in ("lora", "qlora"):
        raise f.bad("adapter", "lora or qlora (other adapters are not modelled)", adapter)
    if adapter == "qlora":
        s["method"] = "qlora"  # loaders/model.py: nf4, double quant, compute dtype = torch_dtype
        if not four:
            m.ignore("adapter", "qlora", "qlora without load_in_4bit: axolotl's loader expects load_in_4bit; "
                     "a 4-bit base assumed")
    else:
        s["method"] = "lora"
        if eight:
            s["quant"] = "int8"
        elif four:
            m.ignore("load_in_4bit", True, "axolotl builds a 4-bit base only with adapter: qlora")
    rank = f.int("lora_r")
    if rank is None:
        m.assume("lora_r", None, "not given: vramplan's default rank 16 assumed")
    else:
        s["lora_rank"] = rank
    if f.has("lora_alpha"):
        s["lora_alpha"] = f.int("lora_alpha")
    s["lora_dropout"] = f.float("lora_dropout", 0.0)
    modules = f.names("lora_target_modules", ())
    if f.bool("lora_target_linear", False):
        s["lora_targets"] = "all-linear"  # adds every Linear but the head; a superset of any list
    elif modules:
        s["lora_targets"] = ",".join(modules)
    else:
        m.assume("lora_target_modules", None, "no targets: peft's default for the model (q_proj,v_proj) assumed")
        s["lora_targets"] = "q_proj,v_proj"
    if f.bool("peft_use_dora", False):  # loaders/adapter.py: LoraConfig(use_dora=cfg.peft_use_dora)
        s["dora"] = True
    saved = f.names("lora_modules_to_save", ())
    if saved:  # LoraConfig(modules_to_save=cfg.lora_modules_to_save)
        s["modules_to_save"] = ",".join(saved)


def _attn(f: Fields, m: Mapped) -> str:
    name = f.str("attn_implementation")
    key = "attn_implementation"
    if name is None:
        for flag, impl in _DEPRECATED_ATTN:
            if f.bool(flag, False):
                name, key = impl, flag
                break
    return attn_from_name(name, m, key)


def _precision(f: Fields, m: Mapped) -> str:
    bf16 = f.bool("bf16", "auto", extra=("auto", "full"))
    fp16 = f.bool("fp16", False)
    if bf16 == "auto":
        if fp16:
            bf16 = False
        else:
            m.assume("bf16", "auto", "bf16 assumed (a GPU with bf16; axolotl falls back to fp16 without)")
            bf16 = True
    if bf16 or f.bool("bfloat16", False):
        return "bf16"
    if fp16 or f.bool("float16", False) or f.bool("load_in_8bit", False):
        return "fp16"
    return "fp32"
