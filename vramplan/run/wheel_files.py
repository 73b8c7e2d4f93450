"""Files of a framework's wheel, executed without installing it (the truths of vramplan/run/unsloth_tiled.py,
axolotl_tiled.py, llamafactory_gc.py): the wheel an environment variable names, its files unpacked once per
process, and the package modules those files import answered in ``sys.modules`` while they load."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

__all__ = ["extracted", "installed_modules", "wheel_in"]


def wheel_in(env: str, members: tuple[str, ...]) -> Path | None:
    """The wheel the environment variable ``env`` names, if it holds every one of ``members``; None otherwise."""
    given = os.environ.get(env)
    if not given or not Path(given).is_file():
        return None
    return Path(given) if extracted(str(Path(given).resolve()), members) is not None else None


@functools.cache
def extracted(wheel_path: str, members: tuple[str, ...]) -> Path | None:
    """The directory ``members`` of the wheel are unpacked to (once per process), None when one is missing."""
    with zipfile.ZipFile(wheel_path) as wheel:
        if not set(members) <= set(wheel.namelist()):
            return None
        out = Path(tempfile.mkdtemp(prefix="vramplan-wheel-"))
        for member in members:
            wheel.extract(member, out)
        return out


@contextlib.contextmanager
def installed_modules(modules: dict[str, types.ModuleType]):
    """``modules`` in ``sys.modules`` within (a wheel's file imports them), what was there before restored after."""
    before = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in before.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
