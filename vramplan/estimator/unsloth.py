"""Unsloth's step (``--framework unsloth``): what it keeps on the device where transformers' step differs.

Read from the source of unsloth 2026.8.19 and unsloth-zoo 2026.8.13 (the PyPI wheels; Unsloth imports
only with a GPU, so nothing here is a CPU truth: each term is derived from the code named and is
checked against Unsloth's own published notebook peaks, docs/frameworks.md):

- **preparation** (setup/frameworks.py): ``unsloth_zoo.training_utils.prepare_model_for_training``
  upcasts only the LoRA weights to fp32; embeddings, head and norms keep the load dtype; the base is
  bitsandbytes nf4 with double quantization in the compute dtype (``FastLlamaModel.from_pretrained``),
  ``lm_head`` never quantized (``SKIP_QUANTIZATION_MODULES``).
- **offloaded checkpointing** (``use_gradient_checkpointing="unsloth"``, the default):
  ``unsloth_zoo/gradient_checkpointing.py`` ``UnslothCheckpointFunction.forward`` copies each
  checkpointed layer's input hidden states to a pinned host buffer when it needs a gradient and has
  more than ``MINIMUM_SIZE`` (2 MiB of elements / element size, i.e. 1 Mi bf16 elements) — all but the
  last checkpointed layer (``LAST_GC_INDEX``: "Don't offload the last layer"). The backward copies
  each back into one persistent device buffer (``GPU_BUFFERS``, resized to the largest hidden state),
  and a second one for double buffering (``GPU_BUFFERS_B``) kept while more than 512 MiB stays free
  after the first pass (``DOUBLE_BUFFER_HEADROOM``): :func:`device_checkpoint_bytes` counts both.
  Below ``max_seq_length`` 512 Unsloth falls back to plain checkpointing
  (``unsloth/models/_utils.py`` ``apply_unsloth_gradient_checkpointing``).
- **the fused cross-entropy** (``unsloth_zoo/fused_losses/cross_entropy_loss.py``, called from
  ``_CausalLM_fast_forward`` unless ``UNSLOTH_RETURN_LOGITS=1``): no N x V logits. The tokens are cut
  into ``n_chunks`` (:func:`chunks`: the fp32 logits of a chunk at most ``target_gb`` = min(half the
  free device memory at the first call, 4 GiB), rounded up to a multiple of 4); each chunk's
  loss and gradient run in one ``torch.func.grad_and_value`` call, compiled by default: its c-byte
  logits and their c-byte gradient are the chunk's transient (4 bytes per logit in bf16; the eager
  fallback's fp32 copies are not modelled). ``grad_inputs = torch.empty_like(hidden_states)`` is
  allocated in the forward and saved for the backward (:func:`loss_transients`).
- **the dequantization buffer**: ``unsloth/kernels/utils.py`` ``fast_dequantize(...,
  use_global_buffer=True)`` keeps one device buffer per GPU in the compute dtype, resized to the
  largest dequantized weight, for the run (:func:`dequantization_buffer_bytes`).

- **the recomputed layer** (:func:`recompute_bytes`): Unsloth's own decoder forward
  (``unsloth/models/llama.py`` ``LlamaDecoderLayer_fast_forward``) with its fused autograd functions
  (``unsloth/kernels/fast_lora.py``): ``LoRA_QKV`` saves its input X (the first norm's output) and
  returns Q, K, V (RoPE rotates Q and K in place, ``fast_rope_embedding``), the attention kernel
  keeps Q, K, V, its output and the fp32 log-sum-exp, ``LoRA_W`` (o_proj) keeps that output,
  ``fast_rms_layernorm`` keeps its input and an fp32 inverse RMS per row, ``LoRA_MLP`` keeps X, e
  (gate) and g (up) — not the SwiGLU product nor the down projection's input. Its backward builds DW
  (the intermediate-sized gradient) and overwrites e and g with the derivatives in place
  (``swiglu_DWf_DW_dfg_kernel``), writes dX into X (``inplace=True``) and dequantizes the up and gate
  weights outside the global buffer one at a time. Checked against Unsloth's README table of the
  longest context Llama-3.1-8B QLoRA r32 reaches per card size (docs/frameworks.md).

Not modelled: the dynamic
``-unsloth-bnb-4bit`` uploads keep some extra modules 16-bit (per checkpoint, not read: the plan names the one
Unsloth would load and the emitted config loads the plain upload, search/planner.py and emit/unsloth.py); padding-free
batches (Unsloth turns them on) change no tensor of a full-length batch. Torch-free."""

