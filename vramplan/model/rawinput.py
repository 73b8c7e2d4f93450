"""Raw input without the shipped data: a text file within the size limit, JSON without NaN or
deep nesting, and a model's config.json checked for the kinds and bounds of the values vramplan
reads. :mod:`vramplan.setup.inputs` re-exports these; this module imports nothing of vramplan's but
:mod:`vramplan.specs`, so ``architecture`` and ``profiles`` can use it without a cycle."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..specs import SpecError
from ..util.numbers import MAX_NUMBER, check_numbers, count_shown  # noqa: F401  (re-exported)

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64


def shown_value(value: Any) -> str:
    """A value for a message: its repr, cut short (a hostile file's value may be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return count_shown(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """A text file's contents, refused when missing, a directory, too large or not UTF-8."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise SpecError(f"{path}: is a directory, not a {what}")
        if size > MAX_FILE_BYTES:
            raise SpecError(f"{path}: {size:,} bytes is too large for a {what} (limit {MAX_FILE_BYTES:,})")
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such {what}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number vramplan accepts")


def loads_json(text: str, where: str) -> Any:
    """JSON text to data; NaN/Infinity, depth over MAX_DEPTH and malformed text are SpecErrors."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(f"{where}: too large (limit {MAX_FILE_BYTES:,} bytes)")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{where}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except ValueError as exc:
        raise SpecError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    check_depth(data, where)
    check_numbers(data, where)
    return data


def check_depth(data: Any, where: str) -> None:
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value if isinstance(k, (tuple, dict, list)))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


# ----------------------------------------------------------------------------------------------
# Model configs (config.json)

#: Integer keys of the configs vramplan reads, and their largest accepted value (beyond these a
#: number is not a model: the search and the estimator's loops over layers stay bounded).
_CONFIG_INTS: dict[str, int] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "n_embd", "n_inner", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "rotary_dim"), 1 << 24),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "first_k_dense_replace", "max_window_layers",
                     "decoder_sparse_step", "sliding_window_pattern"), 1 << 14),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head"), 1 << 16),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
                     "num_experts_per_tok"), 1 << 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "sliding_window"), 1 << 30),
}
#: Integer keys where 0 (or null) means "none".
_CONFIG_ZERO_OK = frozenset({"intermediate_size", "n_inner", "q_lora_rank", "n_shared_experts", "sliding_window",
                             "first_k_dense_replace", "max_window_layers", "max_position_embeddings", "n_positions",
                             "shared_expert_intermediate_size", "rotary_dim", "head_dim", "moe_intermediate_size"})
_CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_parallel_residual", "use_sliding_window",
                 "use_qkv_bias", "use_qk_norm", "use_bias", "qkv_bias", "qk_layernorm", "norm_topk_prob")
_CONFIG_FRACTIONS = ("rotary_pct", "partial_rotary_factor")
_CONFIG_STRINGS = ("hidden_act", "hidden_activation", "activation_function", "_name_or_path")


def check_model_config(config: Any, where: str = "config.json") -> dict:
    """``config`` (a parsed config.json) when its values are of the kinds transformers' config
    classes hold: ``model_type`` a name; the integer sizes vramplan reads whole numbers within
    bounds (``hidden_size: 576.5``, ``num_key_value_heads: 0`` or ``"big"`` are refused, as are
    more active experts than experts); flags booleans; every number finite; nesting within
    :data:`MAX_DEPTH`. Errors name ``where``, the key and the value."""
    if not isinstance(config, dict):
        raise SpecError(f"{where} must hold a JSON object")
    check_depth(config, where)
    mt = config.get("model_type")
    if mt is None or mt == "":
        raise SpecError(f"{where} has no model_type; is it a transformers model config?")
    if not isinstance(mt, str) or len(mt) > 100 or not mt.replace("_", "").replace("-", "").isalnum():
        raise SpecError(f"{where}: model_type must be a name such as 'llama'; got {shown_value(mt)}")
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"{where}: {key} must be a finite number; got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1 << 62:
            raise SpecError(f"{where}: {key} is out of range; got {count_shown(value)}")
    for key, limit in _CONFIG_INTS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        low = 0 if key in _CONFIG_ZERO_OK else 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= limit:
            kind = "a non-negative" if low == 0 else "a positive"
            raise SpecError(f"{where}: {key} must be {kind} integer up to {limit:,}; got {shown_value(config[key])}")
    for key in _CONFIG_BOOLS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise SpecError(f"{where}: {key} must be true or false; got {shown_value(config[key])}")
    for key in _CONFIG_FRACTIONS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
            raise SpecError(f"{where}: {key} must be a number in (0, 1]; got {shown_value(value)}")
    for key in _CONFIG_STRINGS:
        if config.get(key) is not None and not isinstance(config[key], str):
            raise SpecError(f"{where}: {key} must be a string; got {shown_value(config[key])}")
    active = config.get("num_experts_per_tok")
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(k)), None)
    if active and experts and active > experts:
        raise SpecError(f"{where}: num_experts_per_tok ({active}) is more than the {experts} experts")
    for key in ("layer_types", "mlp_only_layers"):
        value = config.get(key)
        if value is not None and not isinstance(value, list):
            raise SpecError(f"{where}: {key} must be a list; got {shown_value(value)}")
    if config.get("text_config") is not None and not isinstance(config["text_config"], dict):
        raise SpecError(f"{where}: text_config must be a mapping; got {shown_value(config['text_config'])}")
    return config


def read_model_config(path: str | os.PathLike) -> dict:
    """A config.json file read within the limits and checked (:func:`check_model_config`)."""
    return check_model_config(loads_json(read_text(path, "config.json"), str(path)), str(path))
