"""What ``--loss chunked`` means: the output head and cross-entropy run chunk by chunk.

transformers' loss (``ForCausalLMLoss``) computes the logits of every token (N x V in the compute
dtype), upcasts them to fp32 and keeps fp32 log-probabilities for backward: about 10 N V bytes in
the forward and 12 N V in the backward, the largest term of many steps. The chunked loss used by
vramplan instead takes the final hidden states and, for each chunk of ``LOSS_CHUNK_TOKENS``
tokens, computes that chunk's logits, their fp32 upcast and the summed cross-entropy inside
``torch.utils.checkpoint`` (non-reentrant): nothing of the chunk is kept, and backward recomputes
one chunk at a time. No N x V tensor ever exists; the cost is one extra head matmul per chunk.
(Liger's fused linear cross-entropy goes further and computes the gradients in the forward; its
memory is one chunk's logits too.)

:func:`patch_chunked_loss` makes a transformers causal-LM (peft-wrapped or not) compute its loss
this way; the tracer and the CPU truth both use it, so the estimate is checked against this code.
"""

from __future__ import annotations

import contextlib

from ..estimator.transients import LOSS_CHUNK_TOKENS


def chunked_cross_entropy(hidden, weight, labels, chunk: int = LOSS_CHUNK_TOKENS):
    """Mean next-token cross-entropy of ``hidden @ weight.T`` against ``labels`` (shifted as
    transformers shifts them: the last position and -100 are ignored), chunk by chunk."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    count = (shift != -100).sum()

    def chunk_loss(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="sum")

    total = None
    for start in range(0, flat.shape[0], chunk):
        part = checkpoint(chunk_loss, flat[start:start + chunk], weight, shift[start:start + chunk],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total / count.clamp(min=1).to(total.dtype)


class _Output:
    def __init__(self, loss) -> None:
        self.loss = loss


@contextlib.contextmanager
def patch_chunked_loss(model):
    """Within the block, ``model(input_ids=..., labels=...)`` runs the decoder and returns an
    object whose ``.loss`` is :func:`chunked_cross_entropy` of its last hidden states."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(hf, hf.base_model_prefix)
    head = hf.get_output_embeddings()

    def forward(input_ids=None, labels=None, **kwargs):
        hidden = decoder(input_ids=input_ids, **kwargs)[0]
        return _Output(chunked_cross_entropy(hidden, head.weight, labels))

    hf.forward = forward
    try:
        yield
    finally:
        del hf.forward
