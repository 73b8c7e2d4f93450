"""config.json -> ModelSpec for Liquid AI's LFM2 (``lfm2``: LFM2-350M/700M/1.2B/2.6B), a hybrid decoder.

Most of its layers are gated short-convolution blocks (``conv``: Lfm2ShortConv, ``in_proj`` h -> 3h giving
B, C and x, ``B * x`` through a depthwise causal Conv1d of kernel ``conv_L_cache``, ``C *`` its output,
``out_proj``), the others grouped-query attention with per-head q/k RMSNorms (``self_attn.q/k/v_proj``,
``out_proj``, ``q_layernorm``, ``k_layernorm``); every layer has a SwiGLU ``feed_forward`` (``w1``, ``w3``,
``w2``) whose width Lfm2MLP may adjust, two RMSNorms (``operator_norm``, ``ffn_norm``), and the model a final
``embedding_norm`` and a head tied to the embedding by default. Read off transformers 5.24's
``models/lfm2/modeling_lfm2.py`` and ``configuration_lfm2.py`` (its defaults and the legacy keys it maps:
``block_ff_dim`` -> intermediate_size, ``tie_embedding`` -> tie_word_embeddings, ``full_attn_idxs`` ->
layer_types); ``tests/test_catalogue_models.py`` holds the count against transformers' own Lfm2ForCausalLM
on the meta device. The conv blocks' Linears have role ``conv`` (their saved activations:
``vramplan/estimator/short_conv.py``).
"""

from __future__ import annotations

from ..specs import SpecError
from .builders import Layers as _Layers
from .builders import family as _family
from .builders import head as _head
from .builders import req as _req
from .builders import spec as _spec
from .modelspec import ModelSpec

