"""The eval step (``--eval-batch N``) as its own phase of the run: the HF Trainer's evaluation.

Read off transformers 5.24 ``trainer.py``: ``Trainer.evaluate`` -> ``evaluation_loop`` ->
``prediction_step``. Every ``eval_steps`` the Trainer runs, after the optimizer step and
``model.zero_grad()`` (set_to_none: no gradients are alive), the model's forward under
``torch.no_grad()`` over ``per_device_eval_batch_size`` rows (the Trainer's default is 8, whatever
the train batch: unsloth#5168, LlamaFactory#5419) with the labels, so the loss is computed inside
the model (``ForCausalLMLoss``: the compute-dtype logits, their fp32 upcast and log_softmax's fp32
output). Nothing is saved for backward: one decoder layer's temporaries at a time beside its input.

What is kept between eval steps: ``evaluate`` passes ``prediction_loss_only=True`` when
``compute_metrics`` is None (trainer.py ``evaluate``: "No point gathering the predictions if there
are no metrics"), so ``prediction_step`` returns the loss only and the logits die with the step.
That is what is modelled. With a ``compute_metrics`` (and ``prediction_loss_only`` False) the
logits of every eval batch are concatenated on the GPU (``EvalLoopContainer.add`` ->
``nested_concat``) until ``eval_accumulation_steps`` moves them to the host: memory that grows
with the eval set, not modelled (a note says so).

The model states alive at eval: weights, adapters, optimizer states (and DeepSpeed/DDP buffers);
under autocast (full fine-tuning), the half copies of the trainable fp32 weights autocast caches
inside its region (torch ``autocast`` caches casts of leaf tensors that require grad, grad mode or
not); a frozen base's casts are per op and die with it (nothing is saved under no_grad).
"""

from __future__ import annotations

from dataclasses import replace

from ..specs import PHASES, Component, ModelSpec, Setup
from ..util.errors import SpecError
from ..util.units import gib
from .lora import adapted_linears
from .precision import adapter_dtype_bytes, autocast_bytes, compute_bytes

#: the transformers version this phase is read off
TRANSFORMERS_VERSION = "5.24"
#: the phase name (Breakdown.phase_peaks_bytes, Component.phases)
EVAL = "eval"


def check_eval(setup: Setup) -> None:
    """SpecError for the eval setups these terms do not model (one line each)."""
    why = eval_unmodelled(setup)
    if why:
        raise SpecError(f"--eval-batch is modelled for a one-GPU SFT step with transformers' loss; not with {why}")


def eval_unmodelled(setup: Setup) -> str | None:
    """What of ``setup`` the eval step's terms do not model (None: modelled, or no eval)."""
    if not setup.eval_batch:
        return None
    why = None
    if setup.objective != "sft":
        why = f"--objective {setup.objective} (its trainer's prediction_step scores chosen/rejected or completions)"
    elif setup.gpus > 1 or setup.zero_stage or setup.fsdp != "none" or setup.device_map != "none":
        why = "more than one GPU or a layer split (the eval forward's sharding is not modelled yet)"
    elif setup.loss != "hf" or setup.liger:
        why = "a chunked or Liger loss (the Trainer's skip_logits path is not modelled yet)"
    elif setup.quant != "none":
        why = "a quantized base (the eval forward's dequantization is not verified yet)"
    elif setup.attn == "eager":
        why = "eager attention (its no-grad score matrices are not modelled yet)"
    elif setup.padding_free:
        why = "padding-free batches"
    return why


def eval_layer_bytes(model: ModelSpec, setup: Setup, tokens: int) -> int:
    """One decoder layer's no-grad forward beside its input: the residual input, the normed input,
    the MLP's gate, up and activation outputs (transformers ``LlamaMLP.forward``:
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``)."""
    c, h, i = compute_bytes(setup), model.hidden_size, model.intermediate_size
    width = 3 * i if model.mlp_kind == "gated" else 2 * i
    return c * tokens * (width + 3 * h)


def eval_lora_layer_bytes(model: ModelSpec, setup: Setup, tokens: int) -> int:
    """One decoder layer's no-grad forward at its widest LoRA projection, beside what is alive
    then (peft 0.21 ``lora/layer.py`` ``Linear.forward``: ``result = base_layer(x)``, ``x`` cast to
    the adapter dtype, ``result + lora_B(lora_A(x)) * scaling``: the base output in the compute
    dtype beside two out-sized tensors in the adapter dtype, then the sum's cast back). Alive before:
    the layer input and its normed copy, and on the MLP side the activation output (gate) or the
    product (down), on the attention side the projections done."""
    if not setup.adapters:
        return 0
    c, a, h, r = compute_bytes(setup), adapter_dtype_bytes(setup), model.hidden_size, setup.lora_rank
    copy = a if c != a or setup.lora_dropout > 0 else 0
    peaks, attn_before = [0], 2 * c * h
    for lin in adapted_linears(model, setup):
        if lin.role == "attn":
            before = attn_before if lin.out_features != h or lin.in_features == h else 2 * c * h
            attn_before += c * lin.out_features if lin.in_features == h else 0
        elif lin.role == "mlp":
            # MLP side: four hidden-sized tensors (the layer's input, still held by the decoder loop, the
            # post-attention residual, the normed input, and the attention output's sum, measured by
            # vramplan/truths/eval_truth.py) beside the activation output (gate/up) or the product (down)
            before = 4 * c * h + (c * lin.in_features if lin.in_features != h else c * model.intermediate_size)
        else:
            continue
        peaks.append(before + copy * lin.in_features + a * r + c * lin.out_features + 2 * a * lin.out_features)
    return int(max(peaks) * tokens)


