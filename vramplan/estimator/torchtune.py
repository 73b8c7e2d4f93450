"""torchtune 0.6.1's single-device step (``--framework torchtune``): its own model, loss and states.

torchtune runs its own ``TransformerDecoder`` (not transformers'), built in bf16 with no autocast
(``training.set_default_dtype``; LoRA weights bf16 too, ``validate_expected_param_dtype``), the recipes
``recipes/lora_finetune_single_device.py`` (LoRA, QLoRA) and ``recipes/full_finetune_single_device.py``.
What each module of it saves for the backward (read from the 0.6.1 wheel; checked op by op and
against the real step on the CPU, vramplan/truths/torchtune_truth.py), per token, c = 2 bytes:

- ``RMSNorm`` (modules/rms_norm.py): ``F.rms_norm(x.float(), weight=scale).to(x.dtype)``: with a bf16
  scale and an fp32 input torch takes the composite path, which keeps the fp32 input (4 h) and the
  fp32 inverse RMS (4) when the input needs a gradient, the fp32 normalized input (4 h) when the scale
  is trained (full fine-tuning), and the bf16 output (c h) when a consumer Linear is trained (a LoRA
  on q/k/v, the MLP's w1/w3; the head in full fine-tuning). In LoRA the embeddings are frozen, so the
  first layer's first norm keeps only its output.
- ``MultiHeadAttention`` (modules/attention.py): RoPE (``Llama3ScaledRoPE`` / ``RotaryPositionalEmbeddings``)
  computes in fp32 and keeps nothing but its cache; q after RoPE (c q) is kept by SDPA; grouped K/V are
  ``expand``-ed and ``flatten``-ed to all heads, a copy (c q each) whenever there are several kv heads
  and fewer than query heads (one kv head: a view of c kv); SDPA (CUDA's fused kernels) keeps its output
  (c q, which ``output_proj`` reads through a view) and an fp32 log-sum-exp per head.
- ``LoRALinear`` (modules/peft/lora.py): the base ``F.linear`` (QLoRA: torchao's ``linear_nf4``, which
  saves only the NF4 weight) and ``lora_a``'s output (c r) kept by ``lora_b``; no dropout module at
  p = 0 (``nn.Identity``).
- ``FeedForward`` (modules/feed_forward.py): w1's output (SiLU's input), SiLU's output and w3's output
  (the product's two inputs), 3 c i, and the product (w2's input, c i) when w2 is trained.
- the head (``TransformerDecoder.chunked_output``, ``set_num_output_chunks(8)``): the final norm as
  above, then eight bf16 logit chunks, all alive until the recipe's ``del logits``;
  ``CEWithChunkedOutputLoss`` (modules/loss/ce_chunked_output_loss.py) upcasts one chunk at a time but
  each ``F.cross_entropy``'s ``log_softmax`` keeps its fp32 output: at the last chunk c N V + 4 N V +
  4 C V (C: a chunk's tokens); the backward starts with the fp32 log-probs and one chunk's two fp32
  gradients.
- checkpointing (``training.set_activation_checkpointing``, torch's non-reentrant ``checkpoint_wrapper``
  on every ``TransformerSelfAttentionLayer``): each layer keeps its input (c h); the backward recomputes
  one layer at a time.
- QLoRA: ``to_nf4`` (torchao ``NF4Tensor``, block 64, scaler block 256) on every Linear of the layers
  (``FrozenNF4Linear`` for the untargeted ones); the head, embeddings and norms stay bf16. Per weight
  element: 4-bit data (0.5), an int8 scaler per 64 (1/64), a bf16 factor per 256 blocks (1/8192),
  plus a bf16 scaler mean and the 16-value bf16 NF4 table per tensor. The frozen NF4 base's backward
  dequantizes its weight (``weight.to(bf16)``) for the input gradient, one Linear at a time.

Refused in one line (setup/checks.py ``check_torchtune``, :func:`check`): more than one GPU (the
distributed recipes shard with FSDP2), a precision other than bf16, int8/fp4/GPTQ/AWQ bases,
``--activation-offload`` (torchtune's OffloadActivations runs on CUDA streams only: not verified here),
Liger, DoRA, modules_to_save, LoRA on the head (``apply_lora_to_output``) or on part of the MLP,
selective checkpointing, an eval step, ``--loss`` or ``--attn`` set (its own loss and SDPA are the
step), LoRA with the optimizer in backward, DPO/GRPO, model families other than Llama 2/3/3.1/3.2,
Qwen2/2.5 (no QLoRA builder in 0.6.1) and Mistral. Setup.loss stays ``hf``: the loss modelled is
always its ``CEWithChunkedOutputLoss``. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math

from ..setup.checks import check_torchtune
from ..specs import ModelSpec, Setup
from ..util.errors import SpecError
from . import optimizers as opt_rules
from .lora import adapted_linears, lora_params

__all__ = ["CHUNKS", "check", "layer_saved_per_token", "loss_bytes", "loss_note", "states", "step", "torchtune",
           "weights_bytes"]

#: CEWithChunkedOutputLoss's default ``num_output_chunks`` (every recipe config keeps it)
CHUNKS = 8
#: the model families torchtune 0.6.1 has builders for, as vramplan names them (HF model_type)
FAMILIES = ("llama", "mistral", "qwen2")
_C = 2  # bf16


def torchtune(setup: Setup) -> bool:
    return setup.framework == "torchtune"


def check(model: ModelSpec, setup: Setup) -> None:
    """What of torchtune's single-device recipes is modelled (setup/checks.py ``check_torchtune``, and the
    model families it has builders for); the rest refused in one line."""
    check_torchtune(setup)
    why = None
    if model.model_type not in FAMILIES or model.moe is not None:
        why = f"the {model.model_type} family: modelled for Llama 2/3/3.1/3.2, Qwen2/2.5 and Mistral (its builders)"
    elif setup.quant == "nf4" and model.model_type == "qwen2":
        why = "QLoRA on Qwen2/2.5: torchtune 0.6.1 has no qlora_qwen2 builder"
    if why:
        raise SpecError(f"--framework torchtune {why}")


# ----------------------------------------------------------------------------------------------
# model states


def _quantized_params(model: ModelSpec) -> list[int]:
    """The weight element count of each NF4 Linear (every Linear of the layers; not the head)."""
    return [l.weight_params for l in model.linears if l.role != "head" for _ in range(l.count)]


def nf4_bytes(n: int) -> int:
    """torchao's ``to_nf4(w, 64, 256)`` (``NF4Tensor.__tensor_flatten__``): uint8 data (two per byte), an
    int8 scaler per 64-block, a bf16 factor per 256 scalers, a bf16 scaler mean, the 16-entry bf16 table."""
    blocks = n // 64
    return n // 2 + blocks + _C * math.ceil(blocks / 256) + _C + 16 * _C


def _llama3_rope(model: ModelSpec) -> bool:
    scaling = model.config.get("rope_scaling") or {}
    return model.model_type == "llama" and scaling.get("rope_type", scaling.get("type")) == "llama3"


def rope_cache_bytes(model: ModelSpec, setup: Setup) -> int:
    """The RoPE modules' fp32 buffers: ``cache`` [max_seq_len, head_dim / 2, 2] (Qwen2's
    [max_seq_len, 2 head_dim]: cos and sin of the doubled angles) and ``theta``; the model builders pass
    the model's context length as ``max_seq_len``. One module shared by the layers, but the LoRA builders
    of Llama 2/3, Mistral and Qwen2 build one per layer (``lora_*_self_attention``); Llama 3.1/3.2's share."""
    hd, S = model.head_dim, model.max_position_embeddings
    one = 4 * ((2 * S * hd if model.model_type == "qwen2" else S * hd) + hd // 2)
    per_layer = setup.adapters and not _llama3_rope(model)
    return one * (model.num_layers if per_layer else 1)


def rope_saved_bytes(model: ModelSpec, setup: Setup) -> int:
    """Qwen2's RoPE casts its cos and sin slices to bf16 on every call and ``x * cos``, ``rotated * sin``
    keep them ([1, s, 1, head_dim], for q and for k): 8 s head_dim bytes a layer, whatever the batch;
    the others' RoPE keeps only views of its fp32 cache."""
    return 4 * _C * setup.seq * model.head_dim if model.model_type == "qwen2" else 0


def weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """The base (not the adapters): bf16, or NF4 Linears in the layers beside bf16 embeddings, norms, head;
    the RoPE buffers."""
    if setup.quant != "nf4":
        return _C * model.params_total + rope_cache_bytes(model, setup)
    q = _quantized_params(model)
    return _C * (model.params_total - sum(q)) + sum(nf4_bytes(n) for n in q) + rope_cache_bytes(model, setup)


@dataclasses.dataclass(frozen=True)
class States:
    weights: int
    adapters: int
    gradients: int
    optimizer_states: int
    optimizer_step: int
    trainable: int


def states(model: ModelSpec, setup: Setup) -> States:
    """bf16 weights, bf16 adapters (or every parameter trained), their bf16 gradients and optimizer states."""
    trainable = lora_params(model, setup) if setup.adapters else model.params_total
    tensors = opt_rules.trainable_tensors(model, setup)
    if setup.adapters:
        tensors = [((setup.lora_rank, l.in_features), l.count) for l in adapted_linears(model, setup)] + [
            ((l.out_features, setup.lora_rank), l.count) for l in adapted_linears(model, setup)]
    opt = "adamw-8bit" if setup.optimizer == "paged-adamw-8bit" else setup.optimizer
    S = sum(c * opt_rules.tensor_state_bytes(opt, shape, _C) for shape, c in tensors)
    if setup.optimizer == "paged-adamw-8bit":  # the large ones paged (outside torch's allocator)
        S -= sum(c * opt_rules.tensor_paged_bytes(setup.optimizer, shape, False) for shape, c in tensors)
    T = sum(c * math.prod(shape) for shape, c in tensors) * _C if setup.optimizer == "adamw" else 0
    return States(weights_bytes(model, setup), _C * trainable if setup.adapters else 0, _C * trainable, S, T,
                  trainable)


# ----------------------------------------------------------------------------------------------
# activations


def _adapted(model: ModelSpec, setup: Setup) -> set[str]:
    """Which of q, k, v, o, w1 (gate), w3 (up), w2 (down) carry a LoRA (vramplan's names)."""
    names = set()
    for l in adapted_linears(model, setup):
        names.add(l.name.rsplit(".", 1)[-1])
    return names


def layer_saved_per_token(model: ModelSpec, setup: Setup, idx: int) -> float:
    """What layer ``idx`` keeps for the backward per token (the module docstring)."""
    h, q, kv, i = model.hidden_size, model.q_dim, model.kv_dim, model.intermediate_size
    full = setup.method == "full"
    lora = _adapted(model, setup)
    in_grad = full or idx > 0
    qkv = full or bool(lora & {"q_proj", "k_proj", "v_proj"})
    up = full or bool(lora & {"gate_proj", "up_proj"})
    down = full or "down_proj" in lora
    norm1 = (4 * h + 4 if in_grad else 0) + (4 * h if full else 0) + (_C * h if qkv else 0)
    norm2 = 4 * h + 4 + (4 * h if full else 0) + (_C * h if up else 0)
    copy = 1 < model.num_kv_heads < model.num_heads
    kv_saved = 2 * _C * (q if copy else kv)
    attn = _C * q + kv_saved + _C * q + 4 * model.num_heads
    mlp = 3 * _C * i + (_C * i if down else 0)
    lora_a = _C * setup.lora_rank * sum(l.count for l in adapted_linears(model, setup)
                                        if l.role in ("attn", "mlp")) / max(model.num_layers, 1)
    return norm1 + attn + norm2 + mlp + lora_a


def _global_per_token(model: ModelSpec, setup: Setup) -> float:
    """The final norm's saves (its output too when the head is trained)."""
    h = model.hidden_size
    return 4 * h + 4 + ((4 + _C) * h if setup.method == "full" else 0)


def _chunk_tokens(setup: Setup) -> int:
    return setup.batch * math.ceil(setup.seq / CHUNKS)


def loss_note(setup: Setup) -> str:
    return (f"{CHUNKS} bf16 logit chunks; compiled cross-entropy: no fp32 logits" if setup.compile else
            f"{CHUNKS} bf16 logit chunks, every chunk's fp32 log-probs (CEWithChunkedOutputLoss, eager)")


def loss_bytes(model: ModelSpec, setup: Setup) -> tuple[int, int]:
    """(at the last chunk's cross-entropy, at the backward's start): the bf16 logit chunks, the fp32
    log-probs every chunk keeps, one chunk's fp32 upcast; then the log-probs and one chunk's two fp32
    gradients (nll_loss's and log_softmax's).

    Compiled (``compile: True``: ``training.compile_loss`` compiles ``compute_cross_entropy``, one chunk's
    upcast and cross-entropy, with inductor): the compiled function saves its bf16 input chunk and two
    fp32 numbers per token (the row max and log-sum-exp), and its kernels materialize no fp32 logits:
    the bf16 chunks stay to the backward, which starts with one chunk's bf16 gradient (read off the
    saved tensors and inductor's generated code on the CPU: tests/test_torchtune_compile.py)."""
    N, V, C = setup.tokens, model.vocab_size, _chunk_tokens(setup)
    if setup.compile:
        return _C * N * V + 8 * N, _C * N * V + 8 * N + _C * C * V
    return _C * N * V + 4 * N * V + 4 * C * V, 4 * N * V + 8 * C * V


# ----------------------------------------------------------------------------------------------
# the step


def step(model: ModelSpec, setup: Setup, st, acts, phase_peaks: dict, recompute: int):
    """(states, acts, phase peaks, recompute) of torchtune's step, over estimator/step.py's ModelStates
    and StepActivationTerms (their fields replaced by torchtune's); those given when the framework is
    another's."""
    if not torchtune(setup):
        return st, acts, phase_peaks, recompute
    check(model, setup)
    s = states(model, setup)
    st = dataclasses.replace(st, weights=s.weights, adapters=s.adapters, gradients=s.gradients,
                             optimizer_states=s.optimizer_states, optimizer_step=s.optimizer_step, cast_cache=0,
                             buffers=0, ddp_buckets=0)
    N, L, h = setup.tokens, model.num_layers, model.hidden_size
    saved = [layer_saved_per_token(model, setup, k) * N + rope_saved_bytes(model, setup) for k in range(L)]
    kept = [_C * h * N] * L if setup.checkpointing else saved
    A_layers = int(sum(kept))
    A_glob = int(_global_per_token(model, setup) * N)
    loss_fwd, loss_bwd = loss_bytes(model, setup)
    acts = dataclasses.replace(acts, layers=A_layers, model_io=A_glob, logits_forward=loss_fwd,
                               logits_backward=loss_bwd, checkpointed_inputs=A_layers if setup.checkpointing else 0,
                               layers_inputs=0, dequantization=0, dequantization_forward=0)
    W, A_w, G, S = st.weights, st.adapters, st.gradients, st.optimizer_states
    accum = G if setup.grad_accum > 1 else 0
    base = W + A_w + S
    full = setup.method == "full"
    deq = _C * max(_quantized_params(model), default=0) if setup.quant == "nf4" else 0
    forward = base + accum + A_layers + A_glob + loss_fwd
    start = base + accum + A_layers + A_glob + loss_bwd
    # a layer's backward: (checkpointing: its recomputed saves, beside the others' inputs) and the gradient
    # temporaries of its norms (fp32, 16 h) or its MLP (4 i, wide MLPs: Qwen2's 5.3 h), and a frozen NF4
    # weight dequantized
    t_layer = max(16 * h, 4 * model.intermediate_size) * N + deq
    recompute = 0
    top = base + accum + A_layers + t_layer
    bottom = base + kept[0] + t_layer
    if setup.checkpointing:
        # the recomputed layer's backward: its MLP's gradient temporaries (4 i) beside its incoming and
        # outgoing hidden-state gradients (2 h; full fine-tuning, its fp32 norm-weight products too, 6 h) and a
        # frozen NF4 weight dequantized in the recompute beside the backward's (4 i + 2 h read off the CPU
        # truth across MLP widths 2.75-5.25 h: Llama 2, 3.1, 3.2, Qwen2.5; torchtune_truth.py)
        t_layer = (4 * model.intermediate_size + (6 if full else 2) * h) * N + 2 * deq
        recompute = int(saved[-1] + t_layer)
        top = base + accum + A_layers + saved[-1] + t_layer
        bottom = base + kept[0] + saved[0] + t_layer
    if full:  # the gradients, head's first, then layer by layer
        G_head = _C * model.vocab_size * h
        G_layer = (G - G_head) / max(L, 1)
        # (the loss's backward runs before any head gradient: autograd takes the eight chunks' cross-entropy
        # first, then their head matmuls)
        top += G_head if not accum else 0
        bottom += G if accum else G - G_layer
        end = base + G + (2 * G_head if model.tie_word_embeddings else 0) + _C * N * h
    else:
        bottom += G
        end = base + G
    backward = max(start, top, bottom, end)
    optimizer = W + A_w + G + S + st.optimizer_step
    if setup.optimizer_in_backward:
        from . import knobs

        G_in = knobs.in_backward_gradient(model, setup, in_layers=True)
        backward = max(start, top - (G_head if full else 0), base + kept[0] + G_in + t_layer)
        optimizer = W + A_w + S
        st = dataclasses.replace(st, gradients=int(G_in), optimizer_step=0)  # one parameter's at a time
    peaks = {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
    return st, acts, peaks, recompute
