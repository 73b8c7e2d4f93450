"""axolotl's own tiled MLP (axolotl 0.18.0 ``axolotl/monkeypatch/tiled_mlp``) on this CPU, for the truth of
``--tiled-mlp --framework axolotl`` (estimator/tiled_mlp.py).

axolotl is not installed for this (its dependencies pin their own stacks): three files are loaded from its wheel
(:data:`ENV`) and executed as the modules they are, ``tiled_mlp/base.py`` (``TiledMLP``), ``tiled_mlp/patch.py``
(``patch_tiled_mlp``) and ``utils/callbacks/models.py`` (``get_causal_lm_model_cls_prefix``, which only reads
transformers' causal-LM mapping); ``axolotl.utils.logging.get_logger`` is answered with ``logging.getLogger``.
Nothing else is replaced: ``patch_tiled_mlp`` patches transformers' ``{Prefix}MLP.forward`` as axolotl's patch
manager calls it (``use_original_mlp`` and ``tiled_mlp_num_shards`` as the config says), its forward picks the
shard count and, outside DeepSpeed, base.py's ``TiledMLP`` (patch.py imports DeepSpeed's as well)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import types
from pathlib import Path

from .wheel_files import extracted, installed_modules, wheel_in

__all__ = ["ENV", "VERSION", "find_wheel", "load", "patched"]

#: an axolotl wheel (``axolotl-0.18.0-py3-none-any.whl``)
ENV = "VRAMPLAN_AXOLOTL_WHEEL"
#: the axolotl the estimate reads (estimator/tiled_mlp.py)
VERSION = "0.18.0"
_FILES = {"axolotl.utils.callbacks.models": "axolotl/utils/callbacks/models.py",
          "axolotl.monkeypatch.tiled_mlp.base": "axolotl/monkeypatch/tiled_mlp/base.py",
          "axolotl.monkeypatch.tiled_mlp.patch": "axolotl/monkeypatch/tiled_mlp/patch.py"}
_PACKAGES = ("axolotl", "axolotl.utils", "axolotl.utils.callbacks", "axolotl.monkeypatch",
             "axolotl.monkeypatch.tiled_mlp")


def find_wheel() -> Path | None:
    """The axolotl wheel :data:`ENV` names, if it holds the tiled-MLP files; None otherwise."""
    return wheel_in(ENV, tuple(_FILES.values()))


def load(wheel: Path | None = None) -> types.ModuleType:
    """axolotl's ``tiled_mlp.patch`` module, executed with its package imports answered (module docstring);
    FileNotFoundError without the wheel."""
    wheel = wheel or find_wheel()
    root = extracted(str(Path(wheel).resolve()), tuple(_FILES.values())) if wheel else None
    if root is None:
        raise FileNotFoundError(f"no axolotl tiled-MLP files: set {ENV} to an axolotl {VERSION} wheel")
    shims = {name: types.ModuleType(name) for name in (*_PACKAGES, "axolotl.utils.logging", *_FILES)}
    for name in _PACKAGES:
        shims[name].__path__ = []
    shims["axolotl.utils.logging"].get_logger = logging.getLogger
    with installed_modules(shims):
        for name, member in _FILES.items():  # models and base first: patch imports them
            spec = importlib.util.spec_from_file_location(name, root / member)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = shims[name] = module
            spec.loader.exec_module(module)
            setattr(shims[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], module)
    patch = shims["axolotl.monkeypatch.tiled_mlp.patch"]
    patch.vramplan_modules = shims  # patch_tiled_mlp imports base.py when it runs: installed again then
    return patch


@contextlib.contextmanager
def patched(model_type: str, shards: int | None = None, module: types.ModuleType | None = None):
    """Within: transformers' ``{Prefix}MLP`` of ``model_type`` runs axolotl's tiled forward (``patch_tiled_mlp(
    model_type, use_original_mlp=True, cfg_num_shards=shards)``, as its patch manager calls it); restored after."""
    patch = module or load()
    prefix, _ = patch.get_causal_lm_model_cls_prefix(model_type)  # (patch.py's import of it)
    modeling = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["_"])
    mlp = getattr(modeling, f"{prefix}MLP", None) or getattr(modeling, f"{prefix}TextMLP")
    saved = {k: mlp.__dict__[k] for k in ("forward", "_compute_params", "_tiled_mlp_dist_impl") if k in mlp.__dict__}
    with installed_modules(patch.vramplan_modules):
        patch.patch_tiled_mlp(model_type, use_original_mlp=True, cfg_num_shards=shards)
    try:
        yield mlp
    finally:
        for k in ("forward", "_compute_params", "_tiled_mlp_dist_impl"):
            if k in saved:
                setattr(mlp, k, saved[k])
            elif k in mlp.__dict__:
                delattr(mlp, k)
