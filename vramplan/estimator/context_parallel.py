"""Context parallelism (``--cp N``) as accelerate 1.15 and the HF Trainer (transformers 5.24) run it:
one rank's share of the step, on torch 2.13's ring attention.

``ParallelismConfig(dp_shard_size=gpus / N, cp_size=N)`` (accelerate/parallelism_config.py) needs FSDP2;
``fsdp2_prepare_model`` shards every parameter over the joint ``dp_shard_cp`` mesh, i.e. all ``gpus``
GPUs, so the model states are FSDP2's on ``gpus`` ranks (estimator/fsdp2.py); each group of N GPUs
shares one micro-batch. ``Trainer._prepare_context_parallel_inputs``
adds ``shift_labels`` and ``position_ids`` to the batch and ``Accelerator.maybe_context_parallel`` (torch
``context_parallel``) shards ``input_ids``, ``labels``, ``shift_labels`` and ``position_ids`` along the
sequence (head-tail load balancing): every activation, the logits and the loss are those of
``seq / N`` tokens (:func:`local_setup`). Attention is torch 2.13's ring
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``); what it allocates beyond
a plain flash call is :func:`ring_backward_bytes`, at each layer's attention backward (the ring's
largest moment: :func:`attention_floor` is that moment for estimator/step.py). Beside them: the batch's
buffers (:func:`input_bytes`) and, with checkpointing, the causal mask transformers builds for the
load-balanced positions (:func:`mask_bytes`). Every term was read off the truth's live tensors at
each rank's peak (vramplan/truths/cp_truth.py, ``VRAMPLAN_CP_DETAIL``; ``vramplan validate --knob cp``).

K/V head count: transformers 5.24 calls SDPA with ``enable_gqa=True`` and K/V at their own head count
when there is no mask (``integrations/sdpa_attention.use_gqa_in_sdpa``; under CP accelerate's hooks
drop the mask, ``big_modeling._attach_context_parallel_hooks``). torch's CUDA dispatch
(aten/src/ATen/native/transformers/attention.cpp ``scaled_dot_product_attention``) hands flash (and
cuDNN) ``query, key, value`` unrepeated (only the last dim padded to 8): the repeat
(``pre_process_group_query_attention_input``) is on the math path alone, and flash admits grouped
heads (cuda/sdp_utils.cpp ``can_use_flash_attention``: ``backend_supports_grouped_query_attention =
true``). So the ring's all-gather and its dK/dV carry the KV heads, as modelled here (and as the
truth's stand-in kernel takes them, vramplan/truths/cp_truth.py).

Per layer, with q = b H s_l d and kv = b K s_l d elements (s_l = seq / N, c bytes per activation
element; rotate method "allgather", accelerate's default ``cp_comm_strategy``, torch's
``_cp_options.convert_to_f32 = True``), the backward (``_templated_ring_attention_backward``) holds at
its last ring step's block kernel:

- the fp32 accumulators ``grad_query`` / ``grad_key`` / ``grad_value`` (``zeros_like(..., float32)``):
  4 (q + 2 kv);
- the dK/dV all-to-all (``_AllToAllRotater``): the flat fp32 ``next_grad_kv`` it sent and the
  ``permute_tensor`` output it receives: 2 x 8 kv;
- K/V: ``_AllGatherRotater``'s all-gathered buffer of every rank's ``cat([k, v])`` (N x 2 c kv), this
  rank's last ``cat`` (2 c kv, alive to the end: ``next_kv`` is not reassigned at the last step) and,
  past 2 ranks, the first ``cat`` the all-gather was given (held with the gathered buffer on the truth);
- the previous block's dq, dk, dv beside the one being computed (``grad_query_`` ... reassigned when
  the kernel returns): one extra c (q + 2 kv) set;
- beside what a plain flash backward holds there: the attention output's gradient (c q) and the block
  kernel's dq, dk, dv (c (q + 2 kv)).

The forward (``_templated_ring_attention`` with ``_SDPAMerger``) holds the same gathered K/V and an
fp32 copy of the merged output (4 q) with its temporaries (a few 4 q) inside one layer's forward, below
the moment at the loss (the logits) for every setup modelled here, so it is not a term. Not modelled:
what the CUDA flash backward kernel allocates inside (``dq_accum`` and GQA-expanded dK/dV), as for the
step without CP, and the ring buffers' lifetimes under NCCL's streams (the truth runs gloo).

Refused (:func:`check_cp`, one line each): what accelerate 1.15 / transformers 5.24 refuse themselves
(no FSDP2, attention other than SDPA, sliding-window or chunked attention layers, a non-causal mask) and
what the truth does not run (tensor parallelism or hybrid sharding beside CP, MoE, latent attention or
head_dim > 256 (transformers repeats K/V there: ``use_gqa_in_sdpa``), quantized bases, 32-bit compute,
padded or padding-free batches, the knobs FSDP2 refuses).
"""

