"""Saved activations per token: what autograd keeps between forward and backward.

The dtypes they are kept in are in ``estimator/precision.py``, the gradient temporaries and loss
transients of the step's moments in ``estimator/transients.py``; the family traits they depend
on (norm style, RoPE, dropout, sliding windows, ...) come from ``ModelSpec.traits``.

Each function returns bytes per token, read off the modeling code of transformers 5 and peft and
checked op by op with the tracer (``vramplan.run.tracer.trace_numbers(...).saved_detail`` lists every
saved storage with the module that saved it). Notation as in Korthikanti et al. 2022
(arXiv 2205.05198): h hidden, q = heads*head_dim, kv = kv_heads*head_dim, i intermediate, a heads,
s sequence, c bytes of the compute dtype, r LoRA rank. Attention is costed as CUDA runs it: SDPA
picks flash attention for a causal step without a mask (q, k, v, output, fp32 logsumexp).
"""

from __future__ import annotations

from collections.abc import Callable

from ..specs import ModelSpec, Setup
from . import alibi, liger, llama4
from .lora import adapted_linears, converted_moe, expert_lora_params
from .precision import (
    adapter_dtype_bytes,
    attention_impl,
    autocast_bytes,
    compute_bytes,
    mixed,
)

#: Elementwise tensors an activation function saves for backward, in units of its input.
#: F.silu / F.gelu (exact or tanh) save their input; GPT-2's NewGELUActivation is written out in
#: Python (0.5*x*(1+tanh(k*(x+0.044715*x^3)))) and keeps four.
ACTIVATION_SAVES = {"silu": 1, "gelu": 1, "gelu_tanh": 1, "gelu_new": 4, "relu": 1, "swish": 1}


def masked_layers(model: ModelSpec, setup: Setup) -> int:
    """Layers whose SDPA call gets an explicit boolean mask: sliding-window layers once the
    sequence reaches the window (masking_utils._ignore_causal_mask_sdpa); the others run with
    ``is_causal``. A masked call repeats K/V to every head (no ``enable_gqa`` with a mask) and
    CUDA's memory-efficient kernel keeps the mask for backward."""
    if attention_impl(model, setup) == "eager":
        return 0
    if setup.pad_mask:  # a padded batch: every layer gets the boolean padding + causal mask
        return model.num_layers
    window = model.traits.sliding_window
    if not window or setup.seq < window:
        return 0
    return model.traits.sliding_layers


def norm_bytes(model: ModelSpec, setup: Setup, trainable_weight: bool, width: int | None = None,
               rows: int = 1) -> float:
    """One norm over ``width`` (h by default), ``rows`` of them per token.

    - rms (llama): fp32 upcast of the input (4w) and rsqrt (4), plus the c-byte normalised tensor
      when ``weight * x`` needs it for the weight's gradient;
    - rms_fp32_mul (Gemma's (1 + w) * x, OLMo2's w * x in fp32): the normalised tensor is fp32;
    - layernorm (F.layer_norm): input (c*w) and mean and rstd;
    - cohere (CohereLayerNorm in fp32): x - mean computed twice (2 x 4w), rsqrt, fp32 normalised.
    """
    if setup.liger and model.traits.norm in ("rms", "rms_fp32_mul"):  # LigerRMSNorm (estimator/liger.py)
        return liger.norm_bytes(model, setup, width, rows)
    w, c = width or model.hidden_size, compute_bytes(setup)
    style = model.traits.norm
    if style == "rms":
        # under autocast the residual stream is fp32 (fp32 weights), so the normalised tensor is
        return 4 * w + 4 * rows + ((4 if mixed(setup) else c) * w if trainable_weight else 0)
    if style == "rms_fp32_mul":
        return 4 * w + 4 * rows + (4 * w if trainable_weight else 0)
    if style == "cohere":
        return 8 * w + 4 * rows + (4 * w if trainable_weight else 0)
    return c * w + 2 * c * rows


#: Families whose layers norm after attention and the MLP (no input norm): their first op on the layer input is a
#: (trainable) projection.
POST_NORM_FAMILIES = frozenset({"olmo2", "olmo3"})


