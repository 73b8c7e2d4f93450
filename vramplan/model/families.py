"""config.json -> ModelSpec for the families the catalogue added beyond the Llama-shaped decoders
(issue 29): Falcon, InternLM2, Baichuan 2, GPT-BigCode (StarCoder, SantaCoder, Granite Code), OPT,
gpt-oss, and Gemma 3's image-text model (``gemma3``: its Gemma 3 text tower and SigLIP vision tower).

Each builder reads the keys the family's modeling code reads, with its config class's defaults
(transformers 5.24, or the remote code the Hub repository ships: InternLM2, Baichuan 2), and lists
every Linear by module name; ``tests/test_catalogue_models.py`` holds each against transformers'
own model on the meta device (or, for remote code, against the Llama model of the same shapes).
"""

from __future__ import annotations

from ..specs import SpecError
from .builders import FAMILIES, attention, gated_mlp, learned_positions, mha_and_mlp
from .builders import Layers as _Layers
from .builders import act as _act
from .builders import family as _family
from .builders import head as _head
from .builders import req as _req
from .builders import spec as _spec
from .modelspec import LinearSpec, ModelSpec, MoeSpec
from .textconfig import falcon_norms, gemma3_text_config


def _heads(cfg: dict, a: int, key: str = "num_key_value_heads") -> int:
    kvh = int(cfg.get(key) or a)
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of {key} ({kvh})")
    return kvh


# ----------------------------------------------------------------------------------------------
# Falcon (FalconForCausalLM): fused query_key_value, parallel attention and MLP, LayerNorm, GELU


@_family("falcon")
def _falcon(cfg: dict, name: str, source: str) -> ModelSpec:
    """falcon-7b (multi-query, one LayerNorm feeding both branches), falcon-40b/180B and Falcon2-11B
    (``new_decoder_architecture``: grouped KV heads, ``ln_attn`` and ``ln_mlp``). FalconConfig's defaults:
    multi_query, parallel_attn, no bias, ffn 4h, tied head. ALiBi configs (falcon-rw: ``alibi``, no multi-query, biases,
    sequential attention) have the same tensors; their attention is estimator/alibi.py's."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    hd = h // a
    new = bool(cfg.get("new_decoder_architecture", False))
    if new:
        kvh = _heads(cfg, a, "num_kv_heads")
    else:
        kvh = 1 if cfg.get("multi_query", True) else a
    norms = falcon_norms(cfg)
    bias = bool(cfg.get("bias", False))
    ffn = int(cfg.get("ffn_hidden_size") or 4 * h)
    lay = _Layers("transformer.h", L)
    lay.linear("self_attention.query_key_value", h, (a + 2 * kvh) * hd, bias, "attn")
    lay.linear("self_attention.dense", h, h, bias, "attn")
    lay.linear("mlp.dense_h_to_4h", h, ffn, bias, "mlp")
    lay.linear("mlp.dense_4h_to_h", ffn, h, bias, "mlp")
    lay.add("norms", (norms * L + 1) * 2 * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, True)
    # the multi-query layout hands SDPA one K/V head for all query heads without enable_gqa: torch's fused
    # kernels need equal head counts, so it runs the math kernel, which keeps the s x s scores (eager's memory)
    mqa_math = not new and kvh != a
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=ffn, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="plain", activation=_act(cfg, "activation", "gelu"), norm_kind="layernorm",
        default_attn="eager" if mqa_math else "sdpa", family="falcon",
    )


# ----------------------------------------------------------------------------------------------
# InternLM2 / 2.5 (remote code, modeling_internlm2.py): Llama with a fused, grouped wqkv


@_family("internlm2")
def _internlm2(cfg: dict, name: str, source: str) -> ModelSpec:
    """InternLM2ForCausalLM as the Hub repositories' modeling_internlm2.py builds it: ``tok_embeddings``,
    ``attention.wqkv`` (the q, k and v heads of each KV group interleaved in one Linear) and ``attention.wo``
    (bias: ``bias``, InternLM2Config's default true; the released configs set false),
    ``feed_forward.w1/w3/w2`` (SwiGLU, no bias), RMSNorms, an untied ``output`` head. The config's
    ``attn_implementation`` (``eager`` in the released files) picks the attention class."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = _heads(cfg, a)
    hd, i = h // a, _req(cfg, "intermediate_size")
    bias = bool(cfg.get("bias", True))
    lay = _Layers("model.layers", L)
    lay.linear("attention.wqkv", h, (a + 2 * kvh) * hd, bias, "attn")
    lay.linear("attention.wo", a * hd, h, bias, "attn")
    lay.linear("feed_forward.w1", h, i, False, "mlp")
    lay.linear("feed_forward.w3", h, i, False, "mlp")
    lay.linear("feed_forward.w2", i, h, False, "mlp")
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tie = bool(cfg.get("tie_word_embeddings", False))
    if not tie:
        lay.linear("output", h, V, False, "head", count=1, top=True)
    attn = str(cfg.get("attn_implementation") or "eager")
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation=_act(cfg), norm_kind="rmsnorm",
        default_attn="eager" if attn == "eager" else "sdpa", family="internlm2",
    )


