"""Fit what the analytic model cannot derive from measurements; flag what it gets wrong.

From the CUDA records of ``calibration/measurements/`` (complete runs, OOMs excluded), per GPU
family (compute capability) and torch version where there are enough runs, and pooled:

- **workspace**: ``peak_allocated = ws + (1 + r) * tensor_peak`` (numpy least squares over runs):
  ``ws`` is what ``max_memory_allocated`` holds beyond live tensors (cuBLAS workspaces), ``r``
  the allocator's 512-byte rounding, both measured in the same run;
- **allocator fragmentation**: ``peak_reserved = c + (1 + f) * peak_allocated``: the caching
  allocator's slack as a function of the peak size (``f`` the proportional part, ``c`` the fixed);
- **CUDA context**: ``device_total - peak_reserved`` (the context, lazily loaded kernels, library
  handles; NCCL on multi-GPU runs is left out), a constant: its least-squares fit is the mean;
  the context measured at CUDA init is reported beside it;
- **component factors**: ``tensor_peak (measured) = sum_k g_k * share_k``, where ``share_k`` is
  component k's part of the estimated peak (the components present in the peak phase, scaled to
  add up to the peak: a backward peak is a moment inside the phase), least squares regularised
  towards 1. These are never
  applied: a factor off 1 by more than ``tolerance`` is a wrong formula to fix, so it is flagged.

The residuals of the calibrated prediction give the error band: twice the RMS relative error of
``device_total`` (the number a fit is judged on), at least the largest error seen.
:func:`vramplan.estimator.corrections.load_calibrated` reads ``coefficients.json`` back into the
estimator's ``Corrections``. numpy is the only dependency; no torch.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from .fileio import atomic_write_text

#: Default output, next to the records.
COEFFICIENTS_PATH = Path("calibration") / "coefficients.json"

#: Runs a group needs before it gets its own fit (else it uses the pooled one).
MIN_GROUP_RUNS = 4

#: Estimate components that are device overheads, not tensors.
DEVICE_COMPONENTS = ("cublas_workspace", "allocator_overhead", "cuda_context", "nccl")

#: Regularisation of the component factors towards 1 (relative to the data's scale).
FACTOR_RIDGE = 1e-3

FORMAT_VERSION = 1


def usable(record: dict) -> bool:
    """A complete, single-GPU CUDA run with every number the fits need."""
    got = record.get("measured") or {}
    return (record.get("device") == "cuda" and not got.get("failed") and not got.get("oom")
            and (record.get("setup") or {}).get("gpus", 1) == 1
            and all(got.get(k) for k in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                          "device_total_bytes")))


def group_of(record: dict) -> str:
    """``sm90/torch-2.8``: GPU family (compute capability) and torch minor version."""
    prov = record.get("provenance") or {}
    cc = str(prov.get("compute_capability") or "unknown").replace(".", "")
    torch_version = (prov.get("versions") or {}).get("torch") or "unknown"
    return f"sm{cc}/torch-{'.'.join(torch_version.split('+')[0].split('.')[:2])}"


def _lstsq(columns: list[list[float]], y: list[float]):
    import numpy as np

    a = np.array(columns, dtype=float).T
    coef, *_ = np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)
    return coef


def fit_device(records: list[dict]) -> dict[str, Any]:
    """Workspace, fragmentation and context from complete CUDA runs (see the module docstring)."""
    import numpy as np

    t = [r["measured"]["tensor_peak_bytes"] for r in records]
    a = [r["measured"]["peak_allocated_bytes"] for r in records]
    res = [r["measured"]["peak_reserved_bytes"] for r in records]
    d = [r["measured"]["device_total_bytes"] for r in records]
    if len(records) >= 3 and np.ptp(t) > 0:
        ws, slope = _lstsq([[1.0] * len(t), t], a)
    else:  # too few runs for a slope: the workspace alone
        ws, slope = float(np.mean(np.subtract(a, t))), 1.0
    if len(records) >= 3 and np.ptp(a) > 0:
        c, frag_slope = _lstsq([[1.0] * len(a), a], res)
    else:
        c, frag_slope = 0.0, float(np.mean(np.divide(res, a)))
    other = np.subtract(d, res)
    init_ctx = [r["measured"].get("cuda_context_bytes") for r in records if r["measured"].get("cuda_context_bytes")]
    return {
        "runs": len(records),
        "workspace_bytes": round(float(ws)),
        "allocated_rounding": float(slope - 1),
        "fragmentation": float(frag_slope - 1),
        "fragmentation_fixed_bytes": round(float(c)),
        "cuda_context_bytes": round(float(np.mean(other))),
        "cuda_context_at_init_bytes": round(float(np.mean(init_ctx))) if init_ctx else None,
    }


def predict(coef: dict, tensor_peak: float) -> dict[str, float]:
    """The device-level numbers the coefficients predict from a tensor peak."""
    allocated = coef["workspace_bytes"] + (1 + coef["allocated_rounding"]) * tensor_peak
    reserved = coef["fragmentation_fixed_bytes"] + (1 + coef["fragmentation"]) * allocated
    return {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
            "device_total_bytes": reserved + coef["cuda_context_bytes"]}


def residuals(coef: dict, records: list[dict]) -> dict[str, dict[str, float]]:
    """Relative errors (predicted / measured - 1) of each device number, predicted from the
    *estimated* tensor peak (what the estimator will do), and from the measured one."""
    import numpy as np

    out = {}
    for source in ("estimate", "measured"):
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
            errs = []
            for r in records:
                tensor = (r["estimate"] if source == "estimate" else r["measured"])["tensor_peak_bytes"]
                errs.append(predict(coef, tensor)[key] / r["measured"][key] - 1)
            arr = np.array(errs)
            out[f"{key}.from_{source}_tensor_peak"] = {
                "rms": float(np.sqrt(np.mean(arr**2))), "max_abs": float(np.max(np.abs(arr))),
                "mean": float(np.mean(arr))}
    return out


def fit_components(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per-component factors g_k: measured tensor peak = sum_k g_k * component_k (in the
    estimate's peak phase), least squares regularised towards 1 so that a component the data
    cannot separate stays at 1 instead of taking an arbitrary value."""
    import numpy as np

    names: list[str] = []
    rows: list[dict[str, float]] = []
    y: list[float] = []
    for r in records:
        est = r["estimate"]
        phase = est.get("phase")
        row: dict[str, float] = defaultdict(float)
        for comp in est.get("components") or []:
            if comp["name"] in DEVICE_COMPONENTS or comp.get("where", "gpu") != "gpu":
                continue
            if phase in (comp.get("phases") or [phase]):
                row[comp["name"]] += comp["bytes"]
        total = sum(row.values())
        if not total:
            continue
        # backward peaks are a moment inside the phase: scale the components to the peak
        rows.append({n: v * est["tensor_peak_bytes"] / total for n, v in row.items()})
        y.append(r["measured"]["tensor_peak_bytes"])
        names += [n for n in row if n not in names]
    if not rows:
        return {}
    a = np.array([[row.get(n, 0.0) for n in names] for row in rows])
    scale = float(np.mean(y))
    lam = FACTOR_RIDGE * len(rows)
    # minimise |A g - y|^2 + lam * scale^2 * |g - 1|^2 (normal equations)
    lhs = a.T @ a + lam * scale**2 * np.eye(len(names))
    rhs = a.T @ np.array(y) + lam * scale**2 * np.ones(len(names))
    g = np.linalg.solve(lhs, rhs)
    support = (a > 0).sum(axis=0)
    return {n: {"factor": float(g[i]), "runs": int(support[i])} for i, n in enumerate(names)}


