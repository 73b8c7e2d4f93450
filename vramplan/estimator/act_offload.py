"""Activation offloading (``--activation-offload``): TRL 1.16's ``OffloadActivations``.

What runs (trl/models/activation_offloading.py, TRL 1.16, copied from torchtune's
``training/_activation_offloading.py`` and since grown a storage deduplication, a parameter-storage
filter and stash clearing on enter/exit: torchtune's own, held over its model's forward only, is not
modelled, readers/torchtune.py): ``SFTTrainer.training_step``
holds ``get_act_offloading_ctx_manager(model)`` (``use_streams=True``, ``min_offload_size=1024``,
``max_fwd_stash_size=5``) over the forward and backward. Its ``pack_tensor`` sees every tensor
autograd saves outside the output head (``lm_head`` runs under a ``NoOpManager``) and copies it to
host RAM unless it is under 1024 bytes, a parameter (or a view of one's storage:
``update_model_params``), on the CPU already, or a storage already offloaded in this forward
(``storage_to_tensor_id``: such a second save keeps its *device* tensor). The last offloaded
tensors stay on the device in ``fwd_stash`` (ids within ``max_fwd_stash_size`` of the newest) and
are handed back from there in the backward; the rest come back one autograd node at a time.

With HF gradient checkpointing (non-reentrant), saved tensors inside a checkpointed layer go to the
checkpoint's own hooks (the innermost ``saved_tensors_hooks`` wins): what reaches the offloader is
each layer's input (``_NoopSaveInputs.save_for_backward``) and what is saved outside the layers
(embedding indices, the final norm, the fp32 log-probabilities, the labels). Read off ``vramplan
trace`` of the real manager (vramplan/run/act_offload.py), the device moments are:

- **the loss** (the forward's peak): every layer input is in host RAM except those still in the
  forward stash (the final norm's saves are the newest offloads: :func:`_stashed_layer_inputs`)
  and, with adapters, the first layer's: peft's ``enable_input_require_grads`` makes the embedding
  output a leaf, held by its AccumulateGrad node whatever the manager does. The manager adds a clone
  of the shifted labels (a view at a storage offset) and, with adapters, the previous step's
  :func:`stale_bytes` (its ``curr_autograd_node`` keeps that leaf and its gradient alive);
- **the start of the backward**: the stash is emptied by the first node that unpacks, so every
  offloaded tensor that is not also kept is off the device (:func:`backward_start_saving_bytes`);
- **the layers' backward**: each input comes back as its layer is recomputed; the previous node's stay
  until the next node's post hook, so the top layers' backward holds two layers' inputs and the
  resident one (:func:`top_layers_saving_bytes`); **the optimizer step**: the stale pair again.

Modelled: full fine-tuning and LoRA with checkpointing, a 16-bit step on a 16-bit base,
transformers' loss, one GPU, the RMSNorm families (Llama, Qwen, Mistral; Gemma's fp32 ``1 + w``; Gemma 2 under
TRL's fused head, which soft-caps inside its tiles: tests/test_act_offload.py), with
gradient accumulation (the manager is entered once per micro-step); with TRL's ``use_liger_kernel`` (Liger's
layer kernels beside TRL's fused head: the final norm's saves are Liger's, :func:`_final_norm`).
Refused, each with its reason
(setup_checks.check_activation_offload): no checkpointing (every saved tensor is offloaded, but the
storage deduplication keeps each tensor saved twice within the stash window on the device: the
norms' fp32 inputs and their normalised outputs that q/k/v and gate/up all save; this is why
offloading everything can take
*more* device memory than checkpointing alone, axolotl#3733: docs/knobs.md), and the combinations not
traced.

The host copies (``use_pin_memory=True``: pinned) are the one host term: :func:`host_bytes`.
"""

from __future__ import annotations

from ..specs import Component, ModelSpec, Setup
from . import activations as act
from . import precision

__all__ = ["COPY_EXPOSURE", "MAX_FWD_STASH", "MIN_OFFLOAD_BYTES", "backward_start_saving_bytes",
           "components", "device_saving_bytes", "exposed_copy_bytes_per_micro_step", "host_bytes", "stale_bytes",
           "top_layers_saving_bytes"]

#: OffloadActivations(min_offload_size=1024): smaller saved tensors stay on the device (TRL 1.16).
MIN_OFFLOAD_BYTES = 1024
#: OffloadActivations(max_fwd_stash_size=5): offloaded tensors kept on the device in the forward stash.
MAX_FWD_STASH = 5


