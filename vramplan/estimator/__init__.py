"""The analytic tier: one training step's memory per GPU from counts only, in milliseconds.

``estimate(model, setup, gpu)`` sums one pure function per memory term into a Breakdown and takes
the peak as the maximum over the phases of a step (end of forward, backward, optimizer step), not
the sum of all terms: optimizer transients and activations never coexist. No torch import.
"""

from __future__ import annotations

from ..checks import check
from ..specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup
from ..units import BNB_8BIT_STATE_BYTES, DTYPE_BYTES, PRECISION_WEIGHT_DTYPE, QUANT_BYTES_PER_PARAM
from . import activations as act
from .lora import adapted_linears, lora_params
from .corrections import DEFAULT_CORRECTIONS, Corrections, device_overheads

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
    qb = QUANT_BYTES_PER_PARAM[(setup.quant, setup.double_quant)]
    quantized = sum(l.count * l.weight_params for l in model.linears if l.role != "head")
    rest = model.params_total - quantized
    if setup.quant == "int8":
        quantized_bytes = quantized + 4 * sum(l.count * l.out_features for l in model.linears if l.role != "head")
    else:
        quantized_bytes = quantized * qb
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
    """torch.optim keeps states as zeros_like(param): AdamW 2, SGD-momentum/Lion 1; bitsandbytes
    8-bit AdamW 2 x (1 + 4/256) B; Adafactor factored row+column second moments (fp32)."""
    n = trainable_params(model, setup)
    pb = 4 if setup.adapters else _weight_dtype_bytes(setup)
    opt = setup.optimizer
    if opt in ("adamw", "adamw-fused"):
        return 2 * n * pb
    if opt in ("sgd", "lion"):
        return n * pb
    if opt in ("adamw-8bit", "paged-adamw-8bit"):
        return int(2 * n * BNB_8BIT_STATE_BYTES)
    # adafactor: per matrix (out + in) fp32 entries; vectors keep a full state
    if setup.adapters:
        mats = [(l.count, setup.lora_rank, l.in_features) for l in adapted_linears(model, setup)]
        mats += [(l.count, l.out_features, setup.lora_rank) for l in adapted_linears(model, setup)]
        return int(4 * sum(c * (a + b) for c, a, b in mats))
    return int(4 * sum(l.count * (l.in_features + l.out_features) for l in model.linears)
               + 4 * model.vocab_size * 2 + 4 * model.hidden_size * 2)


