"""Fixed device overheads and allocator behaviour: explicit, named inputs of the estimator.

``DEFAULT_CORRECTIONS`` are published figures (the raw model, ``--no-calibration``);
``vramplan calibrate`` fits the device terms the real-GPU rows support (``calibration/coefficients.json``,
shipped as ``vramplan/profile_data/coefficients.json``) and :func:`load_calibrated` /
:func:`calibration_for` read them back. Nothing here is a hidden multiplier: each term appears as
its own component of the Breakdown. Reading the coefficients is one small JSON file (no torch, no
package metadata), cached per path.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..bands import CalibrationInfo, ErrorBand, ErrorBands
from ..specs import SpecError
from ..util.units import MiB


@dataclass(frozen=True)
class Corrections:
    #: CUDA context with lazy module loading (default since CUDA 11.7 / torch 1.13): 300-500 MB
    #: reported for A100/H100 in the PyTorch forums and NVIDIA's lazy-loading notes; take the top.
    cuda_context_bytes: int = 500 * MiB
    #: cuBLAS(Lt) workspace per handle: 8 MiB before Hopper, 32 MiB on sm90+ (torch's
    #: CUBLAS_WORKSPACE_CONFIG default); forward and the autograd thread each hold one.
    cublas_workspace_bytes: int = 8 * MiB
    cublas_workspace_bytes_sm90: int = 32 * MiB
    cublas_handles: int = 2
    #: Caching-allocator slack: reserved / allocated - 1 at the peak. Typical 2-10 % for a
    #: training step (torchtune and HF issues); 5 % until calibration measures it per GPU.
    allocator_fragmentation: float = 0.05
    #: NCCL communicator buffers per process when more than one GPU is used.
    nccl_bytes: int = 600 * MiB
    #: Measured by ``vramplan calibrate`` (0 in the published defaults): allocated bytes per
    #: tensor byte beyond 1 (the allocator's 512-byte rounding), and a fixed part of the slack.
    allocated_rounding: float = 0.0
    reserved_fixed_bytes: int = 0
    #: Error band of each headline number from calibration residuals (None: uncalibrated, the
    #: estimate carries the documented default band).
    bands: ErrorBands | None = None
    #: The same from the rows without CPU offload, where enough of them exist (calibration/reserved_fit.py):
    #: the band of a setup whose parameters and optimizer states stay on the GPU (:func:`bands_for`)
    bands_resident: ErrorBands | None = None
    #: What was applied (None: the published defaults).
    calibration: CalibrationInfo | None = None
    name: str = "published-defaults"


DEFAULT_CORRECTIONS = Corrections()


def resident(offload_optimizer: str, offload_params: str) -> bool:
    """Parameters and optimizer states stay on the GPU: no DeepSpeed or FSDP CPU/NVMe offload."""
    return offload_optimizer == "none" and offload_params == "none"


def bands_for(corrections: Corrections, setup) -> ErrorBands | None:
    """The error bands of ``setup``'s estimate: the resident rows' (:func:`resident`) when the calibration has
    them, else every row's (None: uncalibrated)."""
    if corrections.bands_resident and resident(setup.offload_optimizer, setup.offload_params):
        return corrections.bands_resident
    return corrections.bands


def device_overheads(tensor_peak_bytes: int, gpus: int, gpu, corrections: Corrections = DEFAULT_CORRECTIONS):
    """From a tensor peak to the three device-level numbers, with the overhead components.

    Returns ``(allocated, reserved, device_total, components)`` where components is a list of
    (name, bytes, note): cuBLAS workspaces count in ``max_memory_allocated``; the caching
    allocator's slack in ``max_memory_reserved``; the CUDA context and NCCL only in nvidia-smi.
    Shared by the analytic and the traced tier, so both judge a fit the same way.
    """
    sm90 = gpu is not None and gpu.compute_capability is not None and float(gpu.compute_capability) >= 9.0
    ws = corrections.cublas_handles * (corrections.cublas_workspace_bytes_sm90 if sm90
                                       else corrections.cublas_workspace_bytes)
    allocated = int(tensor_peak_bytes * (1 + corrections.allocated_rounding)) + ws
    reserved = int(allocated * (1 + corrections.allocator_fragmentation)) + corrections.reserved_fixed_bytes
    nccl = corrections.nccl_bytes if gpus > 1 else 0
    device_total = reserved + corrections.cuda_context_bytes + nccl
    components = [
        ("cublas_workspace", ws, ""),
        ("allocator_overhead", reserved - allocated, _slack_note(corrections)),
        ("cuda_context", corrections.cuda_context_bytes, ""),
    ]
    if nccl:
        components.append(("nccl", nccl, ""))
    return allocated, reserved, device_total, components


