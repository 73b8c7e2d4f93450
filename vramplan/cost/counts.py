"""The counts the cost model multiplies (vramplan.cost.model): matmul and adapter parameters, the LoRA path's
width, the weights bitsandbytes dequantizes, the bytes a sharded step gathers, and the library
behaviour (:class:`Stack`) they depend on. Pure and torch-free; vramplan.cost.model re-exports every name."""

from __future__ import annotations

from collections.abc import Mapping

from ..estimator import trainable_params, weights_bytes
from ..estimator.lora import adapted_linears
from ..estimator.optimizers import trainable_tensors
from ..estimator.stack import DEFAULT_STACK, Stack, stack_from_versions
from ..estimator.tiled_mlp import tile_tokens
from ..specs import ModelSpec, Setup

#: bitsandbytes bytes per weight per dequantization: packed read + 16-bit write.
DEQUANT_BYTES_PER_PARAM = {"nf4": 0.5 + 2, "fp4": 0.5 + 2, "int8": 1 + 2}
#: 4-bit weight with its double-quantized absmax, as FSDP gathers it.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
#: GPTQ / AWQ (not fitted): gptqmodel's torch dequantization (~6 B per intermediate at 4 bits,
#: estimator.GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT) then the matmul's read; AWQ's GEMM kernel like bnb.
GPTQ_DEQUANT_BYTES_PER_PARAM = {2: 0.25 + 2 * 6 + 2, 3: 0.375 + 2 * 14 + 2, 4: 0.5 + 2 * 6 + 2, 8: 1 + 2 * 8 + 2}
AWQ_DEQUANT_BYTES_PER_PARAM = 0.5 + 2 + 2


#: The library stack the cost models: the estimator's one :class:`~vramplan.estimator.stack.Stack`
#: (transformers 5 unless a record says otherwise), so memory and speed describe the same stack.
STACK = DEFAULT_STACK


def stack_of(software: Mapping[str, str] | None) -> Stack:
    """The :class:`Stack` of a record's pinned versions (``{"transformers": "4.48.1", ...}``)."""
    return stack_from_versions(dict(software or {}))


#: families whose transformers 5.24 MoE block runs every token through every expert (the routing weights scale
#: the inputs; the non-routed rows are zeros, still multiplied): Llama 4 (``Llama4TextMoe``, estimator/llama4.py)
DENSE_EXPERT_FAMILIES = frozenset({"llama4"})


def routed_share(model: ModelSpec) -> float:
    """The share of the experts' weights a token multiplies through: top_k of num_experts, or all of them where
    the family computes every expert (:data:`DENSE_EXPERT_FAMILIES`)."""
    if model.moe is None:
        return 0.0
    return 1.0 if model.family in DENSE_EXPERT_FAMILIES else model.moe.top_k / model.moe.num_experts


def matmul_params(model: ModelSpec) -> float:
    """Parameters a token multiplies through: every Linear (head included), the routed share of
    the experts (:func:`routed_share`) and the router. Embedding lookups and norms cost no matmul."""
    n = float(sum(l.params for l in model.linears))
    other = dict(model.other_params)
    if model.moe is not None:
        n += other.get("experts", 0) * routed_share(model)
        n += other.get("router", 0)
    return n


def adapter_params(model: ModelSpec, setup: Setup) -> float:
    """Adapter parameters a token multiplies through (the experts' adapters only for routed tokens)."""
    if not setup.adapters:
        return 0.0
    from ..estimator.lora import expert_lora_params

    routed = expert_lora_params(model, setup)
    share = routed_share(model) if routed else 0.0
    return float(trainable_params(model, setup) - routed + routed * share)


def lora_width(model: ModelSpec, setup: Setup) -> float:
    """``sum (in + out + 2r)`` over the Linears peft adapts: the elements per token its adapter path moves."""
    return float(sum(l.count * (l.in_features + l.out_features + 2 * setup.lora_rank)
                     for l in adapted_linears(model, setup)))


def _experts_hit(model: ModelSpec, setup: Setup) -> float:
    """Share of the experts that get at least one token of a micro-batch (transformers loops over those)."""
    k, e = model.moe.top_k, model.moe.num_experts
    return 1.0 - (1.0 - k / e) ** setup.tokens


