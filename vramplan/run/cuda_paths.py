"""What a measurement on the CPU runs as CUDA would: the stand-in for CUDA's fused SDPA kernels
(real output, the fused kernels' saved tensors), LLM.int8 on bitsandbytes' CUDA path, and the
tensors bitsandbytes keeps beside its quantized weights (counted with the weights). Shared by the
measuring worker (``vramplan measure --device cpu``) and the CPU truths (:mod:`vramplan.truths`)."""

from __future__ import annotations

import contextlib


def quant_state_tensors(model) -> list:
    """Tensors bitsandbytes keeps beside its quantized weights, which are not parameters or
    buffers: a 4-bit weight's ``quant_state`` (absmax, code, offset and the nested state of
    double quantization) and LLM.int8's per-row scales ``SCB``."""
    import torch

    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            out += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
            qs = getattr(qs, "state2", None)
        scb = getattr(p, "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    return out


# ----------------------------------------------------------------------------------------------
# attention kernels as CUDA runs them


def _flash_real():
    import torch
    import torch.nn.functional as F

    from ..run.real_paths import efficient_attn_bias

    orig = F.scaled_dot_product_attention

    class FlashReal(torch.autograd.Function):
        """CUDA's fused SDPA kernels' memory (the tracer's stand-in: q, k, v, the output, a fp32
        logsumexp and the additive mask made of a bool one, if any, are saved; backward allocates
        dq, dk, dv) with the real output computed, so that what follows sees real values."""

        @staticmethod
        def forward(ctx, q, k, v, mask, is_causal, scale):
            b, a, s, _ = q.shape
            with torch.no_grad():
                res = orig(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
                           enable_gqa=k.shape[1] != a)
            out = q.new_empty(b, s, a, v.shape[-1]).transpose(1, 2)
            out.copy_(res)
            del res
            lse = q.new_empty(b, a, s, dtype=torch.float32)
            # the memory-efficient kernel keeps the additive mask torch converts the bool one into
            bias = [] if mask is None else [efficient_attn_bias(mask, q, k)]
            ctx.save_for_backward(q, k, v, out, lse, *bias)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None

    return FlashReal, orig


@contextlib.contextmanager
def cuda_kernels():
    """SDPA takes the stand-in of CUDA's flash / memory-efficient kernels (see the module
    docstring), dropout CUDA's fused kernel (a bool mask), LLM.int8 bitsandbytes' CUDA path;
    everything else runs the real code."""
    import torch
    import torch.nn.functional as F

    from ..run.real_paths import autocast_inputs

    flash, orig = _flash_real()

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.dim() == 4 and (attn_mask is None or attn_mask.dtype == torch.bool):
            query, key, value = autocast_inputs(query, key, value)
            return flash.apply(query, key, value, attn_mask, is_causal, scale)
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)

    orig_dropout = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        # CUDA's fused dropout (ATen ``dropout``: ``is_fused_kernel_acceptable`` takes it on CUDA only)
        # keeps a bool mask; CPU's multiplies by a mask of the input's dtype, which MulBackward keeps
        # (4 bytes an element beside an fp32 LoRA input instead of 1): take the fused one here too
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return orig_dropout(input, p, training, inplace)

    F.scaled_dot_product_attention = sdpa
    F.dropout = dropout
    restore = int8_as_on_cuda()
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
        F.dropout = orig_dropout
        restore()


def int8_as_on_cuda():
    """In training, bitsandbytes runs LLM.int8 on CPU as dequantize-then-matmul
    (``MatMul8bitFp``, which keeps a dequantized fp32 copy of the weight in the forward); on CUDA
    it runs ``MatMul8bitLt`` (int8 matmul with fp16 outlier decomposition). Make ``bnb.matmul``
    take the CUDA path, whose kernels have CPU implementations. Returns the undo function."""
    try:
        import bitsandbytes as bnb
        from bitsandbytes.autograd import _functions as fn
    except ImportError:  # pragma: no cover - the extra is not installed
        return lambda: None
    orig = bnb.matmul

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or fn.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return fn.MatMul8bitLt.apply(A, B, out, bias, state)

    bnb.matmul = matmul
    return lambda: setattr(bnb, "matmul", orig)
