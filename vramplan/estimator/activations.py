"""Saved activations per token: what autograd keeps between forward and backward.

Each function returns bytes per token for one decoder layer (or for the model's ends), read off
the modeling code of transformers 5 and peft and checked op by op with ``vramplan trace``
(the tracer's ``saved_detail`` lists every saved storage). Notation as in
Korthikanti et al. 2022 (arXiv 2205.05198): h hidden, q = heads*head_dim, kv = kv_heads*head_dim,
i intermediate, a heads, s sequence, c bytes of the compute dtype, r LoRA rank.
"""

from __future__ import annotations

from ..checks import lora_targets
from ..specs import ModelSpec, Setup
from ..units import DTYPE_BYTES, PRECISION_COMPUTE_DTYPE


def compute_bytes(setup: Setup) -> int:
    return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])


def attention_impl(model: ModelSpec, setup: Setup) -> str:
    return model.default_attn if setup.attn == "auto" else setup.attn


def _adapted(model: ModelSpec, setup: Setup) -> list:
    """Linears that get a LoRA adapter, resolved as peft resolves ``target_modules``."""
    if not setup.adapters:
        return []
    return lora_targets(model, setup)[0]


def norm_bytes(model: ModelSpec, setup: Setup, trainable_weight: bool) -> float:
    """One norm over h. RMSNorm (llama): fp32 upcast of the input (4h) and the fp32 rsqrt (4),
    plus the c-byte normalised tensor when ``weight * x`` needs it for the weight's gradient.
    LayerNorm (F.layer_norm): input (c*h) and fp32 mean and rstd (8)."""
    h, c = model.hidden_size, compute_bytes(setup)
    if model.norm_kind == "rmsnorm":
        gemma = model.family in ("gemma", "gemma2", "gemma3_text")
        if gemma:
            # Gemma computes (1 + w) * x in fp32: keeps the fp32 input, rsqrt and, with a
            # trainable weight, the fp32 normalised tensor.
            return 4 * h + 4 + (4 * h if trainable_weight else 0)
        return 4 * h + 4 + (c * h if trainable_weight else 0)
    return c * h + 8


def layer_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Saved bytes per token of one decoder layer without checkpointing."""
    h, c = model.hidden_size, compute_bytes(setup)
    q, kv, a, i = model.q_dim, model.kv_dim, model.num_heads, model.intermediate_size
    full = setup.method == "full"
    adapted = _adapted(model, setup)
    s = setup.seq

    # norms (input, post-attention; Gemma2/3 add pre/post feed-forward norms)
    norms_per_layer = {"gemma2": 4, "gemma3_text": 4, "cohere": 1}.get(model.family, 2)
    if model.family == "stablelm" and model.config.get("use_parallel_residual"):
        norms_per_layer = 1
    total = norms_per_layer * norm_bytes(model, setup, trainable_weight=full)

    # inputs of trainable linears, c bytes each, once per distinct input tensor
    if full:
        total += c * h  # q/k/v (or fused qkv) input: the norm output
        total += c * h if model.moe is None and model.family not in ("cohere",) else 0  # mlp input
        if model.moe is not None:
            total += c * h
    # attention core
    impl = attention_impl(model, setup)
    if impl == "eager":
        # q, k and v repeated to all heads, scores softmaxed in fp32 and cast back, the output and
        # o_proj's contiguous input; Gemma2's soft-capping keeps tanh's output (c*a*s) too
        total += 4 * c * q + (4 + c) * a * s + (c * q if full else 0)
        if model.config.get("attn_logit_softcapping") and model.family == "gemma2":
            total += c * a * s
    else:
        # SDPA/flash: rotated q, k, v, the output (shared with o_proj's input) and fp32 logsumexp
        total += 2 * c * q + 2 * c * kv + 4 * a
        if model.family == "phi3":
            # fused qkv: v is a view of the whole qkv output, and o_proj keeps its own copy
            total += c * (q + 2 * kv) - c * kv + (c * q if full else 0)
    # q/k norms (Qwen3, Gemma3 per head; OLMo2 over all heads): fp32 input and rsqrt, plus the
    # normalised tensor when the norm weight trains (fp32 for Gemma-style (1 + w) norms)
    if model.family in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"):
        rows = 2 if model.family == "olmo2" else a + model.num_kv_heads
        normed = (4 if model.family == "gemma3_text" else c) if full else 0
        total += (4 + normed) * (q + kv) + 4 * rows
    # MLP
    if model.moe is None:
        if model.mlp_kind == "gated":
            total += 3 * c * i + (c * i if full else 0)  # gate out, act out, up out (+ down input)
        else:
            total += c * i + (c * i if full else c * i)  # fc out (act input) + act out (fc2 input)
    else:
        total += moe_bytes_per_token(model, setup)
    # LoRA adapters: peft casts the input to the adapter dtype (fp32) and lora_B keeps lora_A's out
    for l in adapted:
        if l.role == "head":
            continue
        share = l.count / model.num_layers
        total += share * (4 * l.in_features + 4 * setup.lora_rank)
    return total


def moe_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Routed experts (transformers' grouped_mm path) per token, averaged over layers."""
    moe = model.moe
    assert moe is not None
    h, c, k, ei = model.hidden_size, compute_bytes(setup), moe.top_k, moe.expert_intermediate_size
    E = moe.num_experts
    per_moe = (
        4 * E  # router logits softmax in fp32
        + k * (c * h + 2 * c * 2 * ei + c * ei + c * h)  # gathered input, gate_up out, act, down out
        + c * h
    )
    if moe.shared_expert_intermediate_size:
        per_moe += 3 * c * moe.shared_expert_intermediate_size + c * h
    dense_layers = model.num_layers - moe.num_moe_layers
    dense = 3 * c * model.intermediate_size + (c * model.intermediate_size if setup.method == "full" else 0)
    return (per_moe * moe.num_moe_layers + dense * dense_layers) / model.num_layers


def checkpoint_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """HF gradient checkpointing (non-reentrant) keeps each layer's input hidden states."""
    return compute_bytes(setup) * model.hidden_size


def global_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Saved outside the decoder layers: token ids, RoPE cos/sin, final norm, head input, and the
    fp32 log-probabilities cross-entropy keeps (transformers' ForCausalLMLoss upcasts logits)."""
    h, c, V = model.hidden_size, compute_bytes(setup), model.vocab_size
    full = setup.method == "full"
    total = 8.0  # labels (int64) for nll_loss
    if full:
        total += 8  # input ids for the embedding backward
    if model.family not in ("gpt2",):
        total += 2 * c * model.head_dim  # cos and sin, shared by every layer
    total += norm_bytes(model, setup, trainable_weight=full)
    if full:
        total += c * h  # lm_head input
    total += 4 * V  # log_softmax output (fp32)
    if model.config.get("final_logit_softcapping"):
        total += c * V  # tanh output of the final soft-capping (Gemma2)
    return total
