"""transformers 4.x's mixture-of-experts blocks: the Stack's ``moe_experts_linear`` side.

transformers 4.x builds each routed expert as its own MLP of ``nn.Linear`` modules and routes
with a Python loop over the experts (4.48.1 modeling_mixtral.py ``MixtralSparseMoeBlock`` and
``MixtralBlockSparseTop2MLP``; modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock`` the same loop with
its shared expert, OLMoE's and 4.51.3-4.57.1's Qwen3-MoE the same; 4.57.1 loops over the experts
hit only, which keeps the same tensors); transformers 5 fuses the experts into 3-D parameters run by ``grouped_mm``
(estimator/activations.py ``moe_layer_bytes_per_token``). What changes under 4.x:

- the weights: the experts' w1/w3/w2 (gate/up/down) and the router ``gate`` are ``nn.Linear``, so
  bitsandbytes quantizes them on a QLoRA/int8 base like any Linear (NF4/FP4 blocks of 64 and
  their absmax, double quant as set; LLM.int8 plus its row scales) and
  ``prepare_model_for_kbit_training`` has no fused fp32 experts to upcast. :func:`linear_experts`
  gives the model these Linears (role ``expert``; the router role ``router``), so every weight
  term (estimator/model_states.py, fsdp.py, fsdp2.py, the dequantization transient) counts them as
  it counts any quantized Linear;
- LoRA: peft 0.13 matches modules by name, so ``all-linear`` wraps every expert's w1/w2/w3 and
  the router (estimator/lora.py: no v5 conversion); named targets (``w1``, ``gate``) match them too;
- the saved tensors of the routing loop (:func:`moe_layer_bytes_per_token`) and its backward
  (:func:`backward_transient_per_token`): read off 4.48.1's ``forward`` and checked against the
  real 4.48.1 + peft 0.13.2 step on the CPU (calibration/published/moe_4x_probe.py).

bitsandbytes' ``MatMul4Bit`` (0.43.3 and 0.50.2 alike, autograd/_functions.py) keeps only the packed
weight for its backward (``ctx.tensors = (None, B)``), never its input: a frozen 4-bit expert keeps
nothing of the rows it ran on; what the loop keeps is the activation's input and output, the up
projection's output, the expert's output and the routing weight it is scaled by, the index
vectors, and whatever a LoRA adapter on an expert keeps.
"""

from __future__ import annotations

import dataclasses

from ..specs import LinearSpec, ModelSpec, Setup
from ..util.errors import SpecError

#: transformers 4.x MoE blocks modelled here: family -> (the block's module name, gate, up, down
#: expert Linear names), each read off the 4.48.1 wheel
FAMILIES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    # Qwen3-MoE (4.51.3, 4.57.1: Qwen3MoeSparseMoeBlock) and OLMoE (4.48.1 OlmoeSparseMoeBlock), the same loop
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}

#: families whose transformers 4.x experts were fused 3-D parameters already (Llama4TextExperts
#: since 4.51, GptOssExperts since 4.55, 4.48.1's GraniteMoeParallelExperts): their 4.x estimate is their 5.x one
FUSED_IN_4X = frozenset({"llama4", "gpt_oss", "granitemoe"})

#: the role of a routed expert's Linear (count: experts x MoE layers)
EXPERT_ROLE = "expert"


def has_linear_experts(model: ModelSpec) -> bool:
    """The model's experts are per-expert Linears (:func:`linear_experts` built it)."""
    return any(l.role == EXPERT_ROLE for l in model.linears)


def _experts_router(model: ModelSpec) -> tuple[int, int]:
    other = dict(model.other_params)
    return other.get("experts", 0), other.get("router", 0)


def model_for(model: ModelSpec, stack, setup: Setup | None = None) -> ModelSpec:
    """The model as ``stack`` builds it: under transformers 4.x an MoE model's experts and router
    become Linears (:func:`linear_experts`; with ``setup``, what that does not model is refused:
    :func:`check`); otherwise ``model`` itself (the same object)."""
    if model.moe is None or not stack.moe_experts_linear:
        return model
    experts, _ = _experts_router(model)
    if experts and model.family not in FUSED_IN_4X and not has_linear_experts(model):
        model = linear_experts(model, stack.transformers)
    if setup is not None and has_linear_experts(model):
        check(model, setup, stack.transformers)
    return model


