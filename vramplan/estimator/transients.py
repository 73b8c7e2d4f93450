"""The moments of a step beyond its saved activations: gradient temporaries inside a layer's
backward, the widest LoRA projection of a (recomputed) forward, and the logits and loss.

Per token unless stated, read off the tracer's per-moment peaks and op timeline
(``vramplan.run.tracer``); ``vramplan.estimator.estimate`` places them at the step's moments.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup
from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE
from . import liger
from .activations import (
    ACTIVATION_SAVES,
    is_moe_layer,
    layer_split_per_token,
    norm_bytes,
)
from .lora import adapted_linears
from .precision import (
    adapter_dtype_bytes,
    attention_impl,
    autocast_bytes,
    compute_bytes,
)
from .stack import DEFAULT_STACK, Stack
from .torchtune import step as framework_step  # noqa: F401  (torchtune's own step, estimator/step.py)

#: Bytes per token, in units of h, of the norm and attention gradients at the worst moment of a
#: layer's backward (fp32 norm gradients dominate), per norm style and full/LoRA; read off the
#: tracer's per-moment peaks on micro-configs where the MLP is too narrow to matter.
NORM_BACKWARD_H = {
    ("rms", "full"): 22, ("rms", "lora"): 22,
    ("rms_fp32_mul", "full"): 26, ("rms_fp32_mul", "lora"): 22,
    ("layernorm", "full"): 16, ("layernorm", "lora"): 7,
    ("cohere", "full"): 30, ("cohere", "lora"): 7,
}


def mlp_backward_transient_per_token(model: ModelSpec, setup: Setup, idx: int) -> float:
    """Gradient temporaries of an MLP's backward, while the whole layer's activations are still
    saved: c (3 i + h) (the product's, the gate's and up's gradients and the hidden state's; a
    LoRA down_proj's fp32 adapter path in place of the product's); MoE: the routed tokens'
    expert width. Read off the tracer's per-moment peaks."""
    h, c = model.hidden_size, compute_bytes(setup)
    if is_moe_layer(model, idx):
        routed = model.moe.expert_intermediate_size * model.moe.top_k
        return c * (routed + 2 * h)  # grouped_mm backward over the routed tokens
    i = model.intermediate_size
    if setup.method == "full":
        return c * (3 * i + h)
    # LoRA: the gradient of the widest adapted MLP projection's lora_B output (in the adapter
    # dtype), beside the c-byte gradients of the gate/up product
    widest = max((l.out_features for l in adapted_linears(model, setup) if l.role == "mlp"), default=i)
    return adapter_dtype_bytes(setup) * widest + 0.64 * i + c * h


def lora_forward_peak_per_token(model: ModelSpec, setup: Setup, idx: int) -> float:
    """The peak inside a layer's forward (a recomputed one, with checkpointing) at its widest
    LoRA projection, per token, over the layer's input: peft's ``result + lora_B(lora_A(x)) *
    scaling`` holds the base output (c bytes) beside two out-sized tensors in the adapter dtype
    (lora_B's output and its scaled copy, then the sum), on top of what the layer saved before it. Fused
    projections (Phi-3's gate_up_proj, out = 2 i) make this the layer's peak, above its backward.
    Read off the tracer's op timeline; MoE layers' routed experts are not plain Linears."""
    if not setup.adapters:
        return 0.0
    h, c = model.hidden_size, compute_bytes(setup)
    mask = 1 if setup.lora_dropout > 0 else 0
    r, a = setup.lora_rank, adapter_dtype_bytes(setup)

    # adapters in the activations' dtype (fp32 of a k-bit-prepared base, 16-bit under DeepSpeed
    # stage 1/2): the adapter's cast of its input is a no-op
    copy = 0 if c == a and not mask else a + mask

    def at(l, before: float) -> float:
        return before + copy * l.in_features + a * r + c * l.out_features + 2 * a * l.out_features

    common, _ = layer_split_per_token(model, setup, idx)
    # alive beside the saves: the norm's output being projected, and (MLP side) the residual
    norm = norm_bytes(model, setup, trainable_weight=False) + c * h
    peaks, before = [0.0], norm
    for l in adapted_linears(model, setup):
        if l.role != "attn" or (l.out_features == h and l.in_features == model.q_dim
                                and l.name.endswith(("o_proj", "dense", "out_proj", "c_proj"))):
            continue  # the output projection runs on the attention's output, after its saves
        peaks.append(at(l, before))
        before += c * l.out_features + copy * l.in_features + a * r
    if not is_moe_layer(model, idx) and not setup.tiled_mlp:  # (a tiled MLP's forward runs a tile at a time)
        act = ACTIVATION_SAVES.get(model.activation, 1)
        before = common + 2 * c * h
        ups = [l for l in adapted_linears(model, setup) if l.role == "mlp" and l.out_features != h]
        for n, l in enumerate(ups):
            peaks.append(at(l, before))
            before += (c * l.out_features * (act + 1) if n == 0 and len(ups) > 1 else 0) + copy * l.in_features + a * r
    return max(peaks)


