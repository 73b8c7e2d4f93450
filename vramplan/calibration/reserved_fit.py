"""Device terms of a GPU class from published rows that report only ``max_memory_reserved`` (issue 28).

Consumer cards have no published run with both ``max_memory_allocated`` and the nvidia-smi peak (what
:func:`vramplan.calibration.calibrate.fit_published_group` fits); what they have is the reserved peak of
runs whose setup vramplan can estimate (Answer.AI's fsdp_qlora benchmarks on RTX 3090s and 4090s:
``calibration/published/README.md``). Per GPU class (compute capability), over the comparable rows that
measured the reserved peak::

    reserved (measured) = (1 + f) * allocated (the raw estimate: tensor peak + cuBLAS workspaces)

(numpy least squares through the origin: ``f`` the caching allocator's slack per allocated byte, the
estimate's own error in it). No fixed part: these rows sit near the card's capacity (20-23 GiB of 24),
where the allocator gives its cache back, so a two-term fit is ill-posed (on the RTX 4090 rows it gives
a negative slope, -7 %, and a 3.6 GiB fixed part that would land on an 8 GB card whole). The CUDA context and NCCL
stay the quoted figures (no row measured the device total). The bands: the same rows estimated with
the fitted terms (in-sample), reserved as measured, and the device total as the measured reserved peak
plus the quoted context and NCCL (its relative error is the reserved one, scaled); allocated and the
tensor peak keep the default band (no row measured them). A class needs :data:`MIN_ROWS` rows. numpy
only; no torch."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["MIN_ROWS", "fit_reserved_group", "is_resident", "reserved_groups", "reserved_rows"]

#: comparable reserved rows a GPU class needs before it gets a fit of its own
MIN_ROWS = 5


def reserved_rows(records: list[dict]) -> list[dict]:
    """Comparable, completed rows that measured the reserved peak on a GPU vramplan knows, each with its
    class (``sm89/torch-unknown``)."""
    from .fitting import gpu_class

    out = []
    for r in records:
        if not r.get("comparable") or r.get("oom") or r.get("quantity") != "reserved" or not r.get("measured_bytes"):
            continue
        cls = gpu_class(r)
        if cls is not None:
            out.append({"id": r["id"], "record": r, **cls})
    return out


def reserved_groups(records: list[dict], taken: set[str]) -> dict[str, list[dict]]:
    """The classes with :data:`MIN_ROWS` reserved rows whose compute capability no other fit covers
    (``taken``: group names already fitted)."""
    covered = {name.split("/")[0] for name in taken}
    by: dict[str, list[dict]] = defaultdict(list)
    for row in reserved_rows(records):
        by[row["group"]].append(row)
    return {g: rows for g, rows in sorted(by.items()) if len(rows) >= MIN_ROWS and g.split("/")[0] not in covered}


def fit_reserved_group(rows: list[dict]) -> dict[str, Any]:
    """The coefficients of one class from its reserved rows (module docstring)."""
    import numpy as np

    from ..bands import DEFAULT_ERROR_BAND, ErrorBands
    from ..estimator.corrections import DEFAULT_CORRECTIONS, corrections_from
    from . import published as pub
    from .fitting import FORMAT_VERSION, band_of, quoted_workspace, relative_stats

    q = DEFAULT_CORRECTIONS
    raw = [pub.estimate_record(r["record"], q) for r in rows]
    a = np.array([bd.peak_allocated_bytes for bd in raw], dtype=float)
    m = np.array([r["record"]["measured_bytes"] for r in rows], dtype=float)
    slope = float(np.dot(a, m) / np.dot(a, a))
    f, pred = slope - 1, slope * a
    stderr = float(np.sqrt(np.sum((m - pred) ** 2) / max(len(rows) - 1, 1) / np.dot(a, a)))
    gpus = sorted({r["gpu"] for r in rows})
    coef: dict[str, Any] = {
        "source": "published-reserved", "runs": len(rows),
        "fitted_on": f"{len(rows)} published runs (max_memory_reserved only; {', '.join(gpus)}; "
                     f"{', '.join(sorted({r['group'] for r in rows}))})",
        "workspace_bytes": quoted_workspace(rows[0]["cc"]), "allocated_rounding": 0.0,
        "fragmentation": round(f, 6), "fragmentation_fixed_bytes": 0,
        "cuda_context_bytes": q.cuda_context_bytes, "nccl_bytes": q.nccl_bytes,
        "residuals": {"peak_reserved_bytes.from_estimated_allocated": relative_stats(m / pred - 1)},
        "terms": {
            "fragmentation": {"fitted": True, "stderr": round(stderr, 6),
                              "what": "the caching allocator's slack per allocated byte (measured reserved / "
                                      "estimated allocated - 1; the estimate's own error in it)"},
            "fragmentation_fixed_bytes": {"fitted": False, "what": "0: not separable from the slope on rows near "
                                                                   "the card's capacity"},
            "cuda_context_bytes": {"fitted": False, "what": "published figure: no row measured the device total"},
            "workspace_bytes": {"fitted": False, "what": "cuBLAS workspaces, published figure (in allocated)"},
            "nccl_bytes": {"fitted": False, "what": "per process on several GPUs, published figure"},
            "cudnn_workspace": {"fitted": False, "what": "not modelled (no convolutions in a decoder LLM)"},
            "expandable_segments": {"fitted": False, "what": "every row ran with the default (off): not fitted"},
        },
    }
    fitted = corrections_from({"vramplan_coefficients": FORMAT_VERSION, "groups": {"fit": coef}}, None, "fit",
                              group="fit")
    reserved, device, resident = [], [], []
    for r in rows:
        bd = pub.estimate_record(r["record"], fitted)
        measured = r["record"]["measured_bytes"]
        reserved.append(measured / bd.peak_reserved_bytes - 1)
        beyond = bd.device_total_bytes - bd.peak_reserved_bytes  # the quoted context (and NCCL): not measured
        device.append((measured + beyond) / bd.device_total_bytes - 1)
        resident.append(is_resident(r["record"].get("setup") or {}))
    basis = "published rows, measured reserved / calibrated estimate - 1"

    def bands_of(keep: list[bool], which: str) -> ErrorBands:
        res = [e for e, k in zip(reserved, keep, strict=True) if k]
        dev = [e for e, k in zip(device, keep, strict=True) if k]
        return ErrorBands(tensor_peak_bytes=DEFAULT_ERROR_BAND, peak_allocated_bytes=DEFAULT_ERROR_BAND,
                          peak_reserved_bytes=band_of(res, f"{basis}, {len(res)} {which}"),
                          device_total_bytes=band_of(dev, f"{basis} plus the quoted CUDA context, {len(dev)} {which}"))

    coef["error_bands"] = bands_of([True] * len(rows), "rows").to_json()
    coef["error_band"] = coef["error_bands"]["device_total_bytes"]["high"]
    if sum(resident) >= MIN_ROWS and not all(resident):  # a setup without CPU offload: the rows without it
        coef["error_bands_resident"] = bands_of(resident, "rows without CPU offload").to_json()
    return coef


def is_resident(setup: dict) -> bool:
    """A setup (a record's, or ``Setup.to_dict``'s) whose parameters and optimizer states stay on the GPU: no
    DeepSpeed or FSDP CPU/NVMe offload. FSDP's CPU offload moves every gradient and parameter between host and
    device each step, and its rows reserve more beyond the estimate than the resident ones (issue 28: the
    RTX 4090 rows, +19.6 % at most with it, +9.6 % without)."""
    from ..estimator.corrections import resident

    return resident(setup.get("offload_optimizer", "none"), setup.get("offload_params", "none"))
