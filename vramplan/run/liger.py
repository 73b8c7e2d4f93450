"""What ``--liger`` means on fake tensors: stand-ins that keep exactly what Liger's kernels keep.

Liger's kernels (liger-kernel 0.8.5) are Triton: they run on CUDA only and do nothing on fake
tensors. ``Trainer(use_liger_kernel=True)`` (transformers 5.24 ``integrations/liger.py``,
``apply_liger_kernel``) calls ``liger_kernel.transformers._apply_liger_kernel_to_instance``,
which for llama, mistral, qwen2, qwen3 and gemma (``apply_liger_kernel_to_<type>``, defaults:
rope, rms_norm, swiglu/geglu and fused_linear_cross_entropy on, cross_entropy off):

- replaces the modeling module's ``apply_rotary_pos_emb`` by ``liger_rotary_pos_emb``
  (ops/rope.py ``LigerRopeFunction``: rotates q and k in place, saves cos and sin);
- binds ``LigerRMSNorm.forward`` to every RMSNorm (decoder norm, both layer norms; qwen3's
  q_norm/k_norm) (ops/rms_norm.py ``LigerRMSNormFunction``: a new output Y, saves the input X,
  the weight and a fp32 ``RSTD`` per row; backward writes dX into dY in place and sums a fp32
  ``(sm_count, h)`` partial dW; gemma: offset 1, casting "gemma");
- binds ``LigerSwiGLUMLP.forward`` (gemma: ``LigerGEGLUMLP``) to every MLP: ``down_proj(
  LigerSiLUMulFunction(gate_proj(x), up_proj(x)))``, which saves the two projections' outputs
  and in backward overwrites them with their gradients (ops/swiglu.py, ops/geglu.py);
- replaces ``model.forward`` by ``lce_forward`` (transformers/model/llama.py): in training with
  labels the logits are never built; ``LigerForCausalLMLoss`` shifts the labels (a new int64
  copy) and calls ``LigerFusedLinearCrossEntropyFunction`` (ops/fused_linear_cross_entropy.py),
  which in the forward allocates ``grad_input`` (N x h, zeros_like), ``grad_weight`` (V x h in
  the weight's dtype, when the head trains), ``loss_1d`` (N fp32), and one chunk of logits
  (``chunk_size = next_pow2(ceil(N / ceil(V / h)))`` rows of V, reused across chunks on CUDA's
  ``mm(out=)`` path), in which the CE kernel writes the logits' gradient in place; it saves
  ``grad_input`` and ``grad_weight`` and its backward returns them (mean reduction: unscaled).

The stand-ins below are autograd Functions with the same outputs, saved tensors and
allocations as the CUDA path, without computing the kernels' values: on fake tensors nothing is
computed; on real ones (the CPU truth on a bitsandbytes base, vramplan/truths/cpu_truth.py) the
outputs are copies of an input (a norm passes its input through, the gated product its up
projection), so every value stays finite and the quantized layers downstream see real-sized
activations (LLM.int8's outlier columns depend on them), with no allocation the kernels lack.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

#: Liger's model types whose kernels vramplan models (the same set in vramplan.estimator.liger).
LIGER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")

#: Streaming multiprocessors of the GPU the RMSNorm backward's partial dW is sized by
#: (``torch.cuda.get_device_properties().multi_processor_count``): an H100 SXM's 132.
SM_COUNT = 132


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def flce_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows of one logits chunk (ops/fused_linear_cross_entropy.py ``fused_linear_cross_entropy_forward``)."""
    inc_factor = math.ceil(vocab / hidden)
    return min(_next_pow2(math.ceil(tokens / inc_factor)), tokens)


