"""The version of the estimator's formulas, recorded with every `vramplan check` baseline.

Bump ``MODEL_VERSION`` in the same change as any edit to ``vramplan/estimator/`` (or to the
published overheads in ``corrections.py``) that moves a number of a Breakdown. A baseline recorded
under another model version then tells its reader that a difference may come from vramplan's
formulas rather than from their own change to a model, a config or a library.
"""

from __future__ import annotations

MODEL_VERSION = 6