def quantized_params(model: ModelSpec, setup: Setup, stack: Stack = STACK) -> float:
    """Weights bitsandbytes dequantizes each pass: every Linear but the head, and, where the experts
    are Linears (:class:`Stack`), every expert a token reaches."""
    if setup.quant not in DEQUANT_BYTES_PER_PARAM:
        return 0.0
    q = float(sum(l.count * l.weight_params for l in model.linears if l.role != "head"))
    if model.moe is not None and stack.moe_experts_linear:
        q += float(dict(model.other_params).get("experts", 0)) * _experts_hit(model, setup)
    return q


def gathered_weight_bytes(model: ModelSpec, setup: Setup, quantized: float) -> float:
    """Bytes of the weights a sharded step gathers: 16-bit, or 4-bit for every weight bitsandbytes
    quantized plus the 16-bit rest."""
    if setup.quant not in ("nf4", "fp4"):
        return float(weights_bytes(model, setup))
    return quantized * NF4_BYTES_PER_WEIGHT + (model.params_total - quantized) * 2.0


def dequant_bytes_per_pass(model: ModelSpec, setup: Setup, stack: Stack = STACK) -> float:
    """Bytes one dequantization of every quantized weight moves (the head stays unquantized)."""
    if setup.quant == "none":
        return 0.0
    if setup.quant in ("gptq", "awq"):  # the head and MoE routers stay 16-bit
        quantized = sum(l.count * l.weight_params for l in model.linears if l.role not in ("head", "router"))
        per = GPTQ_DEQUANT_BYTES_PER_PARAM[setup.quant_bits] if setup.quant == "gptq" else AWQ_DEQUANT_BYTES_PER_PARAM
        return quantized * per
    return quantized_params(model, setup, stack) * DEQUANT_BYTES_PER_PARAM[setup.quant]


def dequant_passes(setup: Setup) -> int:
    """How often each quantized weight is dequantized per micro-step. bitsandbytes: every use.
    GPTQ: each forward (and recompute); the backward reuses the copy the forward saved. AWQ's GEMM
    kernel: every backward, and a forward (or recompute) only over 1024 rows."""
    if setup.quant == "gptq":
        return 2 if setup.checkpointing else 1
    if setup.quant == "awq":
        fwd = 1 if setup.tokens > 1024 else 0
        return 1 + fwd * (2 if setup.checkpointing else 1)
    return passes_per_micro_step(setup)


def tiled_mlp_extra(model: ModelSpec, setup: Setup) -> tuple[float, float]:
    """Unsloth's tiled MLP (estimator/tiled_mlp.py): (the extra forward FLOPs per token: ``TiledMLP.backward``
    runs each tile's MLP forward once more; the extra dequantized MLP weights per micro-step: bitsandbytes
    dequantizes a 4-bit weight at every call, and every tile calls it, in the no-grad forward (and the
    checkpoint's recompute) and in the backward's forward and backward). (0, 0) untiled."""
    if not setup.tiled_mlp:
        return 0.0, 0.0
    mlp = float(sum(l.count * l.weight_params for l in model.linears if l.role == "mlp"))
    flops = 2.0 * mlp
    flops += 2.0 * sum(l.count * setup.lora_rank * (l.in_features + l.out_features)
                       for l in adapted_linears(model, setup) if l.role == "mlp")
    if setup.quant not in DEQUANT_BYTES_PER_PARAM:
        return flops, 0.0
    tiles = -(-setup.batch * setup.seq // tile_tokens(model, setup))
    passes = tiles * (4 if setup.checkpointing else 3) - passes_per_micro_step(setup)
    return flops, mlp * max(passes, 0)


def passes_per_micro_step(setup: Setup) -> int:
    """How often each weight is used per micro-step: forward, backward, and the recompute."""
    return 3 if setup.checkpointing else 2


#: Optimizer in backward: the kernel launches one parameter's own optimizer step issues (torch 2.13's
#: single-tensor foreach/fused AdamW or SGD on a list of one tensor: about ten elementwise kernels), each
#: at a launch's CPU cost (not fitted). The update's bytes and FLOPs are those of the whole-model step
#: (optimizer_update_s prices them unchanged); only the launches of one step per tensor are added.
IN_BACKWARD_LAUNCHES_PER_TENSOR = 10
LAUNCH_S = 5e-6


def in_backward_overhead_s(model: ModelSpec, setup: Setup) -> float:
    """Seconds per optimizer step the per-parameter optimizer steps add (0 without the knob)."""
    if not setup.optimizer_in_backward:
        return 0.0
    tensors = sum(count for _, count in trainable_tensors(model, setup))
    return tensors * IN_BACKWARD_LAUNCHES_PER_TENSOR * LAUNCH_S
