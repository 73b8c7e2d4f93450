"""config.json -> ModelSpec: exact parameter accounting for the families transformers ships.

Each family function reads the config keys transformers' own modeling code reads (with the same
defaults its config class has) and lists every Linear by module name, so LoRA targets and
parameter counts come out exactly; ``tests/test_architecture.py`` builds every shipped profile on
the meta device and asserts equality with ``sum(p.numel())``. Unknown ``model_type``s fall back to
the structure of the model built on the meta device (needs the ``run`` extra).
"""

from __future__ import annotations

import dataclasses

from ..specs import SpecError
from . import (  # noqa: F401  (registers the builders of model/families.py, families_lfm2.py, families_vl.py)
    families,
    families_alibi,  # (BLOOM's and MPT's, model/families_alibi.py)
    families_lfm2,
    families_llama4,  # (Llama 4's and Kimi-K2's, model/families_llama4.py)
    families_vl,
)
from .builders import FAMILIES, gated_mlp, learned_positions, mha_and_mlp
from .builders import Layers as _Layers
from .builders import act as _act
from .builders import family as _family
from .builders import head as _head
from .builders import req as _req
from .builders import spec as _spec
from .modelspec import ModelSpec, MoeSpec, truncate_config
from .traits import family_traits

# ----------------------------------------------------------------------------------------------
# Llama-shaped decoders: embed, L x (attn + mlp + norms), final norm, head