def attention_backward_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """Gradient temporaries of the attention and norm backward, once the MLP side is freed:
    the fp32 norm gradients dominate (NORM_BACKWARD_H); eager attention's score gradients
    (fp32 and c-byte, 5.75 a s net of what they free) where larger."""
    mode = "full" if setup.method == "full" else "lora"
    norm = NORM_BACKWARD_H[(model.traits.norm, mode)] * model.hidden_size
    eager = 5.75 * model.num_heads * setup.seq if attention_impl(model, setup) == "eager" else 0
    return max(norm, eager)


#: Tokens per chunk of vramplan's chunked loss (vramplan/run/chunked_loss.py).
LOSS_CHUNK_TOKENS = 1024


def loss_transients(model: ModelSpec, setup: Setup, stack: Stack = DEFAULT_STACK) -> tuple[int, int]:
    """Bytes alive at the loss in the forward and at its backward, beyond saved activations.

    transformers' ForCausalLMLoss: the c-byte logits and their fp32 copy while log_softmax runs
    (its fp32 output is saved), then two fp32 N x V gradients in log_softmax's backward.
    The chunked loss (vramplan/run/chunked_loss.py) holds one chunk of C tokens at a time: in the
    forward its fp32 logits and log-probabilities (the c-byte logits are freed by the upcast),
    in the backward the recomputed pair and the fp32 gradient of the logits, beside the c-byte
    gradient of the hidden states being assembled and (full fine-tuning, more than one chunk) the
    head weight's gradient of the chunks already done.

    transformers 4.46-4.48 (``stack.loss_shift_copy``) also copy the shifted fp32 logits
    (``logits[..., :-1, :].contiguous()``, b (s-1) V; none at b = 1) while cross_entropy runs; its backward then
    peaks as 5's does (the slice's zero-filled fp32 gradient appears once the log-probs' are freed)."""
    if setup.liger:  # the fused linear cross-entropy (estimator/liger.py)
        return liger.loss_transients(model, setup)
    if setup.loss == "unsloth":  # Unsloth's fused cross-entropy (estimator/unsloth.py; chunks for a large card)
        from .unsloth import loss_transients as unsloth_loss

        return unsloth_loss(model, setup)
    c, V, N, h = autocast_bytes(setup), model.vocab_size, setup.tokens, model.hidden_size
    if setup.loss == "hf":
        # fp32 logits (fp32 or k-bit-prepared models): ``.float()`` is a no-op, no copy
        forward = (c + (4 if c < 4 else 0)) * N * V
        # at micro-batch 1 the slice of a [1, s, V] tensor is already contiguous: no copy (run
        # on transformers 4.48.1's ForCausalLMLoss: 2-layer, vocab-32000 model, CPU live-tensor
        # counter, forward +450,992 B/token at batch 2, +321,260 at batch 1)
        if stack.loss_shift_copy and setup.batch > 1:
            forward += 4 * setup.batch * (setup.seq - 1) * V
        return forward, 8 * N * V
    chunk = min(N, LOSS_CHUNK_TOKENS)
    # full fine-tuning: the head weight's gradient of the chunks done so far waits for the next
    # (FSDP: the unsharded gradient, in the compute dtype; else the weight's dtype)
    grad_bytes = c if setup.fsdp != "none" else int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])
    head_grad = V * h * grad_bytes if setup.method == "full" and N > chunk else 0
    return 8 * chunk * V, 12 * chunk * V + c * N * h + head_grad
