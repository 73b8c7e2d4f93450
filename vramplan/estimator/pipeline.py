"""Pipeline parallelism (``--pp N``) as torch 2.13's ``torch.distributed.pipelining`` runs it: one stage
per GPU, each stage's share of the step.

The model is split by decoder layers as a manual stage split does (torchtitan's
``pipeline_module_split``; :func:`stage_layers`: an even split, the first ``L % N`` stages one layer
more): stage 0 also holds the embedding, the last stage the final norm, the head and the loss. Each
stage is a ``PipelineStage`` driven by ``ScheduleGPipe`` or ``Schedule1F1B`` over ``n_microbatches =
grad_accum`` micro-batches of ``batch`` sequences (the schedule's ``step`` takes ``grad_accum x batch``
rows and splits them), called as torchtitan calls it: ``schedule.step(ids, target=labels,
losses=losses, return_outputs=False)``, then the optimizer over the stage's own parameters.

What a stage holds (torch 2.13 ``distributed/pipelining/stage.py`` and ``schedules.py``, read off the
real schedule on gloo ranks: vramplan/truths/pipeline.py, ``validate --knob pp``):

- its parameters, their gradients (accumulated over the micro-batches from the first backward on:
  ``backward_one_chunk`` runs ``torch.autograd.backward`` into ``.grad``; ``scale_grads`` divides them
  in place at the end; on a later micro-batch each gradient is computed apart and added in place, so
  the head's and the embedding's are whole-matrix temporaries) and the optimizer's states and step
  transient, for its own parameters only;
- per micro-batch in flight (forwarded, not yet backwarded): its layers' saved activations (the
  single-GPU terms of estimator/activations.py per layer; with checkpointing the layer inputs),
  RoPE's cos/sin (every stage computes its own), and the stage's output, which ``fwd_cache`` keeps
  for the backward (``forward_one_chunk``): the hidden states on a middle stage, the 16-bit logits on
  the last (beside the loss's fp32 log-probs, the final norm's and the head input's saves); the
  labels the loss pads and shifts;
- the receive buffers, allocated once per micro-batch and kept across steps
  (``_setup_forward_recv_info`` / ``_setup_backward_recv_info``: one ``b x s x h`` buffer per
  micro-batch for the activations a later stage receives, and one for the output gradients an
  earlier stage receives);
- the input gradient it sends back, kept by the schedule's send list until the next backward has
  replaced it (``Schedule1F1B``: ``bwd_sends``; ``ScheduleGPipe``: ``bwd_sends_to_wait`` keeps each
  send's work, and with it the tensor, to the end of the backward);
- the token ids of all micro-batches on the first stage and the labels on the last (the schedule
  splits the batch into views).

How many micro-batches are in flight at a stage's peak comes from replaying its action list
(:func:`actions`): GPipe forwards all ``n`` before the first backward; 1F1B forwards ``min(n, p - r)``
(``warmup_chunks`` in ``Schedule1F1B._step_microbatches``), then alternates one backward and one
forward, so stage ``r`` holds at most ``min(n, p - r)``. Each action's moments are the single-GPU
moments of estimator/step.py over the stage's layers (the loss and its gradients on the last stage;
a layer's backward at the stage's top and bottom layers; the end of the backward) on top of what
the other micro-batches in flight keep.

Refused (:func:`check_pp`, one line each): what the truth does not run yet (LoRA/QLoRA and quantized
bases, ZeRO/FSDP/TP/CP beside PP, data parallelism beside it, tied embeddings (torch's pipelining
has no shared-weight sync between the first and last stage), MoE, families other than the dense
Llama-like ones, mixed precision, other optimizers, the fused losses and the other knobs), and the
schedules not modelled yet (Setup). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..specs import Breakdown, Component, GpuSpec, ModelSpec, RankPeak, Setup, SpecError
from . import activations as act
from . import transients
from .model_states import optimizer_state_bytes, optimizer_step_transient_bytes, weight_dtype_bytes, weights_bytes
from .pipeline_check import PP_MODEL_TYPES, PP_OPTIMIZERS, check_pp
from .precision import compute_bytes

__all__ = ["PP_MODEL_TYPES", "PP_OPTIMIZERS", "actions", "check_pp", "in_flight_peak", "rank_estimate", "stage_layers",
           "stage_model", "stage_peaks", "stage_terms"]


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers of ``stage``: an even split, the first ``num_layers % stages`` stages one
    layer more (the last stage, which holds the head and the loss, is never the longer one)."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


# ----------------------------------------------------------------------------------------------
# one stage


@dataclass(frozen=True)
class StageTerms:
    """What one stage holds (bytes): its states, what persists across steps, per micro-batch in flight."""

    stage: int
    layers: range
    weights: int
    gradients: int
    optimizer_states: int
    optimizer_step: int
    buffers: int  # the receive buffers (activations in, gradients in), kept across steps
    batch_ids: int  # token ids (first stage) and labels (last stage) of every micro-batch
    held: int  # one micro-batch in flight: saved activations, RoPE, the stage's output kept by fwd_cache
    output: int  # of ``held``: the stage's output (hidden states, or the 16-bit logits on the last stage)
    sent: int  # the input gradient sent back to the previous stage (0 on the first)
    forward_extra: int  # at the end of a micro-batch's forward, beyond ``held`` (the loss's fp32 copy)
    backward_moments: tuple[tuple[int, int], ...]  # (bytes over the others in flight, gradients present): first B
    backward_later: tuple[int, ...]  # the same moments once every gradient exists


def stage_model(model: ModelSpec, setup: Setup, stage: int) -> ModelSpec:
    """The part of ``model`` a stage holds: its layers' Linears and norms, the embedding on the first
    stage, the final norm and the head on the last."""
    p, L, h = setup.pp, model.num_layers, model.hidden_size
    n = len(stage_layers(L, p, stage))
    first, last = stage == 0, stage == p - 1
    final_norm = h * (2 if model.norm_kind == "layernorm" else 1)
    other = []
    for name, count in model.other_params:
        if name == "embed_tokens":
            if first:
                other.append((name, count))
        elif name == "norms":
            other.append((name, (count - final_norm) * n // L + (final_norm if last else 0)))
        else:  # per-layer parameters (q/k norms)
            other.append((name, count * n // L))
    linears = tuple(dataclasses.replace(l, count=l.count * n // L) if l.role != "head" else l
                    for l in model.linears if l.role != "head" or last)
    return dataclasses.replace(model, name=f"{model.name} (pipeline stage {stage} of {p})", num_layers=n,
                               linears=linears, other_params=tuple(other))


def _layer_backward(model: ModelSpec, setup: Setup, idx: int, last: bool) -> tuple[float, float]:
    """(bytes layer ``idx``'s backward adds over its kept activations, its kept bytes), as estimator/step.py
    places a dense layer's backward under full fine-tuning (recomputed first with checkpointing), with the
    MLP's moment read off the pipeline truth: the gradients of the gate/up product and of gate's and up's
    outputs once the product itself is freed (2 c i N) beside down_proj's weight gradient (i h w; on a
    later micro-batch the temporary autograd accumulates into ``.grad``). The gradient coming into the
    layer is the receive buffer on a stage before the last (kept across steps), a fresh one (the final
    norm's input gradient) on the last."""
    N, c, h, i = setup.tokens, compute_bytes(setup), model.hidden_size, model.intermediate_size
    attn_side, mlp_side = act.layer_split_per_token(model, setup, idx)
    saved = (attn_side + mlp_side) * N
    t_mlp = 2 * c * i * N + i * h * weight_dtype_bytes(setup)
    t_attn = transients.attention_backward_transient_per_token(model, setup) * N
    t_grad = max(t_mlp, t_attn - mlp_side * N)
    kept = c * h * N if setup.checkpointing else saved
    incoming = c * N * h if last else 0
    extra = (saved if setup.checkpointing else 0) + t_grad + incoming
    if setup.checkpointing:
        extra = max(extra, transients.lora_forward_peak_per_token(model, setup, idx) * N + incoming)
    return extra, kept


def stage_terms(model: ModelSpec, setup: Setup, stage: int) -> StageTerms:
    """One stage's states and per-micro-batch terms (see the module docstring)."""
    p, n = setup.pp, setup.grad_accum
    layers = stage_layers(model.num_layers, p, stage)
    first, last = stage == 0, stage == p - 1
    part = stage_model(model, setup, stage)
    N, c, h, V = setup.tokens, compute_bytes(setup), model.hidden_size, model.vocab_size
    wb = weight_dtype_bytes(setup)
    W, G = weights_bytes(part, setup), part.params_total * wb
    hidden = c * N * h
    # per micro-batch: the layers' saves (with checkpointing each layer's input, the first one's
    # being the receive buffer on a later stage), RoPE's cos/sin, the output fwd_cache keeps
    per_layer = (act.checkpoint_bytes_per_token(model, setup) if setup.checkpointing
                 else act.layer_bytes_per_token(model, setup)) * N
    saved = len(layers) * per_layer - (hidden if setup.checkpointing and not first else 0)
    rope = 2 * (model.traits.rope_bytes or c) * model.rope_dim * N if model.traits.rope else 0
    logits = c * N * V
    loss_saved = 0
    if last:  # final norm, head input, fp32 log-probs, the shifted labels nll_loss keeps
        loss_saved = int((act.norm_bytes(model, setup, trainable_weight=True) + c * h + 4 * V + 8) * N)
    output = logits if last else hidden
    held = int(saved + rope + loss_saved + output)
    fwd_logits, bwd_logits = transients.loss_transients(model, setup)
    # at the end of a micro-batch's forward: the loss's fp32 upcast beside the 16-bit logits (last stage);
    # before it, the top layer's residual, its MLP's output and the stage output being formed
    forward_extra = fwd_logits - logits if last else 3 * hidden
    # the backward of one micro-batch, over what the others keep: the loss's gradients (last stage),
    # the top layer, the bottom layer, the end (every gradient and the input gradient)
    top_extra, _ = _layer_backward(model, setup, layers[-1], last)
    bottom_extra, bottom_kept = _layer_backward(model, setup, layers[0], last and len(layers) == 1)
    head_g = (sum(l.params for l in part.linears if l.role == "head") + h) * wb if last else 0
    embed_g = dict(part.other_params).get("embed_tokens", 0) * wb
    layer_g = (G - head_g - embed_g) / max(len(layers), 1)
    rest_top = held - loss_saved  # the loss's saves are gone by the top layer's backward
    sent = hidden if not first else 0
    start = (held + bwd_logits, 0) if last else None
    moments_first = tuple(m for m in (
        start, (rest_top + top_extra, head_g), (bottom_kept + rope + output + bottom_extra, G - layer_g - embed_g),
        (rope + output + sent, G)) if m is not None)
    # on a later micro-batch autograd computes each gradient apart and adds it into ``.grad`` in place
    # (AccumulateGrad): the head's (last stage, beside the logits' 16-bit gradient once the fp32 ones are
    # gone) and the embedding's (first stage, at the end) are whole-matrix temporaries
    head_temp = (held - 4 * V * N + logits + head_g,) if last else ()
    embed_temp = (rope + output + sent + embed_g,) if first else ()
    moments_later = tuple(int(b) for b, _ in moments_first) + tuple(int(b) for b in head_temp + embed_temp)
    return StageTerms(
        stage=stage, layers=layers, weights=int(W), gradients=int(G),
        optimizer_states=optimizer_state_bytes(part, setup),
        optimizer_step=optimizer_step_transient_bytes(part, setup),
        buffers=n * hidden * ((not first) + (not last)), batch_ids=8 * n * N * (first + last), held=held,
        output=int(output), sent=int(sent), forward_extra=int(forward_extra),
        backward_moments=tuple((int(b), int(g)) for b, g in moments_first), backward_later=moments_later)


def actions(schedule: str, stages: int, stage: int, n: int) -> list[tuple[str, int]]:
    """The stage's forward ("F") and backward ("B") of each micro-batch in the order torch 2.13's
    schedule runs them (``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches``)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]
    warmup = min(n, stages - stage)
    out = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < n:
        out.append(("B", b))
        b += 1
        if f < n:
            out.append(("F", f))
            f += 1
    return out


def in_flight_peak(schedule: str, stages: int, stage: int, n: int) -> int:
    """The most micro-batches forwarded and not yet backwarded at once (GPipe: n; 1F1B: min(n, p - r))."""
    live, most = 0, 0
    for kind, _ in actions(schedule, stages, stage, n):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def stage_peaks(t: StageTerms, setup: Setup) -> tuple[dict[str, int], int]:
    """The stage's tensor peak per phase from replaying its actions, and the micro-batches in flight
    at its peak moment."""
    base = t.weights + t.optimizer_states + t.buffers + t.batch_ids
    live = backs = 0
    peaks = {"forward": 0, "backward": 0}
    at_peak, best = 0, -1
    gpipe = setup.pp_schedule == "gpipe"
    for kind, _ in actions(setup.pp_schedule, setup.pp, t.stage, setup.grad_accum):
        # the input gradients already sent: 1F1B keeps the last one, GPipe every one to the end
        sent = t.sent * (backs if gpipe else min(backs, 1))
        grads = t.gradients if backs else 0
        if kind == "F":
            moment = base + grads + live * t.held + t.held + t.forward_extra + sent
            live += 1
        else:
            live -= 1
            others = live * t.held
            if backs:
                moment = base + t.gradients + others + sent + max(t.backward_later)
            else:
                moment = base + others + max(b + g for b, g in t.backward_moments)
            backs += 1
        phase = "forward" if kind == "F" else "backward"
        peaks[phase] = max(peaks[phase], int(moment))
        if moment > best:
            best, at_peak = moment, live + (1 if kind == "B" else 0)
    peaks["optimizer"] = int(base + t.gradients + t.optimizer_step)
    return peaks, at_peak


def rank_estimate(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections, stack, estimate) -> Breakdown:
    """The fullest stage's Breakdown, with ``per_rank`` one row per stage (``estimate``:
    estimator/step.py's, for the single-GPU checks and notes of the same setup)."""
    from ..setup.checks import check
    from .corrections import device_overheads

    notes = check(model, setup, gpu)
    if not stack.is_default:
        raise SpecError(f"--pp is modelled for transformers 5.24, not transformers {stack.transformers}")
    one = estimate(model, dataclasses.replace(setup, pp=1, pp_schedule="1f1b", gpus=1), gpu, corrections, stack)
    stages = []
    for r in range(setup.pp):
        t = stage_terms(model, setup, r)
        peaks, live = stage_peaks(t, setup)
        phase = max(peaks, key=lambda ph: peaks[ph])
        allocated, reserved, total, overheads = device_overheads(peaks[phase], setup.gpus, gpu, corrections)
        stages.append((t, peaks, phase, live, (allocated, reserved, total), overheads))
    per_rank = tuple(RankPeak(t.stage, tuple(t.layers), peaks[ph], *nums[:2], nums[2], ph)
                     for t, peaks, ph, _, nums, _ in stages)
    fullest = max(range(len(per_rank)), key=lambda i: (per_rank[i].device_total_bytes, -i))
    t, peaks, phase, live, nums, overheads = stages[fullest]
    fb, all_phases = ("forward", "backward"), ("forward", "backward", "optimizer")
    comps = [
        Component("weights", t.weights, all_phases, note=f"stage {t.stage}'s layers {t.layers.start}-"
                  f"{t.layers.stop - 1}" + (", the embedding" if t.stage == 0 else "")
                  + (", the final norm and head" if t.stage == setup.pp - 1 else "")),
        Component("gradients", t.gradients, ("backward", "optimizer"), note="its own parameters', accumulated over "
                  "the micro-batches"),
        Component("optimizer_states", t.optimizer_states, all_phases, note=setup.optimizer),
        Component("optimizer_step", t.optimizer_step, ("optimizer",), note="foreach step transient")
        if t.optimizer_step else None,
        Component("activations", t.held * live, fb, note=f"{live} micro-batch(es) in flight at the peak "
                  f"({setup.pp_schedule}, stage {t.stage} of {setup.pp}): saved activations, RoPE, the stage output "
                  "fwd_cache keeps" + (", the loss's saves" if t.stage == setup.pp - 1 else "")),
        Component("logits_loss", t.forward_extra, fb, note="the fp32 upcast of the logits at the loss")
        if t.forward_extra and t.stage == setup.pp - 1 else None,
        Component("pp_buffers", t.buffers + t.sent + t.batch_ids, all_phases, note="receive buffers (one per "
                  "micro-batch, kept across steps), the input gradient being sent, token ids / labels"),
        *(Component(name, n_, all_phases, note=note or ("NCCL communicators" if name == "nccl" else ""))
          for name, n_, note in overheads),
    ]
    comps = [c for c in comps if c is not None]
    rest = peaks[phase] - sum(c.bytes for c in comps if phase in c.phases and c.name not in dict(
        (name, 0) for name, _, _ in overheads))
    if rest > 0:  # what the peak moment adds: the loss's gradients, a layer's backward or forward temporaries
        comps.append(Component(f"{phase}_transient", int(rest), (phase,), note="the peak moment's temporaries: the "
                               "loss's fp32 gradients (last stage), a layer's backward or the forward's tail"))
    counts = " / ".join(str(len(x[0].layers)) for x in stages)
    flights = " / ".join(str(in_flight_peak(setup.pp_schedule, setup.pp, r, setup.grad_accum))
                         for r in range(setup.pp))
    note = (f"--pp {setup.pp} ({setup.pp_schedule}, {setup.grad_accum} micro-batches of {setup.batch} = "
            f"--grad-accum x --batch): decoder layers per stage {counts}, micro-batches in flight at most "
            f"{flights}; the numbers are stage {t.stage}'s, the fullest (--json per_rank has every stage's)")
    return dataclasses.replace(
        one, setup=setup, components=tuple(comps), phase_peaks_bytes=peaks, phase=phase,
        tensor_peak_bytes=int(peaks[phase]), peak_allocated_bytes=int(nums[0]), peak_reserved_bytes=int(nums[1]),
        device_total_bytes=int(nums[2]), notes=(note, *notes), per_rank=per_rank)
