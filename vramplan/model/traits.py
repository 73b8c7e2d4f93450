"""Family traits: the config keys that change what autograd saves, read once from a built ModelSpec
(``vramplan/estimator/activations.py`` reads the traits, never the raw config)."""

from __future__ import annotations

from .modelspec import FamilyTraits, MlaDims, ModelSpec


def _p(cfg: dict, *keys: str) -> float:
    return max(float(cfg.get(k) or 0.0) for k in keys)


def family_traits(spec: ModelSpec) -> FamilyTraits:
    """The traits of ``spec``'s family, from its config (``spec.config``) and its built shape:
    norm style and count, parallel blocks, fused q/k/v, RoPE, q/k norms, dropout masks, sliding
    window layers, soft-capping and DeepSeek-V2's latent attention widths."""
    f, cfg = spec.family, spec.config
    norm = {"gemma": "rms_fp32_mul", "gemma2": "rms_fp32_mul", "gemma3_text": "rms_fp32_mul",
            "olmo2": "rms_fp32_mul", "cohere": "cohere"}.get(f, "layernorm" if spec.norm_kind == "layernorm" else "rms")
    norms = {"gemma2": 4, "gemma3_text": 4, "glm4": 4, "cohere": 1, "gptj": 1, "phi": 1}.get(f, 2)
    parallel = f in ("cohere", "gptj", "phi") or (f == "stablelm" and bool(cfg.get("use_parallel_residual")))
    if f == "stablelm" and parallel:
        norms = 1
    qk_rows = 0
    if f in ("qwen3", "qwen3_moe", "gemma3_text"):
        qk_rows = spec.num_heads + spec.num_kv_heads
    elif f == "olmo2":
        qk_rows = 2
    masks, embed_drop = 0, False
    if f in ("gpt2", "gptj", "phi3", "phi"):
        masks, embed_drop = 2 * (_p(cfg, "resid_pdrop") > 0), _p(cfg, "embd_pdrop") > 0
    elif f == "starcoder2":
        masks, embed_drop = 2 * (_p(cfg, "residual_dropout") > 0), _p(cfg, "embedding_dropout") > 0
    elif f == "gpt_neox":
        masks = 2 * (_p(cfg, "hidden_dropout") > 0)
    elif f == "stablelm":
        masks = 1 * (_p(cfg, "hidden_dropout") > 0)
    mla = None
    if f == "deepseek_v2":
        mla = MlaDims(qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                      v_head_dim=cfg["v_head_dim"], kv_lora_rank=cfg["kv_lora_rank"],
                      q_lora_rank=cfg.get("q_lora_rank", 1536) or 0)
    return FamilyTraits(
        norm=norm, norms_per_layer=norms, shared_norm=parallel,
        fused_qkv=any(l.name in ("qkv_proj", "query_key_value", "c_attn") for l in spec.linears),
        rope=f != "gpt2", rope_bytes=4 if f == "olmo2" else 0, rope_dim=_rope_dim(spec),
        qk_norm_rows=qk_rows, dropout_masks_per_layer=masks, embedding_dropout=embed_drop,
        sliding_window=int(cfg.get("sliding_window") or 0), sliding_layers=_sliding_layers(spec),
        attn_softcapping=bool(cfg.get("attn_logit_softcapping")) and f == "gemma2",
        final_logit_softcapping=bool(cfg.get("final_logit_softcapping")), mla=mla,
    )


def _sliding_layers(spec: ModelSpec) -> int:
    """Layers with sliding-window attention, as transformers' config classes lay them out."""
    cfg, L, f = spec.config, spec.num_layers, spec.family
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


def _rope_dim(spec: ModelSpec) -> int | None:
    """Width of the cos/sin tables where it is not the whole head (None)."""
    cfg = spec.config
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
    if spec.family in ("glm", "glm4"):  # GlmConfig/Glm4Config default partial_rotary_factor 0.5
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        return int(spec.head_dim * float(factor))
    return None