@functools.cache
def _functions():
    import torch

    class RMSNormLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, X, W, in_place):
            shape = X.shape
            X = X.contiguous().view(-1, shape[-1])
            Y = torch.empty(X.shape, dtype=X.dtype, device=X.device).copy_(X)  # finite values on real tensors
            rstd = torch.ones(X.shape[0], dtype=torch.float32, device=X.device)
            ctx.in_place, ctx.shape = in_place, shape
            ctx.save_for_backward(X, W, rstd)
            return Y.view(shape)

        @staticmethod
        def backward(ctx, dY):
            X, W, _rstd = ctx.saved_tensors
            dY = dY.contiguous().view(-1, ctx.shape[-1])
            dX = dY if ctx.in_place else torch.zeros_like(dY)
            dW = None
            if ctx.needs_input_grad[1]:
                partial = torch.zeros((SM_COUNT, X.shape[1]), dtype=torch.float32, device=W.device)
                dW = partial.sum(dim=0).to(W.dtype)
            return dX.view(ctx.shape), dW, None

    class GatedMulLike(torch.autograd.Function):
        """LigerSiLUMulFunction / LigerGELUMulFunction: c = act(a) * b."""

        @staticmethod
        def forward(ctx, a, b):
            a, b = a.contiguous(), b.contiguous()
            c = torch.empty_like(a).copy_(b)
            ctx.save_for_backward(a, b)
            return c

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors  # the kernel writes da into a and db into b
            return a, b

    class RopeLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin):
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # rotated in place
            ctx.save_for_backward(cos.contiguous(), sin.contiguous())
            return q.transpose(1, 2), k.transpose(1, 2)

        @staticmethod
        def backward(ctx, dq, dk):
            dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()  # rotated back in place
            return dq.transpose(1, 2), dk.transpose(1, 2), None, None

    class FusedLinearCrossEntropyLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, _input, weight, target, ignore_index=-100):
            BT, H = _input.shape
            V = weight.shape[0]
            chunk = flce_chunk_rows(BT, V, H)
            grad_input = torch.zeros_like(_input)
            grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
            loss_1d = torch.zeros(BT, dtype=torch.float32, device=_input.device)
            target_mask = target != ignore_index  # noqa: F841 (alive while the chunks run; .item() read)
            autocast = torch.is_autocast_enabled(_input.device.type)
            use_mm_out = _input.dtype == weight.dtype and (
                not autocast or _input.dtype == torch.get_autocast_dtype(_input.device.type))
            storage = torch.empty((chunk, V), dtype=_input.dtype, device=_input.device) if use_mm_out else None
            for start in range(0, BT, chunk):
                end = min(start + chunk, BT)
                part = _input[start:end]
                if storage is not None:
                    logits = storage[: end - start]
                    torch.mm(part, weight.t(), out=logits)
                else:
                    logits = part @ weight.t()
                # (the Triton CE kernel writes loss_1d[start:end] and the logits' gradient in place)
                grad_logits = logits
                if use_mm_out and grad_logits.dtype == grad_input.dtype:
                    torch.mm(grad_logits, weight, out=grad_input[start:end])
                else:
                    grad_input[start:end] = grad_logits @ weight
                if grad_weight is not None:
                    if grad_weight.dtype == torch.float32 and grad_logits.dtype != torch.float32:
                        part_c = part.to(grad_logits.dtype)  # addmm(out_dtype=float32, out=grad_weight)
                        del part_c
                    elif grad_weight.dtype == grad_logits.dtype:
                        torch.addmm(grad_weight, grad_logits.t(), part, out=grad_weight)
                    else:
                        grad_weight += torch.mm(grad_logits.t(), part).float()
                del logits, grad_logits, part
            del storage
            loss = torch.sum(loss_1d)
            ctx.save_for_backward(grad_input, grad_weight)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            grad_input, grad_weight = ctx.saved_tensors  # mean reduction: grad_output is 1, no scaling
            return grad_input, grad_weight, None, None

    return RMSNormLike, GatedMulLike, RopeLike, FusedLinearCrossEntropyLike


def _modeling_module(hf):
    return importlib.import_module(type(hf).__module__)


def _norms(decoder, model_type: str):
    yield decoder.norm
    for layer in decoder.layers:
        yield layer.input_layernorm
        yield layer.post_attention_layernorm
        if model_type == "qwen3":
            yield layer.self_attn.q_norm
            yield layer.self_attn.k_norm


class _Output:
    def __init__(self, loss) -> None:
        self.loss = loss


@contextlib.contextmanager
def patch_liger(model, fused_loss: bool = True):
    """Within the block, ``model`` (peft-wrapped or not) runs the stand-ins of the kernels
    ``_apply_liger_kernel_to_instance`` applies to its model type (LIGER_TYPES). ``fused_loss=False``:
    the layer kernels only, the model's own forward and loss kept, as TRL 1.16's SFTTrainer applies
    Liger (it sets ``liger_kernel_config["fused_linear_cross_entropy"] = False`` and raises when asked
    for it: its own fused LM head replaces the model's forward, ``trl/trainer/sft_trainer.py``)."""
    import torch.nn.functional as F

    rmsnorm, gated, rope, flce = _functions()
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = hf.config.model_type
    if model_type not in LIGER_TYPES:
        raise ValueError(f"Liger stand-ins model {', '.join(LIGER_TYPES)}, not {model_type}")
    modeling = _modeling_module(hf)
    decoder = getattr(hf, hf.base_model_prefix)
    head = hf.get_output_embeddings()
    patched: list = []

    def bind(mod, forward) -> None:
        mod.forward = forward
        patched.append(mod)

    for norm in _norms(decoder, model_type):
        bind(norm, lambda x, n=norm: rmsnorm.apply(x, n.weight, True))
    for layer in decoder.layers:
        mlp = layer.mlp
        bind(mlp, lambda x, m=mlp: m.down_proj(gated.apply(m.gate_proj(x), m.up_proj(x))))

    def rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return rope.apply(q, k, cos, sin)

    def forward(input_ids=None, labels=None, **kwargs):
        hidden = decoder(input_ids=input_ids, **kwargs)[0]
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().view(-1)
        return _Output(flce.apply(hidden.view(-1, hidden.shape[-1]), head.weight, shift))

    orig_rope = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = rotary
    if fused_loss:
        bind(hf, forward)
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = orig_rope
        for mod in patched:
            del mod.forward
