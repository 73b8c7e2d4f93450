"""Unsloth's tiled MLP (``--tiled-mlp``: ``FastLanguageModel.from_pretrained(..., unsloth_tiled_mlp=True)``).

Read from unsloth 2026.8.19 (``unsloth/models/loader.py``: ``patch_tiled_mlp(model, "arctic")`` after loading,
or the ``UNSLOTH_TILED_MLP`` environment variable) and unsloth-zoo 2026.8.13 (``unsloth_zoo/tiled_mlp.py``):
every module named ``*.mlp`` (``.ffn``, ``.feed_forward``...) gets a forward that calls ``TiledMLP.apply``. In
"arctic" mode (``tiled_forward_arctic_size``) a tile is ``hidden_size`` tokens: ``n = max(1, seq // h)`` tiles of
``min(h, batch * seq)`` flattened rows, and what is left of the ``batch * seq`` rows, if anything, one more tile
(so with a batch above one the last tile holds the other rows: :func:`tile_tokens`).

- **forward**: under ``torch.no_grad`` each tile runs the MLP (its intermediates one tile's at a time) and is
  copied into one output tensor; only the MLP's input ``x`` is saved.
- **backward**: ``x_gradients = torch.zeros_like(x)``; each tile's forward runs again with grad and is
  back-propagated at once (its saves and gradient temporaries one tile's), the tile's input gradient
  accumulating into its slice of ``x_gradients``. With Unsloth's fused kernels
  (``unsloth/models/llama.py`` ``patch_peft_model``: ``mlp_module._unsloth_forward`` becomes
  ``apply_lora_mlp`` when the MLP was tiled) the tile runs ``LoRA_MLP``.

So a layer keeps ``x`` (c h per token) of its MLP where it kept the MLP's saves, and its backward holds one tile's
saves and gradients beside the full-length ``x_gradients``. Modelled for dense MLPs (an MoE block is refused:
setup/checks.py). The extra MLP forward per layer is in the cost model.

**axolotl 0.18.0** (``tiled_mlp: true``; ``axolotl/monkeypatch/tiled_mlp/patch.py`` ``patch_tiled_mlp`` replaces
the ``forward`` of transformers' ``{Prefix}MLP`` class, ``base.py`` ``TiledMLP``) runs the same autograd function
on one GPU, with other tiles: ``torch.chunk(x, shards, dim=1)``, ``shards = tiled_mlp_num_shards`` or
``max(1, ceil(seq / 32768))`` (:func:`axolotl_shards`), so below 32,768 tokens one shard: the MLP recomputed in
the backward, which saves nothing over checkpointing. Its backward also keeps a ``zeros_like`` accumulator per
trained MLP parameter (the adapters' here: full fine-tuning is refused). The layer is transformers' (no fused
kernels). Torch-free."""

from __future__ import annotations

import math

from ..specs import ModelSpec, Setup
from .precision import adapter_dtype_bytes

__all__ = ["AXOLOTL_SHARD_TOKENS", "axolotl_shards", "tile_tokens", "tiled_gradient_saving"]

#: axolotl 0.18.0 ``tiled_mlp_forward``: ``target_tokens_per_shard = 32768`` unless ``tiled_mlp_num_shards``
AXOLOTL_SHARD_TOKENS = 32768


def axolotl_shards(setup: Setup) -> int:
    """axolotl's shard count: ``tiled_mlp_num_shards``, else ``max(1, ceil(seq / 32768))``."""
    return setup.tiled_mlp_shards or max(1, math.ceil(setup.seq / AXOLOTL_SHARD_TOKENS))


def tile_tokens(model: ModelSpec, setup: Setup) -> int:
    """The largest tile's tokens. Unsloth: ``tiled_forward_arctic_size`` passes ``n = max(1, seq // h)`` tiles of
    ``min(h, batch * seq)`` rows to ``TiledMLP.forward``, which adds the rows left over as one more tile. axolotl:
    ``torch.chunk(x, shards, dim=1)``, every sequence of the batch cut into shards of ``ceil(seq / shards)``."""
    if setup.framework == "axolotl":
        return setup.batch * math.ceil(setup.seq / axolotl_shards(setup))
    h, rows = model.hidden_size, setup.batch * setup.seq
    n = max(1, setup.seq // max(h, 1))
    chunk = min(h, rows)
    return max(chunk, rows - chunk * n)


def tiled_gradient_saving(model: ModelSpec, setup: Setup) -> float:
    """Bytes per token the layer's norm-gradient moment holds less when the MLP is tiled: untiled, the MLP
    input's gradient arrives as full-length LoRA-branch input gradients in the adapters' dtype summed into it
    (transients.NORM_BACKWARD_H counts one such hidden-sized tensor); tiled, each tile's are summed into its
    slice of ``x_gradients`` and freed with the tile. Read off the CPU truth (vramplan/truths/tiled_truth.py)."""
    return adapter_dtype_bytes(setup) * model.hidden_size if setup.adapters else 0.0
