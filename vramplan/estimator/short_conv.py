"""Saved activations of a hybrid decoder whose layers are either gated short-convolution blocks or attention:
Liquid AI's LFM2 (``lfm2``, vramplan/model/families_lfm2.py). ``activations.layer_split_per_token`` hands such
a model's layers here.

An attention layer is the GQA path of ``activations.py`` (with LFM2's per-head q/k RMSNorms); a ``conv`` layer
keeps, read off transformers 5.24's ``Lfm2ShortConv.forward`` (torch path, ``causal_conv1d_fn``) and checked
with the fake-tensor tracer (``vramplan.run.tracer.trace_numbers(...).saved_detail``):

- ``in_proj``'s output BCx (3h: ``B * x`` keeps both chunks and ``C * conv`` the third, views of it);
- ``B * x``, the depthwise Conv1d's input (h);
- the Conv1d's output, padded by ``conv_L_cache - 1`` positions (h (s + K - 1) / s), which ``C *`` keeps;
- with full fine-tuning ``out_proj``'s input, the contiguous ``C * conv`` (h; LoRA's copies are the
  adapters' terms, as for any Linear).

All in the compute dtype: under autocast ``in_proj`` returns 16 bits and the conv runs on a 16-bit copy of
its input. (With the ``causal-conv1d`` package installed transformers runs its CUDA kernel instead; that path
is not modelled.) The other terms of a layer (norms, the MLP, the adapters' inputs) are ``activations.py``'s,
computed on views of the model whose every layer is of one kind.
"""

from __future__ import annotations

import dataclasses
import functools

from ..specs import ModelSpec, Setup
from . import activations as act
from .precision import autocast_bytes

#: model families whose layers are short-conv blocks or attention (``ModelSpec.family``)
CONV_FAMILIES = frozenset({"lfm2"})
#: the role of a conv block's Linears (model/families_lfm2.py)
CONV_ROLE = "conv"


def layer_kinds(model: ModelSpec) -> tuple[bool, ...]:
    """Per layer: True where it is a short-conv block (FamilyTraits.conv_layers, from the config's layer_types
    or full_attn_idxs; part of the ModelSpec's equality, so the estimate's memo keys on it)."""
    return model.traits.conv_layers


def _per_layer(model: ModelSpec, keep: str) -> tuple:
    """The Linears of one layer kind (``attn`` or ``conv``) as if every layer had them, and the others but the
    other kind's as they are (the MLPs', the head)."""
    out = []
    for l in model.linears:
        if l.role == keep:
            out.append(dataclasses.replace(l, count=model.num_layers))
        elif l.role not in ("attn", CONV_ROLE):
            out.append(l)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def views(model: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    """(attention view, conv view): ``model`` with every layer an attention layer (its per-head q/k norms as a
    trait), and with every layer a conv block; a Llama-recipe family, so ``activations.py`` costs them."""
    attn = dataclasses.replace(model, family="llama", linears=_per_layer(model, "attn"), traits=dataclasses.replace(
        model.traits, qk_norm_rows=model.num_heads + model.num_kv_heads))
    conv = dataclasses.replace(model, family="llama", linears=_per_layer(model, CONV_ROLE))
    return attn, conv


def conv_block_bytes(model: ModelSpec, setup: Setup) -> float:
    """What one short-conv block keeps per token beside its Linears' inputs (module docstring)."""
    c, h, s = autocast_bytes(setup), model.hidden_size, setup.seq
    K = int(model.config.get("conv_L_cache") or 3)
    total = c * 3 * h + c * h + c * h * (s + K - 1) / s
    if setup.method == "full":
        total += c * h  # out_proj's input, for its weight's gradient
    return total


def layer_split_per_token(model: ModelSpec, setup: Setup, which: str | int = "mean") -> tuple[float, float]:
    """``activations.layer_split_per_token`` for a conv/attention hybrid: layer ``which``'s (attention or conv
    side, MLP side), or their mean over the layers."""
    attn_view, conv_view = views(model)
    kinds = layer_kinds(model)
    if isinstance(which, int):
        kinds = (kinds[which],)
    sides = []
    if not all(kinds):
        sides.append((act.layer_split_per_token(attn_view, setup, which), kinds.count(False)))
    if any(kinds):
        common, mlp = act.layer_split_per_token(conv_view, setup, which)
        common += conv_block_bytes(conv_view, setup) - act.attention_bytes(conv_view, setup)
        roles = (CONV_ROLE,)
        common += (act._adapter_bytes_per_layer(conv_view, setup, roles)
                   + act._int8_inputs_per_layer(conv_view, setup, roles)
                   + act._zero3_frozen_inputs_per_layer(conv_view, setup, roles))
        if setup.method == "full" and act.mixed(setup):  # autocast's copy of in_proj's (fp32) input
            common += sum(autocast_bytes(setup) * l.in_features for l in conv_view.linears
                          if l.role == CONV_ROLE and l.name not in act.OUTPUT_PROJECTIONS)
        sides.append(((common, mlp), kinds.count(True)))
    n = sum(k for _, k in sides)
    return (sum(s[0] * k for s, k in sides) / n, sum(s[1] * k for s, k in sides) / n)


for _family in CONV_FAMILIES:  # activations.layer_split_per_token hands these families' layers here
    act.LAYER_SPLITS[_family] = layer_split_per_token