def linear_experts(model: ModelSpec, version: str = "4") -> ModelSpec:
    """``model`` with transformers 4.x's per-expert Linears in place of the fused experts and the
    router parameter (the same parameter count); a family whose 4.x block is not modelled, or whose
    experts are not three h x i matrices each, is refused."""
    moe, h = model.moe, model.hidden_size
    experts, router = _experts_router(model)
    if model.family not in FAMILIES:
        raise SpecError(f"transformers {version}'s {model.family or model.model_type} MoE block is not modelled "
                        f"(per-expert Linears are modelled for {', '.join(FAMILIES)}); estimate it with the "
                        "default stack (transformers 5)")
    E, ei, nm = moe.num_experts, moe.expert_intermediate_size, moe.num_moe_layers
    if experts != 3 * E * ei * h * nm:
        raise SpecError(f"{model.name}'s experts ({experts} parameters) are not {nm} x {E} gated MLPs of width "
                        f"{ei}: transformers {version}'s per-expert Linears are not modelled for it")
    block, gate, up, down = FAMILIES[model.family]
    path = f"model.layers.*.{block}"
    count = E * nm
    linears = [LinearSpec(gate, f"{path}.experts.*.{gate}", h, ei, False, count, EXPERT_ROLE),
               LinearSpec(up, f"{path}.experts.*.{up}", h, ei, False, count, EXPERT_ROLE),
               LinearSpec(down, f"{path}.experts.*.{down}", ei, h, False, count, EXPERT_ROLE)]
    other = [(n, p) for n, p in model.other_params if n != "experts"]
    if router == h * E * nm:  # the router ``gate``: an nn.Linear(h, E) in 4.x
        linears.append(LinearSpec("gate", f"{path}.gate", h, E, False, nm, "router"))
        other = [(n, p) for n, p in other if n != "router"]
    head = [l for l in model.linears if l.role == "head"]
    body = [l for l in model.linears if l.role != "head"]
    return dataclasses.replace(model, linears=tuple(body + linears + head), other_params=tuple(other))


def check(model: ModelSpec, setup: Setup, version: str) -> None:
    """Refuse what the 4.x MoE terms do not model (raises SpecError)."""
    why = None
    if setup.tp > 1 or setup.ep > 1:
        why = ("tensor/expert parallelism is modelled as transformers 5.24 runs it (tp_plan, DistributedConfig); "
               "transformers {v}'s per-expert MoE under --tp/--ep is not")
    elif setup.dora and any(l.role == EXPERT_ROLE for l in _adapted(model, setup)):
        why = "DoRA on transformers {v}'s per-expert Linears is not modelled; target the attention"
    elif setup.liger:
        why = "Liger's kernels on transformers {v} are not modelled (vramplan models liger-kernel 0.8.5 on 5.24)"
    if why:
        raise SpecError(why.format(v=version))


def _adapted(model: ModelSpec, setup: Setup) -> list[LinearSpec]:
    from .lora import adapted_linears

    return adapted_linears(model, setup)


def _expert_adapter_bytes_per_row(model: ModelSpec, setup: Setup) -> float:
    """What LoRA adapters on one routed row's expert Linears keep (peft 0.13 ``Linear.forward``):
    lora_A its input cast to the adapter dtype (with dropout the dropped copy and its bool mask),
    lora_B lora_A's output. When the cast is a no-op and there is no dropout, lora_A keeps the
    very tensor the expert reads: the gathered rows (gate and up share them) and the product the
    down projection reads, each once."""
    from .precision import adapter_dtype_bytes, compute_bytes

    adapted = [l for l in _adapted(model, setup) if l.role == EXPERT_ROLE]
    if not adapted:
        return 0.0
    a, c, r = adapter_dtype_bytes(setup), compute_bytes(setup), setup.lora_rank
    mask = 1 if setup.lora_dropout > 0 else 0
    if a == c and not mask:
        inputs = {l.in_features for l in adapted}  # h (gate, up: the gathered rows), i (down: the product)
        return sum(c * n for n in inputs) + a * r * len(adapted)
    return sum((a + mask) * l.in_features + a * r for l in adapted)


