"""LLaMA-Factory YAML (hiyouga/LLaMA-Factory at the commit in tests/data/configs/llamafactory/SOURCES.json).

Defaults and semantics, from its source:
- ``src/llamafactory/hparams/finetuning_args.py``: ``stage="sft"``, ``finetuning_type="lora"``,
  ``lora_rank=8``, ``lora_alpha=None`` (2 x rank), ``lora_dropout=0.0``, ``lora_target="all"``
  (every Linear but the head: peft's ``all-linear``), ``pure_bf16=False``;
- ``src/llamafactory/hparams/model_args.py``: ``quantization_bit=None``, ``quantization_method="bnb"``,
  ``quantization_type="nf4"``, ``double_quantization=True``, ``flash_attn="auto"``,
  ``disable_gradient_checkpointing=False`` (``model/model_utils/checkpointing.py`` turns HF
  gradient checkpointing on unless it is set), ``enable_liger_kernel``, ``use_unsloth_gc``,
  ``upcast_lmhead_output``;
- ``src/llamafactory/hparams/data_args.py``: ``cutoff_len=2048``, ``packing=None`` (on for ``stage: pt``,
  ``hparams/parser.py``), ``neat_packing=False``;
- the rest are TrainingArguments (``vramplan.readers.trainer``);
- ``src/llamafactory/model/loader.py`` loads with ``torch_dtype="auto"`` (the checkpoint's dtype)
  and ``model/adapter.py`` ``init_adapter`` casts the trainable parameters to fp32 unless
  ``pure_bf16``: a full fine-tune is fp32 weights under bf16 autocast (vramplan's ``bf16-mixed``),
  LoRA a bf16 base with fp32 adapters (vramplan's ``bf16``).
"""

from __future__ import annotations

from pathlib import Path

from .common import TORCH_COMPILE_WHY, Fields, Mapped
from .trainer import load_precision, training_arguments

__all__ = ["read_llamafactory"]

_ATTN = {"auto": "auto", "disabled": "eager", "sdpa": "sdpa", "fa2": "flash", "fa3": "flash"}

_UNMODELLED = {
    "use_unsloth": "unsloth's kernels are not modelled",
    "upcast_lmhead_output": "an fp32 lm_head output is not modelled beyond the HF loss's fp32 upcast",
    "upcast_layernorm": "fp32 layernorm weights are not modelled",
    "neat_packing": "packing is not modelled: sequences of cutoff_len assumed",
    "use_galore": "GaLore is not modelled: the optimizer over every trainable parameter assumed",
    "use_apollo": "APOLLO is not modelled: the optimizer over every trainable parameter assumed",
    "use_badam": "BAdam is not modelled: the optimizer over every trainable parameter assumed",
    "use_adam_mini": "Adam-mini is not modelled: AdamW assumed",
    "use_muon": "Muon is not modelled: AdamW assumed",
    "shift_attn": "LongLoRA's shifted attention is not modelled",
    "mixture_of_depths": "mixture of depths is not modelled",
    "torch_compile": TORCH_COMPILE_WHY,
}


