"""Per-GPU memory of a layer split (``device_map``): each GPU's share of one step.

One process drives every GPU (naive pipeline parallelism: accelerate's ``AlignDevicesHook``
moves each module's inputs to its GPU, ``send_to_device`` in ``pre_forward``; accelerate 1.15
hooks.py). Each GPU holds the model states of its modules (estimator/layer_split.py says which):
the weights as trained (after peft's k-bit preparation), the LoRA adapters of its layers, their
gradients and optimizer states (torch's foreach AdamW groups tensors by device, so the step's
transient is per device too). At the end of the forward every GPU holds what its layers saved;
the backward then runs layer by layer in reverse, GPU by GPU: the moments of a rank are those of
one GPU (estimator/step.py) over its own layers, and the loss's (logits, fp32 log-probs and their
gradients) are on the GPU of ``lm_head``. The hooks add copies:

- the top module's hook (``io_same_device=True``) moves the model's output to GPU 0: the logits,
  computed on the head's GPU, are copied to GPU 0 at the end of the forward (then dropped with
  the output once ``.loss`` is read);
- RoPE's cos/sin are computed on the GPU of ``model.rotary_emb`` (placed after the final norm)
  and every decoder layer on another GPU gets its own copy, which its attention saves (not with
  checkpointing: the copy is made inside the checkpointed call and recomputed);
- the hidden states crossing to the next GPU are that layer's input there (saved by it, counted
  in its activations); their gradient crosses back in the backward (one ``b x s x h`` tensor).

Torch-free. The split's rank numbers go into ``Breakdown.per_rank``; the headline numbers are
the fullest GPU's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..specs import PHASES, GpuSpec, ModelSpec, RankPeak, Setup
from .corrections import Corrections, device_overheads
from .layer_split import LayerSplit, place
from .model_states import head_params, weight_dtype_bytes
from .optimizers import paged_bytes
from .precision import autocast_bytes, mixed


@dataclass(frozen=True)
class RankTerms:
    """What one GPU of the split holds (bytes), and its tensor peak per phase."""

    rank: int
    layers: tuple[int, ...]
    weights: int
    adapters: int
    gradients: int
    optimizer_states: int
    optimizer_step: int
    cast_cache: int
    paged: int
    saved: int  # the activations its layers keep to the backward
    model_io: int  # outside the layers (the head's GPU)
    logits_forward: int
    logits_backward: int
    copies: int  # the hooks' copies: RoPE tables per layer (kept), the logits on GPU 0 (transient)
    phase_peaks: dict[str, int]

    @property
    def holds_anything(self) -> bool:
        return bool(self.layers) or self.weights > 0


@dataclass(frozen=True)
class StepTerms:
    """The single-GPU terms of estimator/step.py the split divides (all bytes)."""

    weights: int
    adapters: int
    gradients: int
    optimizer_states: int
    optimizer_step: int
    cast_total: int
    cast_head: int
    paged: int
    layers_saved: int  # every layer's saved activations (a.layers)
    model_io: int
    logits_forward: int
    logits_backward: int
    dequantization_forward: int
    top_extra: float
    bottom_extra: float
    bottom_kept: float


def _nonlayer_params(model: ModelSpec) -> tuple[int, int, int]:
    """(embedding, final norm, untied head) parameters."""
    embed = dict(model.other_params).get("embed_tokens", model.vocab_size * model.hidden_size)
    norm = model.hidden_size * (2 if model.norm_kind == "layernorm" else 1)
    return embed, norm, head_params(model)


def rank_terms(model: ModelSpec, setup: Setup, split: LayerSplit, t: StepTerms) -> tuple[RankTerms, ...]:
    """Each GPU's states, activations and phase peaks."""
    L = max(model.num_layers, 1)
    N, h, V = setup.tokens, model.hidden_size, model.vocab_size
    embed_p, norm_p, head_p = _nonlayer_params(model)
    params_total = model.params_total
    layer_p = (params_total - embed_p - norm_p - head_p) / L
    # weights as trained: prepare_model_for_kbit_training upcasts what is not quantized to fp32
    nonlayer_b = 4 if setup.quant in ("nf4", "fp4", "int8") else weight_dtype_bytes(setup)
    layer_w = (t.weights - (embed_p + norm_p + head_p) * nonlayer_b) / L
    c_logits = autocast_bytes(setup)
    rope_b = model.traits.rope_bytes or (4 if mixed(setup) else autocast_bytes(setup))
    rope_copy = 2 * N * model.rope_dim * rope_b if model.traits.rope and not setup.checkpointing else 0
    embed_rank, norm_rank, head_rank = split.embed_rank, split.norm_rank, split.head_rank
    rotary_rank = split.rotary_rank
    out = []
    empty: dict | None = None  # an empty GPU's terms (no layer, no end of the model, not GPU 0): all alike
    for r in range(split.gpus):
        layers = split.layers_on(r)
        n = len(layers)
        embed, norm, head = embed_rank == r, norm_rank == r, head_rank == r
        if empty is not None and not n and r != 0 and not (embed or norm or head):
            out.append(RankTerms(**{**empty, "rank": r}))  # what the computation below gives it (many GPUs: fast)
            continue
        params = n * layer_p + embed_p * embed + norm_p * norm + head_p * head
        weights = n * layer_w + (embed_p * embed + norm_p * norm + head_p * head) * nonlayer_b
        share = (params / params_total) if setup.method == "full" else n / L  # of what trains
        cast = (t.cast_total - t.cast_head) * n / L + (t.cast_head if head else 0)
        saved = t.layers_saved * n / L + (0 if rotary_rank == r else n * rope_copy)
        out.append(_rank(model, setup, t, RankTerms(
            rank=r, layers=layers, weights=int(weights), adapters=int(t.adapters * n / L),
            gradients=int(t.gradients * share), optimizer_states=int(t.optimizer_states * share),
            optimizer_step=int(t.optimizer_step * share), cast_cache=int(cast), paged=int(t.paged * share),
            saved=int(saved), model_io=t.model_io if head else 0, logits_forward=t.logits_forward if head else 0,
            logits_backward=t.logits_backward if head else 0,
            copies=int((0 if rotary_rank == r else n * rope_copy)
                       + (c_logits * N * V if r == 0 and head_rank != 0 else 0)),
            phase_peaks={}), head_grad=head_p * weight_dtype_bytes(setup) if head else 0,
            tied_end=model.tie_word_embeddings and embed, logits_copy=c_logits * N * V
            if r == 0 and head_rank != 0 else 0, h=h))
        if empty is None and not n and r != 0 and not (embed or norm or head):
            empty = {f.name: getattr(out[-1], f.name) for f in dataclasses.fields(out[-1])}
    return tuple(out)


