"""One table of sizes used everywhere: bytes per element, byte-size parsing and formatting.

Nothing here imports torch; dtype names follow torch's spelling without the ``torch.`` prefix.
"""

from __future__ import annotations

import re

GiB = 1024**3
MiB = 1024**2
KiB = 1024

#: Bytes per element of every dtype the estimator reasons about.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
    # bitsandbytes 4-bit: two values per byte, before the absmax scales (see bnb_4bit_tensor_bytes).
    "nf4": 0.5,
    "fp4": 0.5,
}

#: Storage dtype of the model weights for each precision setting (the canonical step loads bf16).
PRECISION_WEIGHT_DTYPE: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    # Mixed precision keeps fp32 weights (the master copy) and computes in half under autocast.
    "bf16-mixed": "float32",
    "fp16-mixed": "float32",
}

#: Dtype activations are computed in for each precision setting.
PRECISION_COMPUTE_DTYPE: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "bf16-mixed": "bfloat16",
    "fp16-mixed": "float16",
}

BNB_4BIT_BLOCK = 64  # elements per fp32 absmax (transformers' BitsAndBytesConfig default)
BNB_NESTED_BLOCK = 256  # absmax values per fp32 scale of the nested (double) quantisation


def bnb_4bit_tensor_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of one bitsandbytes 4-bit weight of ``numel`` elements, as ``Params4bit`` and its
    ``quant_state`` hold it: two values per byte, one fp32 absmax per 64-element block (double
    quant: uint8 absmax, one fp32 scale per 256 blocks, a 256-entry fp32 code and an fp32
    offset), and the 16-entry fp32 nf4/fp4 code. Per parameter that is 0.5625 B, or 0.5159 B
    with double quant (Dettmers et al. 2023, QLoRA, section 3), plus ~1.1 KB per tensor."""
    blocks = -(-numel // BNB_4BIT_BLOCK)
    scales = blocks + 4 * -(-blocks // BNB_NESTED_BLOCK) + 256 * 4 + 4 if double_quant else 4 * blocks
    return -(-numel // 2) + scales + 16 * 4


#: bitsandbytes keeps 32-bit optimizer states for tensors under this many elements
#: (``min_8bit_size``); the per-optimizer rules are in estimator/optimizers.py.
BNB_MIN_8BIT_SIZE = 4096

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_MULT = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB, "ki": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB, "mi": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB, "gi": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}


def parse_bytes(text: str | int | float) -> int:
    """Parse ``"24GiB"``, ``"24 GB"``, ``"80g"`` or a plain number of bytes into an int.

    Decimal suffixes (GB) are powers of 1000 and binary ones (GiB) powers of 1024, as printed by
    vendors and by nvidia-smi respectively. Raises ValueError with a message naming the input.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        unit = ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"cannot read {text!r} as a size; write e.g. 24GiB, 24GB or 25769803776")
        value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if not value > 0 or value == float("inf"):
        raise ValueError(f"size must be a positive finite number; got {str(text)[:40]!r}")
    return int(value * _SIZE_MULT[unit])


def fmt_bytes(n: float, unit: str = "GiB", digits: int = 2) -> str:
    """Format a byte count in a fixed binary unit (GiB by default)."""
    div = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}[unit]
    return f"{n / div:,.{digits}f} {unit}"