from __future__ import annotations

import dataclasses
import math

from ..specs import PHASES, Component, GpuSpec, ModelSpec, Setup
from ..util.units import GiB, MiB
from .precision import compute_bytes
from .tiled_mlp import tile_tokens

__all__ = ["CE_TARGET_CAP_BYTES", "LOSS_NOTE", "OFFLOAD_MIN_SEQ", "checkpoint_note", "chunks", "components",
           "llamafactory_gc", "llamafactory_gc_copy_bytes",
           "dequantization_buffer_bytes", "device_checkpoint_bytes", "fast_path", "host_bytes", "loss_transients",
           "offloads", "tiled_recompute_bytes",
           "on_card", "overhead_note", "recompute_bytes", "unsloth"]

#: ``_get_chunk_multiplier``: a chunk's fp32 logits at most min(half the free memory, 4 GiB)
CE_TARGET_CAP_BYTES = 4 * GiB
#: ``apply_unsloth_gradient_checkpointing``: below this max_seq_length, plain checkpointing
OFFLOAD_MIN_SEQ = 512
#: ``MINIMUM_SIZE``: a layer input of at most this many bytes stays on the device
MINIMUM_OFFLOAD_BYTES = 2 * MiB


def unsloth(setup: Setup) -> bool:
    return setup.framework == "unsloth"


def fast_path(model: ModelSpec, setup: Setup) -> bool:
    """Unsloth runs its own decoder forward and fused LoRA kernels (:func:`recompute_bytes`) for the model
    types of ``FastLanguageModel``'s dispatch (setup/frameworks.py ``UNSLOTH_FAST_PATH``); others go through
    ``FastModel``, transformers' modeling code compiled by unsloth-zoo: their recomputed layer is estimated as
    transformers' (an upper bound for the compiled one)."""
    from ..setup.frameworks import UNSLOTH_FAST_PATH

    return unsloth(setup) and model.model_type in UNSLOTH_FAST_PATH


def offloads(model: ModelSpec, setup: Setup) -> bool:
    """Unsloth's checkpointing copies the layer inputs to the host (long enough, large enough); so does
    LLaMA-Factory's ``use_unsloth_gc`` (:func:`llamafactory_gc`), always."""
    return llamafactory_gc(setup) or (
        unsloth(setup) and setup.checkpointing and setup.seq >= OFFLOAD_MIN_SEQ
        and setup.tokens * model.hidden_size * compute_bytes(setup) > MINIMUM_OFFLOAD_BYTES)


def llamafactory_gc(setup: Setup) -> bool:
    """LLaMA-Factory's ``use_unsloth_gc`` (0.9.5 ``model/model_utils/checkpointing.py``
    ``UnslothGradientCheckpointing``, its copy of Unsloth's 2024 checkpointer): each checkpointed layer's
    input goes to the host (``hidden_states.to("cpu", non_blocking=True)``, pageable), the last one too; the
    backward copies it back (``.to("cuda")``), recomputes the layer and back-propagates it, one layer at a
    time. On the device no persistent buffer: at the backward's peak two layer inputs' worth, read off the CPU
    truth (vramplan/truths/lf_gc_truth.py: one input fewer than that left the saving 15 % too large), the
    reloaded input and the input gradient the function returns beside it."""
    return setup.unsloth_gc and setup.checkpointing


def _input_bytes(model: ModelSpec, setup: Setup) -> int:
    return setup.tokens * model.hidden_size * compute_bytes(setup)


