"""Config readings shared by the builders (model/architecture.py, model/families.py, model/families_vl.py) and the
traits (model/traits.py): the text tower of an image-text config, Falcon's LayerNorm layout."""

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


#: Qwen2VLTextConfig's and Qwen2_5_VLTextConfig's defaults (transformers 5.24) for the keys a config may leave out
QWEN2_VL_TEXT_DEFAULTS = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 80,
}
#: Qwen3VLTextConfig's defaults (transformers 5.24)
QWEN3_VL_TEXT_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "attention_bias": False,
}
#: Mistral3Config's text_config when a config names none (transformers 5.24: Mistral Small 3.1's text model)
MISTRAL3_TEXT_DEFAULTS = {
    "model_type": "mistral", "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 1e9, "sliding_window": None, "vocab_size": 131072,
}
#: the keys of a flat Qwen2-VL / Qwen2.5-VL config.json (the Hub's layout) that are not its text tower's
_QWEN_VL_TOP = ("vision_config", "text_config", "architectures", "model_type", "image_token_id", "video_token_id",
                "vision_start_token_id", "vision_end_token_id", "vision_token_id", "tie_word_embeddings")
#: the image-text model types and the model_type of their text tower's config
VL_TEXT_TYPES = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text"}


def qwen_vl_text_config(cfg: dict) -> dict:
    """The text tower's config of a ``qwen2_vl``/``qwen2_5_vl``/``qwen3_vl`` config: its ``text_config``, or (the
    Hub's Qwen2-VL and Qwen2.5-VL files) the flat keys Qwen2VLConfig.__post_init__ moves into one, the text config
    class's defaults filled in. ``tie_word_embeddings`` as transformers 5.24 ties: the root config's (default
    false), or true where the text config says so (Qwen2VLConfig's and Qwen2_5_VLConfig's pre-v5 compatibility; not
    Qwen3VLConfig's)."""
    mt = cfg.get("model_type")
    nested = cfg.get("text_config")
    text = dict(QWEN3_VL_TEXT_DEFAULTS if mt == "qwen3_vl" else QWEN2_VL_TEXT_DEFAULTS)
    if isinstance(nested, dict):
        text.update(nested)
    elif mt != "qwen3_vl":
        text.update({k: v for k, v in cfg.items() if k not in _QWEN_VL_TOP})
    tie = bool(cfg.get("tie_word_embeddings", False))
    if mt != "qwen3_vl" and isinstance(nested, dict):
        tie = tie or bool(nested.get("tie_word_embeddings", False))
    text["tie_word_embeddings"] = tie
    text["model_type"] = VL_TEXT_TYPES[mt]
    return text


def mistral3_text_config(cfg: dict) -> dict:
    """The text tower's config of a ``mistral3`` config (Mistral Small 3.1/3.2). Its head is untied unless the config
    ties it: transformers 5.24's Mistral3Config defaults ``tie_word_embeddings`` to true, so ``from_config`` on the
    Hub file (which names none) ties it, but ``from_pretrained`` finds ``lm_head.weight`` in the checkpoint and keeps
    it (checked on a saved tiny Mistral3ForConditionalGeneration whose config names no tying: untied on load)."""
    nested = cfg.get("text_config")
    text = dict(MISTRAL3_TEXT_DEFAULTS) if not isinstance(nested, dict) else dict(nested)
    text.setdefault("model_type", "mistral")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text["tie_word_embeddings"] = bool(tie)
    return text


#: Llama4TextConfig's defaults (transformers 5.24) for the keys a Llama 4 text_config may leave out
LLAMA4_TEXT_DEFAULTS = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 1, "num_local_experts": 16,
    "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
}
def llama4_text_config(cfg: dict) -> dict:
    """The text tower's config of a ``llama4`` config (its ``text_config``, the class defaults filled in)."""
    text = dict(LLAMA4_TEXT_DEFAULTS)
    text.update({k: v for k, v in (cfg.get("text_config") or {}).items() if v is not None})
    text["model_type"] = "llama4_text"
    return text


def text_config(cfg: dict) -> dict:
    """The config the decoder's traits read: an image-text model's text tower, else ``cfg`` itself."""
    mt = cfg.get("model_type")
    if mt == "llama4":
        return llama4_text_config(cfg)
    if mt == "gemma3":
        return gemma3_text_config(cfg)
    if mt in VL_TEXT_TYPES:
        return qwen_vl_text_config(cfg)
    if mt == "mistral3":
        return mistral3_text_config(cfg)
    return cfg


def falcon_norms(cfg: dict) -> int:
    """LayerNorms per Falcon layer: two (``ln_attn``, ``ln_mlp``) under new_decoder_architecture with
    num_ln_in_parallel_attn 2 (its default there), two in a sequential block, else one feeding both branches."""
    new = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    both = int(cfg.get("num_ln_in_parallel_attn") or (2 if new else 1)) == 2
    return 2 if (not parallel or (new and both)) else 1
