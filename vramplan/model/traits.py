"""Family traits: the config keys that change what autograd saves, read once from a built ModelSpec
(``vramplan/estimator/activations.py`` reads the traits, never the raw config)."""

from __future__ import annotations

from .modelspec import FamilyTraits, MlaDims, ModelSpec
from .textconfig import falcon_norms, text_config

#: the names of a Linear that computes q, k and v in one projection
_FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "wqkv", "W_pack", "Wqkv")
#: families with learned positions instead of RoPE
_NO_ROPE = ("gpt2", "gpt_bigcode", "opt", "gpt_neo", "bloom", "mpt")  # (BLOOM, MPT: ALiBi, model/families_alibi.py)


def _p(cfg: dict, *keys: str) -> float:
    return max(float(cfg.get(k) or 0.0) for k in keys)


def family_traits(spec: ModelSpec) -> FamilyTraits:
    """The traits of ``spec``'s family, from its config (``spec.config``) and its built shape:
    norm style and count, parallel blocks, fused q/k/v, RoPE, q/k norms, dropout masks, sliding
    window layers, soft-capping and DeepSeek-V2's latent attention widths."""
    f, cfg = spec.family, text_config(spec.config)
    norm = {"gemma": "rms_fp32_mul", "gemma2": "rms_fp32_mul", "gemma3_text": "rms_fp32_mul",
            "olmo2": "rms_fp32_mul", "olmo3": "rms_fp32_mul", "cohere": "cohere", "cohere2": "cohere",
            "mpt": "layernorm",  # (F.layer_norm without its bias: the same saves)
            }.get(f, "layernorm" if spec.norm_kind == "layernorm" else "rms")
    norms = {"gemma2": 4, "gemma3_text": 4, "glm4": 4, "cohere": 1, "cohere2": 1, "gptj": 1, "phi": 1}.get(f, 2)
    parallel = f in ("cohere", "cohere2", "gptj", "phi") or (f == "stablelm" and bool(cfg.get("use_parallel_residual")))
    if f == "stablelm" and parallel:
        norms = 1
    if f == "falcon":  # one LayerNorm feeding both branches (falcon-7b), or ln_attn and ln_mlp (falcon-40b/180B)
        norms = falcon_norms(cfg)
        parallel = norms == 1
    qk_rows = 0
    if spec.model_type in ("glm4_moe", "ernie4_5_moe"):  # per-head q/k norms where GLM's use_qk_norm says so
        qk_rows = (spec.num_heads + spec.num_kv_heads) * bool(cfg.get("use_qk_norm"))
    elif f in ("qwen3", "qwen3_moe", "gemma3_text") and spec.model_type != "olmoe":
        qk_rows = spec.num_heads + spec.num_kv_heads
    elif f in ("olmo2", "olmo3") or spec.model_type == "olmoe":  # one norm over the whole q (and k) projection
        qk_rows = 2
    masks, embed_drop = 0, False
    if f in ("gpt2", "gptj", "phi3", "phi", "gpt_bigcode"):
        masks, embed_drop = 2 * (_p(cfg, "resid_pdrop") > 0), _p(cfg, "embd_pdrop") > 0
    elif f == "gpt_neo":
        masks, embed_drop = 2 * (_p(cfg, "resid_dropout") > 0), _p(cfg, "embed_dropout") > 0
    elif f == "opt":  # after the attention and after fc2
        masks = 2 * (_p(cfg, "dropout") > 0)
    elif f == "falcon":  # dropout_add at the block's end (hidden_dropout), and after a sequential attention
        sequential = not cfg.get("parallel_attn", True)
        masks = (_p(cfg, "hidden_dropout") > 0) + (sequential and _p(cfg, "attention_dropout") > 0)
    elif f == "starcoder2":
        masks, embed_drop = 2 * (_p(cfg, "residual_dropout") > 0), _p(cfg, "embedding_dropout") > 0
    elif f in ("gpt_neox", "bloom"):  # (BLOOM: dropout_add after the attention and after the MLP)
        masks = 2 * (_p(cfg, "hidden_dropout") > 0)
    elif f == "mpt":  # resid_attn_dropout and the MLP's dropout, both attn_config.attn_pdrop
        masks = 2 * (_p(cfg.get("attn_config") or {}, "attn_pdrop") > 0)
    elif f == "stablelm":
        masks = 1 * (_p(cfg, "hidden_dropout") > 0)
    mla = None
    if f == "deepseek_v2":
        mla = MlaDims(qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                      v_head_dim=cfg["v_head_dim"], kv_lora_rank=cfg["kv_lora_rank"],
                      q_lora_rank=cfg.get("q_lora_rank", 1536) or 0)
    window, sliding = int(cfg.get("sliding_window") or 0), _sliding_layers(spec)
    rope_bytes = 4 if f in ("olmo2", "olmo3") else 0
    rope_layers: tuple[int, ...] = ()
    if f == "llama4":  # chunked RoPE layers take a mask from attention_chunk_size on, as a window; RoPE's table is one
        # complex64 freqs_cis of head_dim / 2 a position: the bytes of two 2-byte tables of head_dim
        from .families_llama4 import llama4_layout

        rope_layers = tuple(llama4_layout(cfg)[1])
        window = int(cfg.get("attention_chunk_size") or 0)
        sliding, rope_bytes = (sum(rope_layers) if window else 0), 2
    conv_layers: tuple[bool, ...] = ()
    if f == "lfm2":
        from .families_lfm2 import lfm2_layer_types

        conv_layers = tuple(t == "conv" for t in lfm2_layer_types(spec.config, spec.num_layers))
    return FamilyTraits(
        norm=norm, norms_per_layer=norms, shared_norm=parallel,
        fused_qkv=any(l.name in _FUSED_QKV for l in spec.linears),
        rope=f not in _NO_ROPE, rope_bytes=rope_bytes, rope_dim=_rope_dim(spec),
        qk_norm_rows=qk_rows, dropout_masks_per_layer=masks, embedding_dropout=embed_drop,
        sliding_window=window, sliding_layers=sliding,
        attn_softcapping=bool(cfg.get("attn_logit_softcapping")) and f == "gemma2",
        final_logit_softcapping=bool(cfg.get("final_logit_softcapping")), mla=mla,
        conv_layers=conv_layers, rope_layers=rope_layers,
        qk_l2_norm=f == "llama4" and bool(cfg.get("use_qk_norm", True)),
        attn_temperature_tuning=f == "llama4" and bool(cfg.get("attn_temperature_tuning", True)),
    )


