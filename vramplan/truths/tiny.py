"""The tiny models the N-process truths run (:mod:`vramplan.truths.distributed` for ZeRO,
:mod:`vramplan.truths.fsdp` for FSDP and DDP): shipped profiles' configs, truncated and shrunk so
that four processes on two cores finish in seconds. No torch at import."""

from __future__ import annotations

from ..specs import ModelSpec, truncate_config

#: The tiny model every ZeRO truth run uses: Llama-3.2-1B's architecture (tied embeddings, GQA,
#: SwiGLU) scaled down so that four processes on two cores finish in seconds.
TINY_BASE = "meta-llama/Llama-3.2-1B"
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
TINY_LAYERS = 2
TINY_SEQ = 64


#: MoE shapes (transformers 5's fused 3-D experts): 4 experts, top-2, expert width 64.
MOE_BASES = ("mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B")
MOE_SHAPE = {"mistralai/Mixtral-8x7B-v0.1": {"num_local_experts": 4, "num_experts_per_tok": 2},
             "Qwen/Qwen3-30B-A3B": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}}

#: Other shapes the full matrix also runs (on 2 ranks): untied head (Llama-3.1), and q/k/v biases
#: that stage 3 keeps gathered as persistent parameters (Qwen2.5).
OTHER_BASES = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B")


def tiny_config(base: str = TINY_BASE, layers: int = TINY_LAYERS, shape: dict | None = None) -> dict:
    """A shipped profile's config.json truncated to ``layers`` layers with hidden sizes shrunk
    (an MoE base also to 4 experts, top-2)."""
    from ..model.profiles import load_model

    cfg = truncate_config(dict(load_model(base).config), layers)
    cfg.update(TINY_SHAPE if shape is None else shape)
    if shape is None:
        cfg.update(MOE_SHAPE.get(base, {}))
    return cfg


def tiny_model(config: dict | None = None, base: str = TINY_BASE) -> ModelSpec:
    """The ModelSpec of :func:`tiny_config` (what the estimate of a truth run is computed on)."""
    from ..model.architecture import model_spec_from_config

    return model_spec_from_config(config or tiny_config(base), name=f"{base}[tiny]", source=f"profile:{base}")
