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
    #: Safety margin judged on ``device_total_bytes`` by plan (not by estimate).
    name: str = "published-defaults"


DEFAULT_CORRECTIONS = Corrections()
