"""PyTorch FSDP (as accelerate launches it) and plain data parallelism (DDP): what each rank holds.

FSDP. vramplan launches FSDP1 through accelerate (vramplan/emit/accelerate.py: ``fsdp_version: 1``,
TRANSFORMER_BASED_WRAP, BACKWARD_PRE, ``use_orig_params``, ``mixed_precision`` from the Setup).
What a rank holds follows torch 2.13's ``torch/distributed/fsdp`` (``_flat_param.py``,
``_runtime_utils.py``) and accelerate 1.15's ``Accelerator.prepare_model``; every term below was
read off the real N-process run of ``vramplan.truths.fsdp`` (docs/commands/validate.md, knob fsdp):
- units: each decoder layer is one FSDP unit (one FlatParameter), the root unit holds what is left
  (embeddings, the final norm, an untied head); under LoRA the HF Trainer installs peft's
  ``fsdp_auto_wrap_policy``, which makes every adapter Linear its own unit as well;
- each unit is padded to a multiple of the ranks and sharded (NO_SHARD: not sharded; FULL_SHARD on
  one rank is NO_SHARD);
- mixed precision (the ``-mixed`` precisions: accelerate ``mixed_precision`` bf16/fp16):
  ``MixedPrecision(param_dtype, reduce_dtype)`` and accelerate upcasts every *trainable* flat
  parameter to fp32 (as DeepSpeed keeps fp32 masters): the shard, its gradient and the optimizer
  states are fp32; frozen units (the LoRA base) stay in the load dtype; the forward and backward
  run on 16-bit unsharded copies, the adapters too (so peft's adapter inputs are not upcast);
- pure 16-bit (bf16, fp16: accelerate ``mixed_precision: no`` on a 16-bit-loaded model, as on one
  GPU): no policy, no upcast; FSDP shards the parameters as loaded, so a full fine-tune's shards,
  gradients and AdamW states are 16-bit; peft's adapters stay fp32 (their own units) and run in
  fp32 on fp32 casts of their inputs;
- unsharded parameters: the root unit is gathered at the first forward and kept until the end of
  the backward (FSDP1 does not reshard the root after the forward); a layer unit is gathered for
  its forward and freed after it (FULL_SHARD, NO_SHARD's low-precision copy) or kept until its
  backward (SHARD_GRAD_OP); the backward gathers the next unit while one runs (BACKWARD_PRE), so
  two layer units are gathered at once, one already at the start of the backward (not under
  reentrant checkpointing, transformers 4.x's default: ``fsdp_phase_peaks``);
- gradients: a unit's parameters' gradients are views of one unsharded flat gradient (16-bit) that
  autograd assembles when the unit's backward ends; it is reduce-scattered, cast to the shard's
  dtype and accumulated into the sharded ``.grad`` the optimizer steps; the root's gradient (the
  head's, and with tied embeddings the embedding's) is held from the start of the backward to its end;
- gradient accumulation: accelerate's ``accumulate()`` runs all but the last micro-batch under
  ``no_sync()``, where each unit keeps its unsharded 16-bit gradient on the device (the whole
  model's worth, even with CPU offload) until the last micro-batch reduce-scatters;
- LoRA: peft reads an adapter's (fp32, sharded) parameter dtype and casts the adapter's input to
  fp32; autocast casts it back to 16 bits for the gathered weight, so each adapter saves its own
  16-bit copy of its input (vramplan/estimator/activations.py, ``_adapter_bytes_per_layer``);
- CPU offload (``CPUOffload(offload_params=True)``, Setup ``offload_params="cpu"``): the shards,
  their gradients and the optimizer states live in host RAM and the optimizer steps there; the
  device holds the unsharded 16-bit copies, the unsharded gradients and the activations.

DDP (several GPUs, neither ZeRO nor FSDP): ``DistributedDataParallel`` as accelerate/the HF Trainer
build it (``bucket_cap_mb=25``, ``gradient_as_bucket_view=False``): the Reducer allocates flat
buckets covering every trainable parameter at construction, a second copy of the gradients kept for
the whole run (torch/csrc/distributed/c10d/reducer.cpp, ``initialize_buckets``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..specs import ModelSpec, Setup
from ..util.units import (
    BNB_MIN_8BIT_SIZE,
    DTYPE_BYTES,
    PRECISION_WEIGHT_DTYPE,
    bnb_4bit_tensor_bytes,
)
from .hybrid_shard import shard_ranks
from .knobs import fsdp_copy_shard_bytes
from .lora import lora_params
from .optimizers import linear_and_other_tensors

#: Setup.precision -> whether accelerate runs FSDP with a MixedPrecision policy (emit/accelerate.py
#: ``MIXED_PRECISION``: pure bf16, pure fp16 and fp32 run without one).
_FSDP_MIXED = {"bf16": False, "bf16-mixed": True, "fp16": False, "fp16-mixed": True, "fp32": False}

#: Optimizer states per trainable shard element: AdamW's two moments and SGD's momentum in the
#: shard's dtype (this many times its bytes); the others in fixed bytes (Lion's fp32 momentum,
#: Adafactor's full second moment on 1-D shards, paged 8-bit AdamW's uint8 states and block scales;
#: 8-bit AdamW per original parameter's slice: _bnb_8bit_states).
_STATE_PER_ELEMENT = {"adamw": 2, "adamw-fused": 2, "sgd": 1}
_STATE_FIXED = {"lion": 4, "adafactor": 4, "paged-adamw-8bit": 2 * (1 + 4 / 256)}


def is_ddp(setup: Setup) -> bool:
    """Plain data parallelism: several GPUs, neither ZeRO nor FSDP (nor one process's layer split)."""
    return setup.gpus > 1 and not setup.zero_stage and setup.fsdp == "none" and setup.device_map == "none"


def ddp_bucket_bytes(gradient_bytes: int) -> int:
    """DDP's gradient buckets: one flat copy of every trainable gradient, in its dtype
    (``gradient_as_bucket_view=False``, accelerate's and the HF Trainer's default)."""
    return gradient_bytes


def fsdp_mixed(setup: Setup) -> bool:
    return _FSDP_MIXED[setup.precision]


@dataclass(frozen=True)
class FsdpMemory:
    """Per-rank bytes of one FSDP setup's model states (device terms; ``host`` with CPU offload)."""

    shards: int  # sharded flat parameters (fp32 masters of trainable units under mixed precision)
    states: int  # optimizer states over the trainable shards
    grad_shards: int  # sharded gradients (the shards' dtype), from a unit's reduce-scatter to zero_grad
    root: int  # the root unit's unsharded 16-bit parameters (first forward to end of backward)
    layer: int  # one layer unit's unsharded parameters (16-bit compute dtype)
    layer_grad: int  # one layer unit's unsharded gradient (compute dtype); 0 when it does not train
    layer_grad_shard: int  # one layer unit's sharded gradient (the shard's dtype)
    root_grad: int  # the root unit's unsharded gradient (the head's is held through the backward)
    head_grad: int  # the head's (or tied embedding's) gradient held from the start of the backward
    accum_grads: int  # with grad accumulation: the unsharded gradients no_sync() keeps (on the device)
    keep_layers: bool  # SHARD_GRAD_OP: every layer unit stays gathered from its forward to its backward
    step: int  # the optimizer step's transient on the device
    host: int
    host_terms: tuple[tuple[str, int], ...] = ()
    version: int = 1  # accelerate fsdp_version (2: estimator/fsdp2.py, whose terms reuse these fields)
    embed: int = 0  # FSDP2: an untied embedding's gathered group (its forward, and the end of the backward)
    ag_last: int = 0  # FSDP2: the flat all-gather buffer of the group gathered last in the forward
    first_grad: int = 0  # FSDP2: the widest unsharded gradient of a layer (the first one its backward makes)
    ar_held: int = 0  # FSDP2 hybrid sharding: a layer's reduce output held for its all-reduce (hybrid_shard.py)
    ar_held_end: int = 0  # ... every group's (the tail's too), all held at the end of the backward

    @property
    def static(self) -> int:
        return self.shards + self.states


def _root_params(model: ModelSpec) -> int:
    """Parameters of the root unit: embeddings, an untied head, the final norm."""
    embed = sum(n for name, n in model.other_params if name == "embed_tokens")
    head = sum(l.params for l in model.linears if l.role == "head")
    final_norm = model.hidden_size * (2 if model.norm_kind == "layernorm" else 1)
    return embed + head + final_norm


def _packed_layer(model: ModelSpec, setup: Setup) -> tuple[int | None, int, int]:
    """A bitsandbytes 4-bit base under FSDP: (packed bytes of one layer unit's quantized weights,
    its other parameters (norms, biases), every quant state's bytes); (None, 0, 0) otherwise.
    The emitted train.py loads the base without ``prepare_model_for_kbit_training`` under FSDP
    (its fp32 upcast of norms and embeddings would give a unit two dtypes, which FSDP refuses):
    the parameters outside the Linears stay in the load dtype."""
    if setup.quant not in ("nf4", "fp4"):
        return None, 0, 0
    L = max(model.num_layers, 1)
    quantized = [l for l in model.linears if l.role != "head"]
    packed = sum(l.count * -(-l.weight_params // 2) for l in quantized)
    states = sum(l.count * (bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant) - -(-l.weight_params // 2))
                 for l in quantized)
    layer_p = (model.params_total - _root_params(model)) // L
    rest = layer_p - sum(l.count * l.weight_params for l in quantized) // L
    return packed // L, rest, states


def _unit_tensors(model: ModelSpec, setup: Setup) -> list[tuple[list[tuple[int, bool]], int]]:
    """The trainable FSDP units, each as ([(numel, is an nn.Embedding weight)] in flattening
    order, how many such units): the root (embeddings, final norm, an untied head) and a layer
    (its Linears in module order, then its norms) for full fine-tuning; each adapter Linear its
    own unit under LoRA (peft's ``fsdp_auto_wrap_policy``)."""
    L = max(model.num_layers, 1)
    if setup.adapters:
        return [([(math.prod(shape), False)], count) for shape, count in linear_and_other_tensors(model, setup)]
    embed = [(n, True) for name, n in model.other_params if name == "embed_tokens"]
    head = [(l.weight_params, False) for l in model.linears if l.role == "head"]
    root = embed + [(model.hidden_size, False)] + head
    layer: list[tuple[int, bool]] = []
    for shape, count in linear_and_other_tensors(model, setup):
        n = math.prod(shape)
        if shape == (model.vocab_size, model.hidden_size) and any(l.role == "head" for l in model.linears):
            continue  # the head: in the root unit
        layer += [(n, False)] * (count // L)
    return [(root, 1), (layer, L)]


def _bnb_8bit_states(model: ModelSpec, setup: Setup, n: int) -> int:
    """bitsandbytes 8-bit AdamW states on the fullest rank. With ``use_orig_params`` the optimizer
    steps each original parameter's slice of the rank's shard (a 1-D view, empty when the shard
    holds none of it): a slice under ``min_8bit_size`` gets two fp32 states, as do embedding
    slices (the HF Trainer's 32-bit override); others two uint8 states and an fp32 absmax per
    256-element block (estimator/optimizers.py). Each unit is padded to a multiple of the ranks
    and split into equal contiguous shards."""
    per_rank = [0] * n
    for tensors, count in _unit_tensors(model, setup):
        chunk = _shard(sum(t for t, _ in tensors), n)
        for r in range(n):
            lo, hi, offset, total = r * chunk, (r + 1) * chunk, 0, 0
            for numel, embedding in tensors:
                k = max(0, min(hi, offset + numel) - max(lo, offset))
                offset += numel
                if k == 0:
                    continue
                total += 8 * k if embedding or k < BNB_MIN_8BIT_SIZE else 2 * k + 8 * -(-k // 256)
            per_rank[r] += count * total
    return max(per_rank)


def _shard(n: int, ranks: int) -> int:
    return -(-n // ranks)


def fsdp_memory(model: ModelSpec, setup: Setup) -> FsdpMemory:
    """Model-state bytes per rank of ``setup`` under FSDP on ``setup.gpus`` ranks (a bitsandbytes
    4-bit base's units are built here from the model, :func:`_packed_layer`)."""
    L = max(model.num_layers, 1)
    n = 1 if setup.fsdp == "no_shard" else shard_ranks(setup)  # hybrid sharding: its shard group
    # FSDP runs any sharded strategy on one rank as NO_SHARD
    keep_layers = setup.fsdp == "shard_grad_op" and n > 1
    mixed = fsdp_mixed(setup)
    w = int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])  # load dtype
    cb = 2 if mixed else w  # compute dtype of the unsharded copies
    tb = 4 if mixed else w  # a trainable shard's dtype (accelerate upcasts it under mixed precision)
    root_p = _root_params(model)
    layer_p = (model.params_total - root_p) // L
    full = setup.method == "full"
    # a bitsandbytes 4-bit base: each layer unit flattens its packed weights (stored in the load
    # dtype, bnb_4bit_quant_storage) with its norms; the quant states are no parameters and stay
    # whole on every rank (see _packed_layer)
    packed, rest, quant_states = _packed_layer(model, setup)
    layer_elems = layer_p if packed is None else -(-packed // w) + rest
    unit_shards = _shard(root_p, n) + L * _shard(layer_elems, n)
    if full:
        trainable_shard = unit_shards
        shards = tb * unit_shards
    else:  # frozen base in its load dtype; adapters (peft's fp32) in their own units
        trainable_shard = _shard(lora_params(model, setup), n)
        tb = 4
        shards = w * unit_shards + quant_states + tb * trainable_shard
    if setup.optimizer in _STATE_PER_ELEMENT:
        states = int(_STATE_PER_ELEMENT[setup.optimizer] * tb * trainable_shard)
    elif setup.optimizer == "adamw-8bit":
        states = _bnb_8bit_states(model, setup, n)
    else:
        states = int(_STATE_FIXED[setup.optimizer] * trainable_shard)
    grad_shards = tb * trainable_shard
    step = tb * trainable_shard if setup.optimizer == "adamw" else 0  # foreach: one state-sized list
    if setup.modules_to_save.strip() and not full:  # peft's trained copies: units of their own (estimator/knobs.py)
        copy = fsdp_copy_shard_bytes(model, setup, n)
        shards, grad_shards = shards + copy, grad_shards + copy
        states += int(_STATE_PER_ELEMENT[setup.optimizer] * copy)
        step += copy if setup.optimizer == "adamw" else 0
    # unsharded copies: with NO_SHARD and no cast the flat parameter itself is used
    copies = not (n == 1 and not mixed and full) and not (n == 1 and not full)
    root = cb * root_p if copies else 0
    layer = (cb * layer_p if packed is None else packed + cb * rest) if copies else 0
    if not full and keep_layers:
        # SHARD_GRAD_OP keeps every unit gathered from its forward to its backward, a layer's
        # adapter units too (cast to 16 bits; without a policy their fp32 flat parameters);
        # FULL_SHARD regathers them one at a time in backward
        layer += (cb if mixed else 4) * lora_params(model, setup) // L
    head = sum(l.weight_params for l in model.linears if l.role == "head") or (
        model.vocab_size * model.hidden_size if model.tie_word_embeddings else 0)
    layer_grad = cb * layer_p if full else 0
    layer_grad_shard = tb * _shard(layer_p, n) if full else 0
    root_grad = cb * root_p if full else 0
    head_grad = cb * head if full else 0
    # accelerate's accumulate() runs all but the last micro-batch under no_sync(): every unit keeps
    # its unsharded gradient (the compute dtype) on the device until the last one reduce-scatters
    trainable_all = model.params_total if full else lora_params(model, setup)
    accum_grads = (2 if mixed else tb) * trainable_all if setup.grad_accum > 1 else 0
    if setup.modules_to_save.strip() and not full and setup.grad_accum > 1:  # the copies' unsharded gradients
        accum_grads += fsdp_copy_shard_bytes(model, setup, 1) // (2 if mixed else 1)
    host_terms: tuple[tuple[str, int], ...] = ()
    host = 0
    if setup.offload_params == "cpu":
        host_terms = (("sharded parameters", shards), ("sharded gradients", grad_shards),
                      ("optimizer states", states), ("optimizer step", step))
        host = shards + grad_shards + states + step
        shards = states = grad_shards = step = layer_grad_shard = 0
    return FsdpMemory(shards=shards, states=states, grad_shards=grad_shards, root=root, layer=layer,
                      layer_grad=layer_grad, layer_grad_shard=layer_grad_shard, root_grad=root_grad,
                      head_grad=head_grad, accum_grads=accum_grads, keep_layers=keep_layers, step=step, host=host,
                      host_terms=tuple((k, v) for k, v in host_terms if v))


def fsdp_phase_peaks(model: ModelSpec, setup: Setup, fm: FsdpMemory, act, reentrant: bool = False) -> dict[str, int]:
    """Per-rank device peak of each phase under FSDP (``act``: the single-GPU activation moments,
    ``vramplan.estimator.distributed.StepActivations``; FSDP runs the model's own forward and
    backward on the gathered parameters). ``reentrant``: reentrant checkpointing of every layer
    (transformers 4.x's default, estimator/stack.py), which changes two things (torch
    distributed/fsdp/_runtime_utils.py and autograd/graph.py, read in 2.13; the published 2.4.1
    rows show both, calibration/published/README.md):
    - no prefetch: each layer's first forward runs under ``no_grad``, so
      ``_register_pre_backward_hooks`` returns before it sets the unit's
      ``_needs_pre_backward_unshard``, which ``_get_handle_to_prefetch`` requires: BACKWARD_PRE
      gathers no next layer, one layer unit is gathered at a time;
    - a frozen layer unit (LoRA/QLoRA) gets ``_register_post_backward_reshard_only_hook`` in the
      recomputed forward: ``register_multi_grad_hook`` on the layer's input, there the checkpoint's
      detached leaf, whose closure holds the leaf's AccumulateGrad and so the leaf (its storage is
      the checkpointed input) and its ``.grad`` until ``_finalize_params`` removes the handle at the
      end of the backward: at layer k's backward 2 (L - 1 - k) - 1 layer inputs more than one
      process holds (2-rank CPU truth: +2,048 B per token per layer at hidden 1024, bf16)."""
    L = max(model.num_layers, 1)
    accum = fm.accum_grads
    base = fm.static + fm.root + accum
    layers_fwd = L * fm.layer if fm.keep_layers else 0
    forward = base + layers_fwd + act.at_loss
    prefetch = not reentrant
    # reentrant + frozen layer units: the layer inputs and their gradients kept to the end (act.end: one input)
    leak = act.end if reentrant and setup.method != "full" and setup.checkpoint_every == 1 and L > 1 else 0
    held = L * fm.layer if fm.keep_layers else fm.layer * prefetch  # SHARD_GRAD_OP: all; else the prefetched one
    start = base + held + act.backward_start
    # inside the top layer: it and the prefetched next one gathered, the head's gradient held (its
    # parameters' gradients appear as its activations and transients go)
    two = L * fm.layer if fm.keep_layers else (1 + prefetch) * fm.layer
    top = base + two + fm.head_grad + act.top_layer
    # the bottom layer: the other layers' gradient shards are in; at its end its parameters'
    # gradients and the flat gradient they are assembled into coexist
    done = fm.layer_grad_shard * (L - 1) if not accum else 0
    bottom = base + fm.layer + fm.head_grad + done + max(fm.layer_grad + act.bottom_layer,
                                                          2 * fm.layer_grad + act.end) + (2 * L - 3) * leak
    end = base + (fm.grad_shards if not accum else 0) + 2 * fm.root_grad + act.end + (2 * L - 1) * leak
    backward = max(start, top, bottom, end)
    optimizer = fm.static + fm.grad_shards + fm.step
    return {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
