"""What the calibration fits share (calibrate.py, reserved_fit.py): the coefficients file's format, the
published device terms, residual statistics and the error band of a list of residuals. numpy only."""

from __future__ import annotations

import math

from ..bands import DEFAULT_ERROR_BAND, ErrorBand

__all__ = ["FORMAT_VERSION", "MIN_BAND_ROWS", "band_of", "gpu_class", "quoted", "quoted_workspace", "relative_stats"]

FORMAT_VERSION = 2
#: rows a quantity needs before its band comes from them (else the default band)
MIN_BAND_ROWS = 3


def quoted():
    """The published device terms (the estimator's defaults)."""
    from ..estimator.corrections import DEFAULT_CORRECTIONS

    return DEFAULT_CORRECTIONS


def quoted_workspace(cc: str) -> int:
    """cuBLAS workspaces of a class's two handles, as published."""
    q = quoted()
    try:
        sm90 = float(cc) >= 9.0
    except ValueError:
        sm90 = False
    return q.cublas_handles * (q.cublas_workspace_bytes_sm90 if sm90 else q.cublas_workspace_bytes)


def relative_stats(errs) -> dict[str, float]:
    """RMS, worst and mean of relative residuals."""
    import numpy as np

    arr = np.array(errs, dtype=float)
    return {"rms": round(float(np.sqrt(np.mean(arr**2))), 6), "max_abs": round(float(np.max(np.abs(arr))), 6),
            "mean": round(float(np.mean(arr)), 6)}


def band_of(errs: list[float], basis: str) -> ErrorBand:
    """The band ``errs`` (measured / predicted - 1) span, 0 included; the default with too few."""
    if len(errs) < MIN_BAND_ROWS:
        return DEFAULT_ERROR_BAND
    # rounded outwards, so the band still holds every row
    return ErrorBand(math.floor(min(0.0, min(errs)) * 1e6) / 1e6, math.ceil(max(0.0, max(errs)) * 1e6) / 1e6,
                     len(errs), basis)


def gpu_class(record: dict) -> dict | None:
    """The GPU class a published record ran on: ``{"cc", "gpu", "group"}`` (``sm89/torch-2.4``: compute
    capability and torch minor version, ``unknown`` when the record does not say), None when vramplan
    does not know its GPU."""
    from ..model.profiles import load_gpu
    from ..specs import SpecError

    try:
        gpu = load_gpu(record.get("gpu") or "")
    except SpecError:
        return None
    torch_v = ((record.get("versions") or {}).get("torch") or {}).get("version") or "unknown"
    cc = str(gpu.compute_capability or "unknown")
    return {"cc": cc, "gpu": gpu.display_name,
            "group": f"sm{cc.replace('.', '')}/torch-{'.'.join(torch_v.split('+')[0].split('.')[:2])}"}
