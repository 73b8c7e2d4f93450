"""FSDP2 (torch ``fully_shard``, accelerate ``fsdp_version: 2``): what each rank holds.

Modelled on torch 2.13's ``torch/distributed/fsdp/_fully_shard/`` and accelerate 1.15's
``fsdp2_prepare_model`` (accelerate/utils/fsdp_utils.py) as the HF Trainer (transformers 5.24)
runs them; every term was read off the real N-process run of ``vramplan.truths.fsdp2``
(``vramplan validate --knob fsdp2``). What differs from FSDP1 (estimator/fsdp.py):

- groups (accelerate ``fsdp2_prepare_model``): each decoder layer one ``fully_shard`` group
  (TRANSFORMER_BASED_WRAP); an untied input embedding its own group; the final norm and the head
  (with tied embeddings also the embedding) one "tail" group with ``reshard_after_forward=False``;
  the root takes what is left (nothing for the decoder models here). Under LoRA the adapters stay
  in their layer's group: with FSDP2 the Trainer creates the optimizer before ``prepare`` and does
  not install peft's ``fsdp_auto_wrap_policy`` (transformers ``Trainer._prepare_for_training``).
- sharding per parameter, not per flat unit (``FSDPParam._init_sharded_param``): dim 0 is
  chunked over the ranks and every rank holds the padded size of chunk 0, ``ceil(d0 / N)`` rows.
- dtypes: accelerate upcasts the trainable parameters to fp32 under mixed precision (not on a
  bitsandbytes base); the frozen ones stay as loaded. ``MixedPrecisionPolicy(param_dtype,
  reduce_dtype)``: the unsharded parameters and their gradients are 16-bit; without a policy
  (pure bf16/fp16, fp32) each parameter is gathered in its own dtype.
- unsharded parameters live in per-parameter all-gather outputs of ``N * padded shard``
  elements (``FSDPParam.init_all_gather_outputs``), freed by resizing at reshard. In the
  forward the flat all-gather buffer of the last gathered group is kept until the next group's
  copy-out and the last one until the root's post-forward (``FSDPParamGroup.wait_for_unshard``,
  ``FSDPState._post_forward``): the HF loss runs inside the root's forward, so the buffer of the
  group gathered last (the top layer; untied, the tail) is live at the loss.
- backward: each group's pre-backward prefetches the group before it (``_backward_prefetch``),
  so two layers are gathered at once. ``post_backward`` copies the unsharded gradients into one
  flat reduce-scatter input (``foreach_reduce``, reduce dtype) and drops them; that buffer is kept
  until the next group's reduce (``reduce_scatter_max_input_buffers=1``) and the last one until
  the final callback.
- ``shard_grad_op`` is ``reshard_after_forward=False``: every layer (and an untied embedding)
  stays gathered from its forward to its backward.
- QLoRA: the emitted train.py packs the 4-bit weights in the load dtype (``bnb_4bit_quant_storage``,
  emit/trainer.py ``quant_storage``), so each ``Params4bit`` is a floating parameter that
  ``fully_shard`` shards on its packed dim 0 (accelerate ignores only uint8-packed ones); the quant
  states are no parameters and stay whole on every rank; no fp32 upcast (accelerate skips it on a
  bitsandbytes base).
NO_SHARD, CPU offload, one rank, MoE models, LLM.int8/GPTQ/AWQ bases, optimizers other than torch
AdamW (foreach, fused) and SGD, and the knobs no FSDP2 truth runs are refused (setup/checks.py
``check_fsdp2``).
"""

from __future__ import annotations

import math

from ..setup.checks import check_fsdp2
from ..specs import ModelSpec, Setup
from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE, bnb_4bit_tensor_bytes
from .fsdp import FsdpMemory, fsdp_memory, fsdp_mixed, fsdp_phase_peaks
from .hybrid_shard import held_reduce_bytes, shard_ranks
from .lora import adapted_linears