def read_llamafactory(data: dict, path: Path, m: Mapped) -> None:
    f = Fields(data, str(path))
    s = m.setup
    m.model = f.str("model_name_or_path")
    amp = training_arguments(f, path, m, trl=False)
    s["checkpointing"] = not f.bool("disable_gradient_checkpointing", False)
    if f.bool("use_unsloth_gc", False):  # model_utils/checkpointing.py: the layer inputs in host RAM
        if s["checkpointing"]:
            s["unsloth_gc"] = True
        else:
            m.ignore("use_unsloth_gc", True, "gradient checkpointing is off (disable_gradient_checkpointing)")
    s["seq"] = f.int("cutoff_len", 2048)
    stage = f.str("stage", "sft")
    if stage not in ("pt", "sft", "rm", "ppo", "dpo", "kto"):
        raise f.bad("stage", "pt, sft, rm, ppo, dpo or kto", stage)
    kind = f.str("finetuning_type", "lora")
    if kind not in ("lora", "oft", "freeze", "full"):
        raise f.bad("finetuning_type", "lora, oft, freeze or full", kind)
    if f.bool("enable_liger_kernel", False):  # model/model_utils/liger_kernel.py: apply_liger_kernel_to_<type>
        if stage in ("pt", "sft"):
            s["liger"] = True
        else:  # require_logits: fused_linear_cross_entropy=False, cross_entropy=True
            m.ignore("enable_liger_kernel", True, f"Liger without its fused loss (stage {stage}) is not modelled: "
                     "transformers' modules assumed")
    if f.bool("packing", stage == "pt"):
        m.ignore("packing", True, f"packing is not modelled: sequences of cutoff_len ({s['seq']}) assumed")
    if stage in ("ppo", "rm") or (stage in ("dpo", "kto") and kind in ("full", "freeze")):
        m.ignore("stage", stage, "only the policy's step is modelled (no reference, reward or value model)")
    elif stage in ("dpo", "kto"):
        m.ignore("stage", stage, "a preference step runs chosen and rejected rows: the batch is counted once")
    flash = f.str("flash_attn", "auto")
    if flash not in _ATTN:
        raise f.bad("flash_attn", "auto, disabled, sdpa, fa2 or fa3", flash)
    s["attn"] = _ATTN[flash]
    pure = f.bool("pure_bf16", False)
    if kind in ("lora", "oft"):
        if kind == "oft":
            m.ignore("finetuning_type", "oft", "OFT is not modelled: LoRA of the same rank assumed")
        s["lora_rank"] = f.int("lora_rank", 8)
        if f.has("lora_alpha"):
            s["lora_alpha"] = f.int("lora_alpha")
        s["lora_dropout"] = f.float("lora_dropout", 0.0)
        targets = f.names("lora_target", ("all",))
        s["lora_targets"] = "all-linear" if targets == ("all",) else ",".join(targets)
        if f.bool("use_dora", False):  # model/adapter.py: LoraConfig(use_dora=...)
            s["dora"] = True
        saved = f.names("additional_target", ())
        if saved:  # model/adapter.py: LoraConfig(modules_to_save=finetuning_args.additional_target)
            s["modules_to_save"] = ",".join(saved)
        _quant(f, m)
        if pure:
            m.ignore("pure_bf16", True, "bf16 adapters are not modelled: peft's fp32 adapters assumed")
        load = "bf16" if pure or amp == "bf16" else "fp16" if amp == "fp16" else "auto"
        s["precision"] = load_precision(load, None, m, "model dtype")
    else:
        s["method"] = "full"
        if kind == "freeze":
            m.ignore("finetuning_type", "freeze", "freezing layers is not modelled: a full fine-tune assumed, "
                     "an upper bound")
        if f.has("quantization_bit"):
            m.ignore("quantization_bit", f.raw("quantization_bit"), "LLaMA-Factory refuses a quantized full fine-tune")
        # init_adapter: the trainable parameters are cast to fp32 unless pure_bf16
        s["precision"] = "bf16" if pure else load_precision("fp32", amp, m, "model dtype")
    for key in sorted(data):
        if key in _UNMODELLED and data[key] not in (None, False, "", []):
            m.ignore(key, data[key], _UNMODELLED[key])


def _quant(f: Fields, m: Mapped) -> None:
    s = m.setup
    bits = f.int("quantization_bit")
    if bits is None:
        s["method"] = "lora"
        return
    method = f.str("quantization_method", "bnb")
    if method != "bnb":
        m.ignore("quantization_method", method, "only bitsandbytes quantization is modelled: bnb assumed")
    if bits == 4:
        s["method"] = "qlora"
        kind = f.str("quantization_type", "nf4")
        if kind not in ("nf4", "fp4"):
            raise f.bad("quantization_type", "nf4 or fp4", kind)
        s["quant"] = kind
        s["double_quant"] = f.bool("double_quantization", True)
    elif bits == 8:
        s["method"] = "lora"
        s["quant"] = "int8"
    else:
        raise f.bad("quantization_bit", "4 or 8 (bitsandbytes)", bits)
