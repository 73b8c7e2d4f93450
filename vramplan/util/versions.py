"""The library versions vramplan records beside its numbers, read from package metadata: a
version is never read by importing the library (reading torch's must not import torch).

One list, :data:`LIBRARIES`: a measurement's provenance (:mod:`vramplan.calibration.measure`) records all of
them; a ``vramplan check`` baseline (:mod:`vramplan.budget`) records :data:`BASELINE_LIBRARIES`,
the ones its traced tier runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

#: Libraries whose versions change what a training step allocates.
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed", "nvidia-ml-py")

#: The part of :data:`LIBRARIES` a check baseline's ``recorded_with`` holds.
BASELINE_LIBRARIES = ("torch", "transformers", "peft")


def library_versions(names: Iterable[str] = LIBRARIES) -> dict[str, str | None]:
    """``{name: installed version}`` in the order given; None for a library not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
