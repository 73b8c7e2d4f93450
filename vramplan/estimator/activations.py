"""Saved activations per token: what autograd keeps between forward and backward.

Each function returns bytes per token, read off the modeling code of transformers 5 and peft and
checked op by op with the tracer (``vramplan.tracer.trace_numbers(...).saved_detail`` lists every
saved storage with the module that saved it). Notation as in Korthikanti et al. 2022
(arXiv 2205.05198): h hidden, q = heads*head_dim, kv = kv_heads*head_dim, i intermediate, a heads,
s sequence, c bytes of the compute dtype, r LoRA rank. Attention is costed as CUDA runs it: SDPA
picks flash attention for a causal step without a mask (q, k, v, output, fp32 logsumexp).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ModelSpec, Setup
from ..units import DTYPE_BYTES, PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE
from .lora import adapted_linears, converted_moe

#: Elementwise tensors an activation function saves for backward, in units of its input.
#: F.silu / F.gelu (exact or tanh) save their input; GPT-2's NewGELUActivation is written out in
#: Python (0.5*x*(1+tanh(k*(x+0.044715*x^3)))) and keeps four.
ACTIVATION_SAVES = {"silu": 1, "gelu": 1, "gelu_tanh": 1, "gelu_new": 4, "relu": 1, "swish": 1}


@dataclass(frozen=True)
class Traits:
    """What of a family's layer shape changes what autograd saves."""

    norm: str  # rms (llama), rms_fp32_mul (gemma, olmo2), layernorm, cohere
    norms_per_layer: int
    shared_norm: bool  # attention and MLP read the same norm output (parallel blocks)
    fused_qkv: bool  # q, k, v are views of one projection's output
    rope: bool
    rope_bytes: int  # dtype of the cos/sin tables
    qk_norm_rows: int  # 0: none; per-head norms: heads + kv heads; OLMo2: 2
    dropout_masks_per_layer: int  # hidden-state dropouts with p > 0 (bool masks, 1 B/element)
    embedding_dropout: bool


def _p(cfg: dict, *keys: str) -> float:
    return max(float(cfg.get(k) or 0.0) for k in keys)


def traits(model: ModelSpec) -> Traits:
    f, cfg = model.family, model.config
    norm = {"gemma": "rms_fp32_mul", "gemma2": "rms_fp32_mul", "gemma3_text": "rms_fp32_mul",
            "olmo2": "rms_fp32_mul", "cohere": "cohere"}.get(f, "layernorm" if model.norm_kind == "layernorm" else "rms")
    norms = {"gemma2": 4, "gemma3_text": 4, "cohere": 1, "gptj": 1}.get(f, 2)
    parallel = f in ("cohere", "gptj") or (f == "stablelm" and bool(cfg.get("use_parallel_residual")))
    if f == "stablelm" and parallel:
        norms = 1
    qk_rows = 0
    if f in ("qwen3", "qwen3_moe", "gemma3_text"):
        qk_rows = model.num_heads + model.num_kv_heads
    elif f == "olmo2":
        qk_rows = 2
    masks, embed_drop = 0, False
    if f == "gpt2":
        masks, embed_drop = 2 * (_p(cfg, "resid_pdrop") > 0), _p(cfg, "embd_pdrop") > 0
    elif f == "gptj":
        masks, embed_drop = 2 * (_p(cfg, "resid_pdrop") > 0), _p(cfg, "embd_pdrop") > 0
    elif f == "starcoder2":
        masks, embed_drop = 2 * (_p(cfg, "residual_dropout") > 0), _p(cfg, "embedding_dropout") > 0
    elif f == "gpt_neox":
        masks = 2 * (_p(cfg, "hidden_dropout") > 0)
    elif f == "phi3":
        masks, embed_drop = 2 * (_p(cfg, "resid_pdrop") > 0), _p(cfg, "embd_pdrop") > 0
    elif f == "stablelm":
        masks = 1 * (_p(cfg, "hidden_dropout") > 0)
    return Traits(
        norm=norm, norms_per_layer=norms, shared_norm=parallel,
        fused_qkv=any(l.name in ("qkv_proj", "query_key_value", "c_attn") for l in model.linears),
        rope=f != "gpt2", rope_bytes=4 if f == "olmo2" else 0, qk_norm_rows=qk_rows,
        dropout_masks_per_layer=masks, embedding_dropout=embed_drop,
    )


