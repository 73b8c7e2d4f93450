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

Data parallelism beside the pipeline (``--gpus`` = ``pp x dp``, ``dp`` ranks per stage, each its own
batch; :func:`data_parallel`), per stage, on top of the above:

- FSDP2 (``--fsdp full_shard|shard_grad_op --fsdp-version 2``) as torchtitan runs it: torchtitan
  shards each pipeline stage's model part with ``fully_shard`` (``models/llama3/infra/parallelize.py``
  ``parallelize_llama`` -> ``apply_fsdp``; pipeline_parallel.py builds one part per stage) and, under
  PP, does not reshard after forward (``reshard_after_forward_policy="default"``: ``not
  pp_enabled``), so both reshard modes are the same here; DDP it runs only as 1-D parallelism
  ("DDP has not supported > 1D parallelism"), and its current tree applies FSDP2 always
  (``models/llama3/parallelize.py``, ``distributed/fsdp.py`` ``apply_fsdp_to_decoder``,
  ``get_fsdp_reshard_after_forward_policy``, since the config-registry refactor 9810191). The
  pipeline stage drives FSDP2 itself (stage.py ``backward_maybe_with_nosync``:
  ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)`` on every micro-batch;
  ``perform_reduce_grad`` after the last backward): each rank keeps padded shards and the optimizer
  over them, the stage all-gathered from the step's first forward to the reduce, the gradients
  unsharded and accumulated as without FSDP, then reduce-scattered group by group
  (:func:`_fsdp2_terms`).
- DDP (no ``--fsdp``): torch's ``DistributedDataParallel`` around each stage, which stage.py drives
  (``no_sync`` on every micro-batch but the last, whose backward the Reducer reduces): its flat
  gradient buckets (``gradient_as_bucket_view=False``), one more copy of the stage's gradients
  (estimator/fsdp.py ``ddp_bucket_bytes``), and nothing else; the note says torchtitan runs FSDP2.