#: Optimizer states per trainable shard element, in the shard's dtype (torch AdamW foreach or fused, SGD momentum).
_STATES = {"adamw": 2, "adamw-fused": 2, "sgd": 1}


def _padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's padded shard of a parameter (dim 0 chunked over ``n`` ranks)."""
    return -(-shape[0] // n) * math.prod(shape[1:])


def _group_tensors(model: ModelSpec, setup: Setup) -> tuple[list, list, list, list]:
    """(one layer's parameter shapes, the tail's, the untied embedding's, one layer's trainable
    shapes): the decoder layer, the final norm + head (+ a tied embedding), the embedding."""
    L = max(model.num_layers, 1)
    h = model.hidden_size
    w = int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])
    layer: list[tuple[int, ...]] = []
    for l in model.linears:
        if l.role == "head":
            continue
        # a bitsandbytes 4-bit weight is a Params4bit of its packed bytes in the quant storage (the
        # load dtype), shape (packed / itemsize, 1): sharded on that dim 0 like any parameter
        weight = ((-(-l.weight_params // 2) + w - 1) // w, 1) if setup.quant in ("nf4", "fp4") else (
            l.out_features, l.in_features)
        layer += [weight] * (l.count // L) + [(l.out_features,)] * (l.count // L) * l.bias
    for name, n in model.other_params:
        if name == "norms":
            layer += [(h,)] * ((n // h - 1) // L)  # the final norm is the tail's
        elif name == "qk_norms":
            layer += [(model.head_dim,)] * (max(1, n // model.head_dim) // L)
    head = [(l.out_features, l.in_features) for l in model.linears if l.role == "head"]
    embed = [(model.vocab_size, h)] if any(name == "embed_tokens" for name, _ in model.other_params) else []
    tail = [(h,)] + head + (embed if model.tie_word_embeddings else [])
    trainable = layer
    if setup.adapters:
        trainable = []
        for l in adapted_linears(model, setup):
            trainable += [(setup.lora_rank, l.in_features), (l.out_features, setup.lora_rank)] * (l.count // L)
    return layer, tail, [] if model.tie_word_embeddings else embed, trainable


def fsdp2_memory(model: ModelSpec, setup: Setup) -> FsdpMemory:
    """Model-state bytes per rank of ``setup`` under FSDP2 on ``setup.gpus`` ranks."""
    check_fsdp2(model, setup)  # what is not modelled is refused (setup/checks.py)
    L = max(model.num_layers, 1)
    n = shard_ranks(setup)  # hybrid sharding (dp_replicate): the shard group (estimator/hybrid_shard.py)
    mixed = fsdp_mixed(setup)
    w = int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])  # load dtype
    full = setup.method == "full"
    tb = 4 if (mixed or not full) else w  # trainable shards: fp32 masters / peft's fp32 adapters / as loaded
    cb = 2 if mixed else w  # gathered base weights (param_dtype, or as loaded)
    ab = 2 if mixed else 4  # gathered adapters
    layer, tail, embed, train = _group_tensors(model, setup)
    pad = lambda shapes: sum(_padded(s, n) for s in shapes)  # noqa: E731
    numel = lambda shapes: sum(math.prod(s) for s in shapes)  # noqa: E731
    base_shard = L * pad(layer) + pad(tail) + pad(embed)
    train_shard = base_shard if full else L * pad(train)
    # a 4-bit base's quant states (absmax, codes) are no parameters: whole on every rank
    quant_states = sum(l.count * (bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant) - -(-l.weight_params // 2))
                       for l in model.linears if l.role != "head") if setup.quant in ("nf4", "fp4") else 0
    shards = tb * base_shard if full else w * base_shard + tb * train_shard + quant_states
    states = _STATES[setup.optimizer] * tb * train_shard
    grad_shards = tb * train_shard
    step = tb * train_shard if setup.optimizer == "adamw" else 0  # foreach: one state-sized list
    gather = lambda shapes, b: b * n * pad(shapes)  # noqa: E731 (all-gather outputs: N * padded shard)
    layer_g = gather(layer, cb) + (0 if full else gather(train, ab))
    tail_g = gather(tail, cb)
    head = model.vocab_size * model.hidden_size if model.tie_word_embeddings else 0
    layer_grad = gather(train, cb if mixed else tb)  # unsharded gradients (param dtype)
    tail_grad = gather(tail, cb) if full else 0
    trainable_all = numel(train) * L + (numel(tail) + numel(embed) if full else 0)
    accum = (cb if mixed else tb) * trainable_all if setup.grad_accum > 1 else 0
    return FsdpMemory(
        shards=shards, states=states, grad_shards=grad_shards, root=tail_g, layer=layer_g, layer_grad=layer_grad,
        layer_grad_shard=tb * pad(train), root_grad=tail_grad, head_grad=cb * head if full else 0,
        accum_grads=accum, keep_layers=setup.fsdp == "shard_grad_op", step=step, host=0, version=2,
        embed=gather(embed, cb), ag_last=layer_g if model.tie_word_embeddings else tail_g,
        first_grad=max((gather([t], cb if mixed else tb) for t in train), default=0),
        ar_held=held_reduce_bytes(setup, pad(train)),
        ar_held_end=held_reduce_bytes(setup, L * pad(train) + (pad(tail) + pad(embed) if full else 0)))


def sharded_memory(model: ModelSpec, setup: Setup) -> FsdpMemory:
    """FSDP1's or FSDP2's per-rank model states (``setup.fsdp_version``)."""
    return fsdp2_memory(model, setup) if setup.fsdp_version == 2 else fsdp_memory(model, setup)


def sharded_phase_peaks(model: ModelSpec, setup: Setup, fm: FsdpMemory, act, reentrant: bool = False) -> dict[str, int]:
    """FSDP1's or FSDP2's per-rank phase peaks (``act``: estimator/distributed.py StepActivations;
    ``reentrant``: reentrant checkpointing, what it does to FSDP1: fsdp_phase_peaks)."""
    if fm.version != 2:
        return fsdp_phase_peaks(model, setup, fm, act, reentrant)
    L = max(model.num_layers, 1)
    tied = model.tie_word_embeddings
    base = fm.static + fm.accum_grads
    # shard_grad_op: every layer and an untied embedding stay gathered from forward to backward
    kept = L * fm.layer + fm.embed if fm.keep_layers else 0
    # the loss runs in the root's forward: the tail (norm, head; tied, the embedding too) is
    # gathered and the last group's all-gather buffer still held
    forward = base + fm.root + kept + fm.ag_last + act.at_loss
    start = base + fm.root + kept + act.backward_start
    # inside the top layer: it and the prefetched one below; the tail's gradients (tied: the head's
    # in the embedding's unsharded gradient; untied: the tail's reduce-scatter input)
    two = kept or 2 * fm.layer
    tail = fm.root if tied else 0
    top = base + tail + two + (fm.head_grad if tied else fm.root_grad) + act.top_layer
    # the layers done hold their sharded gradients (hybrid sharding: also their reduce outputs)
    done = (fm.layer_grad_shard + fm.ar_held) * (L - 1) if not fm.accum_grads else 0
    rs = fm.layer_grad if not fm.accum_grads else 0  # the layer above's reduce-scatter input
    # the bottom layer: the layer above's reduce-scatter input is held; its own gradients appear one
    # parameter at a time (no flat gradient), so at its MLP's backward only the widest one is there;
    # at its end its unsharded gradients and its own reduce-scatter input coexist
    bottom = base + tail + fm.layer + fm.embed + fm.head_grad + done + max(
        rs + fm.first_grad + act.bottom_layer, 2 * fm.layer_grad + act.end)
    held = fm.ar_held_end if not fm.accum_grads else 0  # hybrid sharding: held to finalize_backward
    end = base + tail + (fm.grad_shards if not fm.accum_grads else 0) + 2 * fm.root_grad + held + act.end
    backward = max(start, top, bottom, end)
    optimizer = fm.static + fm.grad_shards + fm.step
    return {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