def sliding_layers(model: ModelSpec) -> int:
    """Layers with sliding-window attention, as transformers' config classes lay them out."""
    cfg, L, f = model.config, model.num_layers, model.family
    if not cfg.get("sliding_window"):
        return 0
    if isinstance(cfg.get("layer_types"), list):
        return sum(t == "sliding_attention" for t in cfg["layer_types"][:L])
    if f == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return sum((i + 1) % pattern != 0 for i in range(L))
    if f == "gemma2":
        return sum(i % 2 == 0 for i in range(L))
    if f in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        return 0 if not cfg.get("use_sliding_window") else L - min(L, int(cfg.get("max_window_layers") or L))
    return L


def masked_layers(model: ModelSpec, setup: Setup) -> int:
    """Layers whose SDPA call gets an explicit boolean mask: sliding-window layers once the
    sequence reaches the window (masking_utils._ignore_causal_mask_sdpa); the others run with
    ``is_causal``. A masked call repeats K/V to every head (no ``enable_gqa`` with a mask) and
    CUDA's memory-efficient kernel keeps the mask for backward."""
    if attention_impl(model, setup) == "eager":
        return 0
    if setup.pad_mask:  # a padded batch: every layer gets the boolean padding + causal mask
        return model.num_layers
    window = model.config.get("sliding_window")
    if not window or setup.seq < int(window):
        return 0
    return sliding_layers(model)


def mixed(setup: Setup) -> bool:
    """Mixed precision: fp32 weights and residual stream, matmuls and attention under autocast.
    Not under DeepSpeed: accelerate leaves autocast to it (``native_amp`` is off for DeepSpeed)
    and its bf16/fp16 engine casts the parameters to 16 bits (:func:`deepspeed_16bit`)."""
    return setup.precision.endswith("-mixed") and not setup.zero_stage


def deepspeed_16bit(setup: Setup) -> bool:
    """DeepSpeed's bf16/fp16 engine (ZeRO with any precision but fp32) casts every floating-point
    parameter of a model not built under ``zero.Init`` to 16 bits at ``initialize``
    (``DeepSpeedEngine._cast_module_mixed_precision``): the fp32 weights of a ``-mixed`` load and
    the embeddings, norms and head that ``prepare_model_for_kbit_training`` upcast on a quantized
    base (which transformers never builds under ``zero.Init``) become 16-bit again."""
    return bool(setup.zero_stage) and setup.precision != "fp32"


def autocast_bytes(setup: Setup) -> int:
    """Bytes of what autocast's lower-precision ops produce (matmuls, SDPA) under mixed
    precision; otherwise the activations' dtype."""
    if mixed(setup):
        return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])
    return compute_bytes(setup)


def compute_bytes(setup: Setup) -> int:
    """Bytes per element of the activations. A quantized base is prepared for k-bit training
    (peft ``prepare_model_for_kbit_training``), which upcasts the embeddings, norms and head to
    fp32: the residual stream, every projection's output (bitsandbytes casts its matmul result
    back to the input's dtype) and the logits are fp32; only the matmuls run in the compute dtype.
    peft skips that upcast for a GPTQ base: its activations stay in the load dtype (an AWQ base is
    upcast; its GEMM kernel casts each input to fp16 and the output back)."""
    if setup.quant not in ("none", "gptq") and not deepspeed_16bit(setup) and setup.fsdp == "none":
        return 4  # (under FSDP the base is not prepared: estimator/fsdp.py, _packed_layer)
    return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])


def adapter_dtype_bytes(setup: Setup) -> int:
    """Bytes per element of the LoRA adapters' weights and of what they compute. peft upcasts the
    adapters to fp32 (``autocast_adapter_dtype=True``) and casts each adapter's input to that dtype.
    DeepSpeed with bf16/fp16 casts every parameter to 16 bits at ``initialize``
    (``DeepSpeedEngine._cast_module_mixed_precision``), the adapters included, except on a model
    built under ``zero.Init``, whose parameters it leaves as they are: at stage 3 (transformers
    loads the base under ``zero.Init``, peft adds its fp32 adapters after) they stay fp32, unless
    the parameters are offloaded: stage 3 then copies the trainable partitions into 16-bit host
    buffers (``param_groups_fp16_flat_cpu_memory``), which the adapters become views of. A
    quantized base is never built under ``zero.Init`` (transformers creates it on the meta device
    and loads it whole on every rank): stage 3 partitions it at ``initialize`` and casts it,
    adapters included, like stage 1/2."""
    if setup.fsdp != "none":  # FSDP's MixedPrecision computes the adapters on 16-bit copies
        return 2 if setup.precision in ("bf16", "bf16-mixed", "fp16-mixed") else 4
    if setup.precision == "fp32" or not setup.zero_stage:
        return 4
    if setup.zero_stage in (1, 2) or setup.offload_params != "none" or setup.quant != "none":
        return 2  # a quantized base is not built under zero.Init: the engine casts it, adapters too
    return 4


