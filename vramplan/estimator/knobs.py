"""The memory of three knobs of today's fine-tuning runs: peft's ``modules_to_save``, DoRA and the
optimizer in backward. Modelled for peft 0.21, torch 2.13 and torchtune 0.6.1, read off their
source and checked by ``vramplan validate --knob modules_to_save|dora|optimizer_in_backward``.

- ``modules_to_save`` (peft 0.21 utils/other.py, ``ModulesToSaveWrapper.update``): the wrapped
  original stays, frozen, and ``copy.deepcopy(original_module)`` trains beside it, in the dtype the
  module had (peft's ``cast_adapter_dtype`` upcasts only ``BaseTunerLayer`` adapters, so a bf16
  model's copy is bf16; ``prepare_model_for_kbit_training`` made a k-bit base's embeddings and
  head fp32 before). Its gradient and optimizer states follow the copy's dtype, by the rules of
  estimator/optimizers.py (an ``nn.Embedding`` copy gets the Trainer's 32-bit override under
  8-bit AdamW). Tied embeddings: with ``ensure_weight_tying=False`` (the default) each named
  module is copied on its own, so ``embed_tokens,lm_head`` on a tied model trains two copies and
  the head's original keeps sharing the frozen embedding (peft#1750, #2777). The embedding copy's
  backward (``embedding_dense_backward``) makes a dense vocab x hidden gradient; the head copy's
  gradient exists from the head's backward on. peft's ``trainable_token_indices`` is not modelled.
- DoRA (peft 0.21 tuners/lora/dora.py, ``DoraLinearLayer``; variants.py ``DoraLinearVariant``):
  a trainable fp32 magnitude vector (out_features) per adapted Linear. Each forward builds
  ``lora_B(lora_A(eye(in)))`` (an in x in fp32 identity, its in x r product and the in x out
  LoRA weight, held with their graph until the layer returns), the base weight cast to the LoRA
  input's dtype (fp32: a copy of a 16-bit or dequantized weight), ``scaling * lora_weight`` and
  their sum for the detached norm: the largest adapted Linear's set is a forward transient (again
  in backward's recompute under checkpointing). For backward it saves the base result (compute
  dtype) and the LoRA result (fp32, bf16 under autocast) per token and out feature, and three
  out-vectors. With ``lora_dropout`` > 0 the base matmul is redone on an fp32 copy of the weight,
  which is saved: not modelled (refused).
- optimizer in backward (torchtune 0.6.1 training/memory.py, ``register_optim_in_bwd_hooks``):
  one optimizer per parameter, stepped and ``zero_grad``-ed by a
  ``register_post_accumulate_grad_hook`` the moment its gradient is accumulated (torch 2.13 runs
  AccumulateGrad as soon as the gradient is ready), so one parameter's gradient and its step's
  transient are alive at a time; a tied weight's two gradients still meet in autograd's input
  buffer. The states are the same; there is no optimizer phase with every gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ModelSpec, Setup, SpecError
from ..util.units import PRECISION_WEIGHT_DTYPE
from . import optimizers as opt_rules
from .lora import adapted_linears, expert_lora_factors
from .model_states import head_params, weight_dtype_bytes
from .precision import compute_bytes

__all__ = ["KnobStates", "dora_backward_transient", "dora_forward_transient", "dora_saved_per_token",
           "fsdp_copy_shard_bytes", "IN_BACKWARD_OPTIMIZERS", "in_backward_gradient", "knob_states", "saved_modules"]

EMBEDDING_NAMES = ("embed_tokens",)
HEAD_NAMES = ("lm_head",)

#: DoRA's backward of ``(m - 1) * base + m * lora * scaling`` and the fp32 add/cast around it, in
#: bytes per token and out feature of the widest DoRA Linear beyond LoRA's own, on a 16-bit
#: residual stream (fp32 gradients cast back to it; nothing on an fp32 stream, QLoRA's). Read off
#: the top layer's backward in the trace (= the CPU run) of a narrow Llama, where that moment is
#: the backward's peak; at real widths the loss's moment is.
DORA_BACKWARD_BYTES_PER_OUT = 8


@dataclass(frozen=True)
class KnobStates:
    """What the knobs add to one GPU's model states (bytes)."""

    weights: int = 0  # modules_to_save copies and DoRA magnitudes (trainable, beside the adapters)
    gradients: int = 0
    head_gradient: int = 0  # the head copy's gradient: alive from the head's backward on
    optimizer_states: int = 0
    optimizer_step: int = 0  # added to the step's transient
    paged: int = 0
    params: int = 0  # trainable parameters added

    @property
    def any(self) -> bool:
        return bool(self.params)


