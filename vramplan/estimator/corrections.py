"""Fixed device overheads and allocator behaviour: explicit, named inputs of the estimator.

These are published figures, not fits; ``vramplan calibrate`` (a later issue) replaces them with
coefficients measured on real GPUs. Nothing here is a hidden multiplier: each term appears as its
own component of the Breakdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..units import MiB


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
    #: Relative error band of ``device_total_bytes`` from calibration residuals (None: uncalibrated).
    error_band: float | None = None
    #: Safety margin judged on ``device_total_bytes`` by plan (not by estimate).
    name: str = "published-defaults"


DEFAULT_CORRECTIONS = Corrections()


def device_overheads(tensor_peak_bytes: int, gpus: int, gpu, corrections: Corrections = DEFAULT_CORRECTIONS):
    """From a tensor peak to the three device-level numbers, with the overhead components.

    Returns ``(allocated, reserved, device_total, components)`` where components is a list of
    (name, bytes, note): cuBLAS workspaces count in ``max_memory_allocated``; the caching
    allocator's slack in ``max_memory_reserved``; the CUDA context and NCCL only in nvidia-smi.
    Shared by the analytic and the traced tier, so both judge a fit the same way.
    """
    sm90 = gpu is not None and gpu.compute_capability is not None and float(gpu.compute_capability) >= 9.0
    ws = corrections.cublas_handles * (corrections.cublas_workspace_bytes_sm90 if sm90 else corrections.cublas_workspace_bytes)
    allocated = int(tensor_peak_bytes * (1 + corrections.allocated_rounding)) + ws
    reserved = int(allocated * (1 + corrections.allocator_fragmentation)) + corrections.reserved_fixed_bytes
    nccl = corrections.nccl_bytes if gpus > 1 else 0
    device_total = reserved + corrections.cuda_context_bytes + nccl
    components = [
        ("cublas_workspace", ws, ""),
        ("allocator_overhead", reserved - allocated, f"{corrections.allocator_fragmentation:.0%} of allocated"),
        ("cuda_context", corrections.cuda_context_bytes, ""),
    ]
    if nccl:
        components.append(("nccl", nccl, ""))
    return allocated, reserved, device_total, components


def load_calibrated(gpu=None, path=None) -> Corrections | None:
    """The corrections ``vramplan calibrate`` fitted (``calibration/coefficients.json``, or
    ``path``), for ``gpu``'s family and the installed torch when that group was fitted, else the
    pooled fit; None when there is no coefficients file or nothing was fitted. Pass the result as
    ``estimate(..., corrections=...)``; its ``error_band`` becomes the Breakdown's."""
    import json
    from importlib import metadata
    from pathlib import Path

    file = Path(path) if path is not None else Path("calibration") / "coefficients.json"
    try:
        groups = json.loads(file.read_text())["groups"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        torch_mm = ".".join(metadata.version("torch").split("+")[0].split(".")[:2])
    except metadata.PackageNotFoundError:
        torch_mm = "unknown"
    cc = str(getattr(gpu, "compute_capability", None) or "").replace(".", "")
    candidates = [f"sm{cc}/torch-{torch_mm}", *sorted(k for k in groups if k.startswith(f"sm{cc}/"))] if cc else []
    name = next((c for c in (*candidates, "pooled") if c in groups), None)
    if name is None:
        return None
    g = groups[name]
    ws = max(0, int(g["workspace_bytes"]))
    return Corrections(
        cuda_context_bytes=int(g["cuda_context_bytes"]),
        cublas_workspace_bytes=ws, cublas_workspace_bytes_sm90=ws,
        cublas_handles=1,
        allocator_fragmentation=float(g["fragmentation"]),
        allocated_rounding=float(g["allocated_rounding"]),
        reserved_fixed_bytes=int(g["fragmentation_fixed_bytes"]),
        error_band=float(g["error_band"]),
        name=f"calibrated:{name}",
    )
