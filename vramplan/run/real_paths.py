"""The tracer's stand-ins: what makes a step on fake CPU tensors take the code path (and keep the
tensors) of a real eager CUDA step. :func:`real_code_paths` patches transformers' export-tracing
checks, SDPA and dropout for the duration of a trace; :func:`autocast_inputs` and
:func:`padding_mask` are shared with the CPU truth (:mod:`vramplan.truths.cpu_truth`).
"""

from __future__ import annotations

import contextlib
import functools


@functools.cache
def flash_like():
    """The autograd function standing in for CUDA's fused SDPA kernels on fake tensors (built on
    first use: it needs torch)."""
    import torch

    class FlashLike(torch.autograd.Function):
        """Memory stand-in for CUDA's fused SDPA kernels (fake tensors carry no values): saves
        q, k, v (K/V at their own head count, as with ``enable_gqa``), the output, a fp32
        logsumexp of shape (b, heads, s) and the mask if there is one; backward allocates dq,
        dk, dv."""

        @staticmethod
        def forward(ctx, q, k, v, mask=None):
            b, a, s, _ = q.shape
            out = q.new_empty(b, s, a, v.shape[-1]).transpose(1, 2)
            lse = q.new_empty(b, a, s, dtype=torch.float32)
            # with a mask CUDA runs the memory-efficient kernel, which also keeps the mask (attn_bias:
            # the additive one efficient_attn_bias builds)
            ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    return FlashLike


def efficient_attn_bias(mask, query, key):
    """What torch 2.13's SDPA makes of a boolean mask on CUDA (aten/src/ATen/native/transformers/
    attention.cpp): ``convert_boolean_attn_mask`` builds a new additive mask in the query's dtype
    (``where(mask, 0, -inf)``) at every call, and ``preprocess_mask`` expands it to (b, heads,
    s_q, s_k) (a view) and pads the last dimension to a multiple of 16 (or copies it contiguous
    when a stride is not a multiple of 16) for the memory-efficient kernel, which saves that
    tensor (``attn_bias``) for backward. Every layer's call makes its own."""
    import torch
    import torch.nn.functional as F

    bias = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=mask.device))
    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    s_k = bias.shape[-1]
    if s_k % 16:
        return F.pad(bias, (0, 16 - s_k % 16))[..., :s_k]
    if any(stride % 16 for stride in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def autocast_inputs(*tensors):
    """SDPA is on autocast's lower-precision list: under autocast the real kernel receives
    q, k, v cast to the autocast dtype (and saves those copies). A stand-in called in its place
    bypasses autocast's dispatch, so it casts them itself."""
    import torch

    if not tensors or not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def padding_mask(batch: int, seq: int):
    """The attention_mask of a padded batch: the last sequence right-padded by an eighth."""
    import torch

    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - max(1, seq // 8):] = 0
    return mask


@contextlib.contextmanager
def real_code_paths(padded: bool = False):
    """Make the traced step take the code path a real CUDA step takes.

    - transformers treats fake tensors as a sign of torch.export/compile tracing (``is_tracing``)
      and then builds an explicit 4-D causal mask and repeats K/V for SDPA, and it reads position
      ids to detect packed sequences: memory and data a real eager step never touches.
    - torch's CPU kernels save different tensors than its CUDA kernels. SDPA on CPU picks the
      math kernel when dropout is on or K/V are grouped (s^2 scores and probabilities saved) and
      lays its output out so that transformers' ``transpose(1, 2).contiguous()`` copies it for
      some head sizes; CUDA runs flash attention, which saves q, k, v, its output (laid out
      (b, s, heads, d)) and a fp32 logsumexp, whatever the dropout and GQA. The tracer runs a
      stand-in with exactly flash's saved tensors, outputs and gradient allocations.
      Dropout keeps a 16-bit noise tensor on CPU where CUDA's fused ``native_dropout`` keeps a
      bool mask: the tracer calls ``native_dropout`` (its CPU version keeps the bool mask too).
    """
    import torch
    import torch.nn.functional as F
    from transformers import masking_utils

    orig_sdpa, orig_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.dim() == 4 and (attn_mask is None or attn_mask.dtype == torch.bool):
            query, key, value = autocast_inputs(query, key, value)
            bias = None if attn_mask is None else efficient_attn_bias(attn_mask, query, key)
            return flash_like().apply(query, key, value, bias)
        return orig_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return orig_dropout(input, p, training, inplace)

    patches = [
        # real tensors are not being exported: take the eager path (is_causal SDPA, GQA kernel)
        (masking_utils, "is_tracing", lambda tensor=None: False),
        # the canonical step passes no position_ids, so sequences are never packed
        (masking_utils, "find_packed_sequence_indices", lambda position_ids: None),
        # fake tensors carry no values: a padded batch (--pad-mask) is known to have padding
        (masking_utils, "fast_all", lambda tensor: not padded),
        (F, "scaled_dot_product_attention", sdpa),
        (F, "dropout", dropout),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
