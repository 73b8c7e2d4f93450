"""config.json -> ModelSpec for the ALiBi decoders transformers 5.24 runs: BLOOM (``bloom``: bloom-560m ... bloom-7b1,
bloomz-*) and MPT (``mpt``: mpt-7b, mpt-30b); falcon-rw (``falcon`` with ``alibi: true``) is Falcon's builder
(model/families.py). Their attention adds a linear bias per head instead of rotating q and k; what that keeps is
``vramplan/estimator/alibi.py``.

Each builder reads the keys the family's modeling code reads, with its config class's defaults, and lists every
Linear by module name; ``tests/test_catalogue_models.py`` holds each against transformers' own model on the meta
device.

- **BLOOM** (modeling_bloom.py): ``word_embeddings`` and a LayerNorm after it (``word_embeddings_layernorm``), per
  block ``input_layernorm``, ``self_attention.query_key_value`` (h -> 3h, q/k/v interleaved per head) and
  ``self_attention.dense``, ``post_attention_layernorm``, ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h`` (4h, fixed:
  ``n_inner`` is not read), biases everywhere, LayerNorms with bias, a tanh GELU of its own (a custom autograd
  function keeping its input), ``ln_f`` and a head tied to the embedding. BloomConfig maps ``n_embed`` (the older
  files) to hidden_size; ``n_layer`` and ``n_head`` are its names for the layer and head counts.
- **MPT** (modeling_mpt.py): ``wte``, per block ``norm_1`` / ``norm_2`` (LayerNorms whose bias is removed),
  ``attn.Wqkv`` (h -> 3h) and ``attn.out_proj``, ``ffn.up_proj`` / ``ffn.down_proj`` (4h, fixed: ``expansion_ratio``
  is not read), no bias anywhere (whatever ``no_bias`` says), exact GELU, ``norm_f``, a tied head. No position
  embedding (``learned_pos_emb`` is not read: the ALiBi bias replaces it). MptConfig's names: ``d_model``,
  ``n_heads``, ``n_layers`` (a truncated copy carries ``num_hidden_layers``, which MptConfig maps onto it).
"""

from __future__ import annotations

from ..specs import SpecError
from .builders import Layers as _Layers
from .builders import family as _family
from .builders import head as _head
from .builders import req as _req
from .builders import spec as _spec
from .modelspec import ModelSpec

#: the model types whose attention is ALiBi in every config (falcon's is where its config says ``alibi``)
ALIBI_TYPES = ("bloom", "mpt")


def _divides(h: int, a: int) -> int:
    if h % a:
        raise SpecError(f"config.json: hidden size ({h}) is not a multiple of the number of heads ({a})")
    return h // a


@_family("bloom")
def _bloom(cfg: dict, name: str, source: str) -> ModelSpec:
    V = _req(cfg, "vocab_size")
    h = _req(cfg, "hidden_size", "n_embed")
    L = _req(cfg, "num_hidden_layers", "n_layer")
    a = _req(cfg, "num_attention_heads", "n_head")
    hd = _divides(h, a)
    i = 4 * h
    lay = _Layers("transformer.h", L)
    lay.linear("self_attention.query_key_value", h, 3 * h, True, "attn")
    lay.linear("self_attention.dense", h, h, True, "attn")
    lay.linear("mlp.dense_h_to_4h", h, i, True, "mlp")
    lay.linear("mlp.dense_4h_to_h", i, h, True, "mlp")
    lay.add("norms", (2 * L + 2) * 2 * h)  # per block two; word_embeddings_layernorm and ln_f
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=hd,
        intermediate_size=i, max_position_embeddings=int(cfg.get("seq_length") or 2048), tie_word_embeddings=tie,
        mlp_kind="plain", activation="gelu_tanh", norm_kind="layernorm", default_attn="eager", family="bloom",
    )


def mpt_attn_config(cfg: dict) -> dict:
    """MptAttentionConfig's keys with its defaults (transformers 5.24) for those a config leaves out."""
    attn = {"attn_pdrop": 0.0, "clip_qkv": None, "softmax_scale": None, "alibi": True, "alibi_bias_max": 8}
    given = cfg.get("attn_config")
    if given is not None and not isinstance(given, dict):
        raise SpecError(f"config.json: attn_config must be an object; got {given!r}")
    attn.update(given or {})
    if not attn.get("alibi", True):
        raise SpecError("config.json: an MPT config without alibi has no position information in transformers' "
                        "MptModel (learned_pos_emb is not built); it is not modelled")
    return attn


@_family("mpt")
def _mpt(cfg: dict, name: str, source: str) -> ModelSpec:
    V = _req(cfg, "vocab_size")
    h = _req(cfg, "hidden_size", "d_model")
    L = _req(cfg, "num_hidden_layers", "n_layers")
    a = _req(cfg, "num_attention_heads", "n_heads")
    hd = _divides(h, a)
    mpt_attn_config(cfg)  # its checks
    i = 4 * h
    lay = _Layers("transformer.blocks", L)
    lay.linear("attn.Wqkv", h, 3 * h, False, "attn")
    lay.linear("attn.out_proj", h, h, False, "attn")
    lay.linear("ffn.up_proj", h, i, False, "mlp")
    lay.linear("ffn.down_proj", i, h, False, "mlp")
    lay.add("norms", (2 * L + 1) * h)  # norm_1, norm_2 (bias removed), norm_f
    lay.add("embed_tokens", V * h)
    tie = _head(cfg, lay, V, h, True)
    return _spec(
        cfg, name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=hd,
        intermediate_size=i, max_position_embeddings=int(cfg.get("max_seq_len") or 2048), tie_word_embeddings=tie,
        mlp_kind="plain", activation="gelu", norm_kind="layernorm_nobias", default_attn="eager", family="mpt",
    )
