"""What LoRA adapts, as peft resolves it, and how many parameters that adds.

peft 0.21 with transformers 5: "all-linear" wraps every nn.Linear but the output head. For MoE
families whose experts transformers 5 fused into 3-D parameters and whose checkpoints it converts
(``transformers.conversion_mapping``: mixtral, and the families mapped to the qwen2_moe pattern
such as qwen3_moe and deepseek_v2 -- but not qwen2_moe itself), peft's
``utils/transformers_weight_conversion.py`` rewrites the targets the way they were in v4: the
router ``gate`` and the experts' ``gate_up_proj``/``down_proj`` become ``target_parameters``
(``lora.ParamWrapper``: rank r per expert, doubled with alpha for the fused gate_up), and nn.Linear
modules with those v4 names (dense and shared-expert MLPs) are no longer targeted.
"""

from __future__ import annotations

from ..setup.checks import lora_targets
from ..specs import LinearSpec, ModelSpec, Setup

#: v4 names that peft maps to v5 parameters, per conversion pattern.
_CONVERTED_NAMES = {
    "mixtral": {"gate", "w1", "w2", "w3"},
    "qwen2_moe": {"gate", "gate_proj", "up_proj", "down_proj"},
}
_PATTERN = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "deepseek_v2": "qwen2_moe"}


def converted_moe(model: ModelSpec) -> bool:
    """Does peft put LoRA on this model's fused experts and router (see the module docstring)?"""
    # (transformers 4.x's per-expert Linears, estimator/moe_4x.py: peft targets them by name, no conversion)
    return model.moe is not None and model.family in _PATTERN and not any(l.role == "expert" for l in model.linears)


def adapted_linears(model: ModelSpec, setup: Setup) -> list[LinearSpec]:
    """nn.Linear modules that get a LoRA adapter."""
    if not setup.adapters:
        return []
    targeted = lora_targets(model, setup)[0]
    if converted_moe(model) and setup.lora_targets == "all-linear":
        names = _CONVERTED_NAMES[_PATTERN[model.family]]
        targeted = [l for l in targeted if l.name not in names]
    return targeted


def expert_lora_factors(model: ModelSpec, setup: Setup) -> tuple[int, ...]:
    """Numel of each ParamWrapper LoRA factor of one MoE layer (empty if peft puts none there):
    router (E x h) A r x h, B E x r; gate_up (E x 2i x h) at rank 2r per expert, A 2rE x h,
    B 2i x 2rE; down (E x h x i) A rE x i, B h x rE."""
    if not (setup.adapters and converted_moe(model) and setup.lora_targets == "all-linear"):
        return ()
    moe, h, r = model.moe, model.hidden_size, setup.lora_rank
    E, i = moe.num_experts, moe.expert_intermediate_size
    return (r * h, E * r, 2 * r * E * h, 2 * i * 2 * r * E, r * E * i, h * r * E)


def expert_lora_params(model: ModelSpec, setup: Setup) -> int:
    """ParamWrapper adapters on the router weight (E x h: r (h + E)) and on the stacked experts:
    gate_up (E x 2i x h) at rank 2r per expert -> 2rE (h + 2i); down (E x h x i) -> rE (i + h)."""
    factors = expert_lora_factors(model, setup)
    return model.moe.num_moe_layers * sum(factors) if factors else 0


def lora_params(model: ModelSpec, setup: Setup) -> int:
    """r * (d_in + d_out) per adapted Linear (Hu et al. 2021, LoRA, section 4.1), plus the
    experts' and router's ParamWrapper adapters."""
    linear = sum(l.count * setup.lora_rank * (l.in_features + l.out_features) for l in adapted_linears(model, setup))
    return linear + expert_lora_params(model, setup)
