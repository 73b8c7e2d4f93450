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

**Published rows** (``calibration/published/records.jsonl``; issue 13): fms-acceleration reports,
for one run, ``max_memory_allocated`` and the nvidia-smi peak. Per GPU class and torch version,
``device_total - allocated - nccl = c + f * allocated`` (numpy least squares, measured against
measured: any row with both numbers counts, comparable or not): ``f`` the allocator's
proportional slack and ``c`` the fixed part (CUDA context + the allocator's fixed slack, which
these rows cannot separate: the context stays the published figure and ``c`` minus it is the
reserved fixed part). cuBLAS workspaces, NCCL per communicator, cuDNN workspaces and
expandable_segments are not fitted (quoted, or not modelled): ``terms`` in each group says which.
A GPU class with no such pair but comparable rows that measured the reserved peak (consumer cards)
gets its allocator terms from those (calibration/reserved_fit.py).

**Error bands**, one per headline number, from the residuals of the quantity it predicts:
``measured / predicted - 1`` over the rows that measured it (CUDA runs: all four numbers from the
estimated tensor peak; published rows: the comparable ones, estimated with the group's
corrections, allocated and nvidia-smi), ``low`` = min(0, smallest), ``high`` = max(0, largest):
every row measured lies inside its band. A number no row measured keeps the default band (tensor
peak), or the wider of its neighbours' (reserved, between allocated and device total).
:func:`vramplan.estimator.corrections.load_calibrated` reads ``coefficients.json`` back into the
estimator's ``Corrections``. numpy is the only dependency; no torch.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..bands import DEFAULT_ERROR_BAND, HEADLINES, ErrorBand, ErrorBands
from ..util.fileio import atomic_write_text
from .fitting import FORMAT_VERSION, band_of, gpu_class
from .fitting import quoted as _quoted
from .fitting import quoted_workspace as _quoted_workspace
from .fitting import relative_stats as _relative_stats

#: Default output, next to the records.
COEFFICIENTS_PATH = Path("calibration") / "coefficients.json"

#: Runs a group needs before it gets its own fit (else it uses the pooled one).
MIN_GROUP_RUNS = 4

#: Estimate components that are device overheads, not tensors.
DEVICE_COMPONENTS = ("cublas_workspace", "allocator_overhead", "cuda_context", "nccl")

#: Regularisation of the component factors towards 1 (relative to the data's scale).
FACTOR_RIDGE = 1e-3


#: the nvidia-smi peak fms-acceleration publishes beside the allocated peak of the same run
SMI_KEY = "nvidia_smi_peak_memory_used_MiB_mean_over_devices"


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


def fit(records: list[dict], tolerance: float = 0.03, published: list[dict] | None = None) -> dict[str, Any]:
    """Coefficients per group and pooled, residuals, error bands and flags (a JSON-ready mapping),
    from CUDA measurement ``records`` and ``published`` records (both optional). ``pooled`` is the
    CUDA fit when there are CUDA runs, else the fit over every published pair."""
    runs = [r for r in records if usable(r)]
    pairs = published_pairs(published or [])
    result: dict[str, Any] = {"vramplan_coefficients": FORMAT_VERSION, "runs": len(runs),
                              "records_seen": len(records), "published_pairs": len(pairs),
                              "published_seen": len(published or []), "tolerance": tolerance,
                              "groups": {}, "flags": [], "fit_id": fit_id(runs, pairs)}
    if pairs:
        by_pub: dict[str, list[dict]] = defaultdict(list)
        for pr in pairs:
            by_pub[pr["group"]].append(pr)
        pub_fits = {g: ps for g, ps in sorted(by_pub.items()) if len(ps) >= MIN_GROUP_RUNS}
        if not runs:
            pub_fits = {"pooled": pairs, **pub_fits}
        for name, ps in pub_fits.items():
            result["groups"][name] = fit_published_group(ps, published or [])
    from .reserved_fit import fit_reserved_group, reserved_groups

    # GPU classes with only reserved peaks published (consumer cards: calibration/reserved_fit.py)
    reserved = reserved_groups(published or [], set(result["groups"]))
    for name, rows in reserved.items():
        result["groups"][name] = fit_reserved_group(rows)
    if reserved:
        result["fit_id"] = fit_id(runs, pairs, sorted(r["id"] for rows in reserved.values() for r in rows))
    if not runs:
        result["flags"].append("no complete single-GPU CUDA measurement: device terms from published rows only"
                               if pairs else "no complete single-GPU CUDA measurement: nothing to fit "
                               "(run `vramplan sweep` on a GPU)")
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
        coef["source"] = "cuda"
        coef["fitted_on"] = f"{len(rs)} CUDA runs ({name})"
        coef["nccl_bytes"] = _quoted().nccl_bytes
        coef["terms"] = {k: {"fitted": True} for k in ("workspace_bytes", "allocated_rounding", "fragmentation",
                                                       "fragmentation_fixed_bytes", "cuda_context_bytes")}
        coef["terms"]["nccl_bytes"] = {"fitted": False, "what": "published figure (single-GPU runs only)"}
        coef["error_bands"] = cuda_bands(coef, rs).to_json()
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