from __future__ import annotations

import dataclasses

from ..specs import Breakdown, Component, GpuSpec, ModelSpec, Setup, SpecError

#: Setup knobs context parallelism refuses away from their defaults (vramplan.truths.cp_truth runs none).
_CP_UNRUN = ("loss", "liger", "dora", "modules_to_save", "activation_offload", "checkpoint_every",
             "optimizer_in_backward", "objective", "eval_batch", "padding_free", "pad_mask")


def check_cp(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a context-parallel setup that is not modelled (or does not run)."""
    if setup.cp <= 1:
        return
    from .precision import attention_impl

    cp, why = setup.cp, None
    if setup.fsdp == "none" or setup.fsdp_version != 2:
        why = ("context parallelism runs under FSDP2 only (accelerate 1.15 Accelerator.maybe_context_parallel: "
               "\"context_parallel is currently supported with FSDP2\"): add --fsdp full_shard --fsdp-version 2")
    elif setup.tp > 1 or setup.dp_replicate > 1:
        why = "context parallelism with tensor parallelism or hybrid sharding is not modelled yet; use --tp 1"
    elif attention_impl(model, setup) != "sdpa":
        why = (f"context parallelism with {attention_impl(model, setup)} attention: transformers 5.24's Trainer "
               "refuses it (\"Context parallelism is supported only with SDPA attention\"); use --attn sdpa")
    elif model.traits.sliding_layers:
        why = (f"context parallelism on {model.name} (sliding-window attention layers): accelerate 1.15 refuses it "
               "(_attach_context_parallel_hooks: \"Context parallelism does not support attention layers of type "
               "['sliding_attention']\")")
    elif model.moe is not None:
        why = f"context parallelism on a mixture-of-experts model ({model.name}) is not modelled yet"
    elif model.traits.mla is not None or model.head_dim > 256:
        # transformers' use_gqa_in_sdpa wants K and V of one head_dim <= 256; else it repeats K/V (repeat_kv)
        why = (f"context parallelism on {model.name} (latent attention or head_dim {model.head_dim} > 256): "
               "transformers 5.24 repeats K/V to the query heads there and CUDA flash does not take it; not modelled")
    elif setup.quant != "none":
        why = (f"context parallelism on a quantized base (--quant {setup.quant}, QLoRA) is not modelled yet "
               "(a 16-bit base is)")
    elif setup.precision == "fp32":
        why = ("context parallelism in fp32: CUDA flash attention takes 16-bit inputs only and the ring under "
               "memory-efficient attention is not modelled; use --precision bf16 or bf16-mixed")
    elif setup.seq % (2 * cp):
        why = (f"--seq {setup.seq} does not divide by 2 x --cp ({2 * cp}): torch 2.13's load balancer "
               "(context_parallel, head-tail) cuts the sequence into 2 x cp chunks")
    else:
        knob = next((k for k in _CP_UNRUN if getattr(setup, k) != getattr(_DEFAULTS, k)), None)
        if knob is not None:
            why = (f"context parallelism with --{knob.replace('_', '-')} is not modelled yet (the CP truth runs the "
                   "HF loss on causal, unpadded batches)")
    if why:
        raise SpecError(why)


_DEFAULTS = Setup()


def local_setup(setup: Setup) -> Setup:
    """What one rank runs: FSDP2 over all ``gpus`` ranks (the ``dp_shard_cp`` mesh: dp_shard x cp) on
    ``seq / cp`` tokens."""
    return dataclasses.replace(setup, cp=1, seq=setup.seq // setup.cp)


def _shapes(model: ModelSpec, setup: Setup) -> tuple[int, int, int]:
    """(q, kv, c): elements of one rank's query and of its key (or value) in a layer, bytes per element."""
    from .precision import compute_bytes

    tokens = setup.batch * (setup.seq // setup.cp) * model.head_dim
    return tokens * model.num_heads, tokens * model.num_kv_heads, compute_bytes(local_setup(setup))


def ring_backward_bytes(model: ModelSpec, setup: Setup) -> int:
    """Bytes torch 2.13's ``_templated_ring_attention_backward`` holds at its last ring step beyond what
    a plain flash backward holds (module docstring): the fp32 dQ/dK/dV accumulators, the dK/dV all-to-all's
    send and receive buffers, the all-gathered K/V with this rank's concatenations, and the previous ring
    step's block gradients."""
    q, kv, c = _shapes(model, setup)
    P = setup.cp
    accumulators = 4 * (q + 2 * kv)  # zeros_like(query/key/value, dtype=float32)
    dkv = 2 * 4 * 2 * kv  # next_grad_kv (cat, fp32) and the permute_tensor output (_AllToAllRotater)
    # _AllGatherRotater's all_gather_single output (P ranks' cat([k, v])), this rank's last cat (next_kv is
    # not reassigned at the last step) and, past 2 ranks, the first cat the all-gather was given (the truth
    # holds it to the end with the gathered buffer)
    gathered = (P + min(2, P - 1)) * 2 * c * kv
    previous = c * (q + 2 * kv)  # the previous ring step's grad_query_, grad_key_, grad_value_
    return int(accumulators + dkv + gathered + previous)


def attention_floor(model: ModelSpec, setup: Setup) -> int:
    """What a layer's attention backward holds beyond the layer's saved tensors less its MLP side (the
    moment estimator/step.py's ``attention_backward`` term is): the gradient of the attention output
    (c q), the block kernel's dq, dk, dv (c (q + 2 kv)) and the ring's buffers."""
    q, kv, c = _shapes(model, setup)
    return int(c * q + c * (q + 2 * kv) + ring_backward_bytes(model, setup))


def input_bytes(setup: Setup) -> int:
    """The batch under CP: ``input_ids``, ``labels``, and the ``shift_labels`` and ``position_ids``
    ``Trainer._prepare_context_parallel_inputs`` (transformers 5.24) adds, int64; torch's
    ``context_parallel`` shards them in place (``buffer.resize_(shard.shape)``), which keeps each
    full-length storage."""
    return 4 * 8 * setup.batch * setup.seq


def mask_bytes(setup: Setup) -> int:
    """The causal mask the CP step builds and checkpointing keeps: torch's head-tail load balancer hands
    each rank two position ranges, so transformers 5.24 (``masking_utils._preprocess_mask_arguments``:
    ``find_packed_sequence_indices``) reads the jump in ``position_ids`` as a packed-sequence boundary,
    cannot skip the mask (``allow_is_causal_skip`` off) and builds a (b, 1, s_l, s_l) bool mask that
    accelerate's hook then drops from attention. Checkpointed layers hold it as an input to their
    recompute (forward to backward); without checkpointing it dies with the decoder's forward, before
    the loss (not at a peak). Read off the truth (vramplan.truths.cp_truth, ``VRAMPLAN_CP_DETAIL``)."""
    s_l = setup.seq // setup.cp
    return setup.batch * s_l * s_l if setup.checkpointing else 0


def rank_estimate(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections, stack, estimate) -> Breakdown:
    """One context-parallel rank's Breakdown: FSDP2 on ``seq / cp`` tokens with the ring's backward buffers
    at each layer's attention backward (``estimate(..., attention_floor=...)``) and the batch's buffers
    through the step. Every rank holds the same (the model has no rank-dependent term): no ``per_rank``."""
    from .corrections import device_overheads

    check_cp(model, setup)
    ring, inputs, mask = ring_backward_bytes(model, setup), input_bytes(setup), mask_bytes(setup)
    b = estimate(model, local_setup(setup), gpu, corrections, stack, attention_floor=attention_floor(model, setup))
    peaks = {p: n + (inputs + mask if p in ("forward", "backward") else 0) for p, n in b.phase_peaks_bytes.items()}
    phase = max(peaks, key=lambda p: peaks[p])
    allocated, reserved, total, overheads = device_overheads(peaks[phase], setup.gpus, gpu, corrections)
    devices = {name for name, _, _ in overheads}
    comps = [c for c in b.components if c.name not in devices] + [c for c in (
        Component("cp_ring_backward", ring, ("backward",), note="torch 2.13 _templated_ring_attention_backward in "
                  "one layer: fp32 dQ/dK/dV accumulators, the dK/dV all-to-all buffers, the all-gathered K/V "
                  "(estimator/context_parallel.py)"),
        Component("cp_inputs", inputs, ("forward", "backward"), note="input_ids, labels, shift_labels, position_ids "
                  "(transformers 5.24 _prepare_context_parallel_inputs), sharded in place at full-length storage"),
        Component("cp_packed_mask", mask, ("forward", "backward"), note="the (b, 1, s/cp, s/cp) bool mask transformers "
                  "5.24 builds for the load-balanced position_ids (masking_utils find_packed_sequence_indices), kept "
                  "by the checkpointed layers") if mask else None,
    ) if c is not None] + [Component(name, n, note=note) for name, n, note in overheads]
    notes = (f"--cp {setup.cp}: per GPU, FSDP2 over all {setup.gpus} GPUs on seq/{setup.cp} = {setup.seq // setup.cp} "
             "tokens; torch 2.13's ring attention all-gathers K/V at their own head count (CUDA flash takes "
             "enable_gqa unrepeated) and all-to-alls fp32 dK/dV",) + b.notes
    return dataclasses.replace(
        b, setup=setup, components=tuple(comps), notes=notes, phase_peaks_bytes=peaks, phase=phase,
        tensor_peak_bytes=int(peaks[phase]), peak_allocated_bytes=int(allocated), peak_reserved_bytes=int(reserved),
        device_total_bytes=int(total))


__all__ = ["attention_floor", "check_cp", "input_bytes", "local_setup", "mask_bytes", "rank_estimate",
           "ring_backward_bytes"]