def attention_impl(model: ModelSpec, setup: Setup) -> str:
    return model.default_attn if setup.attn == "auto" else setup.attn


def norm_bytes(model: ModelSpec, setup: Setup, trainable_weight: bool, width: int | None = None, rows: int = 1) -> float:
    """One norm over ``width`` (h by default), ``rows`` of them per token.

    - rms (llama): fp32 upcast of the input (4w) and rsqrt (4), plus the c-byte normalised tensor
      when ``weight * x`` needs it for the weight's gradient;
    - rms_fp32_mul (Gemma's (1 + w) * x, OLMo2's w * x in fp32): the normalised tensor is fp32;
    - layernorm (F.layer_norm): input (c*w) and mean and rstd;
    - cohere (CohereLayerNorm in fp32): x - mean computed twice (2 x 4w), rsqrt, fp32 normalised.
    """
    w, c = width or model.hidden_size, compute_bytes(setup)
    style = traits(model).norm
    if style == "rms":
        # under autocast the residual stream is fp32 (fp32 weights), so the normalised tensor is
        return 4 * w + 4 * rows + ((4 if mixed(setup) else c) * w if trainable_weight else 0)
    if style == "rms_fp32_mul":
        return 4 * w + 4 * rows + (4 * w if trainable_weight else 0)
    if style == "cohere":
        return 8 * w + 4 * rows + (4 * w if trainable_weight else 0)
    return c * w + 2 * c * rows


def attention_bytes(model: ModelSpec, setup: Setup) -> float:
    """Attention core per token (its input projection's input is counted with the linears)."""
    c, q, kv, a, s = compute_bytes(setup), model.q_dim, model.kv_dim, model.num_heads, setup.seq
    t = traits(model)
    full = setup.method == "full"
    if model.family == "deepseek_v2" and attention_impl(model, setup) != "eager":
        return mla_attention_bytes(model, setup)
    if attention_impl(model, setup) != "eager":
        c = autocast_bytes(setup)  # SDPA under autocast receives (and keeps) half q, k, v
    if attention_impl(model, setup) == "eager":
        # q, k and v repeated to all heads, scores softmaxed in fp32 and cast back to c, the
        # output and o_proj's contiguous copy; Gemma2's soft-capping keeps tanh's output too
        total = 4 * c * q + (4 + c) * a * s + (c * q if full else 0)
        if model.config.get("attn_logit_softcapping") and model.family == "gemma2":
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
        total += masked_layers(model, setup) / model.num_layers * 2 * c * (q - kv)
    if t.qk_norm_rows:
        total += norm_bytes(model, setup, full, width=q + kv, rows=t.qk_norm_rows)
    return total