# ----------------------------------------------------------------------------------------------
# Baichuan 2 (remote code, modeling_baichuan.py): Llama with a fused W_pack and a NormHead


@_family("baichuan")
def _baichuan(cfg: dict, name: str, source: str) -> ModelSpec:
    """Baichuan2-7B as its modeling_baichuan.py builds it: ``self_attn.W_pack`` (q, k, v in one Linear, no
    bias), ``o_proj``, a SwiGLU MLP, RMSNorms, RoPE, and ``lm_head`` a NormHead (a V x h weight, normalised in
    every training forward). Baichuan2-13B's file is another one (ALiBi, no RoPE): refused, since its config
    names nothing that tells the two apart but its size."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    if h == 5120 and L == 40:
        raise SpecError("Baichuan 13B (ALiBi attention, an s x s bias per head) is not modelled; Baichuan2-7B is")
    hd, i = h // a, _req(cfg, "intermediate_size")
    lay = _Layers("model.layers", L)
    lay.linear("self_attn.W_pack", h, 3 * h, False, "attn")
    lay.linear("self_attn.o_proj", h, h, False, "attn")
    gated_mlp(lay, "mlp", h, i, False, "mlp")
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    lay.linear("lm_head", h, V, False, "head", count=1, top=True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=False, mlp_kind="gated", activation=_act(cfg), norm_kind="rmsnorm",
        default_attn="sdpa", family="baichuan",
    )


# ----------------------------------------------------------------------------------------------
# GPT-BigCode (StarCoder, SantaCoder, Granite Code 20B/34B): GPT-2 with multi-query attention


@_family("gpt_bigcode")
def _gpt_bigcode(cfg: dict, name: str, source: str) -> ModelSpec:
    """GPTBigCodeForCausalLM: learned positions, LayerNorm with bias, ``attn.c_attn`` (h + 2 head_dim outputs
    under multi_query, the config's default; 3h otherwise), biases everywhere, gelu_pytorch_tanh, a head tied to
    ``wte`` (nn.Linear modules, not GPT-2's Conv1D)."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "n_embd", "hidden_size"), _req(cfg, "n_layer", "num_hidden_layers")
    a = _req(cfg, "n_head", "num_attention_heads")
    P = _req(cfg, "n_positions", "max_position_embeddings")
    i = int(cfg.get("n_inner") or 4 * h)
    hd = h // a
    mq = bool(cfg.get("multi_query", True))
    lay = _Layers("transformer.h", L)
    lay.linear("attn.c_attn", h, h + 2 * hd if mq else 3 * h, True, "attn")
    lay.linear("attn.c_proj", h, h, True, "attn")
    lay.linear("mlp.c_fc", h, i, True, "mlp")
    lay.linear("mlp.c_proj", i, h, True, "mlp")
    tie = learned_positions(cfg, lay, V, h, P)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=1 if mq else a,
        head_dim=hd, intermediate_size=i, max_position_embeddings=P, tie_word_embeddings=tie, mlp_kind="plain",
        activation=_act(cfg, "activation_function", "gelu_pytorch_tanh"), norm_kind="layernorm",
        default_attn="sdpa", family="gpt_bigcode",
    )


# ----------------------------------------------------------------------------------------------
# OPT (OPTForCausalLM): learned positions (offset 2), biases, ReLU, dropout 0.1


@_family("opt")
def _opt(cfg: dict, name: str, source: str) -> ModelSpec:
    """OPT-125m ... OPT-66b: ``model.decoder``; ``project_in``/``project_out`` when the embeddings are narrower
    than the model (opt-350m: 512 -> 1024, which also puts its LayerNorms after each block and drops the final
    one); the head tied to the embedding."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    ffn = _req(cfg, "ffn_dim")
    P = int(cfg.get("max_position_embeddings") or 2048)
    proj = int(cfg.get("word_embed_proj_dim") or h)
    bias = bool(cfg.get("enable_bias", True))
    affine = bool(cfg.get("layer_norm_elementwise_affine", True))
    lay = _Layers("model.decoder.layers", L)
    mha_and_mlp(lay, "self_attn", "out_proj", ("fc1", "fc2"), h, ffn, bias, bias, bias)
    final = bool(cfg.get("do_layer_norm_before", True)) and not cfg.get("_remove_final_layer_norm", False)
    lay.add("norms", (2 * L + final) * (2 * h if affine else 0))
    lay.add("embed_tokens", V * proj)
    lay.add("embed_positions", (P + 2) * h)  # OPTLearnedPositionalEmbedding's offset of 2
    if proj != h:  # once per step, not per layer: role "embed_proj"
        lay.linear("project_out", h, proj, False, "embed_proj", count=1, top=True)
        lay.linear("project_in", proj, h, False, "embed_proj", count=1, top=True)
    tie = _head(cfg, lay, V, proj, True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=ffn, max_position_embeddings=P, tie_word_embeddings=tie, mlp_kind="plain",
        activation=_act(cfg, "activation_function", "relu"), norm_kind="layernorm", default_attn="sdpa", family="opt",
    )


# ----------------------------------------------------------------------------------------------
# gpt-oss (GptOssForCausalLM): biased attention with sinks, a biased router, biased fused experts


@_family("gpt_oss")
def _gpt_oss(cfg: dict, name: str, source: str) -> ModelSpec:
    """gpt-oss-20b/120b in transformers 5.24: q/k/v/o with biases, one learned sink logit per head and layer,
    the router (a biased E x h parameter, not an nn.Linear), experts ``gate_up_proj`` (E x h x 2i) and
    ``down_proj`` (E x i x h) with biases, RMSNorms, an untied head. The Hub checkpoint stores the experts in
    MXFP4; this is the model in its load dtype, as transformers runs it for training (dequantized to bf16:
    ``Mxfp4Config(dequantize=True)``, the published fine-tuning recipe). SDPA is not supported (the sinks):
    eager attention by default."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = _heads(cfg, a)
    hd = int(cfg.get("head_dim") or 64)
    E, k = _req(cfg, "num_local_experts"), _req(cfg, "num_experts_per_tok", "experts_per_token")
    ei = _req(cfg, "intermediate_size")
    bias = bool(cfg.get("attention_bias", True))
    lay = _Layers("model.layers", L)
    attention(lay, h, a, kvh, hd, bias, bias)
    lay.add("attention_sinks", a * L)
    lay.add("experts", L * E * (h * 2 * ei + 2 * ei + ei * h + h))
    lay.add("router", L * (E * h + E))
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, False)
    moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=L, norm_topk_prob=True,
                  moe_layers=tuple(range(L)))
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=ei, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation="silu", norm_kind="rmsnorm", default_attn="eager",
        moe=moe, family="gpt_oss",
    )


