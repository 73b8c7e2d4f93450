"""One training step's memory per GPU: the estimate, in named steps.

``estimate(model, setup, gpu)`` sums one pure function per memory term into a Breakdown and takes
the peak as the maximum over the phases of a step (end of forward, backward, optimizer step), not
the sum of all terms: optimizer transients and activations never coexist. The steps, in order:
model states (weights, adapters, gradients, optimizer), the check of the setup, autocast's weight
cache, ZeRO/FSDP/DDP's per-rank states, the activations, the moments of each phase, the device
terms (workspaces, allocator, context) and the Breakdown's components.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..bands import DEFAULT_ERROR_BANDS
from ..setup.checks import check
from ..specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup
from . import act_offload, cache, eval_step, knobs, moe_4x, objectives, selective, transients, unsloth, vllm_share
from . import activations as act
from . import alibi as alibi_recipe
from . import layer_split_memory as split_memory
from . import llama4 as llama4_recipe
from . import optimizers as opt_rules
from .autocast import AutocastCache, autocast_cache
from .cache import memoized
from .components import step_components
from .corrections import DEFAULT_CORRECTIONS, Corrections, bands_for, device_overheads
from .distributed import StepActivations, ZeroMemory, zero_memory, zero_phase_peaks
from .fsdp import FsdpMemory, ddp_bucket_bytes, is_ddp
from .fsdp2 import sharded_memory, sharded_phase_peaks
from .model_states import (
    GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT,
    adapter_bytes,
    dequantization_transient_bytes,
    gptq_saved_weights_bytes_per_layer,
    gradient_bytes,
    head_params,
    optimizer_state_bytes,
    optimizer_step_transient_bytes,
    prequantized_linears,
    text_trained,
    trainable_params,
    weight_dtype_bytes,
    weights_bytes,
)
from .parallel_rank import rank_estimator
from .precision import compute_bytes
from .stack import DEFAULT_STACK, Stack, model_under, stack_notes
from .tiled_mlp import tile_tokens, tiled_gradient_saving


def estimate(
    model: ModelSpec,
    setup: Setup,
    gpu: GpuSpec | None = None,
    corrections: Corrections = DEFAULT_CORRECTIONS,
    stack: Stack = DEFAULT_STACK,
    *,
    loss_model: ModelSpec | None = None,
    attention_floor: int = 0,
) -> Breakdown:
    """Analytic Breakdown of one training step of ``setup`` on ``model`` (per GPU), as the
    libraries of ``stack`` run it (estimator/stack.py: transformers 5 unless told). ``loss_model``:
    the model whose vocabulary the loss sees, when ``model`` is one rank's shard of it; ``attention_floor``:
    the least a layer's attention backward adds (context parallelism's ring, estimator/context_parallel.py).

    The step's tensor terms (:func:`tensor_terms`) are the same on every card unless :func:`card_terms`;
    they are kept per value (estimator/cache.py) and the card's device terms put on them here."""
    model = moe_4x.model_for(model, stack, setup)  # transformers 4.x: per-expert MoE Linears (estimator/moe_4x.py)
    model = model_under(model, stack)  # transformers before 4.54: SDPA's repeated K/V (estimator/stack.py)
    one_rank = rank_estimator(setup)  # pp, cp or tp: one stage's / rank's estimate (estimator/parallel_rank.py)
    if one_rank is not None:
        return one_rank(model, setup, gpu, corrections, stack, estimate)
    on_card = card_terms(setup) or not cache.enabled()  # uncached: every term on the card (the tests' reference)
    t = tensor_terms(model, setup, gpu if on_card else None, corrections if on_card else None, stack, loss_model,
                     attention_floor)
    notes = list(t.check_notes if on_card or gpu is None else setup_warnings(model, setup, gpu, stack)) + list(t.notes)
    states, split, paged, phase_peaks = t.states, t.split, t.paged, t.phase_peaks
    allocated, reserved, device_total, overheads = device_overheads(phase_peaks[t.phase], 1 if split else setup.gpus,
                                                                    gpu, corrections)
    notes += eval_step.eval_fit_note(  # --eval-batch: the eval batch that fits
        model, setup, gpu, phase_peaks, t.ev_rest, states.cast_cache,
        lambda peak: device_overheads(peak, 1 if split else setup.gpus, gpu, corrections)[2] + paged)
    notes += objectives.vllm_room_note(setup, gpu, device_total + paged) + vllm_share.share_notes(model, setup, gpu)
    device_total += paged + objectives.vllm_share_bytes(setup, gpu)  # vLLM colocated: its share of the card
    return Breakdown(
        model=model.name,
        setup=setup,
        tier="analytic",
        components=eval_step.with_eval_phase(setup, objectives.with_objective_phases(setup, t.components[0] + tuple(
            Component(name, n, PHASES, note=unsloth.overhead_note(setup, name, note))
            for name, n, note in overheads) + t.components[1])
            + t.extra.components) + t.last_components,
        phase_peaks_bytes=dict(phase_peaks),
        phase=t.phase,
        tensor_peak_bytes=int(phase_peaks[t.phase]),
        peak_allocated_bytes=int(allocated),
        peak_reserved_bytes=int(reserved),
        device_total_bytes=int(device_total),
        params_total=t.params_total,
        params_trainable=t.params_trainable,
        host_bytes=t.host_bytes,
        gpu=gpu,
        notes=tuple(notes),
        error_band=bands_for(corrections, setup) or DEFAULT_ERROR_BANDS,  # the default when uncalibrated
        calibration=corrections.calibration,
        per_rank=split.per_rank if split else (),
    )