Refused (:func:`check_pp`, one line each): what the truth does not run yet (LoRA/QLoRA and quantized
bases, ZeRO (DeepSpeed's PipelineEngine takes ZeRO-0/1 only; ZeRO-2/3 are refused by Setup), FSDP1,
hybrid sharding, TP and CP beside PP, tied embeddings (torch's pipelining has no shared-weight sync
between the first and last stage), MoE, families other than the dense Llama-like ones, mixed
precision, other optimizers, the fused losses and the other knobs), and the schedules not modelled
yet (Setup). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..specs import Breakdown, Component, GpuSpec, ModelSpec, RankPeak, Setup, SpecError
from . import activations as act
from . import transients
from .fsdp import ddp_bucket_bytes
from .model_states import optimizer_state_bytes, optimizer_step_transient_bytes, weight_dtype_bytes, weights_bytes
from .pipeline_check import PP_MODEL_TYPES, PP_OPTIMIZERS, check_pp, data_parallel
from .precision import compute_bytes

__all__ = ["PP_MODEL_TYPES", "PP_OPTIMIZERS", "actions", "check_pp", "data_parallel", "in_flight_peak", "rank_estimate",
           "stage_groups", "stage_layers", "stage_model", "stage_peaks", "stage_terms"]


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
    # data parallelism beside the pipeline (gpus = pp x dp; ``weights``, ``optimizer_*`` are then
    # what one rank of the stage holds: FSDP2's padded shards)
    unsharded: int = 0  # FSDP2: the all-gather outputs, held from the step's first forward to the reduce
    grad_after: int = 0  # the gradients the optimizer steps on (FSDP2: the reduce-scatter outputs)
    reduce_moment: int = 0  # FSDP2: the reduce's peak beyond the resident bytes (perform_reduce_grad)
    first_forward: int = 0  # FSDP2: the step's first forward's peak beyond them (the all-gathers)
    dp_buckets: int = 0  # DDP: the Reducer's gradient buckets, kept for the whole run


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
    terms = StageTerms(
        stage=stage, layers=layers, weights=int(W), gradients=int(G),
        optimizer_states=optimizer_state_bytes(part, setup),
        optimizer_step=optimizer_step_transient_bytes(part, setup),
        buffers=n * hidden * ((not first) + (not last)), batch_ids=8 * n * N * (first + last), held=held,
        output=int(output), sent=int(sent), forward_extra=int(forward_extra),
        backward_moments=tuple((int(b), int(g)) for b, g in moments_first), backward_later=moments_later,
        grad_after=int(G))
    kind = data_parallel(setup)
    if kind == "ddp":  # torch's DistributedDataParallel: its buckets beside the stage's own states
        return dataclasses.replace(terms, dp_buckets=ddp_bucket_bytes(int(G)))
    if kind == "fsdp2":
        # the activations of the first micro-batch at each group's all-gather (the step's first forward)
        at_head = held - (4 * V + 8) * N if last else 0  # the head's forward: no fp32 log-probs yet
        return dataclasses.replace(terms, **_fsdp2_terms(model, setup, stage, terms, int(per_layer), int(rope),
                                                         int(at_head)))
    return terms


def stage_groups(model: ModelSpec, setup: Setup, stage: int) -> list[list[tuple[int, ...]]]:
    """The parameter shapes of each ``fully_shard`` group of a stage, in the order FSDP2's root state
    lists them (``FSDPState._lazy_init``: the root's modules in ``modules()`` order) and the reduce runs
    them: torchtitan's groups (``apply_fsdp``): the embedding (first stage), each decoder layer (its
    Linears, their biases, its norms; the post-attention norm last), the final norm with the head (last
    stage); the root holds none. The dense untied models ``check_pp`` lets through."""
    L, h = max(model.num_layers, 1), model.hidden_size
    layer: list[tuple[int, ...]] = []
    for l in model.linears:
        if l.role != "head":
            layer += [(l.out_features, l.in_features)] * (l.count // L) + [(l.out_features,)] * (l.count // L) * l.bias
    for name, count in model.other_params:
        if name == "qk_norms":
            layer += [(model.head_dim,)] * (max(1, count // model.head_dim) // L)
    for name, count in model.other_params:
        if name == "norms":  # the final norm is the last stage's
            layer += [(h,)] * ((count // h - 1) // L)
    head = [(l.out_features, l.in_features) for l in model.linears if l.role == "head"]
    n = len(stage_layers(model.num_layers, setup.pp, stage))
    return ([[(model.vocab_size, h)]] if stage == 0 else []) + [layer] * n + ([[(h,), *head]]
                                                                            if stage == setup.pp - 1 else [])


def _padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's padded shard of a parameter: dim 0 chunked over ``n`` ranks, every rank
    holding chunk 0's ``ceil(d0 / n)`` rows (torch 2.13 ``FSDPParam._init_sharded_param``; estimator/fsdp2.py)."""
    return -(-shape[0] // n) * math.prod(shape[1:])


def _fsdp2_terms(model: ModelSpec, setup: Setup, stage: int, t: StageTerms, per_layer: int, rope: int,
                 at_head: int) -> dict:
    """What FSDP2 over the stage's ``dp = gpus / pp`` ranks changes (torch 2.13 ``_fully_shard``, under
    torch.distributed.pipelining's stage.py and torchtitan's ``reshard_after_forward=False`` under PP):

    - each rank keeps the padded shard of every parameter (``FSDPParam._init_sharded_param``: dim 0
      chunked, ``ceil(d0 / dp)`` rows) and the optimizer's states and step transient over those shards;
    - the step's first forward all-gathers every group and nothing is resharded until the reduce
      (``reshard_after_forward=False``; ``backward_maybe_with_nosync`` sets
      ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` on every
      micro-batch): the per-parameter all-gather outputs, ``dp x`` the padded shard, live from the
      first forward to the reduce; the unsharded gradients accumulate in ``.grad`` as without FSDP;
    - in that first forward each group's all-gather lands in one flat output (``foreach_all_gather``,
      ``dp x`` the group's shards) copied out into the per-parameter outputs; the flat output is kept
      for the next group's copy-out (``wait_for_unshard``: ``comm_ctx.all_gather_state``, whose
      ``prev_all_gather_state`` local keeps the one before to its return), so at a group's copy-out
      the groups gathered so far, its own and the previous flat output and the first micro-batch's
      activations up to it are live; on the last stage the norm and head group's flat output is kept
      through the head's forward (to the root's post-forward);
    - ``perform_reduce_grad`` (``PipelineScheduleSingle``'s step, after the last backward) runs each
      group's ``post_backward`` in turn: it drops the group's unsharded parameters (reshard), copies its
      unsharded gradients into one flat reduce-scatter input of ``dp x`` its padded shard
      (``foreach_reduce``), frees them but the last one (``foreach_reduce``'s loop variable
      ``unsharded_grad`` keeps the group's last gradient to its return: the head's in the norm and head
      group, the embedding's), and keeps the reduce output as the sharded gradients (the previous
      group's input dropped first: ``reduce_scatter_max_input_buffers=1``). Its peak is at the group
      where the later groups' parameters and gradients, its own input and the earlier groups' outputs
      add up most (the embedding's on the first stage, reduced first)."""
    dp = setup.gpus // setup.pp
    wb = weight_dtype_bytes(setup)
    groups = stage_groups(model, setup, stage)
    shard = [wb * sum(_padded(s, dp) for s in g) for g in groups]
    grads = [wb * sum(math.prod(s) for s in g) for g in groups]  # autograd's gradients: the unpadded shapes
    gathered = [dp * x for x in shard]
    last = [wb * math.prod(g[-1]) for g in groups]  # the group's last parameter's gradient (see above)
    frac = sum(shard) / max(sum(grads), 1)
    reduce = max(sum(gathered[k + 1:]) + sum(shard[:k]) + gathered[k] + max(
        sum(grads[k:]), sum(grads[k + 1:]) + last[k] + shard[k]) for k in range(len(groups)))
    n_embed, n_layers = int(stage == 0), len(stage_layers(model.num_layers, setup.pp, stage))
    # the first micro-batch's activations when group k is gathered: the layers before it, RoPE's cos/sin
    acts = [0 if k < n_embed else per_layer * min(k - n_embed, n_layers) + rope for k in range(len(groups))]
    first = max(sum(gathered[:k + 1]) + (gathered[k - 1] if k else 0) + gathered[k] + acts[k]
                for k in range(len(groups)))
    if at_head:
        first = max(first, sum(gathered) + gathered[-1] + at_head)
    return {"weights": sum(shard), "unsharded": sum(gathered), "grad_after": sum(shard), "reduce_moment": reduce,
            "first_forward": int(first),
            "optimizer_states": int(t.optimizer_states * frac), "optimizer_step": int(t.optimizer_step * frac)}


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
    at its peak moment. FSDP2's reduce (after the last backward, inside the schedule's step) counts
    to the backward."""
    base = t.weights + t.optimizer_states + t.buffers + t.batch_ids + t.dp_buckets
    live = backs = 0
    peaks = {"forward": 0, "backward": 0}
    at_peak, best = 0, -1
    gpipe = setup.pp_schedule == "gpipe"
    for kind, _ in actions(setup.pp_schedule, setup.pp, t.stage, setup.grad_accum):
        # the input gradients already sent: 1F1B keeps the last one, GPipe every one to the end
        sent = t.sent * (backs if gpipe else min(backs, 1))
        grads = t.gradients if backs else 0
        if kind == "F":
            moment = base + t.unsharded + grads + live * t.held + t.held + t.forward_extra + sent
            if not backs and not live:  # the step's first forward: FSDP2's all-gathers
                moment = max(moment, base + t.first_forward)
            live += 1
        else:
            live -= 1
            others = live * t.held
            if backs:
                moment = base + t.unsharded + t.gradients + others + sent + max(t.backward_later)
            else:
                moment = base + t.unsharded + others + max(b + g for b, g in t.backward_moments)
            backs += 1
        phase = "forward" if kind == "F" else "backward"
        peaks[phase] = max(peaks[phase], int(moment))
        if moment > best:
            best, at_peak = moment, live + (1 if kind == "B" else 0)
    if t.reduce_moment:  # inside the schedule's step: the last forward's output is still its local
        sent = t.sent * (backs if gpipe else min(backs, 1))
        moment = base + sent + t.output + t.reduce_moment
        peaks["backward"] = max(peaks["backward"], int(moment))
        if moment > best:
            best, at_peak = moment, 0
    peaks["optimizer"] = int(base + t.grad_after + t.optimizer_step)
    return peaks, at_peak


def rank_estimate(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections, stack, estimate) -> Breakdown:
    """The fullest stage's Breakdown, with ``per_rank`` one row per stage (``estimate``:
    estimator/step.py's, for the single-GPU checks and notes of the same setup)."""
    from ..setup.checks import check
    from .corrections import device_overheads

    notes = check(model, setup, gpu)
    if not stack.is_default:
        raise SpecError(f"--pp is modelled for transformers 5.24, not transformers {stack.transformers}")
    one = estimate(model, dataclasses.replace(setup, pp=1, pp_schedule="1f1b", gpus=1, fsdp="none", fsdp_version=1),
                   gpu, corrections, stack)
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
    kind, dp = data_parallel(setup), setup.gpus // setup.pp
    sharded = kind == "fsdp2"
    comps = [
        Component("weights", t.weights, all_phases, note=("FSDP2's padded shard of " if sharded else "")
                  + f"stage {t.stage}'s layers {t.layers.start}-{t.layers.stop - 1}"
                  + (", the embedding" if t.stage == 0 else "")
                  + (", the final norm and head" if t.stage == setup.pp - 1 else "")),
        Component("fsdp2_unsharded", t.unsharded, fb, note=f"the stage's parameters all-gathered over its {dp} ranks "
                  "at the step's first forward and kept to the reduce (torchtitan: reshard_after_forward=False under "
                  "PP; the pipeline stage sets set_reshard_after_backward(False))") if sharded else None,
        Component("gradients", t.gradients, ("backward",) if sharded else ("backward", "optimizer"),
                  note="its own parameters', accumulated over the micro-batches"
                  + (" unsharded (set_requires_gradient_sync(False)), reduce-scattered after the last backward"
                     if sharded else "")),
        Component("grad_shards", t.grad_after, ("optimizer",), note="the reduce-scatter outputs the optimizer "
                  "steps on") if sharded else None,
        Component("ddp_buckets", t.dp_buckets, all_phases, note=f"DistributedDataParallel over the stage's {dp} "
                  "replicas: the Reducer's flat gradient buckets (no_sync on all but the last micro-batch)")
        if t.dp_buckets else None,
        Component("optimizer_states", t.optimizer_states, all_phases, note=setup.optimizer
                  + (" over the shards" if sharded else "")),
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
    beside = {"none": "", "ddp": f"; beside it DDP over {dp} replicas of each stage (torch's "
              "DistributedDataParallel; torchtitan runs FSDP2 beside PP instead: --fsdp full_shard --fsdp-version 2)",
              "fsdp2": f"; beside it FSDP2 over {dp} ranks per stage as torchtitan runs it (parameters gathered once "
              "per step, gradients reduce-scattered after the last micro-batch)"}[kind]
    note = (f"--pp {setup.pp} ({setup.pp_schedule}, {setup.grad_accum} micro-batches of {setup.batch} = "
            f"--grad-accum x --batch): decoder layers per stage {counts}, micro-batches in flight at most "
            f"{flights}{beside}; the numbers are stage {t.stage}'s, the fullest (--json per_rank has every stage's)")
    return dataclasses.replace(
        one, setup=setup, components=tuple(comps), phase_peaks_bytes=peaks, phase=phase,
        tensor_peak_bytes=int(peaks[phase]), peak_allocated_bytes=int(nums[0]), peak_reserved_bytes=int(nums[1]),
        device_total_bytes=int(nums[2]), notes=(note, *notes), per_rank=per_rank)