# ----------------------------------------------------------------------------------------------
# published rows (records.jsonl of calibration/published) and error bands


def published_pairs(records: list[dict]) -> list[dict]:
    """Runs that report max_memory_allocated and the nvidia-smi peak (per GPU) of the same run,
    completed (not OOM), on a GPU vramplan knows."""

    out = []
    for r in records:
        smi = (r.get("secondary_measurements") or {}).get(SMI_KEY)
        if r.get("oom") or r.get("quantity") != "allocated" or not r.get("measured_bytes") or not smi:
            continue
        cls = gpu_class(r)
        if cls is None:
            continue
        out.append({"id": r["id"], "gpus": int((r.get("setup") or {}).get("gpus") or 1), **cls,
                    "allocated": int(r["measured_bytes"]), "device_total": int(smi * 2**20)})
    return out


def fit_published_group(pairs: list[dict], records: list[dict]) -> dict[str, Any]:
    """``device_total - allocated - nccl = c + f * allocated`` over ``pairs``; the bands from the
    comparable ``records`` of the same runs estimated with the fitted corrections."""
    import numpy as np

    q = _quoted()
    a = np.array([p["allocated"] for p in pairs], dtype=float)
    d = np.array([p["device_total"] for p in pairs], dtype=float)
    nccl = np.array([q.nccl_bytes if p["gpus"] > 1 else 0 for p in pairs], dtype=float)
    cols = np.array([np.ones_like(a), a]).T
    (c, f), *_ = np.linalg.lstsq(cols, d - a - nccl, rcond=None)
    pred = a * (1 + f) + c + nccl
    cov = float(np.sum((d - pred) ** 2)) / max(len(pairs) - 2, 1) * np.linalg.inv(cols.T @ cols)
    gpus = sorted({p["gpu"] for p in pairs})
    coef: dict[str, Any] = {
        "source": "published", "runs": len(pairs),
        "fitted_on": f"{len(pairs)} published runs (allocated + nvidia-smi; {', '.join(gpus)}; "
                     f"{', '.join(sorted({p['group'] for p in pairs}))})",
        "workspace_bytes": _quoted_workspace(pairs[0]["cc"]), "allocated_rounding": 0.0,
        "fragmentation": round(float(f), 6), "fragmentation_fixed_bytes": round(float(c)) - q.cuda_context_bytes,
        "cuda_context_bytes": q.cuda_context_bytes, "nccl_bytes": q.nccl_bytes,
        "device_fixed_bytes": round(float(c)),
        "residuals": {"device_total_bytes.from_measured_allocated": _relative_stats(pred / d - 1)},
        "terms": {
            "fragmentation": {"fitted": True, "stderr": round(float(np.sqrt(cov[1, 1])), 6),
                              "what": "the caching allocator's slack per allocated byte (nvidia-smi - allocated, "
                                      "proportional part)"},
            "device_fixed_bytes": {"fitted": True, "stderr": round(float(np.sqrt(cov[0, 0]))),
                                   "what": "CUDA context + the allocator's fixed slack (nvidia-smi - allocated at "
                                           "allocated 0); applied as cuda_context_bytes (quoted) + "
                                           "fragmentation_fixed_bytes (the rest)"},
            "cuda_context_bytes": {"fitted": False, "what": "published figure: these rows cannot separate it from "
                                                            "the allocator's fixed slack"},
            "workspace_bytes": {"fitted": False, "what": "cuBLAS workspaces, published figure (in allocated)"},
            "nccl_bytes": {"fitted": False, "what": "per process on several GPUs, published figure (subtracted "
                                                    "before the fit; every multi-GPU row is FSDP on 2 GPUs)"},
            "cudnn_workspace": {"fitted": False, "what": "not modelled (no convolutions in a decoder LLM)"},
            "expandable_segments": {"fitted": False, "what": "every row ran with the default (off): not fitted"},
        },
    }
    coef["error_bands"] = published_bands(coef, {p["id"] for p in pairs}, records).to_json()
    coef["error_band"] = coef["error_bands"]["device_total_bytes"]["high"]
    return coef