def card_terms(setup: Setup) -> bool:
    """Whether the card (and its corrections) enter the step's tensor terms, not only its device terms:
    Unsloth's loss chunks (the memory free at the first loss), a layer split (each GPU's share of the
    card) and DPO/GRPO (vLLM colocated's share, the generation). Otherwise :func:`tensor_terms` sees no card."""
    return setup.loss == "unsloth" or setup.device_map != "none" or setup.objective != "sft"


def setup_warnings(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, stack: Stack = DEFAULT_STACK) -> list[str]:
    """The setup check's warnings under ``stack`` (it raises SpecError for a setup peft would refuse):
    what ``vramplan check`` prints beside the estimate too (budget/runner.py)."""
    notes = check(model, setup, gpu)
    if stack.moe_experts_linear:  # transformers 4.x quantizes per-expert Linears: the fused-experts warning is 5's
        notes = [n for n in notes if "fused 3-D tensors that bitsandbytes" not in n]
    return notes


@dataclass(frozen=True)
class TensorTerms:
    """One step before the card's device terms: the tensor peak of each phase and what it is made of."""

    check_notes: tuple[str, ...]  # the setup check's warnings on the card the terms saw (None: on none)
    notes: tuple[str, ...]  # the terms' own notes, in order
    pset: Setup  # the setup the step's rows are (DPO/GRPO: the policy's)
    states: ModelStates
    acts: StepActivationTerms
    recompute: int
    split: split_memory.SplitResult | None  # a layer split's fullest GPU
    extra: objectives.ObjectiveMemory
    phase_peaks: dict[str, int]  # never changed: each Breakdown gets a copy
    phase: str
    ev_rest: int  # what the eval step holds beside its forward
    paged: int  # bitsandbytes' paged states (managed memory, outside torch's allocator)
    components: tuple[tuple[Component, ...], tuple[Component, ...]]  # before and after the device terms
    last_components: tuple[Component, ...]  # the eval step's and the host copies'
    params_total: int
    params_trainable: int
    host_bytes: int