def eval_loss_bytes(model: ModelSpec, setup: Setup, tokens: int) -> int:
    """At the loss: the final hidden states (c N h), the model's c-byte logits (``CausalLMOutput``
    keeps them), ``ForCausalLMLoss``'s fp32 upcast (none when the logits are fp32) and
    ``cross_entropy``'s fp32 log_softmax output, with the int64 labels (transformers 5.24
    ``loss/loss_utils.py`` ``ForCausalLMLoss`` / ``fixed_cross_entropy``)."""
    c, V, h = autocast_bytes(setup), model.vocab_size, model.hidden_size
    upcast = 4 if c < 4 else 0
    return int(tokens * ((c + upcast + 4) * V + compute_bytes(setup) * h + 16))


def eval_forward_bytes(model: ModelSpec, setup: Setup) -> int:
    """The eval forward's peak beyond the resting model states (``eval_batch`` x ``seq`` tokens)."""
    N = setup.eval_batch * setup.seq
    layer = max(eval_layer_bytes(model, setup, N), eval_lora_layer_bytes(model, setup, N))
    return int(max(layer, eval_loss_bytes(model, setup, N)) + 16 * N)


def eval_phase(model: ModelSpec, setup: Setup, resting: int, cast_cache: int) -> tuple[dict[str, int],
                                                                                         tuple[Component, ...],
                                                                                         tuple[str, ...]]:
    """The eval phase's peak, its components and notes (empty with ``eval_batch`` 0). ``resting``:
    weights, adapters, optimizer states and buffers; ``cast_cache``: autocast's half copies of the
    trainable weights."""
    if not setup.eval_batch:
        return {}, (), ()
    check_eval(setup)
    if setup.method != "full":  # frozen base weights: cast per op, not cached (and nothing saves them)
        cast_cache = 0
    fwd = eval_forward_bytes(model, setup)
    comps = [Component("eval_forward", fwd, (EVAL,),
                       note=f"no-grad forward of {setup.eval_batch} x {setup.seq} tokens: one layer at a time, "
                            "then the logits, their fp32 upcast and log-probs")]
    if cast_cache:
        comps.append(Component("eval_autocast_weight_cache", cast_cache, (EVAL,),
                               note="autocast's half copies of the trainable weights during the eval forward"))
    note = (f"eval step: per_device_eval_batch_size {setup.eval_batch} x {setup.seq} tokens, its own phase "
            f"(transformers {TRANSFORMERS_VERSION} Trainer.evaluate without compute_metrics: loss only, no gradients "
            "alive); with compute_metrics the logits of every eval batch stay on the GPU until "
            "eval_accumulation_steps: not modelled")
    return {EVAL: int(resting + cast_cache + fwd)}, tuple(comps), (note,)


def with_eval_phase(setup: Setup, comps: tuple[Component, ...]) -> tuple[Component, ...]:
    """The components alive through every phase of the train step are alive at eval too, except
    the gradients (None after ``zero_grad``)."""
    if not setup.eval_batch:
        return comps
    out = []
    for c in comps:
        if set(c.phases) >= set(PHASES) and c.name != "gradients" and EVAL not in c.phases:
            c = replace(c, phases=(*c.phases, EVAL))
        out.append(c)
    return tuple(out)


def eval_fit_note(model: ModelSpec, setup: Setup, gpu, phase_peaks: dict[str, int], resting: int,
                  cast_cache: int, device_total_of) -> list[str]:
    """When the eval step is the peak and does not fit ``gpu``: the eval batch that does, as a
    practitioner would say it (``device_total_of(tensor_peak)``: the device total of a peak, the
    same device terms the estimate adds). Empty otherwise."""
    if not setup.eval_batch or gpu is None or max(phase_peaks, key=phase_peaks.get) != EVAL:
        return []
    usable = gpu.usable_memory_bytes
    train = max(b for p, b in phase_peaks.items() if p != EVAL)
    if device_total_of(phase_peaks[EVAL]) <= usable or device_total_of(train) > usable:
        return []
    cast = cast_cache if setup.method == "full" else 0
    for n in range(setup.eval_batch - 1, 0, -1):
        peak = resting + cast + eval_forward_bytes(model, replace(setup, eval_batch=n))
        if device_total_of(max(train, peak)) <= usable:
            return [f"eval batch {setup.eval_batch} needs {gib(device_total_of(phase_peaks[EVAL]), 1)} GiB at "
                    f"its eval step (the train step {gib(device_total_of(train), 1)} GiB); --eval-batch {n} fits "
                    "(per_device_eval_batch_size)"]
    return []
