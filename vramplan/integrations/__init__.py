"""vramplan inside a user's own training process.

:mod:`vramplan.integrations.transformers`: :class:`~vramplan.integrations.transformers.VramplanCallback`,
a ``transformers.TrainerCallback`` for the HF Trainer and TRL's trainers (docs/integrations.md).
It imports torch and transformers (it runs where they already are); nothing on the estimate
path imports this package (``import vramplan`` and the CLI stay torch-free).

May import: util, specs, model, setup, estimator, readers, calibration, run.
"""