def mlp_bytes(model: ModelSpec, setup: Setup) -> float:
    """Dense MLP per token, its input excluded. Gated (SwiGLU/GeGLU): gate output (the
    activation's input), activation output and up output for the product's backward, and the
    product itself when down_proj's weight trains. Plain: the activation's saves, and its output
    when the second projection's weight trains."""
    c, i = compute_bytes(setup), model.intermediate_size
    full = setup.method == "full"
    act = ACTIVATION_SAVES.get(model.activation, 1)
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
    if a == compute_bytes(setup) and not mask and (setup.fsdp == "none" or setup.precision == "fp32"):
        # (under FSDP's MixedPrecision peft reads the adapter's fp32 sharded parameter, casts the input
        # to fp32, and autocast casts it back to 16 bits for the gathered weight: each adapter keeps
        # its own copy; fp32 FSDP has no policy and no cast)
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
    autograd's saved tensors). Without autocast that input is what the LoRA adapter keeps too;
    under autocast the adapter keeps a half copy, so the fp32 inputs add: each norm output once,
    the MLP's product; the attention output is SDPA's (eager: o_proj's contiguous copy)."""
    if setup.quant != "int8" or not mixed(setup):
        return 0.0
    total, groups = 0.0, set()
    for l in model.linears:
        if l.role not in roles or l.role == "head":
            continue
        if l.name in OUTPUT_PROJECTIONS:
            if l.role != "attn":
                total += 4 * l.in_features * l.count
            elif attention_impl(model, setup) == "eager":
                total += autocast_bytes(setup) * l.in_features * l.count
        elif l.role not in groups:
            groups.add(l.role)
            total += 4 * l.in_features * l.count
    return total / model.num_layers


#: Linears that read the attention output or the MLP's hidden activation (not a norm's output).
OUTPUT_PROJECTIONS = frozenset({"o_proj", "dense", "out_proj", "c_proj", "down_proj", "fc2", "fc_out", "w2",
                                "dense_4h_to_h"})


def layer_bytes_per_token(model: ModelSpec, setup: Setup, which: str | int = "mean") -> float:
    """Saved bytes per token of one decoder layer without checkpointing: the mean over the
    layers, or layer ``which`` (dense and MoE layers differ)."""
    return sum(layer_split_per_token(model, setup, which))


def is_moe_layer(model: ModelSpec, idx: int) -> bool:
    return model.moe is not None and idx in model.moe.moe_layers


def layer_split_per_token(model: ModelSpec, setup: Setup, which: str | int = "mean") -> tuple[float, float]:
    """A layer's saved bytes per token as (attention side, MLP side): backward frees the MLP
    side before it reaches the attention and the norms. ``which``: "mean" over the layers, or a
    layer index (dense and MoE layers differ)."""
    h, c = model.hidden_size, compute_bytes(setup)
    t = traits(model)
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
    common += _adapter_bytes_per_layer(model, setup, ("attn", "other")) + _int8_inputs_per_layer(model, setup, ("attn", "other"))
    common += _zero3_frozen_inputs_per_layer(model, setup, ("attn", "other"))
    dense = mlp_bytes(model, setup) + _adapter_bytes_per_layer(model, setup, ("mlp",)) + _int8_inputs_per_layer(model, setup, ("mlp",))
    dense += _zero3_frozen_inputs_per_layer(model, setup, ("mlp",))
    if model.moe is None:
        return common, dense
    moe = moe_layer_bytes_per_token(model, setup) + _adapter_bytes_per_layer(model, setup, ("shared_expert", "router"))
    nm = model.moe.num_moe_layers
    nd = model.num_layers - nm
    if isinstance(which, int):
        return common, moe if is_moe_layer(model, which) else dense
    return common, (moe * nm + dense * nd) / model.num_layers


def moe_layer_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """The MLP of one MoE layer per token.

    transformers 5 routes with a top-k router (fp32 softmax over E, int64 indices, fp32 top-k
    weights when they are renormalised) and runs the experts through ``grouped_mm`` on the
    tokens sorted by expert (three int64 index vectors of length k per token). Saved per routed
    token: the gate_up output (the activation's input and the up half), the activation output,
    the routing weight and the down output it scales; when the expert weights train (full, or
    peft's ParamWrapper on them) also the gathered input and the product down_proj reads.
    """
    moe = model.moe
    assert moe is not None
    h, c, k, ei, E = model.hidden_size, compute_bytes(setup), moe.top_k, moe.expert_intermediate_size, moe.num_experts
    full = setup.method == "full"
    experts_train = full or (setup.adapters and converted_moe(model))
    router = 4 * E + 8 * k + ((4 + 4 * k) if moe.norm_topk_prob else 0)
    if setup.adapters and converted_moe(model):
        router += c * h  # the LoRA-merged router weight trains: its input is kept
    weight_bytes = 4 if model.family == "mixtral" else c
    routed = 24 * k + k * (c * 2 * ei + c * ei + weight_bytes + c * h)
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
    prepared base, whose experts are upcast). Summed over the MoE layers."""
    if not (setup.adapters and converted_moe(model)):
        return 0.0
    from .lora import expert_lora_params

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
    cfg, c, a = model.config, compute_bytes(setup), model.num_heads
    full = setup.method == "full"
    nope, rope, vd, kvr = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    qr = cfg.get("q_lora_rank", 1536)
    total = 0.0
    if qr:
        total += norm_bytes(model, setup, full, width=qr) + (c * qr if full else 0)
    total += norm_bytes(model, setup, full, width=kvr) + (c * kvr if full else 0)
    total += 2 * c * a * (nope + rope) + c * a * (nope + vd) + c * a * vd + 4 * a
    return total


#: Bytes per token, in units of h, of the norm and attention gradients at the worst moment of a
#: layer's backward (fp32 norm gradients dominate), per norm style and full/LoRA; read off the
#: tracer's per-moment peaks on micro-configs where the MLP is too narrow to matter.
NORM_BACKWARD_H = {
    ("rms", "full"): 22, ("rms", "lora"): 22,
    ("rms_fp32_mul", "full"): 26, ("rms_fp32_mul", "lora"): 22,
    ("layernorm", "full"): 16, ("layernorm", "lora"): 7,
    ("cohere", "full"): 30, ("cohere", "lora"): 7,
}


def mlp_backward_transient_per_token(model: ModelSpec, setup: Setup, idx: int) -> float:
    """Gradient temporaries of an MLP's backward, while the whole layer's activations are still
    saved: c (3 i + h) (the product's, the gate's and up's gradients and the hidden state's; a
    LoRA down_proj's fp32 adapter path in place of the product's); MoE: the routed tokens'
    expert width. Read off the tracer's per-moment peaks."""
    h, c = model.hidden_size, compute_bytes(setup)
    if is_moe_layer(model, idx):
        routed = model.moe.expert_intermediate_size * model.moe.top_k
        return c * (routed + 2 * h)  # grouped_mm backward over the routed tokens
    i = model.intermediate_size
    if setup.method == "full":
        return c * (3 * i + h)
    # LoRA: the gradient of the widest adapted MLP projection's lora_B output (in the adapter
    # dtype), beside the c-byte gradients of the gate/up product
    widest = max((l.out_features for l in adapted_linears(model, setup) if l.role == "mlp"), default=i)
    return adapter_dtype_bytes(setup) * widest + 0.64 * i + c * h