def saved_modules(model: ModelSpec, setup: Setup) -> list[tuple[str, tuple[int, int], bool]]:
    """(name, shape, is an nn.Embedding) of each module copied by ``modules_to_save``."""
    out = []
    for name in (m.strip() for m in setup.modules_to_save.split(",") if m.strip()):
        last = name.split(".")[-1]
        if last in EMBEDDING_NAMES:
            out.append((name, (model.vocab_size, model.hidden_size), True))
        elif last in HEAD_NAMES:
            heads = [l for l in model.linears if l.role == "head"]
            shape = (heads[0].out_features, heads[0].in_features) if heads else (model.vocab_size, model.hidden_size)
            out.append((name, shape, False))
        else:
            raise SpecError(f"--modules-to-save {name!r}: only embed_tokens and lm_head are modelled "
                            "(peft modules_to_save)")
    return out


def trained_modules_note(setup: Setup) -> str:
    """The note of the ``trained_modules`` component."""
    parts = [f"copies of {setup.modules_to_save.strip()} ({'fp32' if _copy_bytes(setup) == 4 else '16-bit'})"]
    parts = (parts if setup.modules_to_save.strip() else []) + (["DoRA magnitudes (fp32)"] if setup.dora else [])
    return "trained in full: " + ", ".join(parts)


