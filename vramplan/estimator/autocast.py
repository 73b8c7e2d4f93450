"""Mixed precision's half copies of the weights (autocast's cast cache and the matmuls' saved casts), split
out of estimator/step.py: the total a step holds from the forward to the backward, the head's and one layer's."""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ModelSpec, Setup
from . import selective


@dataclass(frozen=True)
class AutocastCache:
    """Mixed precision: autocast casts each Linear weight to half once per forward and every
    matmul keeps its copy for backward: all of them at the loss, freed layer by layer in backward."""

    total: int = 0
    head: int = 0  # the head's (or tied embedding's) copy
    layer: float = 0.0  # one decoder layer's copies


def autocast_cache(model: ModelSpec, setup: Setup) -> AutocastCache:
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
        if setup.liger:  # the fused linear cross-entropy casts the head in its forward only (estimator/liger.py)
            cast_cache, cast_head = cast_cache - cast_head, 0
    layer = (cast_cache - cast_head) / max(model.num_layers, 1)
    if setup.adapters and setup.checkpointing:
        # autocast caches only leaf tensors that require grad (torch 2.13 autocast_mode.cpp,
        # cached_cast): a frozen base weight's half copy lives as its matmul's saved tensor, which a
        # checkpointed layer drops; only the layers kept in full hold theirs to backward (checkpointing
        # every layer: none; Llama-3.2-1B LoRA bf16-mixed, 4 layers, 2 x 512 tokens: +11.2 % -> see tests)
        kept_layers = model.num_layers - selective.checkpointed_count(setup, model.num_layers)
        cast_cache = int(cast_head + layer * kept_layers)
    return AutocastCache(cast_cache, cast_head, layer)
