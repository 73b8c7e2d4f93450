"""config.json -> ModelSpec for Llama 4 (Scout, Maverick) and Kimi-K2 (issue 29).

**Llama 4** (``llama4``): the text model as transformers 5.24 trains it, Llama4ForCausalLM (modeling_llama4.py), which
AutoModelForCausalLM builds from the Hub's Llama4ForConditionalGeneration config and checkpoint (``language_model.*``,
its base_model_prefix); the vision tower and projector (0.87B parameters of the published totals) are not loaded. The
image-text class cannot run a step in 5.24: its forward reads ``outputs.image_outputs`` off the text model's
MoeCausalLMOutputWithPast and raises AttributeError, with or without images. Each layer: q/k/v/o
(``attention_bias``), and either a MoE block (``moe_layers``, else every ``interleave_moe_layer_step``-th layer) or a
dense SwiGLU MLP ``feed_forward.gate_proj/up_proj/down_proj`` of width ``intermediate_size_mlp``. The MoE block:
``experts.gate_up_proj`` (E x h x 2i) and ``experts.down_proj`` (E x i x h), 3-D parameters (bitsandbytes leaves them
unquantized); ``router``, an nn.Linear (h -> E, no bias) whose forward returns a tuple (all-linear LoRA wraps it and
fails); ``shared_expert`` a SwiGLU of width ``intermediate_size``. The router's top-k sigmoid scores scale the *inputs*
of every expert: all E experts run on all tokens (``hidden_states.repeat(E, 1)``), which the estimator's Llama 4 recipe
counts (estimator/llama4.py). Attention: RoPE (complex, fp32) with an L2 q/k norm (``use_qk_norm``) on the RoPE
layers; every ``no_rope_layer_interval``-th layer (``no_rope_layers`` 0) is NoPE, its queries scaled by temperature
tuning; the RoPE layers are chunked (``attention_chunk_size``).

**Kimi-K2** (``kimi_k2``): Moonshot's config names DeepSeek-V3's remote code (modeling_deepseek.py, inference-only: its
MoE has no training forward); Moonshot's README says to read the config as ``deepseek_v3`` where a framework does not
know ``kimi_k2``, which is how transformers 5.24 trains it (DeepseekV3ForCausalLM, fused experts). So it is
DeepSeek-V3's builder (model/architecture.py) on its own config.

Counts held against transformers' own models on the meta device in tests/test_catalogue_models.py.
"""

from __future__ import annotations

import dataclasses

from ..specs import SpecError
from .builders import FAMILIES, attention, gated_mlp
from .builders import Layers as _Layers
from .builders import act as _act
from .builders import family as _family
from .builders import head as _head
from .builders import req as _req
from .builders import spec as _spec
from .modelspec import ModelSpec, MoeSpec
from .textconfig import llama4_text_config


def llama4_layout(text: dict) -> tuple[list[int], list[int]]:
    """(MoE layer indices, RoPE flags per layer) of a Llama 4 text config, as Llama4TextConfig.__post_init__ fills
    them: ``moe_layers`` or every ``interleave_moe_layer_step``-th layer; ``no_rope_layers`` (1: RoPE) or a NoPE
    layer every ``no_rope_layer_interval`` layers."""
    L = _req(text, "num_hidden_layers")
    step = int(text.get("interleave_moe_layer_step") or 1)
    moe = text.get("moe_layers")
    moe_layers = [int(i) for i in moe] if isinstance(moe, list) else list(range(step - 1, L, step))
    rope = text.get("no_rope_layers")
    interval = int(text.get("no_rope_layer_interval") or 4)
    if not rope:  # (an empty list, as None: the default pattern)
        rope = [int((i + 1) % interval != 0) for i in range(L)]
    if len(rope) < L:
        raise SpecError(f"config.json: no_rope_layers has {len(rope)} entries for {L} layers")
    return sorted(i for i in set(moe_layers) if 0 <= i < L), [int(bool(r)) for r in rope[:L]]


@_family("llama4")
def _llama4(cfg: dict, name: str, source: str) -> ModelSpec:
    """Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E as AutoModelForCausalLM loads them (Llama4ForCausalLM:
    ``model.layers``, ``lm_head``), from the image-text config's ``text_config``."""
    text = llama4_text_config(cfg)
    V, h, L = _req(text, "vocab_size"), _req(text, "hidden_size"), _req(text, "num_hidden_layers")
    a = _req(text, "num_attention_heads")
    kvh = int(text.get("num_key_value_heads") or a)
    if a % kvh:
        raise SpecError(f"config.json: num_attention_heads ({a}) is not a multiple of num_key_value_heads ({kvh})")
    hd = int(text.get("head_dim") or h // a)
    E, k = _req(text, "num_local_experts"), _req(text, "num_experts_per_tok")
    if k > E:
        raise SpecError(f"config.json: num_experts_per_tok ({k}) exceeds num_local_experts ({E})")
    ei, di = _req(text, "intermediate_size"), _req(text, "intermediate_size_mlp")
    moe_layers, _ = llama4_layout(text)
    nm = len(moe_layers)
    nd = L - nm
    bias = bool(text.get("attention_bias", False))
    lay = _Layers("model.layers", L)
    attention(lay, h, a, kvh, hd, bias, bias)
    if nd:
        gated_mlp(lay, "feed_forward", h, di, False, "mlp", nd)
    if nm:
        lay.add("experts", nm * E * (h * 2 * ei + ei * h))
        lay.linear("feed_forward.router", h, E, False, "router", nm)
        gated_mlp(lay, "feed_forward.shared_expert", h, ei, False, "shared_expert", nm)
    lay.add("norms", (2 * L + 1) * h)
    lay.add("embed_tokens", V * h)
    tie = _head(text, lay, V, h, False)
    moe = MoeSpec(num_experts=E, top_k=k, expert_intermediate_size=ei, num_moe_layers=nm,
                  shared_expert_intermediate_size=ei if nm else 0, norm_topk_prob=False, moe_layers=tuple(moe_layers))
    return _spec(
        dict(cfg), name, source, lay, vocab_size=V, hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kvh,
        head_dim=hd, intermediate_size=di, max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        tie_word_embeddings=tie, mlp_kind="gated", activation=_act(text), norm_kind="rmsnorm", default_attn="sdpa",
        moe=moe if nm else None, family="llama4",
    )


@_family("kimi_k2")
def _kimi_k2(cfg: dict, name: str, source: str) -> ModelSpec:
    """Kimi-K2-Base/-Instruct/-Instruct-0905: DeepSeek-V3's shape (MLA, 384 routed experts, top-8 sigmoid router with
    its correction bias, one shared expert, the first layer dense) on DeepSeek-V3's builder, which transformers 5.24
    runs as DeepseekV3ForCausalLM (``model_type`` read as deepseek_v3)."""
    spec = FAMILIES["deepseek_v3"](dict(cfg, model_type="deepseek_v3"), name, source)
    return dataclasses.replace(spec, model_type="kimi_k2")