def _rank(model: ModelSpec, setup: Setup, t: StepTerms, rt: RankTerms, head_grad: int, tied_end: bool,
          logits_copy: int, h: int) -> RankTerms:
    """One GPU's phase peaks: the moments of estimator/step.py's single GPU over its own layers."""
    c, N, L = autocast_bytes(setup), setup.tokens, max(model.num_layers, 1)
    W, A_w, G, S, T = rt.weights, rt.adapters, rt.gradients, rt.optimizer_states, rt.optimizer_step
    base = W + A_w + S
    accum = G if setup.grad_accum > 1 else 0
    io = rt.model_io + rt.logits_forward
    forward = base + rt.cast_cache + accum + rt.saved + io
    if logits_copy:
        forward = max(forward, base + rt.cast_cache + accum + rt.saved + logits_copy)
    if t.dequantization_forward and rt.layers:
        forward = max(forward, base + rt.cast_cache + accum + rt.saved + t.dequantization_forward + c * N * h)
    moments = [base + G]
    if rt.logits_backward:
        moments.append(base + rt.cast_cache + accum + rt.saved + rt.model_io + rt.logits_backward)
    cast_head = t.cast_head if rt.logits_forward else 0
    cast_layer = (t.cast_total - t.cast_head) / L
    if rt.layers:
        if setup.method == "full":
            g_layer = (G - head_grad) / max(len(rt.layers), 1) if G > head_grad else 0
            moments.append(base + rt.cast_cache - cast_head + (G if accum else head_grad) + rt.saved + t.top_extra)
            moments.append(base + cast_layer + (G if accum else G - g_layer) + t.bottom_kept + t.bottom_extra)
        else:
            moments.append(base + rt.cast_cache - cast_head + accum + rt.saved + t.top_extra)
            moments.append(base + cast_layer + G + t.bottom_kept + t.bottom_extra)
    if setup.method == "full":
        tied = (3 if accum else 2) if tied_end else 0
        moments.append(base + G + tied * model.vocab_size * h * weight_dtype_bytes(setup) + (c * N * h if rt.layers
                                                                                          else 0))
    optimizer = W + A_w + G + S + T
    peaks = {"forward": int(forward), "backward": int(max(moments)), "optimizer": int(optimizer)}
    return dataclasses.replace(rt, phase_peaks=peaks)