def untracked_input_norm_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """What the first layer's input norm does not save without checkpointing when only adapters train: its input
    (the embedding output) needs no gradient and neither does its weight, so autograd records nothing there. peft's
    ``enable_input_require_grads`` makes the embedding output require one only with gradient checkpointing
    (transformers 5.24 ``gradient_checkpointing_enable``, TRL 1.16 ``SFTTrainer.__init__``, peft 0.18
    ``prepare_model_for_kbit_training``). Read off the fake-tensor trace: Llama-3.2-1B LoRA without checkpointing
    keeps exactly one input norm's ``4 h + 4`` bytes a token less than every layer saving its own. 0 with
    checkpointing, full fine-tuning, a trained embedding (modules_to_save), post-norm families and the families
    whose layers are modelled elsewhere (LAYER_SPLITS)."""
    if (setup.checkpointing or setup.method == "full" or "embed_tokens" in setup.modules_to_save
            or model.family in POST_NORM_FAMILIES or model.family in LAYER_SPLITS or alibi.is_alibi(model)):
        return 0.0
    return norm_bytes(model, setup, trainable_weight=False)


#: Families whose eager attention softmaxes in the scores' dtype, not fp32 (transformers 5.24).
SOFTMAX_IN_LOGITS_DTYPE = frozenset({"gpt_oss"})


def attention_bytes(model: ModelSpec, setup: Setup) -> float:
    """Attention core per token (its input projection's input is counted with the linears)."""
    c, q, kv, a, s = compute_bytes(setup), model.q_dim, model.kv_dim, model.num_heads, setup.seq
    t = model.traits
    full = setup.method == "full"
    if alibi.is_alibi(model):  # BLOOM, MPT, falcon-rw (estimator/alibi.py)
        return alibi.attention_bytes(model, setup)
    if t.mla is not None and attention_impl(model, setup) != "eager":
        return mla_attention_bytes(model, setup)
    if attention_impl(model, setup) != "eager":
        c = autocast_bytes(setup)  # SDPA under autocast receives (and keeps) half q, k, v
    if attention_impl(model, setup) == "eager" and model.family in SOFTMAX_IN_LOGITS_DTYPE:
        # gpt-oss (modeling_gpt_oss.py eager_attention_forward): the scores and a sink column softmaxed in
        # their own dtype (softmax(..., dtype=combined_logits.dtype)), only that output kept (the scaling,
        # mask and max-subtraction save nothing), the row maxima's int64 indices
        return 4 * c * q + c * a * (s + 1) + 8 * a + (c * q if full else 0)
    if attention_impl(model, setup) == "eager":
        # q, k and v repeated to all heads, scores softmaxed in fp32 and cast back to c, the
        # output and o_proj's contiguous copy; Gemma2's soft-capping keeps tanh's output too
        total = 4 * c * q + (4 + c) * a * s + (c * q if full else 0)
        if t.attn_softcapping:
            total += c * a * s
        return total
    # flash/SDPA: q and k after RoPE (new tensors), v, the output (which o_proj reads), logsumexp;
    # with a fused projection v (and, without RoPE, q and k) are views of its whole output; in a
    # masked layer K and V are repeated to all heads (averaged over the layers here)
    total = c * q + 4 * a
    if t.fused_qkv:
        total += c * (q + 2 * kv) + (c * (q + kv) if t.rope else 0)
    else:
        total += 2 * c * kv + c * q
        # transformers before 4.54 repeats K/V in every SDPA layer (estimator/stack.py model_under)
        repeated = (1.0 if t.sdpa_repeat_kv and attention_impl(model, setup) == "sdpa"
                    else masked_layers(model, setup) / model.num_layers)
        total += repeated * 2 * c * (q - kv)
    # a masked layer's SDPA converts the boolean mask to a new additive one in the query's dtype
    # (torch's convert_boolean_attn_mask), which the memory-efficient kernel saves: (b, 1, s, s),
    # or expanded to every head and padded to a multiple of 16 keys when s is not one
    # (preprocess_mask; vramplan/run/real_paths.py, efficient_attn_bias)
    if masked_layers(model, setup):
        bias = c * s if s % 16 == 0 else c * a * (s + 16 - s % 16)
        total += masked_layers(model, setup) / model.num_layers * bias
    if t.qk_norm_rows:
        total += norm_bytes(model, setup, full, width=q + kv, rows=t.qk_norm_rows)
    if model.family == llama4.FAMILY:  # its RoPE layers' L2 q/k norm, its NoPE layers' scales (estimator/llama4.py)
        total += llama4.attention_extra_bytes(model, setup)
    return total