#: Lfm2Config's defaults (transformers 5.24) for the keys a config may leave out
LFM2_DEFAULTS = {"vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
                 "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0}


def lfm2_layer_types(cfg: dict, num_layers: int) -> list[str]:
    """``conv`` or ``full_attention`` per layer, as Lfm2Config lays them out: ``layer_types`` when the config
    has it, else the layers in ``full_attn_idxs`` are attention (every layer when that is absent too)."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        if len(types) < num_layers or any(t not in ("conv", "full_attention") for t in types[:num_layers]):
            raise SpecError(f"config.json: layer_types must name 'conv' or 'full_attention' for each of the "
                            f"{num_layers} layers; got {types!r}")
        return list(types[:num_layers])
    idxs = cfg.get("full_attn_idxs")
    if idxs is None:
        idxs = range(num_layers)
    elif not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs):
        raise SpecError(f"config.json: full_attn_idxs must be a list of layer indices; got {idxs!r}")
    attn = set(idxs)
    return ["full_attention" if i in attn else "conv" for i in range(num_layers)]


def lfm2_ffn_width(cfg: dict) -> int:
    """Lfm2MLP's width: ``intermediate_size`` (``block_ff_dim`` in the released files), which with
    ``block_auto_adjust_ff_dim`` (default true) becomes int(2/3 of it), times ``block_ffn_dim_multiplier``
    and rounded up to ``block_multiple_of`` (both only when the multiplier is not null)."""
    i = _req(cfg, "block_ff_dim", "intermediate_size") if ("block_ff_dim" in cfg or "intermediate_size" in cfg) \
        else LFM2_DEFAULTS["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim", True):
        i = int(2 * i / 3)
        mult = cfg.get("block_ffn_dim_multiplier", LFM2_DEFAULTS["block_ffn_dim_multiplier"])
        if mult is not None:
            if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
                raise SpecError(f"config.json: block_ffn_dim_multiplier must be a positive number; got {mult!r}")
            m = int(cfg.get("block_multiple_of") or LFM2_DEFAULTS["block_multiple_of"])
            i = int(mult * i)
            i = m * ((i + m - 1) // m)
    if i <= 0:
        raise SpecError(f"config.json: the LFM2 feed-forward width comes out as {i}")
    return i


@_family("lfm2")
def _lfm2(cfg: dict, name: str, source: str) -> ModelSpec:
    full = dict(LFM2_DEFAULTS)
    full.update({k: v for k, v in cfg.items() if v is not None})
    V, h, L = _req(full, "vocab_size"), _req(full, "hidden_size"), _req(full, "num_hidden_layers")
    a = _req(full, "num_attention_heads")
    kvh = _req(full, "num_key_value_heads")
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of num_key_value_heads ({kvh})")
    hd = int(full.get("head_dim") or h // a)
    K = _req(full, "conv_L_cache")
    bias = bool(full.get("conv_bias", False))
    i = lfm2_ffn_width(cfg)
    types = lfm2_layer_types(cfg, L)
    na = types.count("full_attention")
    nc = L - na
    lay = _Layers("model.layers", L)
    if na:
        lay.linear("self_attn.q_proj", h, a * hd, False, "attn", na)
        lay.linear("self_attn.k_proj", h, kvh * hd, False, "attn", na)
        lay.linear("self_attn.v_proj", h, kvh * hd, False, "attn", na)
        lay.linear("self_attn.out_proj", a * hd, h, False, "attn", na)
        lay.add("qk_norms", 2 * hd * na)  # q_layernorm, k_layernorm: RMSNorm(head_dim)
    if nc:
        lay.linear("conv.in_proj", h, 3 * h, bias, "conv", nc)
        lay.linear("conv.out_proj", h, h, bias, "conv", nc)
        lay.add("short_conv", nc * (h * K + (h if bias else 0)))  # depthwise Conv1d: h x 1 x K (+ bias)
    lay.linear("feed_forward.w1", h, i, False, "mlp")
    lay.linear("feed_forward.w3", h, i, False, "mlp")
    lay.linear("feed_forward.w2", i, h, False, "mlp")
    lay.add("norms", (2 * L + 1) * h)  # operator_norm, ffn_norm; the final embedding_norm
    lay.add("embed_tokens", V * h)
    tied = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))  # LFM2's own key first
    tie = _head({**cfg, "tie_word_embeddings": tied}, lay, V, h, True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(full.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation="silu", norm_kind="rmsnorm", default_attn="sdpa",
        family="lfm2",
    )


@_family("lfm2_moe")
def _lfm2_moe(cfg: dict, name: str, source: str) -> ModelSpec:
    """LFM2-8B-A1B (Lfm2MoeForCausalLM, transformers 5.24's modeling_lfm2_moe.py): LFM2's conv and attention
    layers; the first ``num_dense_layers`` feed-forwards are SwiGLU MLPs of ``intermediate_size`` (no width
    adjustment), the others sparse blocks: a sigmoid router (``gate.weight``, an E x h parameter, not an
    nn.Linear; its ``expert_bias`` a buffer), fused experts ``gate_up_proj`` (E x 2 ei x h) and ``down_proj``
    (E x h x ei). transformers converts the checkpoint's per-expert w1/w3/w2 with a mapping of its own, not the
    qwen2_moe or mixtral pattern peft rewrites, so all-linear adapts the nn.Linear modules only."""
    from .modelspec import MoeSpec

    defaults = {"vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3,
                "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32, "max_position_embeddings": 128000}
    full = dict(defaults)
    full.update({k: v for k, v in cfg.items() if v is not None})
    V, h, L = _req(full, "vocab_size"), _req(full, "hidden_size"), _req(full, "num_hidden_layers")
    a, kvh = _req(full, "num_attention_heads"), _req(full, "num_key_value_heads")
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of num_key_value_heads ({kvh})")
    if not isinstance(cfg.get("layer_types"), list):
        raise SpecError("config.json: an lfm2_moe config needs layer_types ('conv' or 'full_attention' per layer); "
                        "Lfm2MoeConfig derives none")
    hd = int(full.get("head_dim") or h // a)
    K = _req(full, "conv_L_cache")
    bias = bool(full.get("conv_bias", False))
    i, ei = _req(full, "intermediate_size"), _req(full, "moe_intermediate_size")
    E, k = _req(full, "num_experts"), _req(full, "num_experts_per_tok")
    if k > E:
        raise SpecError(f"config.json: num_experts_per_tok ({k}) exceeds num_experts ({E})")
    nd = min(int(full.get("num_dense_layers") or 0), L)
    nm = L - nd
    types = lfm2_layer_types(cfg, L)
    na = types.count("full_attention")
    nc = L - na
    lay = _Layers("model.layers", L)
    if na:
        lay.linear("self_attn.q_proj", h, a * hd, False, "attn", na)
        lay.linear("self_attn.k_proj", h, kvh * hd, False, "attn", na)
        lay.linear("self_attn.v_proj", h, kvh * hd, False, "attn", na)
        lay.linear("self_attn.out_proj", a * hd, h, False, "attn", na)
        lay.add("qk_norms", 2 * hd * na)
    if nc:
        lay.linear("conv.in_proj", h, 3 * h, bias, "conv", nc)
        lay.linear("conv.out_proj", h, h, bias, "conv", nc)
        lay.add("short_conv", nc * (h * K + (h if bias else 0)))
    if nd:
        lay.linear("feed_forward.w1", h, i, False, "mlp", nd)
        lay.linear("feed_forward.w3", h, i, False, "mlp", nd)
        lay.linear("feed_forward.w2", i, h, False, "mlp", nd)
    lay.add("experts", nm * E * 3 * ei * h)
    lay.add("router", nm * E * h)
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tied = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))  # LFM2's own key first
    tie = _head({**cfg, "tie_word_embeddings": tied}, lay, V, h, True)
    moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=nm,
                  norm_topk_prob=bool(full.get("norm_topk_prob", True)), moe_layers=tuple(range(nd, L)))
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=i, max_position_embeddings=int(full.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation="silu", norm_kind="rmsnorm", default_attn="sdpa",
        moe=moe, family="lfm2",
    )