def rank_peaks(ranks: tuple[RankTerms, ...], gpu: GpuSpec | None, corrections: Corrections) -> tuple[RankPeak, ...]:
    """Each GPU's headline numbers. A GPU the split left empty holds only the CUDA context that
    accelerate's ``get_max_memory`` created on it (``torch.tensor([0], device=i)``)."""
    out = []
    for rt in ranks:
        if not rt.holds_anything:
            out.append(RankPeak(rank=rt.rank, layers=(), tensor_peak_bytes=0, peak_allocated_bytes=0,
                                peak_reserved_bytes=0, device_total_bytes=corrections.cuda_context_bytes,
                                phase="forward"))
            continue
        phase = max(PHASES, key=lambda p: rt.phase_peaks[p])
        peak = rt.phase_peaks[phase]
        allocated, reserved, total, _ = device_overheads(peak, 1, gpu, corrections)
        out.append(RankPeak(rank=rt.rank, layers=rt.layers, tensor_peak_bytes=int(peak),
                            peak_allocated_bytes=int(allocated), peak_reserved_bytes=int(reserved),
                            device_total_bytes=int(total + rt.paged), phase=phase))
    return tuple(out)


def fullest(peaks: tuple[RankPeak, ...]) -> int:
    """The rank the fit is judged on: the largest device total (the first of equals)."""
    return max(range(len(peaks)), key=lambda i: (peaks[i].device_total_bytes, -i))


@dataclass(frozen=True)
class SplitResult:
    """What estimator/step.py takes from the split: the fullest GPU's states and activations (the
    same dataclasses it built for one GPU, with that GPU's shares), its phase peaks and every GPU's
    headline numbers."""

    states: object  # step.ModelStates
    acts: object  # step.StepActivationTerms
    phase_peaks: dict[str, int]
    paged: int
    per_rank: tuple[RankPeak, ...]
    notes: tuple[str, ...]