def mlp_bytes(model: ModelSpec, setup: Setup) -> float:
    """Dense MLP per token, its input excluded. Gated (SwiGLU/GeGLU): gate output (the
    activation's input), activation output and up output for the product's backward, and the
    product itself when down_proj's weight trains. Plain: the activation's saves, and its output
    when the second projection's weight trains."""
    c, i = compute_bytes(setup), model.intermediate_size
    full = setup.method == "full"
    act = ACTIVATION_SAVES.get(model.activation, 1)
    if model.mlp_kind == "gated" and setup.liger:  # LigerSiLUMulFunction (estimator/liger.py)
        return liger.mlp_bytes(model, setup)
    if model.mlp_kind == "gated":
        return c * i * (act + 2) + (c * i if full else 0)
    return c * i * act + (c * i if full else 0)


def _adapter_bytes_per_layer(model: ModelSpec, setup: Setup, roles: tuple[str, ...]) -> float:
    """peft casts each adapter's input to the adapter dtype (a bytes: ``adapter_dtype_bytes``) and
    lora_A keeps it (with lora_dropout > 0, the dropped-out copy instead, plus its bool mask);
    lora_B keeps lora_A's output. Per token, for one layer that has the Linears of these roles."""
    mask = 1 if setup.lora_dropout > 0 else 0
    a = adapter_dtype_bytes(setup)
    adapted = [l for l in adapted_linears(model, setup) if l.role in roles]
    if mixed(setup) and a == 4 and not mask:
        # autocast: lora_A and lora_B keep c-byte casts of their (fp32) inputs
        c = autocast_bytes(setup)
        return sum(c * l.in_features + c * setup.lora_rank for l in adapted)
    if a == compute_bytes(setup) and not mask and (setup.fsdp == "none" or setup.precision == "fp32"
                                                   or setup.fsdp_version == 2):
        # (under FSDP's MixedPrecision peft reads the adapter's fp32 sharded parameter, casts the input
        # to fp32, and autocast casts it back to 16 bits for the gathered weight: each adapter keeps
        # its own copy; fp32 FSDP has no policy and no cast; FSDP2's MixedPrecisionPolicy gathers the
        # adapters in 16 bits and accelerate runs no autocast: peft's cast is a no-op, estimator/fsdp2.py)
        # the cast is a no-op (fp32 activations of a k-bit-prepared base, or 16-bit adapters under
        # DeepSpeed stage 1/2): lora_A keeps the very input the layer computed
        return _shared_linear_inputs(model, setup, adapted, a) + a * setup.lora_rank * len(adapted)
    return sum((a + mask) * l.in_features + a * setup.lora_rank for l in adapted)


def _shared_linear_inputs(model: ModelSpec, setup: Setup, linears: list, nbytes: int) -> float:
    """Inputs kept for the backward of these Linears of one layer when each keeps the very tensor
    it reads (no cast): Linears reading the same normed input share it; an output projection
    reads what the attention kernel saved (SDPA/flash: a view of its output; eager: a contiguous
    copy) or the MLP's product, which nothing else keeps. Per token."""
    total, groups = 0.0, set()
    for l in linears:
        if l.name in OUTPUT_PROJECTIONS:
            eager = attention_impl(model, setup) == "eager"
            total += nbytes * l.in_features if l.role != "attn" or eager else 0
        elif l.role not in groups:
            groups.add(l.role)
            total += nbytes * l.in_features
    return total