def device_checkpoint_bytes(model: ModelSpec, setup: Setup, kept_per_layer: float, layers: int) -> int:
    """What the checkpointed layers keep on the device: with the offload, the last layer's input and
    the two reload buffers; else every layer's."""
    if not offloads(model, setup):
        return int(layers * kept_per_layer)
    if llamafactory_gc(setup):  # two layer inputs' worth at the backward's peak (:func:`llamafactory_gc`)
        return int(2 * kept_per_layer)
    return int(kept_per_layer + 2 * _input_bytes(model, setup))


def llamafactory_gc_copy_bytes(model: ModelSpec, setup: Setup) -> int:
    """Bytes LLaMA-Factory's ``use_unsloth_gc`` copies between host and device per micro-step: every layer input
    out and back. ``non_blocking=True`` into pageable memory: the copies wait, none overlaps the compute."""
    return 2 * model.num_layers * _input_bytes(model, setup) if llamafactory_gc(setup) else 0


def host_bytes(model: ModelSpec, setup: Setup) -> int:
    """The pinned host copies of every checkpointed layer's input but the last (LLaMA-Factory's
    ``use_unsloth_gc``: pageable copies of every layer's)."""
    if not offloads(model, setup):
        return 0
    return (model.num_layers - (0 if llamafactory_gc(setup) else 1)) * _input_bytes(model, setup)


def chunks(model: ModelSpec, setup: Setup, free_bytes: int | None = None) -> int:
    """``get_chunk_size``: how many chunks the fused cross-entropy cuts the tokens into, for
    ``free_bytes`` free at its first call (None: a card with 8 GiB or more free, the 4 GiB cap)."""
    target = CE_TARGET_CAP_BYTES if free_bytes is None else min(0.5 * max(free_bytes, 1), CE_TARGET_CAP_BYTES)
    exact = setup.tokens * model.vocab_size * 4 / target
    if exact <= 1.0 + 1e-9:
        return 1
    return math.ceil(exact / 4 - 1e-9) * 4


def loss_transients(model: ModelSpec, setup: Setup, free_bytes: int | None = None) -> tuple[int, int]:
    """Bytes alive at the loss (forward) and at the start of the backward, beyond saved activations:
    ``grad_inputs`` (c N h, from the forward on) and one chunk's c-byte logits and their gradient."""
    c, N, V, h = compute_bytes(setup), setup.tokens, model.vocab_size, model.hidden_size
    chunk = math.ceil(N / chunks(model, setup, free_bytes))
    grad_inputs = c * N * h
    return int(grad_inputs + 2 * c * chunk * V), int(grad_inputs)


def recompute_bytes(model: ModelSpec, setup: Setup) -> int:
    """One layer recomputed and back-propagated through Unsloth's kernels (see the module docstring):
    what it saves, c (5 h + 2 kv + 2 i) + fp32 (2 + heads) per token, with the MLP backward's DW
    (c i per token), the incoming gradient (c h) and one weight dequantized outside the buffer."""
    c, N, h = compute_bytes(setup), setup.tokens, model.hidden_size
    i, kv = model.intermediate_size, model.kv_dim
    largest = max((l.weight_params for l in model.linears if l.role == "mlp"), default=0)
    dequant = c * largest if setup.quant in ("nf4", "fp4") else 0
    if setup.tiled_mlp:
        return tiled_recompute_bytes(model, setup) + dequant
    saved = c * (5 * h + 2 * kv + 2 * i) + 4 * (2 + model.num_heads)
    backward = c * (i + h)
    return int(N * (saved + backward) + dequant)


def tiled_recompute_bytes(model: ModelSpec, setup: Setup) -> int:
    """:func:`recompute_bytes` with the MLP tiled (estimator/tiled_mlp.py): the layer keeps the MLP's input and
    no e or g; the MLP's backward holds one tile's ``LoRA_MLP`` saves (X, e, g), its DW and its output beside the
    incoming gradient and ``x_gradients``, c (5 h + 2 kv + 2 h) N + c (3 i + h) per tile token. After it the
    attention's backward (FlashAttention-2's: dQ, dK, dV and an fp32 dQ accumulator, 4 h, beside the incoming
    gradient) can be the larger moment, once the MLP's input is freed; the greater of the two."""
    c, N, h = compute_bytes(setup), setup.tokens, model.hidden_size
    i, kv, fp32 = model.intermediate_size, model.kv_dim, 4 * (2 + model.num_heads)
    mlp = N * (c * (5 * h + 2 * kv + 2 * h) + fp32) + tile_tokens(model, setup) * c * (3 * i + h)
    attention = N * (c * (4 * h + 2 * kv) + fp32 + c * h + c * (h + 2 * kv) + 4 * h + 4 * model.num_heads)
    return int(max(mlp, attention))


