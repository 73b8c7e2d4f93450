"""The analytic tier: one training step's memory per GPU from counts only, in milliseconds.

``estimate(model, setup, gpu)`` sums one pure function per memory term into a Breakdown and takes
the peak as the maximum over the phases of a step (end of forward, backward, optimizer step), not
the sum of all terms: optimizer transients and activations never coexist. No torch import.
"""

from __future__ import annotations

from ..checks import check
from ..specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup
from ..units import (DTYPE_BYTES, PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE, awq_linear_bytes,
                     bnb_4bit_tensor_bytes, gptq_linear_bytes)
from . import activations as act
from . import optimizers as opt_rules
from .corrections import DEFAULT_CORRECTIONS, Corrections, device_overheads
from .distributed import StepActivations, zero_memory, zero_phase_peaks
from .fsdp import ddp_bucket_bytes, fsdp_memory, fsdp_phase_peaks, is_ddp
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
    if setup.quant in ("gptq", "awq"):
        return prequantized_weights_bytes(model, setup)
    quantized = sum(l.count * l.weight_params for l in model.linears if l.role != "head")
    rest = model.params_total - quantized
    if setup.quant == "int8":  # int8 weights and LLM.int8's fp32 scale per output row (SCB)
        quantized_bytes = quantized + 4 * sum(l.count * l.out_features for l in model.linears if l.role != "head")
    else:
        quantized_bytes = sum(l.count * bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant)
                              for l in model.linears if l.role != "head")
    return int(quantized_bytes + rest * 4)


def prequantized_linears(model: ModelSpec) -> list:
    """The Linears a GPTQ/AWQ checkpoint quantizes: every decoder Linear; the head (transformers'
    ``get_modules_to_not_convert`` skips the output embedding) and MoE routers (gptqmodel's model
    definitions leave ``mlp.gate`` out) stay 16-bit, as do embeddings, norms and 3-D expert weights."""
    return [l for l in model.linears if l.role not in ("head", "router")]


def prequantized_weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """A GPTQ/AWQ base: each quantized Linear at its packed size (units.gptq_linear_bytes /
    awq_linear_bytes: int32 qweight/qzeros, fp16 scales, GPTQ's int32 g_idx, fp16 bias, all
    buffers), the other parameters as loaded (fp16/bf16). peft's ``prepare_model_for_kbit_training``
    (peft 0.21 utils/other.py) upcasts fp16/bf16 parameters to fp32 unless the model's
    ``quantization_method`` is gptq (or aqlm/eetq/hqq/torchao): an AWQ base's embeddings, norms
    and head become fp32, a GPTQ base's stay 16-bit. Packed buffers are never upcast."""
    qs = prequantized_linears(model)
    pack = gptq_linear_bytes if setup.quant == "gptq" else awq_linear_bytes
    packed = sum(l.count * pack(l.in_features, l.out_features, setup.quant_bits, setup.quant_group_size, l.bias)
                 for l in qs)
    rest = model.params_total - sum(l.params for l in qs)
    if setup.quant == "awq":
        return int(packed + 4 * rest)
    fp32 = min(model.fp32_params, rest)
    return int(packed + (rest - fp32) * _weight_dtype_bytes(setup) + 4 * fp32)


#: Peak bytes per weight element of gptqmodel's torch dequantization in training mode
#: (``PackableQuantLinear.dequantize_weight``: int32 shifts of the packed words, int8 codes,
#: gathered scales/zeros, the 16-bit product), result included; measured with gptqmodel 7.7's
#: TorchLinear on CPU (fp16 and bf16 alike): the 3-bit unpack concatenates three planes.
GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT = {2: 6, 3: 14, 4: 6, 8: 8}


