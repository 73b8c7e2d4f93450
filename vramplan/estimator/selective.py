"""Selective activation checkpointing: every k-th decoder layer checkpointed, the others keeping
their activations (``Setup.checkpoint_every``).

Where it comes from (the libraries' own code, the versions vramplan models):

- transformers 5.24 ``modeling_utils.PreTrainedModel._set_gradient_checkpointing``: with
  ``every_n_layers=k`` it walks ``self.modules()`` and sets ``gradient_checkpointing`` on the
  i-th ``GradientCheckpointingLayer`` (the decoder layers, counted in module order) to
  ``i % k == 0``: layers 0, k, 2k, ... are checkpointed, ceil(L / k) of them. The Trainer passes
  it through ``activation_checkpointing_kwargs={"every_n_layers": k}`` (trainer.py, popped before
  the rest reaches ``torch.utils.checkpoint.checkpoint``). A checkpointed layer keeps its input
  hidden states (non-reentrant checkpoint's saved-tensor hooks drop everything else); an
  unchecked one saves what it saves without checkpointing (estimator/activations.py).
- torchtune 0.6.1 ``training/activations.py`` ``apply_selective_activation_checkpointing`` with
  ``ac_mode: selective, ac_option: k`` (read only by ``recipes/full_finetune_distributed.py`` and
  ``qat_distributed.py``, and only with ``enable_activation_checkpointing: False``): a counter
  incremented before the test ``count % k == 0`` checkpoints layers k-1, 2k-1, ... (floor(L / k)),
  the same count as transformers' when k divides L, shifted by k - 1 layers. ``ac_option: op``
  fails there (``int("op")``): torchtune 0.6.1 has no op-level policy.
- torch 2.13 ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (torchtitan's "save
  the matmul outputs" op policy): not modelled; no trainer vramplan emits for applies it.

The estimate keeps the layers' saved bytes per layer (checkpointed: the layer input; the others:
the whole layer), and the backward's moments at the top and bottom layers read whether that
layer is checkpointed. Verified by ``vramplan validate --knob selective_checkpointing`` against
the fake-tensor trace of transformers' own ``every_n_layers`` at full depth. Modelled on one GPU
(or DDP ranks) for the SFT step; refused elsewhere until a truth covers it.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError

__all__ = ["checkpointed_count", "is_checkpointed", "check_selective", "selective"]


def selective(setup: Setup) -> bool:
    """Checkpointing on, but not on every layer."""
    return setup.checkpointing and setup.checkpoint_every > 1


def is_checkpointed(setup: Setup, idx: int) -> bool:
    """Whether decoder layer ``idx`` (0-based, in module order) is checkpointed."""
    return setup.checkpointing and idx % setup.checkpoint_every == 0


def checkpointed_count(setup: Setup, num_layers: int) -> int:
    """Checkpointed decoder layers out of ``num_layers``: ceil(L / k), all with k = 1, none without."""
    if not setup.checkpointing:
        return 0
    return -(-num_layers // setup.checkpoint_every)


def check_selective(model: ModelSpec, setup: Setup) -> None:
    """Refuse what the selective estimate has not been checked on (SpecError, one line)."""
    if not selective(setup):
        return
    window = model.traits.sliding_window
    why = None
    if setup.zero_stage or setup.fsdp != "none" or setup.device_map != "none":
        why = "under DeepSpeed ZeRO, FSDP or a layer split"
    elif setup.objective != "sft":
        why = f"with --objective {setup.objective}"
    elif model.moe is not None and model.moe.num_moe_layers:
        why = f"on {model.name}'s MoE layers"
    elif setup.dora or setup.quant in ("gptq", "awq") or setup.activation_offload:
        why = "with DoRA, a GPTQ/AWQ base or activation offloading"
    elif setup.pad_mask or (window and setup.seq >= window):  # activations.masked_layers' masks
        why = "with an explicit attention mask (--pad-mask or sliding-window layers)"
    elif 0 < model.traits.sliding_layers < model.num_layers:
        why = f"on {model.name}'s mix of sliding-window and full-attention layers"
    if why:
        raise SpecError(f"--checkpoint-every {setup.checkpoint_every} (selective checkpointing) {why} is not modelled "
                        "yet; use --checkpoint-every 1")