def dequantization_buffer_bytes(model: ModelSpec, setup: Setup) -> int:
    """``fast_dequantize``'s global buffer: the largest 4-bit Linear's weight in the compute dtype."""
    if not unsloth(setup) or setup.quant not in ("nf4", "fp4"):
        return 0
    largest = max((l.weight_params for l in model.linears if l.role != "head"), default=0)
    return compute_bytes(setup) * largest


def on_card(model: ModelSpec, setup: Setup, gpu: GpuSpec, corrections, states_bytes: int, acts):
    """``acts`` (estimator/step.py StepActivationTerms) with the loss's chunks cut for the memory free when
    the fused loss first runs (``_get_chunk_multiplier`` is ``functools.cache``d: the first step's forward
    decides): ``torch.cuda.mem_get_info``'s free, the card's usable memory less the CUDA context and
    what the caching allocator holds then (estimator/corrections.py ``device_overheads``) for the model
    states (``states_bytes``: the weights and adapters; no gradients or optimizer states exist before the
    first optimizer step), the saved activations and the dequantization buffer."""
    from .corrections import DEFAULT_CORRECTIONS, device_overheads

    held = states_bytes + acts.layers + acts.model_io + dequantization_buffer_bytes(model, setup)
    _, _, device_total, _ = device_overheads(held, 1, gpu, corrections or DEFAULT_CORRECTIONS)
    fwd, bwd = loss_transients(model, setup, gpu.usable_memory_bytes - device_total)
    return dataclasses.replace(acts, logits_forward=fwd, logits_backward=bwd)


def overhead_note(setup: Setup, name: str, note: str) -> str:
    """A device term's note, with what Unsloth changes: it turns the caching allocator's expandable segments
    on at import (``unsloth_zoo/__init__.py``: ``PYTORCH_ALLOC_CONF=expandable_segments:True`` on torch
    2.10+ unless the user set it); the fragmentation fitted on runs of the default allocator is kept."""
    if name != "allocator_overhead" or not unsloth(setup):
        return note
    return (f"{note}; fitted with the default allocator, where Unsloth turns on expandable segments "
            "(usually less): an upper bound")


LOSS_NOTE = "Unsloth's fused cross-entropy: one chunk's logits and their gradient, grad_inputs"


def checkpoint_note(setup: Setup) -> str:
    """The checkpointed inputs' note under Unsloth's offloaded checkpointing ("" otherwise)."""
    if llamafactory_gc(setup):
        return ": two layer inputs' worth, the one reloaded for its backward (LLaMA-Factory's use_unsloth_gc)"
    return ": the last layer's and two reload buffers (Unsloth's offloaded checkpointing)" if (
        unsloth(setup) and setup.checkpointing) else ""


def components(model: ModelSpec, setup: Setup) -> tuple[Component, ...]:
    """The dequantization buffer and the host copies of the offloaded checkpointing (none without Unsloth)."""
    comps = []
    if dequantization_buffer_bytes(model, setup):
        comps.append(Component("dequantization_buffer", dequantization_buffer_bytes(model, setup), PHASES,
                               note="Unsloth's fast_dequantize global buffer: the largest weight, 16-bit"))
    if host_bytes(model, setup):
        note = ("LLaMA-Factory's use_unsloth_gc: the layer inputs copied to host RAM" if llamafactory_gc(setup)
                else "Unsloth's pinned copies of the layer inputs")
        comps.append(Component("checkpoint_offload_host", host_bytes(model, setup), ("forward", "backward"),
                               where="host", note=note))
    return tuple(comps)
