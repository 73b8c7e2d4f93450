"""config.json -> ModelSpec for image-text models whose text tower is a decoder vramplan already models (issue 29):
Qwen2-VL and Qwen2.5-VL (a Qwen2 text tower), Qwen3-VL dense (a Qwen3 text tower) and Mistral 3 (Mistral Small
3.1/3.2: a Mistral text tower, the Pixtral vision tower and its projector).

Modelled as Gemma 3's image-text model (model/families.py ``gemma3``): the text tower under
``model.language_model`` (every activation; the LoRA a text fine-tune trains), the vision tower and its projector
listed with role ``vision`` (weights on the GPU, quantized with the rest under QLoRA, adapted by all-linear and by
the module names they share with the text tower, such as Qwen2.5-VL's and Pixtral's gate_proj/up_proj/down_proj;
no activations: a text-only step never runs them). The text tower's config is read by model/textconfig.py (its
``text_config``, or the flat keys of the Hub's Qwen2-VL/Qwen2.5-VL files). Each count is held against transformers
5.24's own model built on the meta device in tests/test_catalogue_models.py.
"""

from __future__ import annotations

from ..specs import SpecError
from .builders import FAMILIES
from .builders import Layers as _Layers
from .builders import family as _family
from .builders import spec as _spec
from .modelspec import LinearSpec, ModelSpec
from .textconfig import mistral3_text_config, qwen_vl_text_config

#: the builder (model/architecture.py) of each text tower's model_type
_TEXT_BUILDER = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "mistral": "mistral",
                 "llama": "llama"}

#: the vision configs' class defaults (transformers 5.24) for the keys a config may leave out
QWEN2_VL_VISION_DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                            "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN2_5_VL_VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
                              "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "out_hidden_size": 3584}
QWEN3_VL_VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                            "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                            "out_hidden_size": 3584, "num_position_embeddings": 2304,
                            "deepstack_visual_indexes": [8, 16, 24]}
PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "num_channels": 3, "patch_size": 16}


def _vision(vc: dict, defaults: dict) -> dict:
    v = dict(defaults)
    v.update({k: val for k, val in vc.items() if val is not None})
    if "in_chans" in vc and "in_channels" not in vc:  # the Hub's pre-v5 name
        v["in_channels"] = vc["in_chans"]
    return v


def _int(v: dict, key: str) -> int:
    val = v.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise SpecError(f"config.json: vision_config.{key} must be a positive integer; got {val!r}")
    return val


def _text_tower(cfg: dict, text: dict, name: str, source: str) -> tuple[ModelSpec, _Layers]:
    """The text tower's spec from its own builder, its Linears moved under ``model.language_model``."""
    builder = _TEXT_BUILDER.get(str(text.get("model_type")))
    if builder is None:
        raise SpecError(f"model_type {cfg.get('model_type')!r} with a {text.get('model_type')!r} text model is not "
                        f"modelled (text models: {', '.join(sorted(_TEXT_BUILDER))})")
    spec = FAMILIES[builder](dict(text, model_type=builder), name, source)
    lay = _Layers("model.language_model.layers", spec.num_layers)
    for l in spec.linears:
        path = l.path if l.role == "head" else l.path.replace("model.layers.", "model.language_model.layers.", 1)
        lay.linears.append(LinearSpec(l.name, path, l.in_features, l.out_features, l.bias, l.count, l.role))
    lay.other = dict(spec.other_params)
    return spec, lay


def _finish(cfg: dict, name: str, source: str, spec: ModelSpec, lay: _Layers, family: str = "") -> ModelSpec:
    return _spec(
        dict(cfg), name, source, lay, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, mlp_kind=spec.mlp_kind, activation=spec.activation,
        norm_kind=spec.norm_kind, default_attn=spec.default_attn, family=family or spec.family,
    )


def _vl(lay: _Layers, path: str, d_in: int, d_out: int, bias: bool, count: int = 1) -> None:
    lay.linear(path, d_in, d_out, bias, "vision", count=count, top=True)


# ----------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL (Qwen2VLForConditionalGeneration and its successors)