@memoized(typed=1)
def tensor_terms(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections: Corrections | None, stack: Stack,
                 loss_model: ModelSpec | None, attention_floor: int) -> TensorTerms:
    """The tensor terms of one step (no pp/cp/tp: estimator/parallel_rank.py), in named steps; ``gpu`` and
    ``corrections`` None unless :func:`card_terms`. Kept per its arguments (estimator/cache.py)."""
    single = _model_states(model, setup)
    notes = setup_warnings(model, setup, gpu, stack)  # raises SpecError for a setup peft would refuse
    rest = stack_notes(model, setup, stack)
    cast = autocast_cache(model, setup)
    states = _per_rank_states(model, setup, single, cast)
    pset = setup if setup.objective == "sft" else objectives.policy_setup(setup, stack)  # DPO/GRPO rows
    acts = _activations(model, pset, stack, setup, loss_model or model, attention_floor)
    if setup.loss == "unsloth" and gpu is not None:  # its chunks follow the memory free at the first loss
        acts = unsloth.on_card(model, setup, gpu, corrections, states.weights + states.adapters, acts)
    phase_peaks, recompute = _phase_peaks(model, pset, states, cast, acts, stack)
    states, acts, phase_peaks, recompute = transients.framework_step(model, setup, states, acts, phase_peaks, recompute)
    phase_peaks = {p: b + unsloth.dequantization_buffer_bytes(model, setup) for p, b in phase_peaks.items()}
    split = None
    if setup.device_map != "none":  # a layer split: the fullest GPU's terms (estimator/layer_split_memory.py)
        ends = (_layer_backward(model, pset, acts, model.num_layers - 1)[0], *_layer_backward(model, pset, acts, 0))
        split = split_memory.fullest_rank(model, setup, gpu, corrections, states, cast.head, acts, ends)
        states, acts, phase_peaks, rest = split.states, split.acts, split.phase_peaks, rest + list(split.notes)
    extra = _objective(model, setup, gpu, states, acts, phase_peaks, stack)
    phase_peaks = {**extra.phases, **{p: b + extra.ref_weights for p, b in phase_peaks.items()}}
    rest += extra.notes
    ev_rest = states.weights + states.adapters + states.optimizer_states + states.buffers
    ev_peaks, ev_comps, ev_notes = eval_step.eval_phase(  # --eval-batch: the eval step (estimator/eval_step.py)
        model, setup, ev_rest, states.cast_cache)
    phase_peaks, rest = {**phase_peaks, **ev_peaks}, rest + list(ev_notes)
    # bitsandbytes' paged states are managed memory: on the device, outside torch's allocator
    knob = knobs.knob_states(model, setup)
    paged = split.paged if split else opt_rules.paged_bytes(model, setup) + knob.paged
    return TensorTerms(
        check_notes=tuple(notes), notes=tuple(rest), pset=pset, states=states, acts=acts, recompute=recompute,
        split=split, extra=extra, phase_peaks=phase_peaks, phase=max(phase_peaks, key=lambda p: phase_peaks[p]),
        ev_rest=ev_rest, paged=paged, components=step_components(pset, states, acts, recompute, paged),
        last_components=tuple(ev_comps) + act_offload.components(model, setup) + unsloth.components(model, setup),
        params_total=model.params_total,
        params_trainable=trainable_params(model, setup) + knob.params,
        host_bytes=int(states.host + act_offload.host_bytes(model, setup) + unsloth.host_bytes(model, setup)))


# ----------------------------------------------------------------------------------------------
# model states


@dataclass(frozen=True)
class ModelStates:
    """What one GPU holds for the model itself, between and during the step."""

    weights: int
    adapters: int
    gradients: int
    optimizer_states: int
    optimizer_step: int  # the optimizer step's transient
    host: int = 0  # host RAM of an offload
    cast_cache: int = 0  # autocast's half copies of the weights (forward to backward)
    buffers: int = 0  # DeepSpeed's buckets and staging buffers, or DDP's gradient buckets
    ddp_buckets: int = 0
    fsdp_gathered: int = 0  # FSDP's unsharded root unit and one layer unit
    zero: ZeroMemory | None = None
    fsdp: FsdpMemory | None = None
    trained_modules: int = 0  # of ``adapters``: modules_to_save copies and DoRA magnitudes (estimator/knobs.py)


