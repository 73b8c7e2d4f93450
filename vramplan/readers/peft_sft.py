"""peft's own SFT example scripts (``examples/sft/run_peft*.sh`` -> ``examples/sft/train.py``): their model
flags as the TRL fields that mean the same.

peft's ``examples/sft/train.py`` parses its own ``ModelArguments`` and ``DataTrainingArguments`` beside the
Trainer's arguments and hands ``utils.create_and_prepare_model``'s model and ``LoraConfig`` to TRL's
``SFTTrainer`` (huggingface/peft ``examples/sft/train.py`` and ``utils.py`` at 93288afb). What its flags do,
read off that code:

- ``--use_peft_lora``: ``LoraConfig(r=lora_r, lora_alpha, lora_dropout, target_modules=...)`` handed to
  ``SFTTrainer(peft_config=...)`` (TRL's ``--use_peft``); ``--lora_target_modules`` is one comma-separated
  string or ``all-linear`` (default: the seven Llama projections); ``--lora_r`` defaults to 64;
- ``--use_4bit_quantization``: ``BitsAndBytesConfig(load_in_4bit, bnb_4bit_quant_type (nf4),
  bnb_4bit_use_double_quant=--use_nested_quant, bnb_4bit_quant_storage=--bnb_4bit_quant_storage_dtype)``
  (TRL's ``--load_in_4bit``, ``--use_bnb_nested_quant``); no ``prepare_model_for_kbit_training`` (SFTTrainer
  with a peft_config: TRL's preparation);
- ``--use_8bit_quantization``: its ``BitsAndBytesConfig(load_in_8bit=True)`` sits inside the 4-bit branch
  (``elif`` of the fp16 compute-dtype check), so alone it loads no 8-bit model;
- the model's dtype: ``torch_dtype=quant_storage_dtype or torch.float32``: fp32 weights unless the 4-bit
  storage dtype is given (``--bf16`` then runs them under autocast);
- ``--use_flash_attn``: ``attn_implementation="flash_attention_2"``, otherwise ``"eager"``;
- ``--use_reentrant``: ``gradient_checkpointing_kwargs={"use_reentrant": ...}`` (default False);
- ``--use_unsloth``: Unsloth's ``FastLanguageModel`` instead: not read from this script (``--framework unsloth``);
- the data flags (``--chat_template_format``, ``--splits``, ...) change no memory; ``--max_seq_length``
  (older copies) is the sequence length.
"""

from __future__ import annotations

import json

from .common import Mapped

__all__ = ["PEFT_SFT_FLAGS", "is_peft_sft", "translate"]

#: flags only peft's examples/sft/train.py defines (its ModelArguments / DataTrainingArguments)
PEFT_SFT_FLAGS = frozenset({
    "use_peft_lora", "use_4bit_quantization", "use_8bit_quantization", "use_nested_quant", "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage_dtype", "use_flash_attn", "use_reentrant", "use_unsloth", "chat_template_format",
    "append_concat_token", "add_special_tokens", "splits"})
#: its defaults where TRL's differ (examples/sft/train.py ModelArguments)
_DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"
_TRUE = ("yes", "true", "t", "y", "1")
_SOURCE = "peft examples/sft (train.py, utils.py create_and_prepare_model)"


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--name value`` / ``--name=value`` / a bare ``--name`` of an argument list (the last word wins)."""
    out: dict[str, str | None] = {}
    for i, tok in enumerate(argv):
        if not tok.startswith("--"):
            continue
        name, eq, value = tok[2:].partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[name.replace("-", "_")] = value
    return out


def is_peft_sft(script: str | None, argv: list[str]) -> bool:
    """A command line of peft's SFT example: a ``train.py`` with one of its own flags."""
    return bool(script) and script.endswith("train.py") and bool(PEFT_SFT_FLAGS & _flags(argv).keys())


def _on(value: str | None) -> bool:
    return value is None or value.lower() in _TRUE


def translate(argv: list[str], m: Mapped) -> list[str]:
    """``argv`` with peft's example flags replaced by the TRL fields that mean the same (what is dropped or
    assumed goes to ``m``'s warnings, with the reason)."""
    flags = _flags(argv)
    out: list[str] = []
    skip = False
    for i, tok in enumerate(argv):
        if skip:
            skip = False
            continue
        name = tok[2:].partition("=")[0].replace("-", "_") if tok.startswith("--") else None
        if name in PEFT_SFT_FLAGS or name in ("lora_target_modules", "max_seq_length", "bnb_4bit_quant_type"):
            skip = "=" not in tok and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(tok)
    if "use_peft_lora" in flags and _on(flags["use_peft_lora"]):
        out += ["--use_peft", "true"]
        targets = flags.get("lora_target_modules") or _DEFAULT_TARGETS
        out += ["--lora_target_modules", *(["all-linear"] if targets == "all-linear" else targets.split(","))]
        if "lora_r" not in flags:
            out += ["--lora_r", "64"]
    four_bit = "use_4bit_quantization" in flags and _on(flags["use_4bit_quantization"])
    if four_bit:
        out += ["--load_in_4bit", "true", "--bnb_4bit_quant_type", flags.get("bnb_4bit_quant_type") or "nf4"]
        if "use_nested_quant" in flags:
            out += ["--use_bnb_nested_quant", "true" if _on(flags["use_nested_quant"]) else "false"]
    if "use_8bit_quantization" in flags and _on(flags["use_8bit_quantization"]) and not four_bit:
        m.ignore("--use_8bit_quantization", flags["use_8bit_quantization"], f"{_SOURCE}: its 8-bit "
                 "BitsAndBytesConfig sits inside the 4-bit branch, so alone it loads no 8-bit model")
    storage = flags.get("bnb_4bit_quant_storage_dtype") if four_bit else None
    out += ["--dtype", storage or "float32"]
    m.assume("dtype", storage or "float32", f"{_SOURCE}: the model loads with torch_dtype=quant_storage_dtype "
             "or torch.float32")
    flash = "use_flash_attn" in flags and _on(flags["use_flash_attn"])
    out += ["--attn_implementation", "flash_attention_2" if flash else "eager"]
    if "use_reentrant" in flags:
        out += ["--gradient_checkpointing_kwargs", json.dumps({"use_reentrant": _on(flags["use_reentrant"])})]
    if flags.get("max_seq_length") and "max_length" not in flags:
        out += ["--max_length", str(flags["max_seq_length"])]
    if "use_unsloth" in flags and _on(flags["use_unsloth"]):
        m.ignore("--use_unsloth", flags["use_unsloth"], f"{_SOURCE}: Unsloth's FastLanguageModel is not read from "
                 "this script; estimate it with --framework unsloth")
    if "bnb_4bit_compute_dtype" in flags:
        m.assume("--bnb_4bit_compute_dtype", flags["bnb_4bit_compute_dtype"], "the 4-bit matmuls run in the "
                 "step's precision (--bf16/--fp16)")
    return out