def fullest_rank(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections: Corrections, states, cast_head: int,
                 acts, ends: tuple[float, float, float]) -> SplitResult:
    """The placement (estimator/layer_split.py), each GPU's terms, and the fullest GPU's.

    ``states``/``acts`` are estimator/step.py's single-GPU ModelStates and StepActivationTerms;
    ``ends`` its (top layer's backward extra, bottom layer's extra, bottom layer's kept bytes)."""
    split = place(model, setup, gpu, corrections.cuda_context_bytes)
    terms = StepTerms(
        weights=states.weights, adapters=states.adapters, gradients=states.gradients,
        optimizer_states=states.optimizer_states, optimizer_step=states.optimizer_step, cast_total=states.cast_cache,
        cast_head=cast_head, paged=paged_bytes(model, setup), layers_saved=acts.layers, model_io=acts.model_io,
        logits_forward=acts.logits_forward, logits_backward=acts.logits_backward,
        dequantization_forward=acts.dequantization_forward, top_extra=ends[0], bottom_extra=ends[1],
        bottom_kept=ends[2])
    ranks = rank_terms(model, setup, split, terms)
    peaks = rank_peaks(ranks, gpu, corrections)
    r = ranks[fullest(peaks)]
    share = len(r.layers) / max(model.num_layers, 1)
    st = dataclasses.replace(states, weights=r.weights, adapters=r.adapters, gradients=r.gradients,
                             optimizer_states=r.optimizer_states, optimizer_step=r.optimizer_step,
                             cast_cache=r.cast_cache)
    a = dataclasses.replace(acts, layers=r.saved, dequantized=int(acts.dequantized * share), model_io=r.model_io,
                            logits_forward=r.logits_forward, logits_backward=r.logits_backward)
    counts = " / ".join(str(len(x.layers)) for x in ranks)
    notes = [f"device_map={setup.device_map} over {split.gpus} GPUs in one process: decoder layers per GPU {counts} "
             f"(embeddings on GPU {split.embed_rank}, lm_head on GPU {split.head_rank}); the numbers are GPU "
             f"{r.rank}'s, the fullest (--json per_rank has every GPU's)"]
    if setup.max_memory:
        notes.extend(cap_notes(setup, gpu, corrections.cuda_context_bytes))
    if split.spilled:
        notes.append(f"the weights do not fit on {split.gpus} GPUs as device_map={setup.device_map} places them: "
                     f"accelerate would offload {split.spilled[0]}{' and the rest' if len(split.spilled) > 1 else ''} "
                     f"to the CPU (not modelled); GPU {split.gpus - 1} is shown holding them")
    empty = [x.rank for x in ranks if not x.holds_anything]
    if empty:
        notes.append(f"device_map={setup.device_map} leaves GPU {', '.join(map(str, empty))} empty: the model fits "
                     "before it (sequential fills GPU 0 first); auto/balanced spreads the layers")
    return SplitResult(states=st, acts=a, phase_peaks=r.phase_peaks, paged=r.paged, per_rank=peaks,
                       notes=tuple(notes))


def cap_notes(setup: Setup, gpu: GpuSpec | None, cuda_context_bytes: int) -> list[str]:
    """What ``--max-memory`` did: the caps the placement used (accelerate takes them as given,
    transformers 5.24 ``get_max_memory``), and any above the GPU's free memory at load."""
    from ..setup.max_memory import caps_text
    from ..util.units import gib
    from .layer_split import free_memory_bytes

    out = [f"placed under max_memory {caps_text(setup.max_memory)} (accelerate takes each cap as given)"]
    if gpu is not None:
        free = free_memory_bytes(gpu, cuda_context_bytes)
        over = [i for i, c in enumerate(setup.max_memory) if c > free]
        if over:
            out.append(f"max_memory gives GPU {', '.join(map(str, over))} more than the {gib(free)} GiB free on "
                       f"{gpu.name} at load: accelerate places by the cap, so the load can run out of memory there")
    return out


def copy_bytes_per_micro_step(model: ModelSpec, setup: Setup) -> float:
    """Bytes a layer split copies between GPUs per micro-step (cost/model.py prices them over the
    interconnect, on the critical path: only one GPU computes at a time). The hidden states cross
    each of the ``gpus - 1`` boundaries forward and their gradient back; RoPE's cos/sin go to each
    layer off the rotary embedding's GPU (again in a checkpointed layer's recompute); an untied
    head's logits come back to GPU 0."""
    if setup.device_map == "none" or setup.gpus < 2:
        return 0.0
    c, N, h = autocast_bytes(setup), setup.tokens, model.hidden_size
    boundaries = setup.gpus - 1
    moved = 2 * boundaries * c * N * h
    off_rotary = model.num_layers * boundaries / setup.gpus
    moved += off_rotary * 2 * N * model.rope_dim * c * (2 if setup.checkpointing else 1)
    if not model.tie_word_embeddings:
        moved += c * N * model.vocab_size
    return moved