def _model_states(model: ModelSpec, setup: Setup) -> ModelStates:
    """Weights, adapters, gradients, optimizer states and step transient of one unsharded GPU
    (with what modules_to_save and DoRA train beside the adapters: estimator/knobs.py)."""
    k = knobs.knob_states(model, setup)
    trained = text_trained(model) if setup.method == "full" else model  # a vision tower gets no gradient
    states = ModelStates(
        weights=weights_bytes(model, setup), adapters=adapter_bytes(model, setup) + k.weights,
        gradients=gradient_bytes(trained, setup) + k.gradients,
        optimizer_states=optimizer_state_bytes(trained, setup) + k.optimizer_states,
        optimizer_step=optimizer_step_transient_bytes(trained, setup) + k.optimizer_step, trained_modules=k.weights,
    )
    if setup.optimizer_in_backward:  # one parameter's gradient (and step) at a time
        states = dataclasses.replace(states, gradients=knobs.in_backward_gradient(model, setup), optimizer_step=0)
    return states


def _per_rank_states(model: ModelSpec, setup: Setup, single: ModelStates, cast: AutocastCache) -> ModelStates:
    """ZeRO: the rank's partitions, DeepSpeed's buckets and the offload (estimator/distributed.py);
    FSDP: the rank's shards and the gathered units (estimator/fsdp.py); DDP: its gradient buckets.
    Under ZeRO and FSDP the weights are cast once, at load, not by autocast."""
    states = dataclasses.replace(single, cast_cache=cast.total)
    if setup.zero_stage:
        # peft's modules_to_save copies train beside the adapters: in DeepSpeed's flat groups alike
        zm = zero_memory(model, setup, trainable_params(model, setup) + knobs.knob_states(model, setup).params)
        states = dataclasses.replace(
            states, zero=zm, weights=zm.weights, adapters=0, cast_cache=0, gradients=zm.grad_partition,
            optimizer_states=zm.master + zm.states, optimizer_step=zm.step, host=zm.host,
            buffers=zm.buckets + zm.staging)
    if setup.fsdp != "none":
        fm = sharded_memory(model, setup)  # FSDP1 or FSDP2 (setup.fsdp_version)
        return dataclasses.replace(
            states, fsdp=fm, weights=fm.shards, adapters=0, cast_cache=0, gradients=fm.grad_shards,
            optimizer_states=fm.states, optimizer_step=fm.step, host=fm.host, fsdp_gathered=fm.root + fm.layer)
    if is_ddp(setup):
        ddp_buckets = ddp_bucket_bytes(states.gradients)
        return dataclasses.replace(states, ddp_buckets=ddp_buckets, buffers=ddp_buckets)
    return states


# ----------------------------------------------------------------------------------------------
# activations


@dataclass(frozen=True)
class StepActivationTerms:
    """The activations of the step and the transients beside them (bytes unless per token)."""

    setup: Setup  # the setup the activations are those of
    compute_bytes: int  # c: bytes per element of the activations
    layer_kept: float  # bytes one layer keeps (its layer input alone, with checkpointing)
    merged_total: float  # peft's merged MoE expert stacks, over the MoE layers
    merged_layer: float  # one MoE layer's
    dequantized_layer: float  # GPTQ: one layer's saved 16-bit weights
    dequantized: int  # GPTQ: every layer's (0 with checkpointing)
    layers: int  # what the decoder layers keep to the backward
    model_io: int  # outside the layers: embeddings, final norm, fp32 log-probs
    logits_forward: int
    logits_backward: int
    attention_backward: float  # the attention and norm gradient temporaries
    dequantization: int  # a quantized Linear's backward dequantization
    dequantization_forward: int  # one Linear dequantized in the forward (GPTQ; AWQ over 1024 rows)
    dora_norm: int = 0  # DoRA: the widest adapted Linear's weight-norm temporaries (estimator/knobs.py)
    checkpointed_inputs: int = 0  # of ``layers``: the checkpointed layers' inputs
    layers_inputs: int = 0  # of ``model_io``: what every layer keeps from outside through its backward