def _zero3_frozen_inputs_per_layer(model: ModelSpec, setup: Setup, roles: tuple[str, ...]) -> float:
    """Under ZeRO-3, ``zero.Init`` replaces ``F.linear`` with ``LinearFunctionForZeroStage3``,
    which saves every Linear's input for the backward, a frozen base Linear's too (autograd's own
    matmul keeps it only for a weight that trains). With adapters whose input is a cast copy, the
    base Linears' c-byte inputs add: each norm output once, the MLP's product (fp32 adapters on
    16-bit activations; 16-bit adapters read, and keep, those very tensors already). Per token,
    dense layers (an MoE layer's experts are not Linears)."""
    if setup.method == "full" or setup.zero_stage != 3 or setup.quant != "none":
        return 0.0
    c = compute_bytes(setup)
    kept = _shared_linear_inputs(model, setup, [l for l in model.linears if l.role in roles], c)
    if adapter_dtype_bytes(setup) == c and setup.lora_dropout == 0:
        kept -= _shared_linear_inputs(model, setup, [l for l in adapted_linears(model, setup) if l.role in roles], c)
    return kept


def _int8_inputs_per_layer(model: ModelSpec, setup: Setup, roles: tuple[str, ...]) -> float:
    """bitsandbytes' ``MatMul8bitLt`` keeps its input for backward (``ctx.tensors``, outside
    autograd's saved tensors). Under autocast the adapter keeps a half copy, so the fp32 inputs add:
    each norm output once, the MLP's product; the attention output is SDPA's (eager: o_proj's
    contiguous copy). Without autocast that input is what the LoRA adapter keeps too when peft's
    cast to the adapter dtype is a no-op (the fp32 stream of a k-bit-prepared base); on a 16-bit
    stream under fp32 adapters (axolotl, LLaMA-Factory: no upcast) or with dropout, each adapter
    keeps its own copy and the 16-bit inputs add the same way (read off the CPU truth: axolotl's
    LLM.int8 LoRA step without checkpointing was -10.7 % without them)."""
    if setup.quant != "int8":
        return 0.0
    if mixed(setup):
        attn_out = autocast_bytes(setup) if attention_impl(model, setup) == "eager" else 0
        return _distinct_linear_inputs(model, roles, stream=4, attn_out=attn_out, mlp_out=4)
    c = compute_bytes(setup)
    if not setup.adapters or (adapter_dtype_bytes(setup) == c and setup.lora_dropout == 0):
        return 0.0
    attn_out = c if attention_impl(model, setup) == "eager" else 0
    return _distinct_linear_inputs(model, roles, stream=c, attn_out=attn_out, mlp_out=c)


def _distinct_linear_inputs(model: ModelSpec, roles: tuple[str, ...] | None, *, stream: float, attn_out: float,
                            mlp_out: float) -> float:
    """Bytes per token and layer of each distinct input of the Linears of ``roles`` (None: all but the head):
    a norm output once per role (the projections reading it share it), ``stream`` bytes an element; the
    attention output ``attn_out`` and the MLP's product ``mlp_out`` bytes an element."""
    total, groups = 0.0, set()
    for l in model.linears:
        if l.role in ("head", "expert") or (roles is not None and l.role not in roles):  # (experts: moe_4x.py)
            continue
        if l.name in OUTPUT_PROJECTIONS:
            total += (attn_out if l.role == "attn" else mlp_out) * l.in_features * l.count
        elif l.role not in groups:
            groups.add(l.role)
            total += stream * l.in_features * l.count
    return total / model.num_layers


def int8_checkpoint_held_per_token(model: ModelSpec, setup: Setup) -> float:
    """What a checkpointed layer keeps besides its input on an LLM.int8 base, per token and layer:
    bitsandbytes 0.50's ``MatMul8bitLt.forward`` keeps its input ``A`` as ``ctx.tensors`` (a ctx
    attribute, not ``save_for_backward``) whenever the input requires grad, as it does under LoRA;
    checkpointing's saved-tensor hooks never see it, so each int8 Linear's input lives until the
    backward reaches its layer: each norm output once (the projections reading it share it), the
    attention output, the MLP's product. (MatMul4Bit saves through ``save_for_backward``: a 4-bit
    base keeps only the layer input.)"""
    if setup.quant != "int8" or not setup.checkpointing or setup.method == "full":
        return 0.0
    stream = 4 if mixed(setup) else compute_bytes(setup)  # a norm's output, the MLP's product: the stream's dtype
    return _distinct_linear_inputs(model, None, stream=stream, attn_out=autocast_bytes(setup), mlp_out=stream)