@_family(
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "cohere",
    "stablelm", "starcoder2", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "smollm3", "granite",
    "glm", "glm4", "olmo", "internlm3", "olmo3", "cohere2", "olmoe", "granitemoe", "phimoe", "ernie4_5",
    "helium", "minicpm", "nemotron",
)
def _llama_like(cfg: dict, name: str, source: str) -> ModelSpec:
    mt = cfg["model_type"]
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = int(cfg.get("num_key_value_heads") or a)
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of num_key_value_heads ({kvh})")
    hd = int(cfg.get("head_dim") or h // a)
    i = int(cfg.get("intermediate_size") or 0)
    lay = _Layers("model.layers", L)
    rms, ln, ln_nobias = "rmsnorm", "layernorm", "layernorm_nobias"
    norm_kind, norms_per_layer, act, mlp_kind = rms, 2, _act(cfg), "gated"
    qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    tie_default = mt in ("gemma", "gemma2", "gemma3_text", "cohere", "cohere2", "starcoder2", "smollm3")
    default_attn = "sdpa"
    qk_norm = 0  # parameters of q/k norms per layer
    moe = None

    if mt == "qwen2":
        qkv_bias, o_bias = True, False
    elif mt in ("gemma", "gemma2", "gemma3_text"):
        act = _act(cfg, "hidden_activation" if cfg.get("hidden_activation") else "hidden_act", "gelu_pytorch_tanh")
        if act == "gelu":  # transformers maps Gemma's legacy "gelu" to the tanh approximation
            act = "gelu_tanh"
        hd = int(cfg.get("head_dim") or 256)
        if mt != "gemma":
            norms_per_layer = 4
        if mt == "gemma2":
            default_attn = "eager"
        if mt == "gemma3_text":
            qk_norm = 2 * hd
    elif mt in ("qwen3", "qwen3_moe"):
        qk_norm = 2 * hd
    elif mt == "qwen2_moe":
        qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
    elif mt in ("olmo2", "olmo3", "olmoe"):  # q_norm/k_norm over the whole projection, not per head
        qk_norm = a * hd + kvh * hd
    elif mt == "internlm3":  # InternLM3Config maps qkv_bias -> attention_bias, bias -> mlp_bias (Llama's modeling)
        qkv_bias = o_bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", False)))
        mlp_bias = bool(cfg.get("bias", cfg.get("mlp_bias", False)))
    elif mt == "phimoe":  # LayerNorms with bias, attention_bias, a biased head (lm_head_bias)
        norm_kind = ln
    elif mt == "ernie4_5":  # use_bias: every projection
        qkv_bias = o_bias = mlp_bias = bool(cfg.get("use_bias", False))
    elif mt == "nemotron":  # LayerNorm1P (weight and bias), a non-gated relu2 MLP (up_proj, down_proj)
        norm_kind, mlp_kind, act = ln, "plain", _act(cfg, default="relu2")
        mlp_bias = bool(cfg.get("mlp_bias", False))
    elif mt in ("cohere", "cohere2"):
        norm_kind, norms_per_layer = ln_nobias, 1
        if cfg.get("use_qk_norm"):
            qk_norm = a * hd + kvh * hd
    elif mt == "stablelm":
        norm_kind = ln
        qkv_bias, o_bias = bool(cfg.get("use_qkv_bias", False)), False
        norms_per_layer = 1 if cfg.get("use_parallel_residual") else 2
        if cfg.get("qk_layernorm"):
            qk_norm = a * hd + kvh * hd  # per-head LayerNorms without bias
    elif mt == "starcoder2":
        norm_kind, mlp_kind = ln, "plain"
        qkv_bias = o_bias = mlp_bias = bool(cfg.get("use_bias", True))
        act = _act(cfg, default="gelu_pytorch_tanh")
    elif mt == "phi3":
        qkv_bias = o_bias = False
    elif mt == "olmo":
        norm_kind = "layernorm_nobias"
        if cfg.get("clip_qkv") is not None:  # clamp_ on q, k and v: no recipe here, as before (meta fallback)
            from ..run.meta import model_spec_from_meta

            return model_spec_from_meta(cfg, name=name, source=source)
    elif mt in ("glm", "glm4"):  # GlmConfig/Glm4Config: q/k/v biases, fused gate_up, head_dim 128 by default
        qkv_bias, o_bias = bool(cfg.get("attention_bias", True)), False
        hd = int(cfg.get("head_dim") or 128)
        if mt == "glm4":  # post_self_attn_layernorm and post_mlp_layernorm
            norms_per_layer = 4

    # attention
    if mt == "phi3":
        lay.linear("self_attn.qkv_proj", h, a * hd + 2 * kvh * hd, False, "attn")
    else:
        lay.linear("self_attn.q_proj", h, a * hd, qkv_bias, "attn")
        lay.linear("self_attn.k_proj", h, kvh * hd, qkv_bias, "attn")
        lay.linear("self_attn.v_proj", h, kvh * hd, qkv_bias, "attn")
    lay.linear("self_attn.o_proj", a * hd, h, o_bias, "attn")
    lay.add("qk_norms", qk_norm * L)

    # mlp (dense, MoE, or a mix)
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe"):
        E = _req(cfg, "num_local_experts", "num_experts")
        k = _req(cfg, "num_experts_per_tok")
        per_expert = mt in ("mixtral", "olmoe", "granitemoe", "phimoe")  # intermediate_size is one expert's
        ei = _req(cfg, "intermediate_size") if per_expert else _req(cfg, "moe_intermediate_size")
        if per_expert:
            moe_layers = list(range(L))
        else:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = [l for l in range(L) if l not in only and (l + 1) % step == 0]
        nm, nd = len(moe_layers), L - len(moe_layers)
        shared_i = int(cfg.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
        lay.add("experts", nm * (E * 2 * ei * h + E * h * ei))
        if mt == "phimoe":  # PhimoeSparseMoeBlock's router is an nn.Linear (all-linear adapts it)
            lay.linear("mlp.router", h, E, False, "router", nm)
        else:
            lay.add("router", nm * E * h)
        if shared_i:
            lay.linear("mlp.shared_expert.gate_proj", h, shared_i, False, "shared_expert", nm)
            lay.linear("mlp.shared_expert.up_proj", h, shared_i, False, "shared_expert", nm)
            lay.linear("mlp.shared_expert.down_proj", shared_i, h, False, "shared_expert", nm)
            lay.linear("mlp.shared_expert_gate", h, 1, False, "router", nm)
        if nd:
            lay.linear("mlp.gate_proj", h, i, False, "mlp", nd)
            lay.linear("mlp.up_proj", h, i, False, "mlp", nd)
            lay.linear("mlp.down_proj", i, h, False, "mlp", nd)
        moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=nm,
                      shared_expert_intermediate_size=shared_i, gated_shared_expert=bool(shared_i),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", mt in ("mixtral", "granitemoe", "phimoe"))),
                      moe_layers=tuple(moe_layers))
    elif mt in ("phi3", "glm", "glm4"):
        lay.linear("mlp.gate_up_proj", h, 2 * _req(cfg, "intermediate_size"), False, "mlp")
        lay.linear("mlp.down_proj", i, h, False, "mlp")
    elif mlp_kind == "plain":
        up, down = ("up_proj", "down_proj") if mt == "nemotron" else ("c_fc", "c_proj")
        lay.linear(f"mlp.{up}", h, _req(cfg, "intermediate_size"), mlp_bias, "mlp")
        lay.linear(f"mlp.{down}", i, h, mlp_bias, "mlp")
    else:
        i = _req(cfg, "intermediate_size")
        lay.linear("mlp.gate_proj", h, i, mlp_bias, "mlp")
        lay.linear("mlp.up_proj", h, i, mlp_bias, "mlp")
        lay.linear("mlp.down_proj", i, h, mlp_bias, "mlp")

    per_norm = 2 * h if norm_kind == ln else h
    if mt == "olmo":  # OlmoLayerNorm: F.layer_norm in fp32 without weight or bias
        per_norm = 0
    lay.add("norms", (norms_per_layer * L + 1) * per_norm)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, tie_default, bias=mt == "phimoe" and bool(cfg.get("lm_head_bias", False)))
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind=mlp_kind, activation=act, norm_kind=norm_kind,
        default_attn=default_attn, moe=moe, family=_RECIPE.get(mt, mt),
    )


