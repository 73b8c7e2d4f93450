"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import os
import shutil
import sys


def vramplan_cmd() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m vramplan``."""
    script = os.path.join(os.path.dirname(sys.executable), "vramplan")
    if os.path.exists(script):
        return [script]
    found = shutil.which("vramplan")
    return [found] if found else [sys.executable, "-m", "vramplan"]
