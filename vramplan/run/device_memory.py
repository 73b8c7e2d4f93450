"""CUDA device memory as the measuring worker reads it (:mod:`vramplan.run.worker`): NVML's view
of this process (nvidia-smi's numbers) or ``cudaMemGetInfo``, the caching allocator's peaks, and the
memory fraction that makes one big GPU emulate a smaller card. torch is imported only inside the
functions that need it; nvidia-ml-py is optional.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any


def nvml_device_ref(index: int, environ: Mapping[str, str] | None = None) -> tuple[str, int | str]:
    """How NVML names CUDA device ``index`` of this process: ``("index", n)`` or ``("uuid", "GPU-...")``.

    CUDA numbers only the devices ``CUDA_VISIBLE_DEVICES`` lists, in that order; NVML sees every
    device of the machine. (CUDA's default order is fastest first; NVML's, PCI bus order: the
    same for the identical GPUs of one machine.)"""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return ("index", index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"CUDA device {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[index]
    if entry.isdigit():
        return ("index", int(entry))
    return ("uuid", entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}")


class DeviceMemory:
    """Device memory this process uses, as nvidia-smi shows it (NVML), or device-wide used bytes
    from ``cudaMemGetInfo`` when nvidia-ml-py is not installed or NVML does not answer.

    ``nvml``: the pynvml module to use (default: import it; None: do without)."""

    _IMPORT = object()

    def __init__(self, index: int, nvml: Any = _IMPORT, environ: Mapping[str, str] | None = None) -> None:
        self.index = index
        self.baseline_bytes = 0  # used by others before this process initialised CUDA (NVML only)
        self.source = "cudaMemGetInfo"
        self.error: str | None = None
        self._nvml = None
        self._handle = None
        try:
            if nvml is DeviceMemory._IMPORT:
                import pynvml as nvml
            if nvml is None:
                raise ImportError("nvidia-ml-py not used")
            nvml.nvmlInit()
            kind, ref = nvml_device_ref(index, environ)
            self._handle = (nvml.nvmlDeviceGetHandleByIndex(ref) if kind == "index"
                            else nvml.nvmlDeviceGetHandleByUUID(ref))
            nvml.nvmlDeviceGetMemoryInfo(self._handle)  # answers, or we fall back now
            self._nvml = nvml
            self.source = "nvml"
        except Exception as exc:  # noqa: BLE001 - no nvidia-ml-py, no NVML library, no permission
            self._nvml = None
            self.error = f"{type(exc).__name__}: {exc}"[:200]

    def used_bytes(self) -> int | None:
        """Bytes used on the device (NVML) or None before CUDA is initialised without NVML."""
        if self._nvml is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        import torch

        if not torch.cuda.is_initialized():
            return None
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def settled_used_bytes(self, tries: int = 20, interval_s: float = 0.05) -> int | None:
        """:meth:`used_bytes` once two reads in a row agree (a process that just ended may
        still be giving its memory back), at most ``tries`` reads."""
        last = self.used_bytes()
        for _ in range(tries):
            time.sleep(interval_s)
            now = self.used_bytes()
            if now == last:
                break
            last = now
        return last

    def process_bytes(self, pid: int | None = None) -> int | None:
        """What nvidia-smi lists for process ``pid`` (default: this one) on the device; None
        without NVML, when the process is not listed (another PID namespace) or the driver
        does not say."""
        if self._nvml is None:
            return None
        pid = os.getpid() if pid is None else pid
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - not supported here
            return None
        for proc in procs:
            if getattr(proc, "pid", None) == pid:
                used = getattr(proc, "usedGpuMemory", None)
                return int(used) if isinstance(used, int) and used >= 0 else None
        return None

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_source": self.source}
        if self._nvml is not None:
            nv = self._nvml
            with contextlib.suppress(Exception):
                out["driver"] = _text(nv.nvmlSystemGetDriverVersion())
            with contextlib.suppress(Exception):
                out["nvml_name"] = _text(nv.nvmlDeviceGetName(self._handle))
        elif self.error:
            out["nvml_error"] = self.error
        return out


def emulation_fraction(emulate_bytes: int, context_bytes: int, total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` that caps the caching allocator so that allocator +
    CUDA context fit a card of ``emulate_bytes`` on a GPU of ``total_bytes``."""
    allocator_bytes = int(emulate_bytes) - int(context_bytes)
    fraction = allocator_bytes / total_bytes
    if not 0 < fraction <= 1:
        raise ValueError(f"cannot emulate {emulate_bytes} bytes on a {total_bytes}-byte GPU "
                         f"with a {context_bytes}-byte CUDA context")
    return fraction


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cuda_peaks() -> dict[str, int]:
    """The caching allocator's peaks since the last reset: allocated, reserved and active bytes."""
    import torch

    stats = torch.cuda.memory_stats()
    return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "active_peak_bytes": int(stats.get("active_bytes.all.peak", 0))}