#: model types that run another family's activation recipe (``ModelSpec.family``): OLMoE's sparse block is
#: Qwen3-MoE's (transformers' conversion maps it to the qwen2_moe pattern, so peft adapts its fused experts alike)
_RECIPE = {"olmoe": "qwen3_moe"}


@_family("deepseek_v2", "deepseek_v3")
def _deepseek_v2(cfg: dict, name: str, source: str) -> ModelSpec:
    """DeepSeek-V2 and V3 (V3's sigmoid router with its fp32 correction bias, a buffer, is the same tensors;
    its config defaults norm_topk_prob to true)."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = int(cfg.get("num_key_value_heads") or a)
    nope, rope, vd = _req(cfg, "qk_nope_head_dim"), _req(cfg, "qk_rope_head_dim"), _req(cfg, "v_head_dim")
    kv_rank = _req(cfg, "kv_lora_rank")
    q_rank = cfg.get("q_lora_rank", 1536)  # DeepseekV2Config's default when the key is absent
    bias = bool(cfg.get("attention_bias", False))
    lay = _Layers("model.layers", L)
    if q_rank:
        lay.linear("self_attn.q_a_proj", h, q_rank, bias, "attn")
        lay.add("norms", q_rank * L)
        lay.linear("self_attn.q_b_proj", q_rank, a * (nope + rope), False, "attn")
    else:
        lay.linear("self_attn.q_proj", h, a * (nope + rope), False, "attn")
    lay.linear("self_attn.kv_a_proj_with_mqa", h, kv_rank + rope, bias, "attn")
    lay.add("norms", kv_rank * L)
    lay.linear("self_attn.kv_b_proj", kv_rank, a * (nope + vd), False, "attn")
    lay.linear("self_attn.o_proj", a * vd, h, bias, "attn")

    i = _req(cfg, "intermediate_size")
    E, k, ei = _req(cfg, "n_routed_experts"), _req(cfg, "num_experts_per_tok"), _req(cfg, "moe_intermediate_size")
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    nd = min(first_dense, L)
    nm = L - nd
    shared = int(cfg.get("n_shared_experts") or 0) * ei
    if nd:
        gated_mlp(lay, "mlp", h, i, False, "mlp", nd)
    lay.add("experts", nm * E * 3 * ei * h)
    lay.add("router", nm * E * h)  # DeepseekV2TopkRouter keeps its weight in fp32
    fp32 = nm * E * h
    if shared and nm:
        gated_mlp(lay, "mlp.shared_experts", h, shared, False, "shared_expert", nm)
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, False)
    moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=nm,
                  shared_expert_intermediate_size=shared,
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg["model_type"] == "deepseek_v3")),
                  moe_layers=tuple(range(nd, L)))
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=nope + rope, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation=_act(cfg), norm_kind="rmsnorm",
        default_attn="sdpa", moe=moe, family="deepseek_v2", fp32_params=fp32,
    )


# ----------------------------------------------------------------------------------------------
# GPT-style decoders with LayerNorm and biases


@_family("gpt_neox")
def _gpt_neox(cfg: dict, name: str, source: str) -> ModelSpec:
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    i = _req(cfg, "intermediate_size")
    bias = bool(cfg.get("attention_bias", True))
    lay = _Layers("gpt_neox.layers", L)
    lay.linear("attention.query_key_value", h, 3 * h, bias, "attn")
    lay.linear("attention.dense", h, h, bias, "attn")
    lay.linear("mlp.dense_h_to_4h", h, i, True, "mlp")
    lay.linear("mlp.dense_4h_to_h", i, h, True, "mlp")
    lay.add("norms", (2 * L + 1) * 2 * h)
    lay.add("embed_tokens", V * h)
    tie = bool(cfg.get("tie_word_embeddings", False))
    if not tie:
        lay.linear("lm_head", h, V, False, "head", count=1, top=True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="plain", activation=_act(cfg, default="gelu"), norm_kind="layernorm",
        default_attn="sdpa", family="gpt_neox",
    )


@_family("phi")
def _phi(cfg: dict, name: str, source: str) -> ModelSpec:
    """Phi-1/1.5/2 (PhiForCausalLM): one LayerNorm feeding parallel attention and MLP, biases everywhere,
    partial RoPE, a biased lm_head."""
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "hidden_size"), _req(cfg, "num_hidden_layers")
    a = _req(cfg, "num_attention_heads")
    kvh = int(cfg.get("num_key_value_heads") or a)
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of num_key_value_heads ({kvh})")
    hd = h // a
    i = _req(cfg, "intermediate_size")
    lay = _Layers("model.layers", L)
    lay.linear("self_attn.q_proj", h, a * hd, True, "attn")
    lay.linear("self_attn.k_proj", h, kvh * hd, True, "attn")
    lay.linear("self_attn.v_proj", h, kvh * hd, True, "attn")
    lay.linear("self_attn.dense", a * hd, h, True, "attn")
    if cfg.get("qk_layernorm"):
        lay.add("qk_norms", 2 * 2 * hd * L)  # q_layernorm and k_layernorm: LayerNorm(head_dim) with bias
    lay.linear("mlp.fc1", h, i, True, "mlp")
    lay.linear("mlp.fc2", i, h, True, "mlp")
    lay.add("norms", (L + 1) * 2 * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, False, bias=True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="plain", activation=_act(cfg, default="gelu_new"), norm_kind="layernorm",
        default_attn="sdpa", family="phi",
    )


@_family("gpt2")
def _gpt2(cfg: dict, name: str, source: str) -> ModelSpec:
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "n_embd", "hidden_size"), _req(cfg, "n_layer", "num_hidden_layers")
    a = _req(cfg, "n_head", "num_attention_heads")
    P = _req(cfg, "n_positions", "max_position_embeddings")
    i = int(cfg.get("n_inner") or 4 * h)
    lay = _Layers("transformer.h", L)
    lay.linear("attn.c_attn", h, 3 * h, True, "attn")
    lay.linear("attn.c_proj", h, h, True, "attn")
    lay.linear("mlp.c_fc", h, i, True, "mlp")
    lay.linear("mlp.c_proj", i, h, True, "mlp")
    tie = learned_positions(cfg, lay, V, h, P)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=i, max_position_embeddings=P, tie_word_embeddings=tie,
        mlp_kind="plain", activation=_act(cfg, "activation_function", "gelu_new"), norm_kind="layernorm",
        default_attn="sdpa", family="gpt2",
    )


@_family("gptj")
def _gptj(cfg: dict, name: str, source: str) -> ModelSpec:
    V, h, L = _req(cfg, "vocab_size"), _req(cfg, "n_embd", "hidden_size"), _req(cfg, "n_layer", "num_hidden_layers")
    a = _req(cfg, "n_head", "num_attention_heads")
    i = int(cfg.get("n_inner") or 4 * h)
    lay = _Layers("transformer.h", L)
    mha_and_mlp(lay, "attn", "out_proj", ("mlp.fc_in", "mlp.fc_out"), h, i, False, False, True)
    lay.add("norms", (L + 1) * 2 * h)
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, False, bias=True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=i, max_position_embeddings=int(cfg.get("n_positions") or 0),
        tie_word_embeddings=tie, mlp_kind="plain", activation=_act(cfg, "activation_function", "gelu_new"),
        norm_kind="layernorm", default_attn="sdpa", family="gptj",
    )


# ----------------------------------------------------------------------------------------------


def model_spec_from_config(config: dict, *, name: str | None = None, source: str = "") -> ModelSpec:
    """Build a ModelSpec from an HF config dict (the parsed config.json), its family traits included."""
    from .rawinput import check_model_config  # the input layer: kinds and bounds of every value read here

    where = source if source and not source.startswith(("profile:", "hub:")) else "config.json"
    mt = check_model_config(config, where)["model_type"]
    if isinstance(config.get("text_config"), dict) and mt not in FAMILIES:
        raise SpecError(f"model_type {mt!r} is multimodal; pass its text model's config (text_config)")
    name = name or str(config.get("_name_or_path") or mt)
    builder = FAMILIES.get(mt)
    if builder is None:
        from ..run.meta import model_spec_from_meta

        spec = model_spec_from_meta(config, name=name, source=source)
    else:
        spec = builder(config, name, source)
    return dataclasses.replace(spec, traits=family_traits(spec))


def with_layers(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """A truncated copy of ``spec`` with ``num_layers`` decoder layers (for tests and tracing)."""
    cfg = truncate_config(spec.config, num_layers)
    return model_spec_from_config(cfg, name=f"{spec.name}[:{num_layers}]", source=spec.source)
