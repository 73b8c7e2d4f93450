"""This machine, as the planner needs it: the NVIDIA GPUs in it and its RAM. Torch-free, quiet.

GPU names come from the driver's ``/proc/driver/nvidia/gpus/*/information`` ("Model:" line), or
``nvidia-smi --query-gpu=name`` when that is absent; RAM from ``/proc/meminfo`` (MemTotal).
Anything missing (no driver, no Linux, a sandbox) gives an empty answer, never an error.
"""

from __future__ import annotations

import functools
import glob
import shutil
import subprocess


@functools.lru_cache(maxsize=1)
def local_gpu_names() -> tuple[str, ...]:
    """The names of the NVIDIA GPUs in this machine ("NVIDIA GeForce RTX 4090"), or ()."""
    names = []
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Model:"):
                        names.append(line.split(":", 1)[1].strip())
                        break
        except OSError:
            continue
    if names:
        return tuple(names)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ()
    if out.returncode != 0:
        return ()
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip())


def local_ram_bytes() -> int | None:
    """This machine's RAM (MemTotal of /proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``/proc/driver/nvidia/version``, else nvidia-smi), or None."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("NVRM version:"):
                    for word in line.split():
                        if word[:1].isdigit() and "." in word:
                            return word
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1] if out.returncode == 0 else []
    return first[0].strip() if first and first[0].strip() else None


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for, read from ``torch/version.py`` as text
    (torch is not imported); None for a CPU build or no torch. ``""`` when the file cannot be read."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(f"{folder}/version.py", encoding="utf-8") as f:
                text = f.read(100_000)
        except OSError:
            continue
        m = re.search(r"^cuda\b[^=\n]*=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
        if m is None:
            return ""
        return m.group(1) or m.group(2) or None
    return ""
