"""Fallback for model types without a family recipe: read the structure of the model built on
the meta device by transformers (needs the ``run`` extra; no weights, no GPU)."""

from __future__ import annotations

import re

from ..specs import LinearSpec, ModelSpec, SpecError


def model_spec_from_meta(config: dict, *, name: str, source: str = "") -> ModelSpec:
    mt = config.get("model_type")
    try:
        import torch
        import transformers
    except ImportError:
        raise SpecError(
            f"model_type {mt!r} has no built-in recipe; reading its structure needs transformers: "
            "pip install 'vramplan[run]'"
        ) from None
    cfg = dict(config)
    cfg.pop("model_type")
    try:
        hf_cfg = transformers.AutoConfig.for_model(mt, **cfg)
    except (ValueError, KeyError) as exc:
        raise SpecError(f"transformers does not know model_type {mt!r}: {str(exc).splitlines()[0]}") from None
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        except Exception as exc:  # noqa: BLE001 - any failure here is a config problem for the user
            raise SpecError(f"cannot build model_type {mt!r} as a causal LM: {str(exc).splitlines()[0]}") from None
    counts: dict[tuple, int] = {}
    linear_params: set[int] = set()
    head_names = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    for mod_name, mod in model.named_modules():
        is_conv1d = type(mod).__name__ == "Conv1D"
        if isinstance(mod, torch.nn.Linear) or is_conv1d:
            w = mod.weight
            d_in, d_out = (w.shape[0], w.shape[1]) if is_conv1d else (w.shape[1], w.shape[0])
            path = re.sub(r"\.\d+\.", ".*.", mod_name)
            role = "head" if mod_name in head_names else "other"
            key = (path, int(d_in), int(d_out), mod.bias is not None, role)
            counts[key] = counts.get(key, 0) + 1
            linear_params.update(id(p) for p in mod.parameters(recurse=False))
    linears = tuple(
        LinearSpec(p.rsplit(".", 1)[-1], p, i, o, b, n, role) for (p, i, o, b, role), n in counts.items()
    )
    other = sum(p.numel() for p in model.parameters() if id(p) not in linear_params)
    text = getattr(hf_cfg, "get_text_config", lambda: hf_cfg)()
    h = int(text.hidden_size)
    a = int(text.num_attention_heads)
    return ModelSpec(
        name=name, model_type=mt, config=config, vocab_size=int(text.vocab_size), hidden_size=h,
        num_layers=int(text.num_hidden_layers), num_heads=a,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or a),
        head_dim=int(getattr(text, "head_dim", None) or h // a),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * h),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        linears=linears, other_params=(("non_linear", other),), mlp_kind="gated", activation="silu",
        norm_kind="rmsnorm", default_attn="sdpa", family="generic", source=source or "meta",
    )