def _activations(model: ModelSpec, setup: Setup, stack: Stack = DEFAULT_STACK,
                 user: Setup | None = None, loss_model: ModelSpec | None = None,
                 attention_floor: int = 0) -> StepActivationTerms:
    """Per layer (token-sized, plus weight-sized for peft's merged MoE experts), outside the layers,
    the loss, and the dequantization transients. ``user``: the Setup of a DPO/GRPO run whose policy
    step ``setup`` is (its loss is TRL's fused head: estimator/objectives.py)."""
    aset = setup  # (under FSDP's MixedPrecision precision.mixed() reads it as the 16-bit step)
    N, L = setup.tokens, model.num_layers
    layer_tok = (act.layer_bytes_per_token(model, aset) + knobs.dora_saved_per_token(model, aset)) * N
    merged_total = act.moe_lora_weight_bytes(model, aset)
    merged_layer = merged_total / model.moe.num_moe_layers if merged_total else 0
    kept_tok = act.checkpoint_kept_per_token(model, aset) * N if setup.checkpointing else layer_tok
    # selective checkpointing (estimator/selective.py): L_ck layers keep their input, the rest all
    L_ck = selective.checkpointed_count(setup, L)
    # GPTQ: every quantized Linear saves its dequantized 16-bit weight (a checkpointed layer's
    # only while it is recomputed)
    D_layer = gptq_saved_weights_bytes_per_layer(model, setup)
    A_deq = 0 if setup.checkpointing else int(L * D_layer)
    A_layers = int(L_ck * kept_tok + (L - L_ck) * layer_tok
                   + (0 if setup.checkpointing else merged_total + knobs.dora_saved_fixed(model, aset)))
    A_layers += A_deq
    A_layers -= int(act.untracked_input_norm_bytes_per_token(model, aset) * N)  # the first layer's, adapters only
    if unsloth.offloads(model, setup):  # Unsloth's checkpointing: the layer inputs in host RAM but the last
        A_layers = unsloth.device_checkpoint_bytes(model, setup, kept_tok, L)
    A_glob = int(act.global_bytes_per_token(loss_model or model, aset) * N)
    logits_fwd, logits_bwd = transients.loss_transients(loss_model or model, aset, stack)
    if user is not None and (user.objective != "sft" or user.loss == "trl"):  # TRL's fused head (objectives.py)
        logits_fwd, logits_bwd, A_glob = objectives.loss_transients(model, user, stack)
    T_attn = max(transients.attention_backward_transient_per_token(model, aset) * N, attention_floor)
    T_deq = dequantization_transient_bytes(model, setup)
    # a GPTQ forward dequantizes each Linear in turn (the largest counts); its backward reuses the
    # saved copy, so only a recomputed (checkpointed) layer dequantizes again
    T_deq_fwd = 0
    if setup.quant == "gptq":
        largest = max((l.weight_params for l in prequantized_linears(model)), default=0)
        T_deq_fwd = (GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT[setup.quant_bits] * largest
                     - (0 if setup.checkpointing else 2 * largest))
        if not setup.checkpointing:
            T_deq = 0
    elif setup.quant == "awq" and N > 1024:  # AwqGemmFn dequantizes the whole weight for > 1024 rows
        T_deq_fwd = T_deq
    return StepActivationTerms(
        setup=aset, compute_bytes=compute_bytes(aset), layer_kept=kept_tok, merged_total=merged_total,
        merged_layer=merged_layer, dequantized_layer=D_layer, dequantized=A_deq, layers=A_layers, model_io=A_glob,
        logits_forward=logits_fwd, logits_backward=logits_bwd, attention_backward=T_attn, dequantization=T_deq,
        dequantization_forward=T_deq_fwd, dora_norm=knobs.dora_forward_transient(model, aset),
        checkpointed_inputs=int(L_ck * kept_tok) if setup.checkpointing else 0,
        layers_inputs=int(act.layers_inputs_per_token(loss_model or model, aset) * N),
    )