def gptq_saved_weights_bytes_per_layer(model: ModelSpec, setup: Setup) -> float:
    """GPTQ trains through gptqmodel's torch path (TorchLinear; TritonV2Linear falls back to it in
    training mode, the fused/Marlin/ExLlama kernels do not train): each forward dequantizes the
    whole weight and ``torch.matmul(x, weights)`` saves it for the input gradient. So every GPTQ
    Linear keeps a 16-bit copy of its weight until its backward: a 16-bit model's worth of
    weights in the activations without checkpointing, one layer's with it. AWQ's GEMM kernel
    (``AwqGemmFn``) saves only the packed tensors."""
    if setup.quant != "gptq":
        return 0.0
    w = _weight_dtype_bytes(setup)
    return sum(l.count * l.weight_params for l in prequantized_linears(model)) * w / max(model.num_layers, 1)


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
    if setup.quant in ("gptq", "awq"):
        largest = max((l.weight_params for l in prequantized_linears(model)), default=0)
        if setup.quant == "gptq":  # the recomputed forward's dequantization, beyond the saved copy
            return (GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT[setup.quant_bits] - _weight_dtype_bytes(setup)) * largest
        # AWQ GEMM backward: ``awq_dequantize_weights(...).to(grad_output.dtype)``, fp16 (no copy)
        return 2 * largest
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
    # FSDP's MixedPrecision runs the step on 16-bit copies of fp32-loaded weights: its activations
    # are those of the bf16/fp16 step (estimator/fsdp.py), not autocast's
    fsdp_mixed_load = setup.fsdp != "none" and setup.precision.endswith("-mixed")
    aset = setup.replace(precision=setup.precision[:4]) if fsdp_mixed_load else setup
    c = act.compute_bytes(aset)
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
    # FSDP: the rank's shards, the gathered units (estimator/fsdp.py); DDP: its gradient buckets
    fm = fsdp_memory(model, setup, W) if setup.fsdp != "none" else None
    fsdp_gathered = ddp_buckets = 0
    if fm is not None:
        W, A_w, cast_cache = fm.shards, 0, 0
        G, S, T_opt, host = fm.grad_shards, fm.states, fm.step, fm.host
        fsdp_gathered = fm.root + fm.layer
    elif is_ddp(setup):
        ddp_buckets = ddp_bucket_bytes(G)
        zero_buffers = ddp_buckets

    # activations: per layer (token-sized, plus weight-sized for peft's merged MoE experts)
    layer_tok = act.layer_bytes_per_token(model, aset) * N
    merged_total = act.moe_lora_weight_bytes(model, aset)
    merged_layer = merged_total / model.moe.num_moe_layers if merged_total else 0
    kept_tok = act.checkpoint_bytes_per_token(model, aset) * N if setup.checkpointing else layer_tok
    # GPTQ: every quantized Linear saves its dequantized 16-bit weight (a checkpointed layer's
    # only while it is recomputed)
    D_layer = gptq_saved_weights_bytes_per_layer(model, setup)
    A_deq = 0 if setup.checkpointing else int(L * D_layer)
    A_layers = int(L * kept_tok + (0 if setup.checkpointing else merged_total)) + A_deq
    A_glob = int(act.global_bytes_per_token(model, aset) * N)
    logits_fwd, logits_bwd = act.loss_transients(model, aset)
    T_attn = act.attention_backward_transient_per_token(model, aset) * N
    T_deq = dequantization_transient_bytes(model, setup)
    # a GPTQ forward dequantizes each Linear in turn (the largest counts); its backward reuses the
    # saved copy, so only a recomputed (checkpointed) layer dequantizes again
    T_deq_fwd = 0
    if setup.quant == "gptq":
        largest = max((l.weight_params for l in prequantized_linears(model)), default=0)
        T_deq_fwd = GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT[setup.quant_bits] * largest - (0 if setup.checkpointing else 2 * largest)
        if not setup.checkpointing:
            T_deq = 0
    elif setup.quant == "awq" and N > 1024:  # AwqGemmFn dequantizes the whole weight for > 1024 rows
        T_deq_fwd = T_deq

    def layer_backward(idx: int) -> tuple[float, float]:
        """(bytes a layer's backward adds over the kept activations, that layer's kept bytes).

        Recomputed with checkpointing, the layer's activations come back; then its MLP's
        gradients appear while the whole layer is saved, or later the attention/norm gradients
        once the MLP side is freed. A merged MoE layer's down stack gets a full gradient."""
        attn_side, mlp_side = act.layer_split_per_token(model, aset, idx)
        merged = merged_layer if act.is_moe_layer(model, idx) else 0
        saved = (attn_side + mlp_side) * N + merged + D_layer
        t_mlp = act.mlp_backward_transient_per_token(model, aset, idx) * N
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
            extra = max(extra, act.lora_forward_peak_per_token(model, aset, idx) * N + c * N * h)
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
    if T_deq_fwd:  # the last layer's largest Linear being dequantized
        forward = max(forward, base + cast_cache + accum_grads + A_layers + T_deq_fwd + c * N * h)
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
    if zm is not None or fm is not None:
        last_kept = bottom_kept + bottom_extra
        step_acts = StepActivations(
            at_loss=int(A_layers + A_glob + logits_fwd), backward_start=int(A_layers + A_glob + logits_bwd),
            top_layer=int(A_layers + top_extra), bottom_layer=int(last_kept), end=int(c * N * h),
            saved=int(A_layers))
        phase_peaks = (zero_phase_peaks(model, setup, zm, step_acts) if zm is not None
                       else fsdp_phase_peaks(model, setup, fm, step_acts))
    phase = max(PHASES, key=lambda p: phase_peaks[p])
    tensor_peak = phase_peaks[phase]

    allocated, reserved, device_total, overheads = device_overheads(tensor_peak, setup.gpus, gpu, corrections)
    # bitsandbytes' paged states are managed memory: on the device, outside torch's allocator
    paged = opt_rules.paged_bytes(model, setup)
    device_total += paged

    fb = ("forward", "backward")
    comps = [
        Component("weights", W, PHASES, note=_weights_note(setup) if fm is None else "this rank's FSDP shards"),
        Component("adapters", A_w, PHASES, note="LoRA A/B in fp32") if A_w else None,
        Component("autocast_weight_cache", cast_cache, fb, note="half copies of weights under autocast") if cast_cache else None,
        Component("gradients", G, ("backward", "optimizer") if setup.grad_accum == 1 else PHASES),
        Component("optimizer_states", S, PHASES, note=setup.optimizer),
        Component("paged_optimizer_states", paged, PHASES,
                  note="cudaMallocManaged: in device_total, not in tensor peak/allocated/reserved") if paged else None,
        Component("optimizer_step", T_opt, ("optimizer",), note="foreach step transient") if T_opt else None,
        Component("activations", A_layers - A_deq if not setup.checkpointing else 0, fb, note="saved for backward"),
        Component("dequantized_weights", A_deq, fb,
                  note="GPTQ: each Linear's 16-bit weight, saved by torch.matmul for backward") if A_deq else None,
        Component("dequantization", max(T_deq, T_deq_fwd), fb,
                  note="one Linear's weight dequantized (estimate only: validate)")
        if setup.quant in ("gptq", "awq") and max(T_deq, T_deq_fwd) else None,
        Component("checkpointed_inputs", A_layers if setup.checkpointing else 0, fb, note="layer inputs kept by checkpointing") if setup.checkpointing else None,
        Component("recompute", A_recompute, ("backward",), note="one layer recomputed, with its gradient temporaries") if A_recompute else None,
        Component("model_io_activations", A_glob, fb, note="embeddings, final norm, fp32 log-probs"),
        Component("logits_loss", max(logits_fwd, logits_bwd), fb,
                  note="logits, fp32 upcast and its gradient" if setup.loss == "hf" else f"one {act.LOSS_CHUNK_TOKENS}-token chunk at a time (chunked loss)"),
        Component("deepspeed_buffers", zero_buffers, PHASES) if zero_buffers and not ddp_buckets else None,
        Component("ddp_buckets", ddp_buckets, PHASES, note="DDP gradient buckets (a copy of the gradients)") if ddp_buckets else None,
        Component("fsdp_gathered", fsdp_gathered, PHASES, note="unsharded root unit + one layer unit (16-bit)") if fsdp_gathered else None,
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
    if setup.quant in ("gptq", "awq"):
        g = "per channel" if setup.quant_group_size == -1 else f"g{setup.quant_group_size}"
        rest = "fp32 (k-bit prep)" if setup.quant == "awq" else PRECISION_WEIGHT_DTYPE[setup.precision]
        return f"{setup.quant} {setup.quant_bits}-bit {g} base (packed int32 + fp16 scales); other params {rest}"
    if setup.quant != "none":
        return f"{setup.quant}{' + double quant' if setup.double_quant else ''} base; other params fp32"
    return PRECISION_WEIGHT_DTYPE[setup.precision]