#: Linears that read the attention output or the MLP's hidden activation (not a norm's output).
OUTPUT_PROJECTIONS = frozenset({"o_proj", "dense", "out_proj", "c_proj", "down_proj", "fc2", "fc_out", "w2",
                                "dense_4h_to_h"})


def tiled_mlp_input_bytes(model: ModelSpec, setup: Setup) -> float:
    """What a tiled MLP saves per token (estimator/tiled_mlp.py): its input, in the residual stream's dtype."""
    return (4 if mixed(setup) else compute_bytes(setup)) * model.hidden_size


def layer_bytes_per_token(model: ModelSpec, setup: Setup, which: str | int = "mean") -> float:
    """Saved bytes per token of one decoder layer without checkpointing: the mean over the
    layers, or layer ``which`` (dense and MoE layers differ)."""
    return sum(layer_split_per_token(model, setup, which))


def is_moe_layer(model: ModelSpec, idx: int) -> bool:
    return model.moe is not None and idx in model.moe.moe_layers


#: per-family replacements of :func:`layer_split_per_token`, registered by the module that models the family's
#: layers (a registry, so that this module imports none of them: estimator/short_conv.py calls back into it)
LAYER_SPLITS: dict[str, Callable[..., tuple[float, float]]] = {}


def layer_split_per_token(model: ModelSpec, setup: Setup, which: str | int = "mean") -> tuple[float, float]:
    """A layer's saved bytes per token as (attention side, MLP side): backward frees the MLP
    side before it reaches the attention and the norms. ``which``: "mean" over the layers, or a
    layer index (dense and MoE layers differ)."""
    split = LAYER_SPLITS.get(model.family)  # a hybrid's own layer kinds (LFM2: estimator/short_conv.py registers it)
    if split is not None:
        return split(model, setup, which)
    h, c = model.hidden_size, compute_bytes(setup)
    t = model.traits
    full = setup.method == "full"
    common = t.norms_per_layer * norm_bytes(model, setup, trainable_weight=full)
    if full and mixed(setup):
        # autocast casts a Linear's fp32 input for each Linear (it caches weights, not
        # activations): every projection reading a norm's output keeps its own c-byte copy
        common += sum(c * l.in_features * l.count for l in model.linears
                      if l.role in ("attn", "mlp") and l.name not in OUTPUT_PROJECTIONS) / model.num_layers
    elif full:  # inputs of trainable projections: once per distinct norm output
        common += c * h * (1 if t.shared_norm else 2)
    common += attention_bytes(model, setup)
    common += t.dropout_masks_per_layer * h
    common += (_adapter_bytes_per_layer(model, setup, ("attn", "other"))
               + _int8_inputs_per_layer(model, setup, ("attn", "other")))
    common += _zero3_frozen_inputs_per_layer(model, setup, ("attn", "other"))
    dense = (mlp_bytes(model, setup) + _adapter_bytes_per_layer(model, setup, ("mlp",))
             + _int8_inputs_per_layer(model, setup, ("mlp",)))
    dense += _zero3_frozen_inputs_per_layer(model, setup, ("mlp",))
    if setup.tiled_mlp:  # Unsloth's TiledMLP saves only the MLP's input (estimator/tiled_mlp.py)
        dense = tiled_mlp_input_bytes(model, setup)
    if model.moe is None:
        return common, dense
    moe = moe_layer_bytes_per_token(model, setup) + _adapter_bytes_per_layer(model, setup, ("shared_expert", "router"))
    nm = model.moe.num_moe_layers
    nd = model.num_layers - nm
    if isinstance(which, int):
        return common, moe if is_moe_layer(model, which) else dense
    return common, (moe * nm + dense * nd) / model.num_layers


#: Expert activations that keep more than SwiGLU's output, in ``ei``-wide tensors per routed row beyond it:
#: gpt-oss's clamped SwiGLU (modeling_gpt_oss.py ``_apply_gate``: the clamped gate, sigmoid(alpha x gate),
#: up + 1 and their product, where a SwiGLU keeps one output; its clamps save their inputs, views of gate_up).
MOE_GATE_EXTRA = {"gpt_oss": 3}