def _sized(nbytes: float) -> float:
    return nbytes if nbytes >= MIN_OFFLOAD_BYTES else 0.0


def _layer_input(model: ModelSpec, setup: Setup) -> float:
    return _sized(act.checkpoint_bytes_per_token(model, setup) * setup.tokens)


def _before_layers(model: ModelSpec, setup: Setup) -> list[float]:
    """What the manager packs before the first layer's input, in order (0: kept on the device): the
    embedding's indices (full fine-tuning; Gemma's ``* normalizer`` also saves its 0-d scalar)."""
    if setup.method != "full":
        return []
    return [_sized(8 * setup.tokens)] + ([0.0] if model.family.startswith("gemma") else [])


def _final_norm(model: ModelSpec, setup: Setup) -> list[float]:
    """The final norm's saves in the order the manager packs them (0: kept), read off the trace of
    transformers 5.24's RMSNorm: the fp32 input, the rsqrt, then both again (``x * rsqrt`` and the
    ``pow``: deduplicated, their device tensors kept), then ``weight * x``'s: the weight itself (a
    parameter: kept) or Gemma's fp32 ``1 + weight``, and with a trainable weight the normalised tensor. With
    Liger's kernels (TRL's ``use_liger_kernel``: the layer kernels, TRL's own fused head; liger-kernel 0.8.5
    ops/rms_norm.py) the input, the weight and one fp32 rstd a row, read off SFTTrainer's real step with the
    kernels' stand-ins (vramplan/run/liger.py)."""
    N, h, c = setup.tokens, model.hidden_size, precision.compute_bytes(setup)
    full = setup.method == "full"
    if setup.liger:  # LigerRMSNormFunction.save_for_backward(X, W, RSTD): the 16-bit input, the weight (a
        return [_sized(c * h * N), 0.0, _sized(4 * N)]  # parameter, trainable or not: kept), fp32 rstd a row
    head = [_sized(4 * h * N), _sized(4 * N), 0.0, 0.0]
    if model.traits.norm == "rms":
        return head + ([_sized(c * h * N)] if full else []) + [0.0]
    return head + [_sized(4 * h)] + ([_sized(4 * h * N)] if full else [])  # rms_fp32_mul


def _stashed_layer_inputs(model: ModelSpec, setup: Setup) -> int:
    """Layer inputs still in the forward stash at the loss (the head's log_softmax): the stash keeps an
    offloaded tensor until a newer one is offloaded ``max_fwd_stash_size`` (5) pack ids later."""
    L = model.num_layers
    packs = [*_before_layers(model, setup), *([_layer_input(model, setup)] * L), *_final_norm(model, setup)]
    last = max((i for i, n in enumerate(packs, 1) if n), default=0)  # the newest offload's id
    first_layer = len(_before_layers(model, setup)) + 1
    return sum(1 for i in range(first_layer, first_layer + L) if packs[i - 1] and i > last - MAX_FWD_STASH)


def _resident_inputs(setup: Setup) -> int:
    """Layer inputs on the device whatever the manager does: with adapters, the embedding output that
    peft's ``enable_input_require_grads`` turns into a leaf is held by its AccumulateGrad node."""
    return 1 if setup.method != "full" else 0


def stale_bytes(model: ModelSpec, setup: Setup) -> int:
    """Device bytes of the previous step the manager still holds in the next forward: its
    ``curr_autograd_node`` (the last backward node that unpacked an offloaded tensor) keeps the graph
    below it, down to the AccumulateGrad of that leaf embedding output (adapters): the leaf and its
    ``.grad``, until the next backward's first unpack replaces the node."""
    if not setup.activation_offload or setup.method == "full":
        return 0
    return int(2 * _layer_input(model, setup))


def device_saving_bytes(model: ModelSpec, setup: Setup) -> int:
    """Device bytes offloading frees at the loss (the forward's peak): the layer inputs neither in the
    forward stash nor resident, less the previous step's stale pair (:func:`stale_bytes`) and the one copy
    the manager adds there: the shifted labels (``labels[..., 1:]``, a view at storage offset 1) are
    cloned before their host copy (``pack_tensor``; 8 bytes a token)."""
    if not setup.activation_offload:
        return 0
    L, N = model.num_layers, setup.tokens
    stashed = _stashed_layer_inputs(model, setup)  # the last layers'; the resident one is the first layer's
    moved = L - stashed - (_resident_inputs(setup) if stashed < L else 0)
    return int(moved * _layer_input(model, setup) - stale_bytes(model, setup) - _sized(8 * N))


