"""Config readings shared by the builders (model/architecture.py, model/families.py) and the traits
(model/traits.py): the text tower of an image-text config, Falcon's LayerNorm layout."""

from __future__ import annotations

#: Gemma3TextConfig's defaults (transformers 5.24) for the keys google/gemma-3-{4b,12b,27b}'s text_config
#: leaves out (the 4b file names only hidden_size, intermediate_size, num_hidden_layers, rope_scaling and
#: sliding_window).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rms_norm_eps": 1e-6,
}


def gemma3_text_config(cfg: dict) -> dict:
    """The text tower's config of a ``gemma3`` config, the class defaults filled in."""
    text = dict(GEMMA3_TEXT_DEFAULTS)
    text.update(cfg.get("text_config") or {})
    text["model_type"] = "gemma3_text"
    return text


def text_config(cfg: dict) -> dict:
    """The config the decoder's traits read: an image-text model's text tower, else ``cfg`` itself."""
    return gemma3_text_config(cfg) if cfg.get("model_type") == "gemma3" else cfg


def falcon_norms(cfg: dict) -> int:
    """LayerNorms per Falcon layer: two (``ln_attn``, ``ln_mlp``) under new_decoder_architecture with
    num_ln_in_parallel_attn 2 (its default there), two in a sequential block, else one feeding both branches."""
    new = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    both = int(cfg.get("num_ln_in_parallel_attn") or (2 if new else 1)) == 2
    return 2 if (not parallel or (new and both)) else 1
