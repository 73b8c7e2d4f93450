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


def gptq_linear_bytes(in_features: int, out_features: int, bits: int, group_size: int, bias: bool) -> int:
    """Bytes of one GPTQ Linear as gptqmodel holds it (``GPTQQuantLinear._register_gptq_buffers``,
    gptqmodel 7.7; the layout of AutoGPTQ and of the checkpoints on the Hub): ``qweight`` int32
    [ceil(in * bits / 32), out], ``qzeros`` int32 [ceil(in / g), ceil(out * bits / 32)], ``scales``
    fp16 [ceil(in / g), out], ``g_idx`` int32 [in], ``bias`` fp16 [out]. ``group_size`` -1 is one
    group over all inputs (per output channel). 4 bits, g=128: 0.5 + 2/128 + 4/in B per weight,
    about 0.516 B per parameter plus 4 B per input channel."""
    g = in_features if group_size == -1 else group_size
    groups = -(-in_features // g)
    qweight = 4 * -(-in_features * bits // 32) * out_features
    qzeros = 4 * groups * -(-out_features * bits // 32)
    return qweight + qzeros + 2 * groups * out_features + 4 * in_features + (2 * out_features if bias else 0)


def awq_linear_bytes(in_features: int, out_features: int, bits: int, group_size: int, bias: bool) -> int:
    """Bytes of one AWQ Linear in the GEMM layout (``AWQuantLinear`` in gptqmodel 7.7, AutoAWQ's
    ``WQLinear_GEMM``): ``qweight`` int32 [in, out * bits / 32] (packed along the outputs),
    ``qzeros`` int32 [in / g, out * bits / 32], ``scales`` fp16 [in / g, out], ``bias`` fp16 [out];
    no ``g_idx``. The same 0.516 B per parameter as GPTQ at 4 bits, g=128, without the 4 B per input."""
    g = in_features if group_size == -1 else group_size
    groups = in_features // g
    packed_out = -(-out_features * bits // 32)
    return (4 * in_features * packed_out + 4 * groups * packed_out + 2 * groups * out_features
            + (2 * out_features if bias else 0))


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


def parse_bytes(text: str | float) -> int:
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


def gib(n: float, digits: int = 2) -> str:
    """A byte count as a bare number of GiB, e.g. ``"1.50"`` (no unit; two decimals by default)."""
    return f"{n / GiB:,.{digits}f}"
