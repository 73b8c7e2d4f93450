"""The analytic tier: one training step's memory per GPU from counts only, in milliseconds.

``estimate(model, setup, gpu)`` (estimator/step.py) sums one pure function per memory term into a
Breakdown: the model states (estimator/model_states.py, optimizers.py, lora.py), the saved
activations (activations.py, in the dtypes of precision.py) and the step's transients
(transients.py), ZeRO and FSDP's per-rank shares (distributed.py, fsdp.py) and the device terms
(corrections.py). No torch import.

May import: util, specs, bands, setup (the types; no torch, no other stage).
"""

from __future__ import annotations

from . import short_conv  # noqa: F401  (registers LFM2's layers with activations.LAYER_SPLITS)
from .corrections import DEFAULT_CORRECTIONS, Corrections
from .lora import lora_params
from .model_states import optimizer_state_bytes, trainable_params, weights_bytes
from .step import estimate

__all__ = [
    "DEFAULT_CORRECTIONS",
    "Corrections",
    "estimate",
    "lora_params",
    "optimizer_state_bytes",
    "trainable_params",
    "weights_bytes",
]