def _layer_backward(model: ModelSpec, setup: Setup, a: StepActivationTerms, idx: int) -> tuple[float, float]:
    """(bytes layer ``idx``'s backward adds over the kept activations, that layer's kept bytes).

    Recomputed with checkpointing, the layer's activations come back; then its MLP's
    gradients appear while the whole layer is saved, or later the attention/norm gradients
    once the MLP side is freed. A merged MoE layer's down stack gets a full gradient."""
    aset, c, N, h = a.setup, a.compute_bytes, setup.tokens, model.hidden_size
    attn_side, mlp_side = act.layer_split_per_token(model, aset, idx)
    merged = a.merged_layer if act.is_moe_layer(model, idx) else 0
    saved = (attn_side + mlp_side + knobs.dora_saved_per_token(model, aset)) * N + merged + a.dequantized_layer
    t_mlp = (transients.mlp_backward_transient_per_token(model, aset, idx) * N
             + knobs.dora_backward_transient(model, aset))
    if merged == 0 and act.is_moe_layer(model, idx) and moe_4x.has_linear_experts(model):  # 4.x's expert loop
        t_mlp = moe_4x.backward_transient_per_token(model, aset) * N + knobs.dora_backward_transient(model, aset)
    if act.is_moe_layer(model, idx) and model.family == llama4_recipe.FAMILY:  # every expert's (estimator/llama4.py)
        t_mlp = (llama4_recipe.moe_backward_transient_per_token(model, aset) * N
                 + llama4_recipe.moe_backward_transient_fixed(model, aset) + knobs.dora_backward_transient(model, aset))
    if merged:
        t_mlp += c * model.moe.num_experts * model.moe.expert_intermediate_size * h
    attention = a.attention_backward - mlp_side * N - merged
    if setup.tiled_mlp:  # one tile's saves and gradients; the MLP input's gradient summed a tile at a time
        plain, tile = aset.replace(tiled_mlp=False), tile_tokens(model, setup)  # (tiled_mlp.py; dense only)
        per_tile = act.layer_split_per_token(model, plain, idx)[1] + transients.mlp_backward_transient_per_token(
            model, plain, idx)
        t_mlp = (per_tile * tile + act.tiled_mlp_input_bytes(model, aset) * N
                 + knobs.dora_backward_transient(model, aset))
        attention -= tiled_gradient_saving(model, aset) * (N - tile)
    # the dequantized weight (down_proj's, first in the MLP's backward) appears beside the
    # gradient its LoRA branch already produced; in a recomputed (checkpointed) layer the
    # 4-bit copy peaks apart from them (read off the CPU truth: validate --knob quantization)
    t_grad = max(t_mlp, attention)
    ck = selective.is_checkpointed(setup, idx)  # (every layer, or every k-th: estimator/selective.py)
    if ck and unsloth.fast_path(model, setup):  # its own decoder forward and fused LoRA kernels (estimator/unsloth.py)
        return unsloth.recompute_bytes(model, setup), a.layer_kept
    apart = ck and setup.quant != "int8"
    transient = max(t_grad, a.dequantization) if apart else t_grad + a.dequantization
    kept = a.layer_kept if ck else saved
    extra = (saved if ck else 0) + transient + c * N * h
    if ck:  # the recomputed forward's widest LoRA projection (DoRA: its weight norm)
        extra = max(extra, transients.lora_forward_peak_per_token(model, aset, idx) * N + c * N * h,
                    saved + knobs.dora_forward_transient(model, aset, recompute=True))
    if ck and alibi_recipe.is_alibi(model):  # the recomputed eager attention's s x s tensors (estimator/alibi.py)
        extra = max(extra, alibi_recipe.recompute_transient_per_token(model, aset) * N + c * N * h)
    return extra, kept


# ----------------------------------------------------------------------------------------------
# the phases


