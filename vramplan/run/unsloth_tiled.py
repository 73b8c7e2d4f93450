"""Unsloth's own ``TiledMLP`` (unsloth-zoo 2026.8.13 ``unsloth_zoo/tiled_mlp.py``) on this CPU, for the truth of
``--tiled-mlp`` (estimator/tiled_mlp.py).

``import unsloth_zoo`` needs a GPU (its ``__init__`` probes the device), so the one file is loaded from an
unsloth-zoo wheel or source tree (:data:`ENV`, else an installed ``unsloth_zoo`` found without importing it) and
executed as ``unsloth_zoo.tiled_mlp`` with its two package imports answered: ``set_device_states`` (the copy of
``torch.utils.checkpoint.set_device_states`` in ``unsloth_zoo/gradient_checkpointing.py``, same signature) and
``DEVICE_TYPE = "cpu"`` (``unsloth_zoo/device_type.py`` would say "cuda"). Nothing else is replaced: the autograd
function, the tile sizes and ``patch_tiled_mlp`` are Unsloth's code as the wheel ships it."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

from .wheel_files import extracted, installed_modules

__all__ = ["ENV", "VERSION", "find_source", "load", "patch"]

#: a wheel (``unsloth_zoo-2026.8.13-py3-none-any.whl``) or a directory holding ``unsloth_zoo/tiled_mlp.py``
ENV = "VRAMPLAN_UNSLOTH_ZOO"
#: the unsloth-zoo the estimate reads (estimator/tiled_mlp.py)
VERSION = "2026.8.13"
_MEMBER = "unsloth_zoo/tiled_mlp.py"


def find_source() -> Path | None:
    """``unsloth_zoo/tiled_mlp.py`` from :data:`ENV` (a wheel is unpacked to a temporary directory), or from an
    installed unsloth-zoo (located, not imported); None when neither has it."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given)
        if path.is_file() and path.suffix == ".whl":
            return _extracted(str(path.resolve()))
        found = path / _MEMBER
        return found if found.is_file() else None
    spec = importlib.util.find_spec("unsloth_zoo")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = Path(root) / "tiled_mlp.py"
        if found.is_file():
            return found
    return None


def _extracted(wheel_path: str) -> Path | None:
    """The wheel's ``unsloth_zoo/tiled_mlp.py``, unpacked once per process to a temporary directory."""
    root = extracted(wheel_path, (_MEMBER,))
    return root / _MEMBER if root is not None else None


def load(source: Path | None = None) -> types.ModuleType:
    """Unsloth's ``tiled_mlp`` module (see the module docstring); FileNotFoundError without a source."""
    import torch.utils.checkpoint as checkpoint

    source = source or find_source()
    if source is None:
        raise FileNotFoundError(f"no unsloth_zoo/tiled_mlp.py: set {ENV} to an unsloth-zoo {VERSION} wheel")
    shims = {"unsloth_zoo": types.ModuleType("unsloth_zoo"),
             "unsloth_zoo.gradient_checkpointing": types.ModuleType("unsloth_zoo.gradient_checkpointing"),
             "unsloth_zoo.device_type": types.ModuleType("unsloth_zoo.device_type")}
    shims["unsloth_zoo"].__path__ = []
    shims["unsloth_zoo.gradient_checkpointing"].set_device_states = checkpoint.set_device_states
    shims["unsloth_zoo.device_type"].DEVICE_TYPE = "cpu"
    with installed_modules(shims):
        spec = importlib.util.spec_from_file_location("unsloth_zoo.tiled_mlp", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def patch(model, module: types.ModuleType | None = None):
    """``patch_tiled_mlp(model, "arctic")``, what ``unsloth_tiled_mlp=True`` runs after loading."""
    return (module or load()).patch_tiled_mlp(model, patch_options_str="arctic")
