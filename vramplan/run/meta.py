"""Fallback for model types without a family recipe: read the structure of the model built on
the meta device by transformers (needs the ``run`` extra; no weights, no GPU)."""

from __future__ import annotations

import contextlib
import re
import warnings

from ..specs import LinearSpec, ModelSpec, SpecError

#: Encoder-decoder model types (transformers 5.24): an encoder stack and cross-attention, no causal-LM step.
ENCODER_DECODER_TYPES = frozenset({
    "t5", "mt5", "umt5", "longt5", "switch_transformers", "bart", "mbart", "plbart", "pegasus", "pegasus_x",
    "marian", "blenderbot", "blenderbot-small", "led", "bigbird_pegasus", "m2m_100", "nllb-moe", "fsmt",
    "prophetnet", "xlm-prophetnet", "whisper", "encoder-decoder", "speech-encoder-decoder", "t5gemma",
})
#: State-space and linear-recurrence model types: no attention layers whose memory vramplan models.
STATE_SPACE_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
_STATE_SPACE_ARCH = re.compile(r"Mamba|Rwkv|RWKV|xLSTM")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def unsupported_reason(config: dict) -> str | None:
    """Why vramplan cannot model the architecture of ``config`` (read from its keys alone, before
    transformers is imported), or None. Encoder-decoder models (``is_encoder_decoder``, encoder and
    decoder layer counts, or a known type) and pure state-space models (a known type, or a
    Mamba/RWKV architecture without attention heads) are refused; hybrids with attention are not."""
    mt = config.get("model_type")
    archs = [a for a in config.get("architectures") or () if isinstance(a, str)]
    if (mt in ENCODER_DECODER_TYPES or config.get("is_encoder_decoder") is True
            or "num_decoder_layers" in config or {"encoder_layers", "decoder_layers"} <= config.keys()):
        return (f"model_type {mt!r} is an encoder-decoder model; vramplan models decoder-only causal LMs "
                "(its step has an encoder and cross-attention it does not count)")
    if mt in STATE_SPACE_TYPES or (any(_STATE_SPACE_ARCH.search(a) for a in archs)
                                   and not any(k in config for k in _HEAD_KEYS)):
        return (f"model_type {mt!r} is a state-space model without attention layers; vramplan models "
                "decoder-only transformers (its recurrent scan's memory is not modelled)")
    return None


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' own logging and Python warnings silenced while it reads and builds a config,
    its verbosity restored after: what reaches the user is vramplan's ``error:`` or result."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)


def model_spec_from_meta(config: dict, *, name: str, source: str = "") -> ModelSpec:
    mt = config.get("model_type")
    reason = unsupported_reason(config)
    if reason:
        raise SpecError(reason)
    try:
        import torch
        import transformers

        from .models import causal_lm_from_config
    except ImportError:
        raise SpecError(
            f"model_type {mt!r} has no built-in recipe; reading its structure needs transformers: "
            "pip install 'vramplan[run]'"
        ) from None
    cfg = dict(config)
    cfg.pop("model_type")
    with _quiet(transformers):
        try:
            hf_cfg = transformers.AutoConfig.for_model(mt, **cfg)
        except (ValueError, KeyError) as exc:
            raise SpecError(f"transformers does not know model_type {mt!r}: {str(exc).splitlines()[0]}") from None
        with torch.device("meta"):
            try:
                model = causal_lm_from_config(hf_cfg)
            except Exception as exc:  # noqa: BLE001 - any failure here is a config problem for the user
                raise SpecError(
                    f"cannot build model_type {mt!r} as a causal LM: {str(exc).splitlines()[0]}") from None
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
    try:
        h = int(text.hidden_size)
        a = int(text.num_attention_heads)
        num_layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    except (AttributeError, TypeError) as exc:
        raise SpecError(f"model_type {mt!r} is not a decoder-only transformer vramplan can model: "
                        f"its config has no {str(exc).rsplit(' ', 1)[-1]}") from None
    return ModelSpec(
        name=name, model_type=mt, config=config, vocab_size=vocab, hidden_size=h, num_layers=num_layers, num_heads=a,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or a),
        head_dim=int(getattr(text, "head_dim", None) or h // a),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * h),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        linears=linears, other_params=(("non_linear", other),), mlp_kind="gated", activation="silu",
        norm_kind="rmsnorm", default_attn="sdpa", family="generic", source=source or "meta",
    )
