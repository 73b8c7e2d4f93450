"""Llama 4's layers as transformers 5.24 trains them (modeling_llama4.py), where they differ from the generic recipe of
estimator/activations.py; per token, bytes kept for the backward. Read off the fake-tensor trace of the real step
(``vramplan.run.tracer.trace_numbers(...).saved_detail``) on truncated Scout and Maverick models.

- **MoE block** (Llama4TextMoe): the router (an nn.Linear, h -> E) takes the top-k logits, scatters them into a row of
  -inf and keeps sigmoid's fp32 output (4E) and the int64 indices (8k). Every expert then runs on every token:
  ``hidden_states.repeat(E, 1) * scores`` keeps the repeated input (c E h) and the score column (c E, a reshaped
  copy); ``torch.bmm`` against ``gate_up_proj`` gives E x 2i per token (c 2 E i: SiLU keeps the gate half, the product
  the up half, views of it) and SiLU's output (c E i); with the experts training (full fine-tuning) the two bmms also
  keep their inputs, the scaled input (c E h) and the product (c E i). The shared expert is a SwiGLU of width i.
- **Attention**: SDPA's q, k, v, output and logsumexp as the generic recipe; on the RoPE layers with ``use_qk_norm``
  the L2 norm keeps the fp32 upcast of q and k after the rotation and an rsqrt per head (4 (q + kv) + 4 (a + kv
  heads)); a NoPE layer's temperature tuning keeps its (1, s, 1, 1) fp32 scales. RoPE's table is one complex64
  ``freqs_cis`` of head_dim / 2 per position (model/traits.py: ``rope_bytes``). The chunked layers take a mask once
  the sequence reaches ``attention_chunk_size``, as a sliding window does (model/traits.py).
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup
from .precision import compute_bytes

FAMILY = "llama4"


def _layout(model: ModelSpec) -> tuple[int, ...]:
    """RoPE (1) or NoPE (0), per layer (FamilyTraits.rope_layers, from the config's layout)."""
    return model.traits.rope_layers


def moe_layer_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """One Llama 4 MoE block per token (its input norm excluded): router, the E-fold routed experts, shared expert."""
    moe = model.moe
    assert moe is not None
    h, c, k, i, E = model.hidden_size, compute_bytes(setup), moe.top_k, moe.expert_intermediate_size, moe.num_experts
    full = setup.method == "full"
    router = 4 * E + 8 * k
    routed = c * E * h + c * E + c * E * 2 * i + c * E * i
    if full:  # the bmms' inputs, for the experts' gradients
        routed += c * E * h + c * E * i
    si = moe.shared_expert_intermediate_size
    shared = 3 * c * si + (c * si if full else 0)
    return router + routed + shared


def attention_extra_bytes(model: ModelSpec, setup: Setup) -> float:
    """Per token and layer (the mean over the layers): the L2 q/k norm of the RoPE layers and the temperature scales of
    the NoPE layers, beside what the generic SDPA recipe counts."""
    rope = _layout(model)
    n_rope = sum(rope)
    n_nope = len(rope) - n_rope
    total = 0.0
    if model.traits.qk_l2_norm:
        q, kv = model.q_dim, model.kv_dim
        total += n_rope * (4 * (q + kv) + 4 * (model.num_heads + model.num_kv_heads))
    if model.traits.attn_temperature_tuning:
        total += n_nope * 4 / setup.batch  # (1, s, 1, 1) fp32, broadcast over the batch
    return total / len(rope)


def moe_backward_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """Gradient temporaries of a Llama 4 MoE block's backward over what it saved, per token: at the experts' SwiGLU
    product's backward the gradient of the product (E x i) and its two operands' gradients (E x i each) are alive
    beside every saved tensor of the block but the shared expert's (its backward runs first: it was computed after the
    routed experts) and one h-wide gradient (read off the tracer's per-moment peaks)."""
    moe = model.moe
    assert moe is not None
    c, si, full = compute_bytes(setup), moe.shared_expert_intermediate_size, setup.method == "full"
    shared = 3 * c * si + (c * si if full else 0)
    # full fine-tuning: down_proj's backward has freed the product it kept for its weight's gradient; two h-wide
    # gradients (the shared expert's input's and the block's) are still alive
    if full:
        return 2 * c * moe.num_experts * moe.expert_intermediate_size - shared + c * model.hidden_size
    return 3 * c * moe.num_experts * moe.expert_intermediate_size - shared - c * model.hidden_size


def moe_backward_transient_fixed(model: ModelSpec, setup: Setup) -> float:
    """Per step, beside :func:`moe_backward_transient_per_token`: with the experts training, the gradient of
    ``down_proj`` (E x i x h), computed at that moment, and the shared expert's weight gradients (3 h x i), computed
    before it."""
    moe = model.moe
    assert moe is not None
    if setup.method != "full":
        return 0.0
    h, si = model.hidden_size, moe.shared_expert_intermediate_size
    return compute_bytes(setup) * (moe.num_experts * moe.expert_intermediate_size * h + 3 * h * si)


def lowest_moe_layer(model: ModelSpec) -> int | None:
    """The lowest MoE layer when dense layers lie below it (Maverick: layer 1 above a dense layer 0), else None: in
    full fine-tuning its backward holds every gradient above it beside its E-fold temporaries, which neither the
    top layer's moment nor the (dense) bottom layer's reaches."""
    if model.moe is None or not model.moe.moe_layers or min(model.moe.moe_layers) == 0:
        return None
    return min(model.moe.moe_layers)


def layer_params(model: ModelSpec, idx: int) -> int:
    """Parameters of decoder layer ``idx`` (a MoE or a dense layer)."""
    moe = model.moe
    is_moe = moe is not None and idx in moe.moe_layers
    n = 2 * model.hidden_size  # the two RMSNorms
    for l in model.linears:
        if l.role == "attn" or (l.role == "mlp" and not is_moe) or (is_moe and l.role in ("router", "shared_expert")):
            n += l.params // l.count
    if is_moe:
        n += dict(model.other_params).get("experts", 0) // moe.num_moe_layers
    return n


def params_not_reached(model: ModelSpec, idx: int) -> int:
    """Parameters whose gradient the backward has not produced when it reaches layer ``idx``'s MLP: layers 0..idx
    and the (untied) input embedding."""
    embed = 0 if model.tie_word_embeddings else dict(model.other_params).get("embed_tokens", 0)
    return sum(layer_params(model, j) for j in range(idx + 1)) + embed