# ----------------------------------------------------------------------------------------------
# GQA attention over DeepSeek's MoE: GLM-4.5 (glm4_moe), ERNIE 4.5 MoE (ernie4_5_moe)


@_family("glm4_moe", "ernie4_5_moe")
def _shared_moe(cfg: dict, name: str, source: str) -> ModelSpec:
    """Glm4MoeForCausalLM and Ernie4_5_MoeForCausalLM in transformers 5.24: q/k/v (biased in GLM-4.5:
    attention_bias; ERNIE: use_bias), o_proj, q/k norms per head where GLM's use_qk_norm says so; dense layers
    before the first MoE layer; each MoE layer a router (an fp32 E x h parameter, its correction bias a buffer in
    GLM and a parameter in ERNIE), fused experts and shared experts (n_shared x the expert width). transformers'
    conversion maps both to the qwen2_moe pattern, so peft adapts their experts as Qwen3-MoE's: the Qwen3-MoE
    recipe (``ModelSpec.family``)."""
    mt = cfg["model_type"]
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = _heads(cfg, a)
    hd = int(cfg.get("head_dim") or h // a)
    i = _req(cfg, "intermediate_size")
    lay = _Layers("model.layers", L)
    if mt == "glm4_moe":
        E, k, ei = _req(cfg, "n_routed_experts"), _req(cfg, "num_experts_per_tok"), _req(cfg, "moe_intermediate_size")
        shared = int(cfg.get("n_shared_experts") or 0) * ei
        first = min(int(cfg.get("first_k_dense_replace", 1) or 0), L)
        moe_layers = list(range(first, L))
        qkv_bias, o_bias, mlp_bias = bool(cfg.get("attention_bias", False)), False, False
        qk_norm = 2 * hd if cfg.get("use_qk_norm") else 0
        bias_params = 0
    else:
        E, k, ei = _req(cfg, "moe_num_experts"), _req(cfg, "moe_k"), _req(cfg, "moe_intermediate_size")
        shared = int(cfg.get("moe_num_shared_experts") or 0) * ei
        start, end = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_end_index", -1))
        step = int(cfg.get("moe_layer_interval", 1) or 1)
        end = L - 1 if end < 0 else min(end, L - 1)
        moe_layers = [l for l in range(start, end + 1) if (l - start) % step == 0]
        qkv_bias = o_bias = mlp_bias = bool(cfg.get("use_bias", False))
        qk_norm = 0
        bias_params = E  # moe_statics.e_score_correction_bias: an fp32 parameter
    nm, nd = len(moe_layers), L - len(moe_layers)
    attention(lay, h, a, kvh, hd, qkv_bias, o_bias)
    lay.add("qk_norms", qk_norm * L)
    if nd:
        gated_mlp(lay, "mlp", h, i, mlp_bias, "mlp", nd)
    lay.add("experts", nm * E * 3 * ei * h)
    lay.add("router", nm * (E * h + bias_params))
    if shared and nm:
        gated_mlp(lay, "mlp.shared_experts", h, shared, mlp_bias, "shared_expert", nm)
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, mt == "ernie4_5_moe")
    moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=nm,
                  shared_expert_intermediate_size=shared, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                  moe_layers=tuple(moe_layers))
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation=_act(cfg), norm_kind="rmsnorm", default_attn="sdpa",
        moe=moe, family="qwen3_moe", fp32_params=nm * (E * h + bias_params),
    )