def optimizer_step_transient_bytes(model: ModelSpec, setup: Setup) -> int:
    """torch AdamW foreach: ``_foreach_sqrt(exp_avg_sqs)`` allocates one state-sized list before
    the in-place update (torch/optim/adamw.py, _multi_tensor_adamw); fused=True has none.
    SGD foreach and Lion allocate one gradient-sized list; 8-bit kernels update in place."""
    n = trainable_params(model, setup)
    pb = 4 if setup.adapters else _weight_dtype_bytes(setup)
    if setup.optimizer in ("adamw", "sgd", "lion"):
        return n * pb
    if setup.optimizer == "adafactor":
        return n * 4  # fp32 update of the largest group; first-order
    return 0


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

    # mixed precision: autocast caches a half copy of each weight for the forward+backward
    cast_cache = 0
    if setup.precision in ("bf16-mixed", "fp16-mixed"):
        cast_cache = sum(l.count * l.weight_params for l in model.linears) * 2

    # ZeRO partitioning (first order here; made exact by the DeepSpeed issue)
    if setup.zero_stage >= 1:
        S //= n_gpus
        T_opt //= n_gpus
    if setup.zero_stage >= 2:
        G //= n_gpus
    if setup.zero_stage >= 3:
        W //= n_gpus
    if setup.offload_optimizer != "none":
        host += S + T_opt
        S, T_opt = 0, 0
    if setup.offload_params != "none":
        host += W
        W = 0
    zero_buffers = 0
    if setup.zero_stage:
        # reduce/allgather buckets (5e8 elements by default, capped by the model) in the param dtype
        bucket = min(int(5e8), trainable_params(model, setup)) * (4 if setup.adapters else _weight_dtype_bytes(setup))
        zero_buffers = bucket if setup.zero_stage in (1, 2) else 2 * _largest_layer_grad(model, setup)

    # activations: per layer (token-sized, plus weight-sized for peft's merged MoE experts)
    layer_tok = act.layer_bytes_per_token(model, setup) * N
    merged_total = act.moe_lora_weight_bytes(model, setup)
    merged_layer = merged_total / model.moe.num_moe_layers if merged_total else 0
    kept_tok = act.checkpoint_bytes_per_token(model, setup) * N if setup.checkpointing else layer_tok
    A_layers = int(L * kept_tok + (0 if setup.checkpointing else merged_total))
    A_glob = int(act.global_bytes_per_token(model, setup) * N)
    logits_fwd, logits_bwd = act.loss_transients(model, setup)
    T_attn = act.attention_backward_transient_per_token(model, setup) * N

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
        transient = max(t_mlp, T_attn - mlp_side * N - merged)
        kept = kept_tok if setup.checkpointing else saved
        return (saved if setup.checkpointing else 0) + transient + c * N * h, kept

    top_extra, _ = layer_backward(L - 1)
    bottom_extra, bottom_kept = layer_backward(0)

    accum_grads = G if setup.grad_accum > 1 else 0
    base = W + A_w + S + cast_cache + zero_buffers

    at_loss = base + accum_grads + A_layers + A_glob + logits_fwd
    # with checkpointing nothing inside a layer is saved, but a layer's forward still builds its
    # merged expert stack (and routes k copies of the hidden states) while it runs
    in_layer = 0
    if setup.checkpointing and merged_total:
        in_layer = base + accum_grads + A_layers + merged_layer + c * N * h * (model.moe.top_k + 2)
    forward = max(at_loss, in_layer)
    start = base + accum_grads + A_layers + A_glob + logits_bwd
    if setup.method == "full":
        G_head = _head_params(model) * _weight_dtype_bytes(setup)
        if setup.zero_stage >= 2:
            G_head //= n_gpus
        G_layer = (G - G_head) / max(L, 1)
        first = base + G_head + A_layers + top_extra
        last = base + G - G_layer + bottom_kept + bottom_extra
        # tied embeddings: autograd's InputBuffer sums the head's and the embedding's gradient
        # out of place, so both and their sum coexist before the parameter's .grad is set
        tied_spike = 2 * model.vocab_size * h * _weight_dtype_bytes(setup) if model.tie_word_embeddings else 0
        end = base + G + tied_spike + c * N * h
        backward = max(start, first, last, end)
    else:
        # the top layer's backward: log-probs and logits gradients are gone by then
        first = base + accum_grads + A_layers + top_extra
        last = base + G + bottom_kept + bottom_extra
        backward = max(start, first, last, base + G)
    A_recompute = int(max(top_extra, bottom_extra)) if setup.checkpointing else 0
    optimizer = W + A_w + G + S + T_opt + cast_cache + zero_buffers
    phase_peaks = {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
    phase = max(PHASES, key=lambda p: phase_peaks[p])
    tensor_peak = phase_peaks[phase]

    allocated, reserved, device_total, overheads = device_overheads(tensor_peak, setup.gpus, gpu, corrections)

    fb = ("forward", "backward")
    comps = [
        Component("weights", W, PHASES, note=_weights_note(setup)),
        Component("adapters", A_w, PHASES, note="LoRA A/B in fp32") if A_w else None,
        Component("autocast_weight_cache", cast_cache, fb, note="half copies of weights under autocast") if cast_cache else None,
        Component("gradients", G, ("backward", "optimizer") if setup.grad_accum == 1 else PHASES),
        Component("optimizer_states", S, PHASES, note=setup.optimizer),
        Component("optimizer_step", T_opt, ("optimizer",), note="foreach step transient") if T_opt else None,
        Component("activations", A_layers if not setup.checkpointing else 0, fb, note="saved for backward"),
        Component("checkpointed_inputs", A_layers if setup.checkpointing else 0, fb, note="layer inputs kept by checkpointing") if setup.checkpointing else None,
        Component("recompute", A_recompute, ("backward",), note="one layer recomputed, with its gradient temporaries") if A_recompute else None,
        Component("model_io_activations", A_glob, fb, note="embeddings, final norm, fp32 log-probs"),
        Component("logits_loss", max(logits_fwd, logits_bwd), fb,
                  note="logits, fp32 upcast and its gradient" if setup.loss == "hf" else f"one {act.LOSS_CHUNK_TOKENS}-token chunk (not traced)"),
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
    )


def _weights_note(setup: Setup) -> str:
    if setup.quant != "none":
        return f"{setup.quant}{' + double quant' if setup.double_quant else ''} base; other params fp32"
    return PRECISION_WEIGHT_DTYPE[setup.precision]