@_family("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
def _qwen_vl(cfg: dict, name: str, source: str) -> ModelSpec:
    """Qwen2-VL 2B/7B/72B, Qwen2.5-VL 3B/7B/32B/72B and Qwen3-VL 2B/4B/8B as AutoModelForImageTextToText loads them:
    the Qwen2 (Qwen3 for Qwen3-VL) text tower and the ``model.visual`` ViT with its patch merger(s). The M-RoPE
    recomposes its three position sections inside the rotary embedding (transformers 5.24), so each layer reads one
    (b, s, head_dim) cos/sin pair, as RoPE's; a text-only step's positions are the same in all three sections."""
    mt = cfg["model_type"]
    spec, lay = _text_tower(cfg, qwen_vl_text_config(cfg), name, source)
    vc = cfg.get("vision_config") or {}
    if mt == "qwen2_vl":
        v = _vision(vc, QWEN2_VL_VISION_DEFAULTS)
        d, n, out = _int(v, "embed_dim"), _int(v, "depth"), _int(v, "hidden_size")
        i = d * _int(v, "mlp_ratio")
        blocks = "model.visual.blocks.*."
        _vl(lay, blocks + "attn.qkv", d, 3 * d, True, n)
        _vl(lay, blocks + "attn.proj", d, d, True, n)
        _vl(lay, blocks + "mlp.fc1", d, i, True, n)
        _vl(lay, blocks + "mlp.fc2", i, d, True, n)
        norms = n * 2 * 2 * d + 2 * d  # norm1/norm2 LayerNorms per block, the merger's ln_q
    else:
        v = _vision(vc, QWEN2_5_VL_VISION_DEFAULTS if mt == "qwen2_5_vl" else QWEN3_VL_VISION_DEFAULTS)
        d, n, out = _int(v, "hidden_size"), _int(v, "depth"), _int(v, "out_hidden_size")
        i = _int(v, "intermediate_size")
        blocks = "model.visual.blocks.*."
        _vl(lay, blocks + "attn.qkv", d, 3 * d, True, n)
        _vl(lay, blocks + "attn.proj", d, d, True, n)
        if mt == "qwen2_5_vl":  # a gated MLP with biases under the text tower's names; RMSNorms
            for p in ("gate_proj", "up_proj"):
                _vl(lay, blocks + f"mlp.{p}", d, i, True, n)
            _vl(lay, blocks + "mlp.down_proj", i, d, True, n)
            norms = n * 2 * d + d
        else:  # Qwen3-VL: linear_fc1/linear_fc2, LayerNorms
            _vl(lay, blocks + "mlp.linear_fc1", d, i, True, n)
            _vl(lay, blocks + "mlp.linear_fc2", i, d, True, n)
            norms = n * 2 * 2 * d + 2 * d
    m2 = _int(v, "spatial_merge_size") ** 2
    p, t, c = _int(v, "patch_size"), _int(v, "temporal_patch_size"), _int(v, "in_channels")
    other = c * t * p * p * d + norms  # the Conv3d patch embedding (no bias before Qwen3-VL)
    if mt == "qwen3_vl":
        deep = len(v.get("deepstack_visual_indexes") or ())
        other += d + _int(v, "num_position_embeddings") * d  # the patch embedding's bias, learned positions
        other += deep * 2 * d * m2  # each deepstack merger's LayerNorm over the merged patches
        _vl(lay, "model.visual.merger.linear_fc1", d * m2, d * m2, True)
        _vl(lay, "model.visual.merger.linear_fc2", d * m2, out, True)
        if deep:
            _vl(lay, "model.visual.deepstack_merger_list.*.linear_fc1", d * m2, d * m2, True, deep)
            _vl(lay, "model.visual.deepstack_merger_list.*.linear_fc2", d * m2, out, True, deep)
    else:
        _vl(lay, "model.visual.merger.mlp.0", d * m2, d * m2, True)
        _vl(lay, "model.visual.merger.mlp.2", d * m2, out, True)
    lay.add("vision_tower", other)
    return _finish(cfg, name, source, spec, lay)


# ----------------------------------------------------------------------------------------------
# Mistral 3 (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2)


@_family("mistral3")
def _mistral3(cfg: dict, name: str, source: str) -> ModelSpec:
    """Mistral Small 3.1/3.2 (24B) as AutoModelForImageTextToText loads them: the Mistral text tower, the Pixtral
    vision tower (``model.vision_tower``: a Conv2d patch embedding, RMSNorms, q/k/v/o_proj and a gated MLP without
    biases) and ``model.multi_modal_projector`` (RMSNorm, the 2 x 2 patch merger, linear_1 and linear_2)."""
    spec, lay = _text_tower(cfg, mistral3_text_config(cfg), name, source)
    v = _vision(cfg.get("vision_config") or {}, PIXTRAL_DEFAULTS)
    d, n, i = _int(v, "hidden_size"), _int(v, "num_hidden_layers"), _int(v, "intermediate_size")
    layers = "model.vision_tower.transformer.layers.*."
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):  # hidden_size wide (PixtralAttention: embed_dim)
        _vl(lay, layers + f"attention.{p}", d, d, False, n)
    for p in ("gate_proj", "up_proj"):
        _vl(lay, layers + f"feed_forward.{p}", d, i, False, n)
    _vl(lay, layers + "feed_forward.down_proj", i, d, False, n)
    m2 = int(cfg.get("spatial_merge_size") or 2) ** 2
    feature = cfg.get("vision_feature_layer", -1)
    feature_layers = 1 if isinstance(feature, int) else len(feature)
    bias = bool(cfg.get("multimodal_projector_bias", False))
    h = spec.hidden_size
    _vl(lay, "model.multi_modal_projector.patch_merger.merging_layer", d * m2, d, False)
    _vl(lay, "model.multi_modal_projector.linear_1", d * feature_layers, h, bias)
    _vl(lay, "model.multi_modal_projector.linear_2", h, h, bias)
    p, c = _int(v, "patch_size"), _int(v, "num_channels")
    # patch_conv (no bias), ln_pre, attention_norm and ffn_norm per layer, the projector's norm
    lay.add("vision_tower", c * p * p * d + d + n * 2 * d + d)
    # its own family name: Mistral's activation recipe and traits are the defaults the estimator runs for a name it
    # does not special-case, and liger-kernel 0.8.5 patches no mistral3 model (MODEL_TYPE_TO_APPLY_LIGER_FN has
    # mistral and pixtral, not mistral3), so --liger is refused for it as for other unpatched families
    return _finish(cfg, name, source, spec, lay, family="mistral3")