def fit(records: list[dict], tolerance: float = 0.03) -> dict[str, Any]:
    """Coefficients per group and pooled, residuals, error band and flags (a JSON-ready mapping)."""
    runs = [r for r in records if usable(r)]
    result: dict[str, Any] = {"vramplan_coefficients": FORMAT_VERSION, "runs": len(runs),
                              "records_seen": len(records), "tolerance": tolerance, "groups": {}, "flags": []}
    if not runs:
        result["flags"].append("no complete single-GPU CUDA measurement: nothing to fit (run `vramplan sweep` on a GPU)")
        return result
    by_group: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_group[group_of(r)].append(r)
    fits = {"pooled": runs, **{g: rs for g, rs in sorted(by_group.items()) if len(rs) >= MIN_GROUP_RUNS}}
    for name, rs in fits.items():
        coef = fit_device(rs)
        res = residuals(coef, rs)
        dev = res["device_total_bytes.from_estimate_tensor_peak"]
        coef["error_band"] = round(max(2 * dev["rms"], dev["max_abs"]), 4)
        coef["residuals"] = res
        coef["components"] = fit_components(rs)
        result["groups"][name] = coef
        for comp, info in coef["components"].items():
            if abs(info["factor"] - 1) > tolerance:
                result["flags"].append(f"{name}: component {comp} measures {info['factor']:.3f}x its estimate "
                                       f"over {info['runs']} runs (more than {tolerance:.0%} off: fix its formula)")
        if abs(coef["allocated_rounding"]) > tolerance:
            result["flags"].append(f"{name}: allocated/tensor peak slope {1 + coef['allocated_rounding']:.3f} "
                                   f"(more than rounding: tensors the live count misses?)")
    return result


def write(result: dict, path: str | os.PathLike = COEFFICIENTS_PATH) -> Path:
    """Write the coefficients atomically."""
    return atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True) + "\n")


def summary_lines(result: dict) -> list[str]:
    """A few lines for the terminal: per group, the fitted corrections and the error band."""
    lines = [f"{result['runs']} usable CUDA runs of {result['records_seen']} records"]
    for name, g in result["groups"].items():
        lines.append(f"{name}: {g['runs']} runs; workspace {g['workspace_bytes'] / 2**20:.1f} MiB, "
                     f"fragmentation {g['fragmentation']:+.1%} + {g['fragmentation_fixed_bytes'] / 2**20:.1f} MiB, "
                     f"CUDA context {g['cuda_context_bytes'] / 2**20:.0f} MiB; error band ±{g['error_band']:.1%}")
    return lines