def moe_layer_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """The MLP of one MoE layer per token.

    transformers 5 routes with a top-k router (fp32 softmax over E, int64 indices, fp32 top-k
    weights when they are renormalised) and runs the experts through ``grouped_mm`` on the
    tokens sorted by expert (three int64 index vectors of length k per token). Saved per routed
    token: the gate_up output (the activation's input and the up half), the activation output,
    the routing weight and the down output it scales; when the expert weights train (full, or
    peft's ParamWrapper on them) also the gathered input and the product down_proj reads.
    """
    if model.family == llama4.FAMILY:  # every expert on every token, inputs scaled by the router (estimator/llama4.py)
        return llama4.moe_layer_bytes_per_token(model, setup)
    if any(l.role == "expert" for l in model.linears):  # transformers 4.x's per-expert loop (estimator/moe_4x.py)
        from . import moe_4x

        return moe_4x.moe_layer_bytes_per_token(model, setup)
    moe = model.moe
    assert moe is not None
    h, c, k, ei, E = model.hidden_size, compute_bytes(setup), moe.top_k, moe.expert_intermediate_size, moe.num_experts
    full = setup.method == "full"
    # LoRA reaches the 3-D expert stack (and router) only when the targets name them: q/k/v/o leave the
    # experts on their own frozen weights (moe_lora_weight_bytes)
    lora_moe = setup.adapters and converted_moe(model) and bool(expert_lora_params(model, setup))
    experts_train = full or lora_moe
    router = 4 * E + 8 * k + ((4 + 4 * k) if moe.norm_topk_prob else 0)
    if lora_moe:
        router += c * h  # the LoRA-merged router weight trains: its input is kept
    weight_bytes = 4 if model.family == "mixtral" else c
    routed = 24 * k + k * (c * 2 * ei + c * ei * (1 + MOE_GATE_EXTRA.get(model.family, 0)) + weight_bytes + c * h)
    if experts_train:
        routed += k * (c * h + c * ei)
    shared = 0.0
    si = moe.shared_expert_intermediate_size
    if si:
        shared = 3 * c * si + (c * si if full else 0)
        if moe.gated_shared_expert:
            shared += c + c * h  # sigmoid gate output and the shared expert's output it scales
    return router + routed + shared


def moe_lora_weight_bytes(model: ModelSpec, setup: Setup) -> float:
    """Per step, not per token: peft's ParamWrapper folds the LoRA factors into a full copy of
    each MoE layer's expert stack (and router) for the forward, and grouped_mm keeps that copy
    for backward, with the factors cast to the experts' dtype (``get_delta_factors``: ``.to(param.dtype)``;
    no copy when the adapters already have it: 16-bit under DeepSpeed stage 1/2, fp32 on a k-bit
    prepared base, whose experts are upcast). Summed over the MoE layers. No ParamWrapper, no copy:
    when the targets leave the experts and router alone (q_proj,k_proj,v_proj,o_proj), peft 0.21
    wraps none of the 3-D expert parameters and the experts run on their own weights (read off the
    fake-tensor trace of the real step: vramplan trace, Mixtral-8x7B LoRA on q/k/v/o)."""
    if not (setup.adapters and converted_moe(model) and expert_lora_params(model, setup)):
        return 0.0
    moe, h, c = model.moe, model.hidden_size, compute_bytes(setup)
    E, ei = moe.num_experts, moe.expert_intermediate_size
    router_lora = setup.lora_rank * (h + E)
    factors = expert_lora_params(model, setup) / moe.num_moe_layers - router_lora
    if adapter_dtype_bytes(setup) == c:
        factors = 0  # the factors are used as they are
    return moe.num_moe_layers * c * (3 * E * ei * h + E * h + factors)


def mla_attention_bytes(model: ModelSpec, setup: Setup) -> float:
    """DeepSeek-V2 multi-head latent attention per token: the q and kv low-rank norms (and the
    normalised inputs of q_b/kv_b when they train), q and k at nope+rope width, kv_b's output
    (v is a view of it), the output and the logsumexp."""
    mla, c, a = model.traits.mla, compute_bytes(setup), model.num_heads
    full = setup.method == "full"
    nope, rope, vd, kvr = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    qr = mla.q_lora_rank
    total = 0.0
    if qr:
        total += norm_bytes(model, setup, full, width=qr) + (c * qr if full else 0)
    total += norm_bytes(model, setup, full, width=kvr) + (c * kvr if full else 0)
    total += 2 * c * a * (nope + rope) + c * a * (nope + vd) + c * a * vd + 4 * a
    return total