#: Layer inputs on the device through the backward besides the resident one: the layer whose recompute
#: unpacked its input and the one before it, which ``bwd_tensor_stash`` keeps until the next node's post
#: hook. Read off ``vramplan trace`` of the real manager, Mistral-7B LoRA with checkpointing at 8 and 16
#: layers, seq 16k and 32k: the backward's peak holds exactly two layer inputs more than "all offloaded"
#: (+277 MB at 16k, +554 MB at 32k, whatever the depth).
ON_DEVICE_IN_BACKWARD = 2


def backward_start_saving_bytes(model: ModelSpec, setup: Setup) -> int:
    """Device bytes offloading frees at the start of the backward: the first node that unpacks an
    offloaded tensor empties the forward stash, so every offloaded tensor that is not also kept
    (deduplicated, resident) is in host RAM, the layer inputs (but :data:`ON_DEVICE_IN_BACKWARD`) and
    the final norm's normalised tensor."""
    if not setup.activation_offload:
        return 0
    N, h = setup.tokens, model.hidden_size
    norm = 0.0
    if setup.method == "full":
        norm = (_sized(precision.compute_bytes(setup) * h * N) if model.traits.norm == "rms"
                else _sized(4 * h) + _sized(4 * h * N))
    return int(top_layers_saving_bytes(model, setup) + norm)


def top_layers_saving_bytes(model: ModelSpec, setup: Setup) -> int:
    """Device bytes offloading frees while the top layers are recomputed and back-propagated: each layer
    input comes back when its layer's recompute unpacks it, and ``bwd_tensor_stash`` keeps the previous
    node's tensors until the next node's post hook, so :data:`ON_DEVICE_IN_BACKWARD` layers' inputs are on
    the device, the resident one beside them; the rest stay in host RAM."""
    if not setup.activation_offload:
        return 0
    moved = model.num_layers - _resident_inputs(setup) - ON_DEVICE_IN_BACKWARD
    return int(max(moved, 0) * _layer_input(model, setup))


def host_bytes(model: ModelSpec, setup: Setup) -> int:
    """Host RAM of the copies at the end of the forward (pinned): each saved storage of 1024 bytes
    or more outside the head, once: the embedding's indices (full fine-tuning), the layer inputs,
    the final norm's saves, the fp32 log-probabilities (TRL's fused head: the head's input) and the labels."""
    if not setup.activation_offload:
        return 0
    N, V, L = setup.tokens, model.vocab_size, model.num_layers
    packs = [*_before_layers(model, setup), *([_layer_input(model, setup)] * L), *_final_norm(model, setup)]
    # the loss's save: transformers' fp32 log-probabilities, or (TRL's fused head, --loss trl) the head's input
    # its chunked log-prob function keeps (read off SFTTrainer's real step: validate --knob activation_offload)
    loss = _sized(precision.compute_bytes(setup) * model.hidden_size * N) if setup.loss == "trl" else _sized(4 * V * N)
    return int(sum(packs) + loss + _sized(8 * N))


def components(model: ModelSpec, setup: Setup) -> tuple[Component, ...]:
    """The host term of the Breakdown (none without offloading)."""
    if not setup.activation_offload:
        return ()
    return (Component("activation_offload_host", host_bytes(model, setup), ("forward", "backward"), where="host",
                      note="TRL 1.16 OffloadActivations' pinned host copies (estimator/act_offload.py)"),)


#: Share of the offloader's copies not hidden behind compute (cost/model.py prices the rest of the host link's
#: time as zero): TRL's manager copies on a side stream (``s1``) and makes the compute stream wait only
#: for copies five saved tensors old (forward) or the tensor a node needs now (backward). A rough reading
#: of axolotl#3776's Qwen3-8B table (seq 8192: "trl_gc" 2758 ms/step vs "gc" 2678 ms, 2.34 GB of host
#: copies), not fitted: no published tokens/s row with activation offloading.
COPY_EXPOSURE = 0.5


def exposed_copy_bytes_per_micro_step(model: ModelSpec, setup: Setup) -> float:
    """Bytes of one micro-step's host copies (each offloaded tensor out in the forward and back in
    the backward) that the step waits for: ``2 x host_bytes x COPY_EXPOSURE``."""
    return 2 * host_bytes(model, setup) * COPY_EXPOSURE if setup.activation_offload else 0.0
