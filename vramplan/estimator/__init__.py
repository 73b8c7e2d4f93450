"""The analytic tier: one training step's memory per GPU from counts only, in milliseconds.

``estimate(model, setup, gpu)`` sums one pure function per memory term into a Breakdown and takes
the peak as the maximum over the phases of a step (end of forward, backward, optimizer step), not
the sum of all terms: optimizer transients and activations never coexist. No torch import.
"""

from __future__ import annotations

from ..checks import check
from ..specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup
from ..units import DTYPE_BYTES, PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE, bnb_4bit_tensor_bytes
from . import activations as act
from . import optimizers as opt_rules
from .corrections import DEFAULT_CORRECTIONS, Corrections, device_overheads
from .distributed import StepActivations, zero_memory, zero_phase_peaks
from .lora import lora_params

__all__ = ["estimate", "Corrections", "DEFAULT_CORRECTIONS", "lora_params", "trainable_params"]


# ----------------------------------------------------------------------------------------------
# parameters


def trainable_params(model: ModelSpec, setup: Setup) -> int:
    return model.params_total if setup.method == "full" else lora_params(model, setup)


def _weight_dtype_bytes(setup: Setup) -> int:
    return int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])


def weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """Base weights. A quantized base stores its Linear weights (head excluded) at the bitsandbytes
    bytes/param; ``prepare_model_for_kbit_training`` upcasts everything else to fp32."""
    w = _weight_dtype_bytes(setup)
    if setup.quant == "none":
        return (model.params_total - model.fp32_params) * w + model.fp32_params * 4
    quantized = sum(l.count * l.weight_params for l in model.linears if l.role != "head")
    rest = model.params_total - quantized
    if setup.quant == "int8":  # int8 weights and LLM.int8's fp32 scale per output row (SCB)
        quantized_bytes = quantized + 4 * sum(l.count * l.out_features for l in model.linears if l.role != "head")
    else:
        quantized_bytes = sum(l.count * bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant)
                              for l in model.linears if l.role != "head")
    return int(quantized_bytes + rest * 4)


def adapter_bytes(model: ModelSpec, setup: Setup) -> int:
    """peft upcasts adapters to fp32 (autocast_adapter_dtype=True)."""
    return 4 * lora_params(model, setup)


def gradient_bytes(model: ModelSpec, setup: Setup) -> int:
    """One gradient per trainable parameter in its dtype (fp32 for adapters and mixed precision)."""
    if setup.adapters:
        return 4 * lora_params(model, setup)
    return model.params_total * _weight_dtype_bytes(setup)


def optimizer_state_bytes(model: ModelSpec, setup: Setup) -> int:
    """States on the device, per trainable tensor (estimator/optimizers.py): AdamW 2 and SGD
    1 in the parameter dtype, bitsandbytes Lion 1 in fp32, 8-bit AdamW two uint8 states + fp32
    block absmax (fp32 states under 4096 elements; paged ones excluded), Adafactor factored."""
    return opt_rules.state_bytes(model, setup, _weight_dtype_bytes(setup))


def optimizer_step_transient_bytes(model: ModelSpec, setup: Setup) -> int:
    """torch AdamW foreach: ``_foreach_sqrt(exp_avg_sqs)`` allocates one state-sized list before
    the in-place update (torch/optim/adamw.py, _multi_tensor_adamw); fused, SGD and the
    bitsandbytes kernels update in place; Adafactor's fp32 copies of the largest tensor."""
    return opt_rules.step_transient_bytes(model, setup, _weight_dtype_bytes(setup))


def dequantization_transient_bytes(model: ModelSpec, setup: Setup) -> int:
    """A quantized Linear's backward dequantizes its weight for the input gradient
    (bitsandbytes/autograd/_functions.py): 4-bit ``dequantize_4bit(B).to(grad.dtype)`` (the
    load dtype, then the compute dtype the matmul's gradient is in), LLM.int8
    ``CB.to(A.dtype, copy=True)`` in the dtype of the Linear's input (fp32 once the model is
    prepared for k-bit training). Alive for one Linear: the largest quantized one counts."""
    if setup.quant == "none":
        return 0
    largest = max((l.weight_params for l in model.linears if l.role != "head"), default=0)
    act_bytes = act.compute_bytes(setup)
    if setup.quant == "int8":
        return act_bytes * largest
    # 4-bit: dequantized to the dtype the model was loaded in (fp32 under mixed precision),
    # then cast to the gradient's, the compute dtype the matmul ran in
    load, compute = _weight_dtype_bytes(setup), int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])
    return (load + (compute if compute != load else 0)) * largest


# ----------------------------------------------------------------------------------------------
# the step


def _largest_layer_grad(model: ModelSpec, setup: Setup) -> int:
    per_layer = sum(l.params for l in model.linears if l.role != "head") / max(model.num_layers, 1)
    per_layer += sum(n for name, n in model.other_params if name in ("experts", "router", "qk_norms")) / max(model.num_layers, 1)
    return int(per_layer * _weight_dtype_bytes(setup))


def _head_params(model: ModelSpec) -> int:
    return sum(l.params for l in model.linears if l.role == "head")