def _bands(per_quantity: dict[str, list[float]], basis: str) -> ErrorBands:
    got = {k: band_of(v, f"{basis}, {len(v)} rows") for k, v in per_quantity.items()}
    alloc, dev = got.get("peak_allocated_bytes"), got.get("device_total_bytes")
    if "peak_reserved_bytes" not in got and alloc is not None and dev is not None:
        got["peak_reserved_bytes"] = ErrorBand(min(alloc.low, dev.low), max(alloc.high, dev.high), 0,
                                               "no row measured it: the wider of allocated's and device total's")
    return ErrorBands(**{k: got.get(k, DEFAULT_ERROR_BAND) for k in HEADLINES})


def cuda_bands(coef: dict, runs: list[dict]) -> ErrorBands:
    """Bands of a CUDA group: every headline number predicted from the estimated tensor peak."""
    errs: dict[str, list[float]] = {k: [] for k in HEADLINES}
    for r in runs:
        est_tensor = r["estimate"]["tensor_peak_bytes"]
        pred = {"tensor_peak_bytes": est_tensor, **predict(coef, est_tensor)}
        for k in HEADLINES:
            errs[k].append(r["measured"][k] / pred[k] - 1)
    return _bands(errs, "CUDA runs, measured / calibrated estimate - 1")


def published_bands(coef: dict, ids: set[str], records: list[dict]) -> ErrorBands:
    """Bands of a published group: its comparable rows estimated with its corrections (allocated
    as measured, device total as nvidia-smi; in-sample for the device total: the terms were
    fitted on the same runs)."""
    from ..estimator.corrections import corrections_from
    from . import published as pub

    corrections = corrections_from({"vramplan_coefficients": FORMAT_VERSION, "groups": {"fit": coef}}, None, "fit",
                                   group="fit")
    errs: dict[str, list[float]] = {"peak_allocated_bytes": [], "device_total_bytes": []}
    chosen = [r for r in records if r.get("comparable") and r["id"] in ids]
    for row in pub.compare(chosen, estimator=lambda r: pub.estimate_record(r, corrections)):
        errs[pub.QUANTITY_FIELD[row.quantity]].append(row.measured_bytes / row.estimated_bytes - 1)
    return _bands(errs, "published rows, measured / calibrated estimate - 1")


def fit_id(runs: list[dict], pairs: list[dict], reserved_ids: list[str] | None = None) -> str:
    """A short digest of what was fitted (which runs, which numbers, which reserved-only rows) and the
    estimator's version."""
    import hashlib

    from ..estimator.version import MODEL_VERSION

    key = [MODEL_VERSION, sorted((p["id"], p["allocated"], p["device_total"]) for p in pairs),
           sorted(json.dumps(r["measured"], sort_keys=True) for r in runs)]
    key = json.dumps(key + ([reserved_ids] if reserved_ids else []), sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def write(result: dict, path: str | os.PathLike = COEFFICIENTS_PATH) -> Path:
    """Write the coefficients atomically."""
    return atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True) + "\n")


def summary_lines(result: dict) -> list[str]:
    """A few lines for the terminal: per group, the fitted corrections and the error band."""
    lines = [f"{result['runs']} usable CUDA runs of {result['records_seen']} records; "
             f"{result.get('published_pairs', 0)} published runs with allocated + nvidia-smi "
             f"of {result.get('published_seen', 0)} published records"]
    for name, g in result["groups"].items():
        fitted = [k for k, t in (g.get("terms") or {}).items() if t.get("fitted")]
        lines.append(f"{name} ({g.get('source', 'cuda')}): {g['runs']} runs; workspace "
                     f"{g['workspace_bytes'] / 2**20:.1f} MiB, fragmentation {g['fragmentation']:+.1%} + "
                     f"{g['fragmentation_fixed_bytes'] / 2**20:.0f} MiB, CUDA context "
                     f"{g['cuda_context_bytes'] / 2**20:.0f} MiB; fitted: {', '.join(fitted)}")
        for k, b in (g.get("error_bands") or {}).items():
            lines.append(f"  error band {k.replace('_bytes', '')}: {b['low']:+.1%} / {b['high']:+.1%} ({b['basis']})")
        b = (g.get("error_bands_resident") or {}).get("device_total_bytes")
        if b:  # a setup without CPU offload (calibration/reserved_fit.py)
            lines.append(f"  error band device_total without CPU offload: {b['low']:+.1%} / {b['high']:+.1%} "
                         f"({b['basis']})")
    return lines