def _phase_peaks(model: ModelSpec, setup: Setup, st: ModelStates, cast: AutocastCache,
                 a: StepActivationTerms, stack: Stack = DEFAULT_STACK) -> tuple[dict[str, int], int]:
    """The tensor peak of each phase, and the recompute term (checkpointing: one layer recomputed
    with its gradient temporaries). ZeRO and FSDP place the same activation moments on their own
    per-rank states (estimator/distributed.py, estimator/fsdp.py)."""
    top_extra, _ = _layer_backward(model, setup, a, model.num_layers - 1)
    bottom_extra, bottom_kept = _layer_backward(model, setup, a, 0)
    ends = [e for i, e in ((model.num_layers - 1, top_extra), (0, bottom_extra)) if selective.is_checkpointed(setup, i)]
    recompute = int(max(ends, default=0))
    if st.zero is None and st.fsdp is None:
        return _single_gpu_phase_peaks(model, setup, st, cast, a, top_extra, bottom_extra, bottom_kept), recompute
    c, N, h = a.compute_bytes, setup.tokens, model.hidden_size
    A_layers = a.layers
    step_acts = StepActivations(
        at_loss=int(A_layers + a.model_io + a.logits_forward),
        backward_start=int(A_layers + a.model_io + a.logits_backward),
        top_layer=int(A_layers + top_extra), bottom_layer=int(bottom_kept + bottom_extra), end=int(c * N * h),
        saved=int(A_layers))
    if st.zero is not None:
        return zero_phase_peaks(model, setup, st.zero, step_acts), recompute
    reentrant = setup.checkpointing and stack.reentrant_checkpointing  # estimator/fsdp.py fsdp_phase_peaks
    return sharded_phase_peaks(model, setup, st.fsdp, step_acts, reentrant), recompute