def lora_forward_peak_per_token(model: ModelSpec, setup: Setup, idx: int) -> float:
    """The peak inside a layer's forward (a recomputed one, with checkpointing) at its widest
    LoRA projection, per token, over the layer's input: peft's ``result + lora_B(lora_A(x)) *
    scaling`` holds the base output (c bytes) beside two out-sized tensors in the adapter dtype
    (lora_B's output and its scaled copy, then the sum), on top of what the layer saved before it. Fused
    projections (Phi-3's gate_up_proj, out = 2 i) make this the layer's peak, above its backward.
    Read off the tracer's op timeline; MoE layers' routed experts are not plain Linears."""
    if not setup.adapters:
        return 0.0
    h, c = model.hidden_size, compute_bytes(setup)
    mask = 1 if setup.lora_dropout > 0 else 0
    r, a = setup.lora_rank, adapter_dtype_bytes(setup)

    # adapters in the activations' dtype (fp32 of a k-bit-prepared base, 16-bit under DeepSpeed
    # stage 1/2): the adapter's cast of its input is a no-op
    copy = 0 if c == a and not mask else a + mask

    def at(l, before: float) -> float:
        return before + copy * l.in_features + a * r + c * l.out_features + 2 * a * l.out_features

    common, _ = layer_split_per_token(model, setup, idx)
    # alive beside the saves: the norm's output being projected, and (MLP side) the residual
    norm = norm_bytes(model, setup, trainable_weight=False) + c * h
    peaks, before = [0.0], norm
    for l in adapted_linears(model, setup):
        if l.role != "attn" or l.out_features == h and l.in_features == model.q_dim and l.name.endswith(("o_proj", "dense", "out_proj", "c_proj")):
            continue  # the output projection runs on the attention's output, after its saves
        peaks.append(at(l, before))
        before += c * l.out_features + copy * l.in_features + a * r
    if not is_moe_layer(model, idx):
        act = ACTIVATION_SAVES.get(model.activation, 1)
        before = common + 2 * c * h
        ups = [l for l in adapted_linears(model, setup) if l.role == "mlp" and l.out_features != h]
        for n, l in enumerate(ups):
            peaks.append(at(l, before))
            before += (c * l.out_features * (act + 1) if n == 0 and len(ups) > 1 else 0) + copy * l.in_features + a * r
    return max(peaks)