def checkpoint_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """HF gradient checkpointing (non-reentrant) keeps each layer's input hidden states."""
    return compute_bytes(setup) * model.hidden_size


def checkpoint_kept_per_token(model: ModelSpec, setup: Setup) -> float:
    """What a checkpointed layer keeps through the forward: its input and, on an LLM.int8 base, its int8
    Linears' inputs (:func:`int8_checkpoint_held_per_token`)."""
    return checkpoint_bytes_per_token(model, setup) + int8_checkpoint_held_per_token(model, setup)


def checkpoint_note(setup: Setup) -> str:
    """The ``checkpointed_inputs`` component's words past "layer inputs kept by checkpointing"."""
    return ((" (host RAM at the loss with activation offloading)" if setup.activation_offload else "")
            + (", each int8 Linear's input (MatMul8bitLt's ctx)" if setup.quant == "int8" else ""))


def layers_inputs_per_token(model: ModelSpec, setup: Setup) -> float:
    """What every decoder layer reads from outside and keeps until the backward has left the
    bottom layer: RoPE's cos and sin (each layer's rotation saves them; checkpointing keeps them as
    its layers' inputs) and, with checkpointing, the (b, 1, s, s) bool mask of a masked layer (a
    sliding window past its length, a padded batch). Part of :func:`global_bytes_per_token`; unlike
    the loss's saves, alive in the layers' backward too."""
    t, c = model.traits, compute_bytes(setup)
    total = 0.0
    if t.rope:
        total += 2 * (t.rope_bytes or (4 if mixed(setup) else c)) * model.rope_dim
    if masked_layers(model, setup) and setup.checkpointing:
        total += setup.seq
    if alibi.is_alibi(model):  # the ALiBi families' masks and biases (estimator/alibi.py)
        total += alibi.layers_inputs_per_token(model, setup)
    return total


def global_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Saved outside the decoder layers: token ids, RoPE cos/sin, embedding dropout, final norm,
    head input, and the fp32 log-probabilities cross-entropy keeps (transformers'
    ForCausalLMLoss upcasts the logits)."""
    h, c, V = model.hidden_size, compute_bytes(setup), model.vocab_size
    t = model.traits
    full = setup.method == "full"
    total = 8.0  # labels (int64) for nll_loss
    if full:
        total += 8 * (2 if model.family == "gpt2" else 1)  # ids for the embedding backward(s)
    # cos and sin, shared by every layer, in the residual stream's dtype (fp32 under autocast); with
    # checkpointing a masked layer's (b, 1, s, s) bool mask, an input every checkpointed layer keeps
    # for its recompute (without checkpointing each layer keeps its own additive copy: attention_bytes)
    total += layers_inputs_per_token(model, setup)
    if t.embedding_dropout and full:
        total += h
    total += norm_bytes(model, setup, trainable_weight=full)
    if full or (setup.zero_stage == 3 and setup.loss == "hf"):
        total += c * h  # lm_head input (ZeRO-3's F.linear keeps a frozen head's too)
    if setup.loss == "hf":
        total += 4 * V  # log_softmax output (fp32)
    elif not full and setup.loss != "unsloth":  # (Unsloth's fused loss keeps only its grad_inputs: unsloth.py)
        total += c * h  # chunked loss: checkpoint keeps its chunks' input, the final norm's output
    if t.final_logit_softcapping and setup.loss == "hf":
        total += c * V  # tanh output of the final soft-capping (Gemma2)
    if setup.liger:  # the fused linear cross-entropy (estimator/liger.py)
        total += liger.global_delta_per_token(model, setup)
    if alibi.is_alibi(model):  # BLOOM's LayerNorm after the embedding (estimator/alibi.py)
        total += alibi.global_bytes_per_token(model, setup)
    return total
