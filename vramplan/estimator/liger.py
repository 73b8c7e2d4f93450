"""Liger kernels (``--liger``: ``use_liger_kernel=True``): what each kernel keeps and allocates.

Modelled as transformers 5.24's ``Trainer`` applies liger-kernel 0.8.5 to a model instance
(``integrations/liger.py`` -> ``liger_kernel.transformers._apply_liger_kernel_to_instance`` ->
``apply_liger_kernel_to_{llama,mistral,qwen2,qwen3,gemma}`` with their defaults: rope, rms_norm,
swiglu (gemma: geglu) and fused_linear_cross_entropy). Read off liger-kernel 0.8.5's source
(the Triton kernels run on CUDA only; the tracer runs stand-ins that keep exactly this,
``vramplan/run/liger.py``):

- ``LigerRMSNormFunction`` (ops/rms_norm.py): saves its input X (the residual stream's dtype) and
  a fp32 ``RSTD`` per row, whether or not the weight trains: no fp32 upcast of the input and no
  normalised copy as transformers' RMSNorm keeps;
- ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` (ops/swiglu.py, ops/geglu.py): save the gate and
  up projections' outputs only (the activation's output is recomputed), and write their
  gradients into them in place;
- ``LigerRopeFunction`` (ops/rope.py): rotates q and k in place and saves cos/sin, which the layer
  keeps anyway: no change to what is saved;
- ``LigerFusedLinearCrossEntropyFunction`` (ops/fused_linear_cross_entropy.py): no N x V logits; in
  the forward ``grad_input`` (N x h, saved), ``grad_weight`` (V x h in the weight's dtype when the
  head trains, saved; it becomes the head's ``.grad``), ``loss_1d`` (fp32 N) and one chunk of
  ``chunk_size = next_pow2(ceil(N / ceil(V / h)))`` logits rows; the backward allocates nothing.
"""

from __future__ import annotations

import math

from ..specs import ModelSpec, Setup
from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE
from .precision import autocast_bytes, compute_bytes, mixed

#: Families whose Liger kernels are modelled (liger-kernel 0.8.5 ``MODEL_TYPE_TO_APPLY_LIGER_FN``).
LIGER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")

#: Model types liger-kernel 0.8.5 patches (``MODEL_TYPE_TO_APPLY_LIGER_FN``) that are not modelled here.
LIGER_OTHER_TYPES = (
    "deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text", "gemma3", "glm4", "gpt_oss", "granite", "llama4",
    "llama4_text", "ministral", "mixtral", "nemotron", "olmo2", "olmo3", "phi3", "qwen3_moe", "qwen3_next", "smollm3",
)


def norm_bytes(model: ModelSpec, setup: Setup, width: int | None = None, rows: int = 1) -> float:
    """One LigerRMSNorm per token: its input (the residual stream's dtype) and fp32 rstd per row."""
    w = width or model.hidden_size
    return (4 if mixed(setup) else compute_bytes(setup)) * w + 4 * rows


def mlp_bytes(model: ModelSpec, setup: Setup) -> float:
    """A gated MLP through LigerSiLUMulFunction: gate and up outputs, and the product when
    down_proj's weight trains (down_proj keeps its input)."""
    c, i = compute_bytes(setup), model.intermediate_size
    return c * i * 2 + (c * i if setup.method == "full" else 0)


def global_delta_per_token(model: ModelSpec, setup: Setup) -> float:
    """What the fused linear cross-entropy changes outside the layers, per token: no fp32
    log-probabilities (4 V), no int64 labels kept for nll_loss (8), no saved head input (full
    fine-tuning) but the N x h ``grad_input`` computed in the forward (the head input's dtype)."""
    c, h, V = compute_bytes(setup), model.hidden_size, model.vocab_size
    head_input = c * h if setup.method == "full" or setup.zero_stage == 3 else 0
    return -4 * V - 8 - head_input + (4 if mixed(setup) else c) * h


def chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    inc = math.ceil(vocab / hidden)
    return min(1 << max(0, (math.ceil(tokens / inc) - 1).bit_length()), tokens)


def head_weight_grad_bytes(model: ModelSpec, setup: Setup) -> int:
    """``grad_weight``: the head's (or tied embedding's) gradient, allocated in the forward when
    the head trains (full fine-tuning), in the weight's dtype."""
    if setup.method != "full":
        return 0
    return model.vocab_size * model.hidden_size * int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])


def loss_transients(model: ModelSpec, setup: Setup) -> tuple[int, int]:
    """(at the loss in the forward, at the start of the backward), beyond the saved activations:
    one chunk of logits (c-byte; a chunk x h gradient copy off CUDA's ``mm(out=)`` path, under
    autocast), fp32 ``loss_1d``, the target mask and the shifted int64 labels, and the head's
    gradient from the forward on."""
    N, V, h = setup.tokens, model.vocab_size, model.hidden_size
    c = autocast_bytes(setup)
    rows = chunk_rows(N, V, h)
    forward = rows * V * c + (rows * h * c if mixed(setup) else 0) + N * (4 + 1 + 8) + 8 * setup.batch
    if mixed(setup):
        # autocast casts the fp32 head weight in the forward: ``_input_chunk @ weight.t()`` casts the
        # view anew per chunk (a view is never cached); a trainable weight's cast for ``grad_logits @
        # weight`` is cached until the forward ends (torch autocast ``cached_cast``: leaf, requires grad)
        forward += V * h * c * (2 if setup.method == "full" else 1)
    grad = head_weight_grad_bytes(model, setup)
    return int(forward + grad), int(grad)
