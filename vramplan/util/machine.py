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