def moe_layer_bytes_per_token(model: ModelSpec, setup: Setup) -> float:
    """One MoE layer's MLP side per token under transformers 4.x (the router's LoRA adapter is
    activations.py's, as under 5): 4.48.1 ``MixtralSparseMoeBlock.forward``

    - router: ``F.softmax(router_logits, dtype=torch.float)`` keeps its fp32 output (4 E),
      ``torch.topk`` its int64 indices (8 k), the in-place renormalisation ``routing_weights /=
      routing_weights.sum(...)`` the original weights and the sum (4 k + 4);
    - per routed row (k per token): ``torch.where(expert_mask[e])``'s (rows, 2) int64 result, whose
      columns idx and top_x the gathers and ``index_add_`` keep (16); the gate projection's output
      (the activation's input), the activation's output and the up projection's output, which the
      product keeps (3 i, in the dtype the Linear returns: bitsandbytes casts back to its input's,
      autocast gives its half); the expert's output and the routing weight it is scaled by
      (h + 1); the scaled output ``index_add_`` adds, which torch keeps as its ``source`` (the
      derivative's ``expand_as(source)``: the whole tensor, not its shape; h); LoRA on the experts:
      :func:`_expert_adapter_bytes_per_row`; full fine-tuning the expert Linears' inputs (the
      gathered rows, the product);
    - the one_hot expert mask (int64, k E per token) and the (rows, h) zeros ``index_add_`` fills
      are freed with the block's forward; the shared expert (Qwen2-MoE) as under 5."""
    from .precision import autocast_bytes, compute_bytes

    moe = model.moe
    h, c, k, ei, E = model.hidden_size, compute_bytes(setup), moe.top_k, moe.expert_intermediate_size, moe.num_experts
    full = setup.method == "full"
    lin = c if setup.quant != "none" else autocast_bytes(setup)  # what an expert Linear returns
    router = 4 * E + 8 * k + 4 * k + 4
    if moe.norm_topk_prob is False and model.family != "mixtral":
        router -= 4 * k + 4  # (Qwen2-MoE renormalises only with norm_topk_prob)
    row = 16 + 3 * lin * ei + lin * h + c + c * h
    if full:
        row += c * h + lin * ei
    elif setup.adapters:
        row += _expert_adapter_bytes_per_row(model, setup)
    if setup.quant == "int8":  # MatMul8bitLt keeps each input A in ctx.tensors: the rows and the product
        row += (0 if _expert_adapter_bytes_per_row(model, setup) and setup.lora_dropout == 0 else c * (h + ei))
    shared = 0.0
    si = moe.shared_expert_intermediate_size
    if si:
        shared = 3 * c * si + (c * si if full else 0)
        if moe.gated_shared_expert:
            shared += c + c * h
    return router + k * row + shared


def backward_transient_per_token(model: ModelSpec, setup: Setup) -> float:
    """Gradient temporaries of a 4.x MoE layer's backward over what it keeps, per token. The experts'
    backward runs one expert at a time (the last first) on its rows (k / E of the tokens, balanced
    routing); its peak is the product's backward: the product's gradient and those of the activation's
    output and of up's output (3 i wide, the stream's dtype), once ``index_add_``'s source and the
    routing multiply's saved output (2 h) are freed, and a LoRA down projection's saved input (the
    product, or its own cast copy) with them; or, with LoRA on the down projection, that adapter's
    backward (its input gradient in the adapter dtype beside the base path's). Read off the live
    bytes of the 4.48.1 block's backward (calibration/published/moe_4x_probe.py)."""
    from .precision import adapter_dtype_bytes, compute_bytes

    moe = model.moe
    h, c, ei = model.hidden_size, compute_bytes(setup), moe.expert_intermediate_size
    rows = moe.top_k / moe.num_experts
    down = [l for l in _adapted(model, setup) if l.role == EXPERT_ROLE and l.in_features == ei]
    a, mask = adapter_dtype_bytes(setup), 1 if setup.lora_dropout > 0 else 0
    kept_input = (c if a == c and not mask else a + mask) * ei if down else 0
    at_product = 3 * c * ei - 2 * c * h - kept_input
    at_down = (a + c) * ei - 2 * c * h if down else 0
    return rows * max(at_product, at_down, 0)


def note(model: ModelSpec, setup: Setup, version: str) -> str:
    """The estimate's words for the 4.x experts."""
    moe = model.moe
    quant = {"nf4": "NF4", "fp4": "FP4", "int8": "LLM.int8"}.get(setup.quant)
    quant = f"quantized by bitsandbytes, {quant}" if quant else "16-bit"
    unverified = ("; the LLM.int8 experts' saved inputs are read off bitsandbytes, not run (4.48.1's int8 loading "
                  "needs a bitsandbytes without CPU kernels)" if setup.quant == "int8" else "")
    return (f"transformers {version}: {moe.num_experts} experts x {moe.num_moe_layers} layers as per-expert nn.Linear "
            f"({quant}) and the router an nn.Linear; routing as its per-expert loop (estimator/moe_4x.py){unverified}")