def estimate(
    model: ModelSpec,
    setup: Setup,
    gpu: GpuSpec | None = None,
    corrections: Corrections = DEFAULT_CORRECTIONS,
) -> Breakdown:
    """Analytic Breakdown of one training step of ``setup`` on ``model`` (per GPU)."""
    N = setup.tokens
    h = model.hidden_size
    c = act.compute_bytes(setup)
    L = model.num_layers
    n_gpus = setup.gpus

    W = weights_bytes(model, setup)
    A_w = adapter_bytes(model, setup)
    G = gradient_bytes(model, setup)
    S = optimizer_state_bytes(model, setup)
    T_opt = optimizer_step_transient_bytes(model, setup)
    host = 0
    notes = check(model, setup, gpu)  # raises SpecError for a setup peft would refuse

    # mixed precision: autocast casts each Linear weight to half once per forward and every
    # matmul keeps its copy for backward: all of them at the loss, freed layer by layer in backward
    cast_cache = cast_head = 0
    if setup.precision in ("bf16-mixed", "fp16-mixed"):
        # a quantized Linear runs bitsandbytes' own matmul (not autocast's): only the head casts
        cast_cache = sum(l.count * l.weight_params for l in model.linears
                         if setup.quant == "none" or l.role == "head") * 2
        if model.tie_word_embeddings:  # the tied head casts the embedding matrix
            cast_cache += model.vocab_size * model.hidden_size * 2
        cast_head = sum(l.count * l.weight_params for l in model.linears if l.role == "head") * 2
        if model.tie_word_embeddings:
            cast_head += model.vocab_size * model.hidden_size * 2
    cast_layer = (cast_cache - cast_head) / max(model.num_layers, 1)

    # ZeRO: the rank's partitions, DeepSpeed's buckets and the offload (estimator/distributed.py)
    zm = zero_memory(model, setup, trainable_params(model, setup)) if setup.zero_stage else None
    zero_buffers = 0
    if zm is not None:
        W, A_w, cast_cache = zm.weights, 0, 0
        G, S, T_opt, host = zm.grad_partition, zm.master + zm.states, zm.step, zm.host
        zero_buffers = zm.buckets + zm.staging

    # activations: per layer (token-sized, plus weight-sized for peft's merged MoE experts)
    layer_tok = act.layer_bytes_per_token(model, setup) * N
    merged_total = act.moe_lora_weight_bytes(model, setup)
    merged_layer = merged_total / model.moe.num_moe_layers if merged_total else 0
    kept_tok = act.checkpoint_bytes_per_token(model, setup) * N if setup.checkpointing else layer_tok
    A_layers = int(L * kept_tok + (0 if setup.checkpointing else merged_total))
    A_glob = int(act.global_bytes_per_token(model, setup) * N)
    logits_fwd, logits_bwd = act.loss_transients(model, setup)
    T_attn = act.attention_backward_transient_per_token(model, setup) * N
    T_deq = dequantization_transient_bytes(model, setup)

    def layer_backward(idx: int) -> tuple[float, float]:
        """(bytes a layer's backward adds over the kept activations, that layer's kept bytes).

        Recomputed with checkpointing, the layer's activations come back; then its MLP's
        gradients appear while the whole layer is saved, or later the attention/norm gradients
        once the MLP side is freed. A merged MoE layer's down stack gets a full gradient."""
        attn_side, mlp_side = act.layer_split_per_token(model, setup, idx)
        merged = merged_layer if act.is_moe_layer(model, idx) else 0
        saved = (attn_side + mlp_side) * N + merged
        t_mlp = act.mlp_backward_transient_per_token(model, setup, idx) * N
        if merged:
            t_mlp += c * model.moe.num_experts * model.moe.expert_intermediate_size * h
        # the dequantized weight (down_proj's, first in the MLP's backward) appears beside the
        # gradient its LoRA branch already produced; in a recomputed (checkpointed) layer the
        # 4-bit copy peaks apart from them (read off the CPU truth: validate --knob quantization)
        t_grad = max(t_mlp, T_attn - mlp_side * N - merged)
        apart = setup.checkpointing and setup.quant != "int8"
        transient = max(t_grad, T_deq) if apart else t_grad + T_deq
        kept = kept_tok if setup.checkpointing else saved
        extra = (saved if setup.checkpointing else 0) + transient + c * N * h
        if setup.checkpointing:  # the recomputed forward's widest LoRA projection
            extra = max(extra, act.lora_forward_peak_per_token(model, setup, idx) * N + c * N * h)
        return extra, kept

    top_extra, _ = layer_backward(L - 1)
    bottom_extra, bottom_kept = layer_backward(0)

    accum_grads = G if setup.grad_accum > 1 else 0
    base = W + A_w + S + zero_buffers

    at_loss = base + cast_cache + accum_grads + A_layers + A_glob + logits_fwd
    # with checkpointing nothing inside a layer is saved, but a layer's forward still builds its
    # merged expert stack (and routes k copies of the hidden states) while it runs
    in_layer = 0
    if setup.checkpointing and merged_total:
        in_layer = base + cast_cache + accum_grads + A_layers + merged_layer + c * N * h * (model.moe.top_k + 2)
    forward = max(at_loss, in_layer)
    start = base + cast_cache + accum_grads + A_layers + A_glob + logits_bwd
    cast_top, cast_bottom = cast_cache - cast_head, cast_layer
    if setup.method == "full":
        G_head = _head_params(model) * _weight_dtype_bytes(setup)
        if setup.zero_stage >= 2:
            G_head //= n_gpus
        G_layer = (G - G_head) / max(L, 1)
        # with accumulation, every gradient exists from the first micro-batch on
        first = base + cast_top + (G if accum_grads else G_head) + A_layers + top_extra
        last = base + cast_bottom + (G if accum_grads else G - G_layer) + bottom_kept + bottom_extra
        # tied embeddings: autograd's InputBuffer sums the head's and the embedding's gradient
        # out of place, so both and their sum coexist before the parameter's .grad is set (with
        # accumulation, beside the .grad of the earlier micro-batches)
        tied = (3 if accum_grads else 2) if model.tie_word_embeddings else 0
        end = base + G + tied * model.vocab_size * h * _weight_dtype_bytes(setup) + c * N * h
        backward = max(start, first, last, end)
    else:
        # the top layer's backward: log-probs and logits gradients are gone by then
        first = base + cast_top + accum_grads + A_layers + top_extra
        last = base + cast_bottom + G + bottom_kept + bottom_extra
        backward = max(start, first, last, base + G)
    A_recompute = int(max(top_extra, bottom_extra)) if setup.checkpointing else 0
    optimizer = W + A_w + G + S + T_opt + zero_buffers
    phase_peaks = {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
    if zm is not None:
        last_kept = bottom_kept + bottom_extra
        phase_peaks = zero_phase_peaks(model, setup, zm, StepActivations(
            at_loss=int(A_layers + A_glob + logits_fwd), backward_start=int(A_layers + A_glob + logits_bwd),
            top_layer=int(A_layers + top_extra), bottom_layer=int(last_kept), end=int(c * N * h)))
    phase = max(PHASES, key=lambda p: phase_peaks[p])
    tensor_peak = phase_peaks[phase]

    allocated, reserved, device_total, overheads = device_overheads(tensor_peak, setup.gpus, gpu, corrections)
    # bitsandbytes' paged states are managed memory: on the device, outside torch's allocator
    paged = opt_rules.paged_bytes(model, setup)
    device_total += paged

    fb = ("forward", "backward")
    comps = [
        Component("weights", W, PHASES, note=_weights_note(setup)),
        Component("adapters", A_w, PHASES, note="LoRA A/B in fp32") if A_w else None,
        Component("autocast_weight_cache", cast_cache, fb, note="half copies of weights under autocast") if cast_cache else None,
        Component("gradients", G, ("backward", "optimizer") if setup.grad_accum == 1 else PHASES),
        Component("optimizer_states", S, PHASES, note=setup.optimizer),
        Component("paged_optimizer_states", paged, PHASES,
                  note="cudaMallocManaged: in device_total, not in tensor peak/allocated/reserved") if paged else None,
        Component("optimizer_step", T_opt, ("optimizer",), note="foreach step transient") if T_opt else None,
        Component("activations", A_layers if not setup.checkpointing else 0, fb, note="saved for backward"),
        Component("checkpointed_inputs", A_layers if setup.checkpointing else 0, fb, note="layer inputs kept by checkpointing") if setup.checkpointing else None,
        Component("recompute", A_recompute, ("backward",), note="one layer recomputed, with its gradient temporaries") if A_recompute else None,
        Component("model_io_activations", A_glob, fb, note="embeddings, final norm, fp32 log-probs"),
        Component("logits_loss", max(logits_fwd, logits_bwd), fb,
                  note="logits, fp32 upcast and its gradient" if setup.loss == "hf" else f"one {act.LOSS_CHUNK_TOKENS}-token chunk at a time (chunked loss)"),
        Component("deepspeed_buffers", zero_buffers, PHASES) if zero_buffers else None,
        *(Component(name, n, PHASES, note=note) for name, n, note in overheads),
        Component("host_offload", host, PHASES, where="host") if host else None,
    ]
    return Breakdown(
        model=model.name,
        setup=setup,
        tier="analytic",
        components=tuple(c_ for c_ in comps if c_ is not None),
        phase_peaks_bytes=phase_peaks,
        phase=phase,
        tensor_peak_bytes=int(tensor_peak),
        peak_allocated_bytes=int(allocated),
        peak_reserved_bytes=int(reserved),
        device_total_bytes=int(device_total),
        params_total=model.params_total,
        params_trainable=trainable_params(model, setup),
        host_bytes=int(host),
        gpu=gpu,
        notes=tuple(notes),
        error_band=corrections.error_band,
    )


def _weights_note(setup: Setup) -> str:
    if setup.quant != "none":
        return f"{setup.quant}{' + double quant' if setup.double_quant else ''} base; other params fp32"
    return PRECISION_WEIGHT_DTYPE[setup.precision]