def _sliding_layers(spec: ModelSpec) -> int:
    """Layers with sliding-window attention, as transformers' config classes lay them out."""
    cfg, L, f = text_config(spec.config), spec.num_layers, spec.family
    if not cfg.get("sliding_window"):
        return 0
    if isinstance(cfg.get("layer_types"), list):
        return sum(t == "sliding_attention" for t in cfg["layer_types"][:L])
    if f == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return sum((i + 1) % pattern != 0 for i in range(L))
    if f == "gemma2":
        return sum(i % 2 == 0 for i in range(L))
    if f == "cohere2":  # Cohere2Config: every 4th layer full (sliding_window_pattern)
        pattern = int(cfg.get("sliding_window_pattern") or 4)
        return sum((i + 1) % pattern != 0 for i in range(L))
    if f in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        return 0 if not cfg.get("use_sliding_window") else L - min(L, int(cfg.get("max_window_layers") or L))
    return L


def _rope_dim(spec: ModelSpec) -> int | None:
    """Width of the cos/sin tables where it is not the whole head (None)."""
    cfg = text_config(spec.config)
    if spec.family == "gptj":
        return int(cfg.get("rotary_dim") or spec.head_dim) // 2
    if spec.family == "gpt_neox":
        return int(spec.head_dim * float(cfg.get("rotary_pct", 1.0)))
    if spec.family == "stablelm":
        return int(spec.head_dim * float(cfg.get("partial_rotary_factor", 0.25)))
    if spec.family == "deepseek_v2":
        return int(cfg.get("qk_rope_head_dim") or spec.head_dim)
    if spec.family == "phi":  # PhiConfig's partial_rotary_factor defaults to 0.5
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        return int(spec.head_dim * float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))))
    if spec.family in ("glm", "glm4", "nemotron") or spec.model_type == "glm4_moe":  # partial_rotary_factor 0.5
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        return int(spec.head_dim * float(factor))
    return None