def _single_gpu_phase_peaks(model: ModelSpec, setup: Setup, st: ModelStates, cast: AutocastCache,
                            a: StepActivationTerms, top_extra: float, bottom_extra: float,
                            bottom_kept: float) -> dict[str, int]:
    """One GPU (or a DDP rank): the end of the forward, the moments of the backward (the loss, the
    top layer, the bottom layer, the end) and the optimizer step."""
    c, N, h, L = a.compute_bytes, setup.tokens, model.hidden_size, model.num_layers
    W, A_w, G, S, T_opt = st.weights, st.adapters, st.gradients, st.optimizer_states, st.optimizer_step
    cast_cache, A_layers = st.cast_cache, a.layers
    merged_total, merged_layer = a.merged_total, a.merged_layer
    accum_grads = G if setup.grad_accum > 1 else 0
    base = W + A_w + S + st.buffers

    off = act_offload.device_saving_bytes(model, setup)  # --activation-offload: layer inputs on host
    at_loss = base + cast_cache + accum_grads + A_layers - off + a.model_io + a.logits_forward
    # with checkpointing nothing inside a layer is saved, but a layer's forward still builds its
    # merged expert stack (and routes k copies of the hidden states) while it runs
    in_layer = 0
    if setup.checkpointing and merged_total:
        in_layer = base + cast_cache + accum_grads + A_layers + merged_layer + c * N * h * (model.moe.top_k + 2)
    forward = max(at_loss, in_layer)
    if alibi_recipe.is_alibi(model):  # eager ALiBi attention's s x s tensors in the top layer's forward (alibi.py)
        forward = max(forward, base + cast_cache + accum_grads + A_layers
                      + alibi_recipe.forward_transient_per_token(model, setup) * N)
    if setup.dora:  # the last layer's widest DoRA Linear's weight norm (estimator/knobs.py), before the head
        forward = max(forward, base + cast_cache - cast.head + accum_grads + A_layers
                      + knobs.dora_forward_transient(model, setup))
    if a.dequantization_forward:  # the last layer's largest Linear being dequantized
        forward = max(forward, base + cast_cache + accum_grads + A_layers + a.dequantization_forward + c * N * h)
    start = (base + cast_cache + accum_grads + A_layers - act_offload.backward_start_saving_bytes(model, setup)
             + a.model_io + a.logits_backward)
    cast_top, cast_bottom = cast_cache - cast.head, cast.layer
    A_top = A_layers - act_offload.top_layers_saving_bytes(model, setup)  # the top layers' backward (offloaded)
    if setup.adapters and setup.checkpointing and selective.is_checkpointed(setup, L - 1):
        cast_top += cast.layer  # the recomputed top layer casts its frozen weights again
    if setup.method == "full":
        G_head = head_params(model) * weight_dtype_bytes(setup)
        G_layer = (G - G_head) / max(L, 1)
        # with accumulation, every gradient exists from the first micro-batch on
        # (the layers' backward still holds RoPE's cos/sin and a checkpointed masked layer's mask: layers_inputs)
        first = base + cast_top + (G if accum_grads else G_head) + A_top + top_extra + a.layers_inputs
        last = base + cast_bottom + (G if accum_grads else G - G_layer) + bottom_kept + bottom_extra + a.layers_inputs
        # tied embeddings: autograd's InputBuffer sums the head's and the embedding's gradient
        # out of place, so both and their sum coexist before the parameter's .grad is set (with
        # accumulation, beside the .grad of the earlier micro-batches)
        tied = (3 if accum_grads else 2) if model.tie_word_embeddings else 0
        end = base + G + tied * model.vocab_size * h * weight_dtype_bytes(setup) + c * N * h
        backward = max(start, first, last, end)
        m = llama4_recipe.lowest_moe_layer(model) if model.family == llama4_recipe.FAMILY else None
        if m is not None:  # Maverick's lowest MoE layer: the gradients above it and its expert gradients
            extra_m, kept_m = _layer_backward(model, setup, a, m)
            below = sum(a.layer_kept if setup.checkpointing else sum(act.layer_split_per_token(model, a.setup, j)) * N
                        for j in range(m))
            done = llama4_recipe.params_not_reached(model, m) * weight_dtype_bytes(setup)
            backward = max(backward, base + cast_bottom + (G if accum_grads else G - done) + below + kept_m + extra_m
                           + a.layers_inputs)
    else:
        # the top layer's backward: log-probs and logits gradients are gone by then
        first = base + cast_top + accum_grads + A_top + top_extra + a.layers_inputs
        last = base + cast_bottom + G + bottom_kept + bottom_extra + a.layers_inputs
        backward = max(start, first, last, base + G)
    optimizer = W + A_w + G + S + T_opt + st.buffers + act_offload.stale_bytes(model, setup)  # (TRL holds them)
    if setup.optimizer_in_backward:  # G is one parameter's (estimator/knobs.py); a tied one's meet at the end
        tied, G_in = knobs.tied_gradient_bytes(model, setup), knobs.in_backward_gradient(model, setup, in_layers=True)
        first = base + cast_top + G_in + tied + A_layers + top_extra + a.layers_inputs
        last = base + cast_bottom + G_in + tied + bottom_kept + bottom_extra + a.layers_inputs
        start += knobs.in_backward_head_gradient(model, setup)
        backward = max(start, first, last, base + max(G, 3 * tied) + c * N * h)
        optimizer = W + A_w + S + st.buffers
    return {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}


def _objective(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, st: ModelStates, a: StepActivationTerms,
               peaks: dict[str, int], stack: Stack) -> objectives.ObjectiveMemory:
    """DPO/GRPO: the reference and generation phases and the reference copy (estimator/objectives.py)."""
    if setup.objective == "sft":  # --loss trl: SFTTrainer's fused head (its refusals and notes)
        return objectives.ObjectiveMemory(0, {}, (), tuple(objectives.check_trl_sft(model, setup)))
    objectives.check_objective(model, setup, gpu)
    resting = st.weights + st.adapters + st.optimizer_states + st.buffers
    after_forward = resting + a.layers + a.model_io
    return objectives.objective_memory(model, setup, gpu, resting, after_forward, stack, st.adapters,
                                       st.gradients if setup.grad_accum > 1 else 0)