def _slack_note(c: Corrections) -> str:
    fixed = f" + {c.reserved_fixed_bytes / 2**30:.2f} GiB" if c.reserved_fixed_bytes else ""
    fitted = " (calibrated)" if c.calibration is not None else ""
    return f"{c.allocator_fragmentation:.1%} of allocated{fixed}{fitted}"


#: The coefficients a source checkout commits (``vramplan calibrate`` writes them); a copy of
#: them ships in the package (:data:`SHIPPED`). A local file here overrides the shipped one.
LOCAL_COEFFICIENTS = Path("calibration") / "coefficients.json"
#: Format versions of coefficients.json this reader understands.
FORMATS = (1, 2)


def shipped_coefficients() -> Path:
    """The coefficients inside the package (``profiles/coefficients.json`` in a checkout)."""
    from importlib import resources

    return Path(str(resources.files("vramplan.profile_data") / "coefficients.json"))


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> dict:
    from ..util.numbers import check_numbers

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SpecError(f"calibration file {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise SpecError(f"calibration file {path}: not valid JSON ({exc})") from None
    check_numbers(data, f"calibration file {path}")
    if not isinstance(data, dict) or data.get("vramplan_coefficients") not in FORMATS \
            or not isinstance(data.get("groups"), dict):
        raise SpecError(f"calibration file {path}: not a vramplan coefficients file (run `vramplan calibrate`)")
    return data


def read_coefficients(path: str | Path) -> dict:
    """The parsed coefficients file; SpecError (one line) when it cannot be read or is not one."""
    p = Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError as exc:
        raise SpecError(f"calibration file {p}: {exc.strerror or exc}") from None
    return _read(str(p), mtime)


def _group_name(groups: dict, gpu) -> tuple[str | None, bool]:
    """The group for ``gpu``: its GPU class (compute capability), the one with the most runs among
    several torch versions; None when its class has no fit, or no GPU is given. A fit is not
    carried to another class: the published A100 fit comes from 80 GB cards, whose allocator keeps
    slack a smaller card under pressure gives back (docs/commands/estimate.md). The installed
    torch is not read: a plan is for the machine it will run on, and reading it costs the
    estimate path. ``pooled`` is read only by an explicit ``group="pooled"``."""
    cc = str(getattr(gpu, "compute_capability", None) or "").replace(".", "")
    if cc:
        own = sorted((k for k in groups if k.startswith(f"sm{cc}/")), key=lambda k: (-groups[k].get("runs", 0), k))
        if own:
            return own[0], True
    return None, False


def corrections_from(data: dict, gpu=None, source: str = "shipped", group: str | None = None) -> Corrections | None:
    """The Corrections a coefficients mapping gives ``gpu`` (or the named ``group``); None when
    nothing was fitted for its class."""
    groups = data.get("groups") or {}
    name, match = (group, False) if group is not None and group in groups else _group_name(groups, gpu)
    if name is None:
        return None
    g = groups[name]
    try:
        ws = max(0, int(g["workspace_bytes"]))
        bands = ErrorBands.from_json(g["error_bands"]) if isinstance(g.get("error_bands"), dict) else None
        if bands is None and g.get("error_band") is not None:  # format 1: one symmetric band of device_total
            b = float(g["error_band"])
            bands = ErrorBands(device_total_bytes=ErrorBand(-b, b, int(g.get("runs", 0)), "format-1 symmetric band"))
        terms = g.get("terms") or {}
        info = CalibrationInfo(
            source=source, group=name, fitted_on=str(g.get("fitted_on") or f"{g.get('runs', 0)} CUDA runs"),
            version=f"{data['vramplan_coefficients']}/{data.get('fit_id', 'unversioned')}",
            fitted=tuple(sorted(k for k, t in terms.items() if t.get("fitted"))),
            quoted=tuple(sorted(k for k, t in terms.items() if not t.get("fitted"))),
            gpu_class_match=match)
        return Corrections(
            cuda_context_bytes=int(g["cuda_context_bytes"]),
            cublas_workspace_bytes=ws, cublas_workspace_bytes_sm90=ws, cublas_handles=1,
            allocator_fragmentation=float(g["fragmentation"]),
            allocated_rounding=float(g["allocated_rounding"]),
            reserved_fixed_bytes=int(g["fragmentation_fixed_bytes"]),
            nccl_bytes=int(g.get("nccl_bytes", DEFAULT_CORRECTIONS.nccl_bytes)),
            bands=bands, calibration=info, name=f"calibrated:{name}",
            bands_resident=(ErrorBands.from_json(g["error_bands_resident"])
                            if isinstance(g.get("error_bands_resident"), dict) else None),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"calibration file {source}: group {name!r} lacks a valid {exc}") from None


def load_calibrated(gpu=None, path=None) -> Corrections | None:
    """The corrections ``vramplan calibrate`` fitted (``path``, else the local
    ``calibration/coefficients.json``, else the shipped ones) for ``gpu``'s class; None when the
    file is missing, unreadable, or fitted nothing for that class. Pass the result as
    ``estimate(..., corrections=...)``; its bands become the Breakdown's."""
    file = Path(path) if path is not None else (LOCAL_COEFFICIENTS if LOCAL_COEFFICIENTS.is_file()
                                                  else shipped_coefficients())
    try:
        return corrections_from(read_coefficients(file), gpu, str(file))
    except SpecError:
        return None


def calibration_for(gpu=None, path=None, enabled: bool = True) -> tuple[Corrections, list[str]]:
    """What the commands apply: (corrections, warnings).

    ``enabled`` False: the published defaults (the raw model). ``path`` given: that file, and a
    file that cannot be read or is not a coefficients file is an error (SpecError). Otherwise the
    local ``calibration/coefficients.json`` when there is one (a corrupt one is a warning, and the
    shipped coefficients apply), else the shipped ones; a GPU class with no fit gets the
    published defaults (calibration None). ``gpu``: a GpuSpec or what ``--gpu`` takes (a shipped
    name or alias: ``"rtx-4090"``)."""
    if not enabled:
        return DEFAULT_CORRECTIONS, []
    if isinstance(gpu, str):  # a name's class, not silently none (the card's compute capability picks the group)
        from ..setup.inputs import resolve_gpu

        gpu = resolve_gpu(gpu)
    warnings: list[str] = []
    if path is not None:
        found = corrections_from(read_coefficients(path), gpu, str(path))
        return found or DEFAULT_CORRECTIONS, warnings
    if LOCAL_COEFFICIENTS.is_file():
        try:
            found = corrections_from(read_coefficients(LOCAL_COEFFICIENTS), gpu, str(LOCAL_COEFFICIENTS))
            return found or DEFAULT_CORRECTIONS, warnings
        except SpecError as exc:
            warnings.append(f"{exc}; using the shipped coefficients")
    try:
        found = corrections_from(read_coefficients(shipped_coefficients()), gpu, "shipped")
    except SpecError as exc:
        warnings.append(f"{exc}; using the published defaults (uncalibrated)")
        found = None
    return found or DEFAULT_CORRECTIONS, warnings


def uncalibrated_reason(gpu=None, path=None, enabled: bool = True) -> str:
    """Why :func:`calibration_for` (same arguments) applied no calibration, in a few words: the
    flag, no GPU, no readable coefficients file, or no fit for the GPU's class (naming the classes
    the file fitted: a fit is not carried to another class, :func:`_group_name`)."""
    if not enabled:
        return "--no-calibration"
    if gpu is None:
        return "no --gpu: coefficients are fitted per GPU class"
    if path is not None:
        file = Path(path)
    else:
        file = LOCAL_COEFFICIENTS if LOCAL_COEFFICIENTS.is_file() else shipped_coefficients()
    try:
        groups = read_coefficients(file).get("groups") or {}
    except SpecError:
        return f"no readable coefficients file ({file})"
    fitted = sorted({k.split("/")[0] for k in groups if k != "pooled"})
    cc = str(getattr(gpu, "compute_capability", None) or "").replace(".", "")
    fits = f"{file} fits {', '.join(fitted) or 'no class'}"
    if not cc:
        return f"{gpu.display_name} has no GPU class (compute capability) to pick a fit by; {fits}"
    return f"no fit for {gpu.display_name}'s class sm{cc}; {fits}, and a fit is not carried to another class"