def attention_backward_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """Gradient temporaries of the attention and norm backward, once the MLP side is freed:
    the fp32 norm gradients dominate (NORM_BACKWARD_H); eager attention's score gradients
    (fp32 and c-byte, 5.75 a s net of what they free) where larger."""
    mode = "full" if setup.method == "full" else "lora"
    norm = NORM_BACKWARD_H[(traits(model).norm, mode)] * model.hidden_size
    eager = 5.75 * model.num_heads * setup.seq if attention_impl(model, setup) == "eager" else 0
    return max(norm, eager)


def checkpoint_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """HF gradient checkpointing (non-reentrant) keeps each layer's input hidden states."""
    return compute_bytes(setup) * model.hidden_size


def global_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Saved outside the decoder layers: token ids, RoPE cos/sin, embedding dropout, final norm,
    head input, and the fp32 log-probabilities cross-entropy keeps (transformers'
    ForCausalLMLoss upcasts the logits)."""
    h, c, V = model.hidden_size, compute_bytes(setup), model.vocab_size
    t = traits(model)
    full = setup.method == "full"
    total = 8.0  # labels (int64) for nll_loss
    if full:
        total += 8 * (2 if model.family == "gpt2" else 1)  # ids for the embedding backward(s)
    if t.rope:
        # cos and sin, shared by every layer, in the residual stream's dtype (fp32 under autocast)
        total += 2 * (t.rope_bytes or (4 if mixed(setup) else c)) * rope_dim(model)
    if t.embedding_dropout and full:
        total += h
    if masked_layers(model, setup):
        total += setup.seq  # the (b, 1, s, s) bool sliding-window mask, shared by the layers
    total += norm_bytes(model, setup, trainable_weight=full)
    if full or (setup.zero_stage == 3 and setup.loss == "hf"):
        total += c * h  # lm_head input (ZeRO-3's F.linear keeps a frozen head's too)
    if setup.loss == "hf":
        total += 4 * V  # log_softmax output (fp32)
    elif not full:
        total += c * h  # chunked loss: checkpoint keeps its chunks' input, the final norm's output
    if model.config.get("final_logit_softcapping") and setup.loss == "hf":
        total += c * V  # tanh output of the final soft-capping (Gemma2)
    return total


#: Tokens per chunk of vramplan's chunked loss (vramplan/run/chunked_loss.py).
LOSS_CHUNK_TOKENS = 1024


def loss_transients(model: ModelSpec, setup: Setup) -> tuple[int, int]:
    """Bytes alive at the loss in the forward and at its backward, beyond saved activations.

    transformers' ForCausalLMLoss: the c-byte logits and their fp32 copy while log_softmax runs
    (its fp32 output is saved), then two fp32 N x V gradients in log_softmax's backward.
    The chunked loss (vramplan/run/chunked_loss.py) holds one chunk of C tokens at a time: in the
    forward its fp32 logits and log-probabilities (the c-byte logits are freed by the upcast),
    in the backward the recomputed pair and the fp32 gradient of the logits, beside the c-byte
    gradient of the hidden states being assembled and (full fine-tuning, more than one chunk) the
    head weight's gradient of the chunks already done."""
    c, V, N, h = autocast_bytes(setup), model.vocab_size, setup.tokens, model.hidden_size
    if setup.loss == "hf":
        # fp32 logits (fp32 or k-bit-prepared models): ``.float()`` is a no-op, no copy
        return (c + (4 if c < 4 else 0)) * N * V, 8 * N * V
    chunk = min(N, LOSS_CHUNK_TOKENS)
    # full fine-tuning: the head weight's gradient of the chunks done so far waits for the next
    head_grad = V * h * int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]]) if setup.method == "full" and N > chunk else 0
    return 8 * chunk * V, 12 * chunk * V + c * N * h + head_grad


def rope_dim(model: ModelSpec) -> int:
    """Width of the cos/sin tables: the rotated part of a head."""
    cfg = model.config
    if model.family == "gptj":
        return int(cfg.get("rotary_dim") or model.head_dim) // 2
    if model.family == "gpt_neox":
        return int(model.head_dim * float(cfg.get("rotary_pct", 1.0)))
    if model.family == "stablelm":
        return int(model.head_dim * float(cfg.get("partial_rotary_factor", 0.25)))
    if model.family == "deepseek_v2":
        return int(cfg.get("qk_rope_head_dim") or model.head_dim)
    return model.head_dim