# ----------------------------------------------------------------------------------------------
# GPT-Neo (GPTNeoForCausalLM): learned positions, alternating global and local (windowed) attention


@_family("gpt_neo")
def _gpt_neo(cfg: dict, name: str, source: str) -> ModelSpec:
    """gpt-neo-125m/1.3B/2.7B: ``attn.attention.q/k/v_proj`` (no bias), ``out_proj`` (bias), ``mlp.c_fc/c_proj``
    (nn.Linear with bias), LayerNorms, learned positions, a tied head. Its attention is eager by default (no SDPA
    class), with the scores in fp32."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_layers", "num_hidden_layers")
    a = _req(cfg, "num_heads", "num_attention_heads")
    P = _req(cfg, "max_position_embeddings")
    i = int(cfg.get("intermediate_size") or 4 * h)
    lay = _Layers("transformer.h", L)
    mha_and_mlp(lay, "attn.attention", "out_proj", ("mlp.c_fc", "mlp.c_proj"), h, i, False, True, True)
    tie = learned_positions(cfg, lay, V, h, P)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=i, max_position_embeddings=P, tie_word_embeddings=tie, mlp_kind="plain",
        activation=_act(cfg, "activation_function", "gelu_new"), norm_kind="layernorm", default_attn="eager",
        family="gpt_neo",
    )


# ----------------------------------------------------------------------------------------------
# Gemma 3's image-text model (Gemma3ForConditionalGeneration, model_type gemma3)

#: SiglipVisionConfig's defaults for the keys a Gemma 3 vision_config may leave out.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "vision_use_head": True}


def _siglip(vc: dict, text_hidden: int, lay: _Layers) -> int:
    """SigLIP's vision tower and Gemma 3's projector: its Linears (role ``vision``: peft's all-linear and names
    such as q_proj reach them; a text-only step never runs them) and the rest as parameters; returns its layers."""
    v = dict(SIGLIP_DEFAULTS)
    v.update(vc)
    d, vi, vl = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"])
    prefix = "model.vision_tower.encoder.layers.*."
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        lay.linear(prefix + f"self_attn.{p}", d, d, True, "vision", count=vl, top=True)
    lay.linear(prefix + "mlp.fc1", d, vi, True, "vision", count=vl, top=True)
    lay.linear(prefix + "mlp.fc2", vi, d, True, "vision", count=vl, top=True)
    patches = (int(v["image_size"]) // int(v["patch_size"])) ** 2
    n = int(v["num_channels"]) * int(v["patch_size"]) ** 2 * d + d + patches * d  # patch conv, positions
    n += vl * 2 * 2 * d + 2 * d  # layer_norm1/2 per layer, post_layernorm
    if v.get("vision_use_head"):  # the attention-pooling head (Gemma 3's configs: none)
        n += d + 3 * d * d + 3 * d + 2 * d
        lay.linear("model.vision_tower.head.attention.out_proj", d, d, True, "vision", count=1, top=True)
        lay.linear("model.vision_tower.head.mlp.fc1", d, vi, True, "vision", count=1, top=True)
        lay.linear("model.vision_tower.head.mlp.fc2", vi, d, True, "vision", count=1, top=True)
    n += d * text_hidden + d  # multi_modal_projector: mm_input_projection_weight, mm_soft_emb_norm
    lay.add("vision_tower", n)
    return vl


@_family("gemma3")
def _gemma3(cfg: dict, name: str, source: str) -> ModelSpec:
    """Gemma 3 4B/12B/27B as ``AutoModelForCausalLM`` loads them (Gemma3ForConditionalGeneration): the Gemma 3
    text tower under ``model.language_model`` (every activation, the LoRA a text fine-tune trains) and the
    SigLIP vision tower with its projector (weights on the GPU, quantized with the rest under QLoRA, adapted
    by all-linear; no activations: a text-only step never runs it)."""
    text = gemma3_text_config(cfg)
    spec = FAMILIES["gemma3_text"](text, name, source)  # the Llama-shaped builder (model/architecture.py)
    lay = _Layers("model.language_model.layers", spec.num_layers)
    for l in spec.linears:
        path = l.path if l.role == "head" else l.path.replace("model.layers.", "model.language_model.layers.", 1)
        lay.linears.append(LinearSpec(l.name, path, l.in_features, l.out_features, l.bias, l.count, l.role))
    lay.other = dict(spec.other_params)
    _siglip(cfg.get("vision_config") or {}, spec.hidden_size, lay)
    out = _spec(
        dict(cfg), name, source, lay, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, mlp_kind=spec.mlp_kind, activation=spec.activation,
        norm_kind=spec.norm_kind, default_attn=spec.default_attn, family="gemma3_text",
    )
    return out