def fsdp_copy_shard_bytes(model: ModelSpec, setup: Setup, ranks: int) -> int:
    """One rank's shard of the modules_to_save copies under FSDP1 (bytes). peft 0.21's
    ``fsdp_auto_wrap_policy`` (utils/other.py, which the HF Trainer's ``update_fsdp_plugin_peft``
    installs; its ``lambda_policy_fn``: a leaf module with a trainable weight) makes each copy a unit,
    flattened and sharded in its dtype (fp32 under MixedPrecision: accelerate upcasts trainable
    parameters), so its gradient and optimizer states follow it; checked on 2 ranks
    (vramplan.truths.fsdp, validate --knob modules_to_save)."""
    b = 4 if setup.precision.endswith("-mixed") else _copy_bytes(setup)
    return sum(b * -(-(shape[0] * shape[1]) // ranks) for _, shape, _ in saved_modules(model, setup))


def _copy_bytes(setup: Setup) -> int:
    """Bytes per element of a copied module: as loaded; fp32 on a bitsandbytes/AWQ base
    (``prepare_model_for_kbit_training`` upcast it; a GPTQ base's stays 16-bit)."""
    return 4 if setup.quant not in ("none", "gptq") else weight_dtype_bytes(setup)


def _magnitudes(model: ModelSpec, setup: Setup) -> list[tuple[tuple[int], int]]:
    return [((l.out_features,), l.count) for l in adapted_linears(model, setup)] if setup.dora else []


def knob_states(model: ModelSpec, setup: Setup) -> KnobStates:
    """The copies' and magnitudes' weights, gradients, optimizer states and step transient."""
    if not setup.adapters:
        return KnobStates()
    if setup.dora and expert_lora_factors(model, setup):
        raise SpecError(f"DoRA on {model.name}'s fused experts: peft's lora.ParamWrapper does not work with "
                        "use_dora=True; narrow --lora-targets to the attention projections")
    if setup.dora and setup.lora_dropout:
        raise SpecError("DoRA with --lora-dropout > 0 redoes the base matmul on an fp32 copy of each weight, "
                        "which is not modelled; use --lora-dropout 0")
    opt, pb = setup.optimizer, _copy_bytes(setup)
    tensors = [(shape, 1, emb, pb) for _, shape, emb in saved_modules(model, setup)]
    tensors += [(shape, count, False, 4) for shape, count in _magnitudes(model, setup)]
    numel = sum(count * shape[0] * (shape[1] if len(shape) > 1 else 1) for shape, count, _, _ in tensors)
    weights = sum(count * _numel(shape) * b for shape, count, _, b in tensors)
    states = sum(count * opt_rules.tensor_state_bytes(opt, shape, b, emb) for shape, count, emb, b in tensors)
    paged = sum(count * opt_rules.tensor_paged_bytes(opt, shape, emb) for shape, count, emb, _ in tensors)
    if opt == "adafactor":  # one tensor at a time: the largest sets it, beyond the adapters' own
        lora_largest = opt_rules.step_transient_bytes(model, setup, weight_dtype_bytes(setup))
        largest = max((opt_rules.tensor_step_bytes(opt, shape, b) for shape, _, _, b in tensors), default=0)
        step = max(0, largest - lora_largest)
    else:
        step = sum(count * opt_rules.tensor_step_bytes(opt, shape, b) for shape, count, _, b in tensors)
    head = sum(_numel(shape) * pb for _, shape, emb in saved_modules(model, setup) if not emb)
    return KnobStates(weights=weights, gradients=weights, head_gradient=head, optimizer_states=states,
                      optimizer_step=step, paged=paged, params=numel)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------------------------
# DoRA's activations


def _mixed(setup: Setup) -> bool:
    return setup.precision.endswith("-mixed")


def dora_saved_per_token(model: ModelSpec, setup: Setup) -> float:
    """Bytes per token one decoder layer's DoRA Linears save for backward: the base result
    (compute dtype) and the LoRA result (fp32 adapters; bf16/fp16 under autocast) per out feature."""
    if not setup.dora:
        return 0.0
    lora_result = 2 if _mixed(setup) else 4
    per = compute_bytes(setup) + lora_result
    return sum(per * l.out_features * l.count for l in adapted_linears(model, setup)) / max(model.num_layers, 1)


def dora_saved_fixed(model: ModelSpec, setup: Setup) -> int:
    """Three fp32 out-vectors per DoRA Linear saved for backward (magnitude / norm and the scales)."""
    if not setup.dora:
        return 0
    return sum(12 * l.out_features * l.count for l in adapted_linears(model, setup))


def dora_forward_transient(model: ModelSpec, setup: Setup, recompute: bool = False) -> int:
    """The largest adapted Linear's weight-norm temporaries (see the module docstring). Building
    the LoRA weight: the fp32 identity (plus its 16-bit cast under autocast), A's product and the
    in x out result; then the norm: the LoRA weight in fp32, the base weight in the LoRA input's
    dtype (fp32: a copy of a 16-bit or dequantized weight), the scaled LoRA weight and the sum,
    beside what the LoRA weight's graph saved of the identity (nothing in a checkpointed forward,
    whose hooks drop what it saves; ``recompute``: backward's recomputation, which keeps it)."""
    if not setup.dora:
        return 0
    mixed = _mixed(setup)
    best = 0
    for l in adapted_linears(model, setup):
        i, o, r = l.in_features, l.out_features, setup.lora_rank
        a_out = (2 if mixed else 4) * r * i
        eye_cast = 2 * i * i if mixed else 0  # autocast's copy, which lora_A's matmul saves
        held = 0 if setup.checkpointing and not recompute else (eye_cast if mixed else 4 * i * i) + a_out
        build = 4 * i * i + eye_cast + a_out + (2 if mixed else 4) * i * o
        if setup.quant == "none":
            weight = 0 if PRECISION_WEIGHT_DTYPE[setup.precision] == "float32" else 4 * i * o
        else:  # dequantize_module_weight in the load dtype, then .to(fp32)
            load = weight_dtype_bytes(setup)
            weight = (load + (4 if load != 4 else 0)) * i * o
        best = max(best, build, held + 4 * i * o + weight + 8 * i * o)
    return best


def dora_backward_transient(model: ModelSpec, setup: Setup) -> float:
    """The widest DoRA Linear's fp32 gradient temporaries in backward (bytes for the micro-batch)."""
    if not setup.dora:
        return 0.0
    if compute_bytes(setup) == 4:  # an fp32 residual stream (QLoRA, fp32): no casts, nothing beyond LoRA's
        return 0.0
    widest = max((l.out_features for l in adapted_linears(model, setup)), default=0)
    return DORA_BACKWARD_BYTES_PER_OUT * widest * setup.tokens


# ----------------------------------------------------------------------------------------------
# the optimizer in backward


#: The optimizers a plan may step in backward (search/space.py) and train.py builds one per parameter with
#: transformers' own factory (emit/trainer.py): torch's, whose per-tensor step this module prices.
IN_BACKWARD_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")


def in_backward_gradient(model: ModelSpec, setup: Setup, in_layers: bool = False) -> int:
    """The gradient alive at a time with the optimizer in backward: the largest trainable
    tensor's, plus its own step's transient (one optimizer per parameter). ``in_layers``: while
    the decoder layers run backward (the head's was stepped before, the embedding's comes after)."""
    wb = 4 if setup.adapters else weight_dtype_bytes(setup)
    tensors = [(s, wb) for s, _ in opt_rules.trainable_tensors(model, setup)]
    if setup.adapters:
        tensors += [(shape, _copy_bytes(setup)) for _, shape, _ in saved_modules(model, setup)]
        tensors += [(shape, 4) for shape, _ in _magnitudes(model, setup)]
    if in_layers:
        vocab = {(model.vocab_size, model.hidden_size), (model.hidden_size, model.vocab_size)}
        tensors = [(s, b) for s, b in tensors if tuple(s) not in vocab]
    return max((_numel(s) * b + opt_rules.tensor_step_bytes(setup.optimizer, s, b) for s, b in tensors), default=0)


def in_backward_head_gradient(model: ModelSpec, setup: Setup) -> int:
    """A trained untied head's gradient with the optimizer in backward: it appears while the
    logits' gradient is alive, and is stepped once that is freed (full fine-tuning, or a
    modules_to_save copy)."""
    if setup.method == "full":
        heads = [l for l in model.linears if l.role == "head"]
        shape, b = ((heads[0].out_features, heads[0].in_features), weight_dtype_bytes(setup)) if heads else (None, 0)
    else:
        copies = [shape for _, shape, emb in saved_modules(model, setup) if not emb]
        shape, b = (copies[0], _copy_bytes(setup)) if copies else (None, 0)
    return _numel(shape) * b if shape is not None else 0


def tied_gradient_bytes(model: ModelSpec, setup: Setup) -> int:
    """A tied embedding's gradient under full fine-tuning (vocab x hidden), else 0."""
    if setup.method != "full" or not model.tie_word_embeddings or head_params(model):
        return 0
    return model.vocab_size * model.hidden_size * weight_dtype_bytes(setup)
