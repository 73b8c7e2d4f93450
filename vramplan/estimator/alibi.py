"""ALiBi attention as transformers 5.24 trains it: BLOOM (``bloom``), MPT (``mpt``) and falcon-rw (``falcon`` with
``alibi: true``); the builders are vramplan/model/families_alibi.py and model/families.py. Per token, bytes kept for
the backward, read off each modeling file and checked with the fake-tensor tracer
(``vramplan.run.tracer.trace_numbers(...).saved_detail``; tests/test_catalogue_models.py).

- **BLOOM** has eager attention only (BloomPreTrainedModel declares no SDPA): the bias is one
  ``(batch * heads, 1, s)`` tensor in the activations' dtype built once per forward; ``alibi.baddbmm(q, k^T)`` keeps
  the reshaped q and k copies, the fp32 softmax keeps its output, ``.to(c)`` gives the probabilities ``bmm`` keeps
  with the reshaped v copy: 3 c q + (4 + c) a s. ``_merge_heads`` copies the output for ``dense``, which keeps it only
  when its weight trains. The additive causal mask of the eager path, ``(b, 1, s, s)`` in c, and the bias are saved by
  nothing (an add, baddbmm's ``self``): only checkpointing keeps them, as every layer's inputs.
- **MPT** has eager attention only too: the bias is ``(heads, 1, max_seq_len)`` fp32, built once; q k^T (its q, k
  copies kept) scaled and plus the fp32 bias promotes the scores to fp32, ``masked_fill`` with the boolean causal
  mask (``(b, 1, s, s)``, one for all layers: every layer keeps it), the fp32 softmax's output, its c cast and the v
  copy for the matmul: 3 c q + (4 + c) a s, and s bytes a token for the mask. ``clip_qkv`` clamps Wqkv's output,
  which the clamp keeps (3 c h).
- **falcon-rw** runs SDPA (FalconPreTrainedModel forces it): FalconModel folds the bias into the causal mask once per
  forward, ``masked_fill(alibi / sqrt(d), causal < -1)``, a ``(b, heads, s, s)`` tensor in the embeddings' dtype
  (c; fp32 under autocast) that every layer's SDPA receives as a float ``attn_mask``. Flash attention takes no mask,
  so CUDA runs the memory-efficient kernel, which
  saves q, k, v (reshaped copies), its output, an fp32 logsumexp and the mask (attn_bias: the same storage in every
  layer when s is a multiple of 16, else a padded copy per layer, torch's ``preprocess_mask``; under autocast each
  layer's own 16-bit cast of the fp32 mask): 4 c q + 4 a, and c a s a token once for the model. The CPU trace's
  kernel (flash for CPU, which takes a float mask) keeps the same tensors; autocast on the CPU casts the mask as
  CUDA's does. Where the head is not a multiple of 8 wide (even: transformers 5.24's RoPE check refuses an odd
  head_dim, falcon-7b's 71, even with alibi), neither flash nor the memory-efficient kernel (nor cuDNN's) can run
  and CUDA falls back to the math kernel, which (torch's default ``allow_fp16_bf16_reduction_math_sdp(False)``)
  upcasts q, k, v to fp32 and keeps the scaled q, k^T, v and the softmax in fp32: 12 q + 4 a s, the mask saved by
  nothing (an in-place add). No shipped config takes that path (falcon-rw-1b and -7b have 64-wide heads); it is
  held against the trace with SDPA forced to the math backend (the same composite on the CPU), not measured on a
  GPU. ``--attn eager`` keeps q, k, v copies and the softmax in c (``F.softmax(..., dtype=c)``): 3 c q + c a s.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError
from .precision import attention_impl, autocast_bytes, compute_bytes, mixed

#: the families whose attention is ALiBi in every config (model/families_alibi.py)
ALIBI_FAMILIES = frozenset({"bloom", "mpt"})


def is_alibi(model: ModelSpec) -> bool:
    """BLOOM, MPT, or a Falcon whose config sets ``alibi`` (falcon-rw)."""
    return model.family in ALIBI_FAMILIES or (model.family == "falcon" and bool(model.config.get("alibi")))


def _attn(model: ModelSpec, setup: Setup) -> str:
    """The attention path: ``eager`` (BLOOM, MPT: their only one), or for falcon-rw ``efficient`` (SDPA's
    memory-efficient kernel), ``math`` (SDPA's math kernel: heads not a multiple of 8 wide) or ``eager``."""
    impl = attention_impl(model, setup)
    if model.family in ALIBI_FAMILIES:
        if impl != "eager":
            name = {"bloom": "BLOOM", "mpt": "MPT"}[model.family]
            raise SpecError(f"{name} has no SDPA or flash attention path in transformers 5.24 (its model class runs "
                            f"eager attention only); use --attn auto or eager")
        return "eager"
    if impl == "eager":
        return "eager"
    return "efficient" if model.head_dim % 8 == 0 else "math"


def _dropout(model: ModelSpec) -> float:
    cfg = model.config
    if model.family == "mpt":
        return float((cfg.get("attn_config") or {}).get("attn_pdrop") or 0.0)
    return float(cfg.get("attention_dropout") or 0.0)


def attention_bytes(model: ModelSpec, setup: Setup) -> float:
    """The attention core of one layer per token (its projections' inputs are counted with the Linears)."""
    c, q, a, s = compute_bytes(setup), model.q_dim, model.num_heads, setup.seq
    full = setup.method == "full"
    path = _attn(model, setup)
    max_seq = int(model.config.get("max_seq_len") or 2048)
    if model.family == "mpt" and s > max_seq:
        raise SpecError(f"seq {s} exceeds {model.name}'s max_seq_len {max_seq}: MptModel builds its ALiBi bias for "
                        f"max_seq_len positions and fails on a longer sequence")
    if path == "efficient":
        ac = autocast_bytes(setup)  # SDPA under autocast receives (and keeps) half q, k, v
        total = 4 * ac * q + 4 * a  # (dense reads a view of the kernel's (b, s, heads, d) output: no copy)
        if _mask_per_layer(setup):  # the mask the kernel keeps is each layer's own copy
            total += ac * a * (s + (16 - s % 16) % 16)
        return total
    if path == "math":
        return 12 * q + 4 * a * s + (c * q if full else 0)
    ac = autocast_bytes(setup)
    if model.family == "falcon":  # F.softmax(..., dtype=hidden_states.dtype): the probabilities in c only
        total = 3 * ac * q + c * a * s
    else:  # the fp32 softmax and its cast back (none in an fp32 step: the same tensor)
        total = 3 * ac * q + (4 + (ac if ac < 4 else 0)) * a * s
    if _dropout(model) > 0:  # native_dropout's bool mask (the dropped probabilities replace the kept ones)
        total += a * s
    if model.family == "mpt" and (model.config.get("attn_config") or {}).get("clip_qkv"):
        total += ac * 3 * model.hidden_size  # the clamp keeps Wqkv's output
    return total + (c * q if full else 0)


def layers_inputs_per_token(model: ModelSpec, setup: Setup) -> float:
    """What every layer reads from outside the layers and keeps to the end of their backward, per token, beside
    what ``activations.layers_inputs_per_token`` counts: the mask a layer saves (MPT's bool causal mask; falcon-rw's
    (b, heads, s, s) bias on the memory-efficient kernel) or, with checkpointing, keeps as its input (and the bias);
    a falcon-rw without checkpointing rotates nothing, so the RoPE tables the generic term counts are not kept."""
    c, a, s = compute_bytes(setup), model.num_heads, setup.seq
    path = _attn(model, setup)
    ck = setup.checkpointing
    if model.family == "bloom":  # the eager (b, 1, s, s) additive mask and the (b * heads, 1, s) bias
        return (c * s + c * a) if ck else 0.0
    if model.family == "mpt":  # the bool mask (saved by masked_fill); the fp32 bias, one (heads, 1, max_seq_len)
        max_seq = int(model.config.get("max_seq_len") or 2048)
        return s + (4 * a * max_seq / setup.tokens if ck else 0.0)
    stream = 4 if mixed(setup) else c  # falcon-rw: the bias folded into the mask, in the embeddings' dtype
    mask = stream * a * s
    rope = 0.0 if ck else -2 * stream * model.rope_dim
    if path == "efficient" and not ck:  # every layer's kernel keeps this one mask, unless each casts or pads its own
        return (0.0 if _mask_per_layer(setup) else mask) + rope
    return (mask + stream * a + rope) if ck else rope


def _mask_per_layer(setup: Setup) -> bool:
    """falcon-rw's memory-efficient kernel keeps a copy of the mask per layer, not the model's one: under autocast
    (SDPA is on its lower-precision list, which casts the fp32 mask to 16 bits at every call, uncached) and where s
    is not a multiple of 16 (torch's ``preprocess_mask`` pads it)."""
    return mixed(setup) or setup.seq % 16 != 0


def global_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """Outside the layers, beside ``activations.global_bytes_per_token``: BLOOM's LayerNorm after the embedding
    keeps its input and statistics when it has a gradient to compute (its weight trains, or checkpointing makes the
    embedding output require grad)."""
    if model.family != "bloom" or not (setup.method == "full" or setup.checkpointing):
        return 0.0
    c = compute_bytes(setup)
    return c * model.hidden_size + 2 * c  # F.layer_norm's input, mean and rstd (activations.norm_bytes' layernorm)


def forward_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """Eager attention's widest moment inside a layer's forward, per token, beyond what the layers save: the s x s
    tensors alive at once while the top layer takes its softmax, with every layer's saves (or checkpointed inputs)
    beside them. Read off the tracer's op timeline (the tracer's live bytes after every op). Per element of the
    (b, heads, s, s) scores, c the activations' dtype:

    - the layer before's probabilities: each block returns them (``attn_weights``) and the model's loop keeps the
      last block's outputs until the next returns; saved anyway without checkpointing, an extra c with it;
    - ``F.softmax(x, dtype=float32)`` of a bf16 x converts x to an fp32 copy first (torch fuses the conversion only
      for fp16 on CUDA: modelled as bf16, the copy kept), beside its fp32 output;
    - BLOOM: baddbmm's scores and the masked scores (c each, held by the function's locals), the fp32 copy and
      softmax, then its c cast (the copy freed): 3c + 8 with checkpointing; 2c + 4 without (the softmax and its
      cast are saves, counted with the layers: max(c + 4, 2c) beyond them);
    - MPT: the fp32 biased and masked scores (4 each), the fp32 softmax and its c cast: 2c + 8 with checkpointing
      (c of it the layer before's); without, the masked scores (4) beyond the saves;
    - falcon-rw (``--attn eager``): q k^T (c, held by its local), its fp32 copy, the biased logits, their masked sum,
      the softmax's c copy of its input and c output: 4c + 12 with checkpointing; 2c + 12 without.

    Beside them the model's mask, alive through the forward (counted with the layers' inputs only where a layer keeps
    it): BLOOM's (b, 1, s, s) additive one, MPT's bool one, falcon-rw's (b, heads, s, s) bias-and-mask.

    falcon-rw's SDPA keeps no s x s tensor in a layer; its mask, the model's, is alive through the forward, counted
    here where no layer keeps it (the math kernel's; each layer's cast or padded copy in its place)."""
    path = _attn(model, setup)
    if path != "eager":
        if model.family == "falcon" and not setup.checkpointing and (path == "math" or _mask_per_layer(setup)):
            return (4 if mixed(setup) else compute_bytes(setup)) * model.num_heads * setup.seq
        return 0.0
    c, a, s = autocast_bytes(setup), model.num_heads, setup.seq
    ck = setup.checkpointing
    copy = 4 if c < 4 else 0  # softmax's fp32 copy of a 16-bit input (a no-op on fp32)
    cast = c if c < 4 else 0  # the cast back of the fp32 softmax (a no-op on fp32)
    if model.family == "bloom":
        per = max(3 * c + copy + 4, 3 * c + 4 + cast) if ck else max(c + copy, 2 * c)
        mask = c * s  # the eager (b, 1, s, s) additive mask, alive through the forward
    elif model.family == "mpt":
        per = (c + 8 + cast) if ck else 4
        mask = s  # the bool causal mask
    else:
        per = (4 * c + 12) if ck else 2 * c + 12
        mask = c * a * s  # the (b, heads, s, s) bias folded into the mask
    return per * a * s + mask


def recompute_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """A checkpointed layer's eager attention recomputed at the start of its backward, per token: the q, k, v copies
    and the s x s tensors alive at its softmax (:func:`forward_transient_per_token`'s, less the layer before's
    probabilities, which a recompute does not hold), beside the gradient of the layer's output."""
    if _attn(model, setup) != "eager":
        return 0.0
    c, a, s = autocast_bytes(setup), model.num_heads, setup.seq
    copy, cast = (4 if c < 4 else 0), (c if c < 4 else 0)
    if model.family == "bloom":
        per = max(2 * c + copy + 4, 2 * c + 4 + cast)
    elif model.family == "mpt":
        per = 8 + cast
    else:
        per = 3 * c + 12
    return per * a * s + 3 * c * model.q_dim
