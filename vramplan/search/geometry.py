"""What a plan must fit (:class:`Target`) and the micro-batches it may pick (:class:`BatchShape`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from ..estimator.corrections import DEFAULT_CORRECTIONS, Corrections
from ..estimator.stack import DEFAULT_STACK, Stack
from ..specs import GpuSpec, SpecError

#: Share of the card's usable memory a plan leaves free by default (``--margin``): room for what no
#: estimate sees (fragmentation over a long run, a longer batch than planned, a library upgrade).
DEFAULT_MARGIN = 0.10
#: Where the host RAM a plan is checked against comes from: ``given`` (--host-ram), ``local``
#: (this machine, which holds the GPU planned for), ``profile`` (the GPU profile's typical host),
#: ``default`` (a GPU given only by its memory: :data:`DEFAULT_HOST_RAM_PER_GPU` per GPU),
#: ``unchecked`` (only a "what would fit" relaxation asks for this).
HostRamSource = Literal["given", "local", "profile", "default", "unchecked"]
#: Host RAM per GPU assumed for a GPU given only by its memory (``--gpu-memory``): a modest desktop.
DEFAULT_HOST_RAM_PER_GPU = 32 * 2**30

#: Without a global batch the micro-batch is free up to this many sequences and tokens.
MAX_FREE_MICRO_BATCH = 64
MAX_FREE_MICRO_TOKENS = 65536


@dataclass(frozen=True)
class Target:
    """What the plan must fit: a GPU (``gpus`` of them over ``nodes``), host RAM per node (and
    where that number comes from), NVMe, and the share of usable memory to leave free; the device
    terms (``corrections``) and library versions (``stack``) its estimates apply."""

    gpu: GpuSpec
    gpus: int = 1
    nodes: int = 1
    host_ram_bytes: int | None = None  # per node; None: not checked
    nvme: bool = False
    margin: float = DEFAULT_MARGIN
    host_ram_source: HostRamSource = "given"
    #: the device terms every estimate of the search uses (the commands pass the calibrated ones)
    corrections: Corrections = DEFAULT_CORRECTIONS
    #: the library versions every estimate and cost of the search models (``--transformers``:
    #: estimator/stack.py; transformers 5 unless told)
    stack: Stack = DEFAULT_STACK

    def __post_init__(self) -> None:
        for name in ("gpus", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer; got {v!r}")
        if self.gpus % self.nodes:
            raise SpecError(f"{self.gpus} GPUs cannot be split evenly over {self.nodes} nodes")
        if self.host_ram_bytes is not None and self.host_ram_bytes <= 0:
            raise SpecError(f"host RAM must be positive; got {self.host_ram_bytes}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 0.9:
            raise SpecError(f"margin must be a share of usable memory in [0, 0.9); got {self.margin!r}")


def typical_host_ram(gpu: GpuSpec, gpus: int, nodes: int) -> tuple[int, HostRamSource]:
    """Host RAM per node of a typical host for ``gpu``: the profile's per-GPU figure times the
    GPUs per node (``profile``), else :data:`DEFAULT_HOST_RAM_PER_GPU` per GPU (``default``)."""
    per_node = max(gpus // max(nodes, 1), 1)
    if gpu.host_ram_per_gpu_bytes:
        return gpu.host_ram_per_gpu_bytes * per_node, "profile"
    return DEFAULT_HOST_RAM_PER_GPU * per_node, "default"


def retarget(target: Target, **changes) -> Target:
    """``target`` with ``changes`` (another card, more GPUs); a host RAM that was the typical host's
    follows the new card and GPU count, one given or read from this machine stays."""
    new = dataclasses.replace(target, **changes)
    if target.host_ram_source in ("profile", "default") and "host_ram_bytes" not in changes:
        ram, source = typical_host_ram(new.gpu, new.gpus, new.nodes)
        new = dataclasses.replace(new, host_ram_bytes=ram, host_ram_source=source)
    return new


@dataclass(frozen=True)
class BatchShape:
    """Micro-batches the search may pick, and the grad accumulation each implies."""

    seq: int
    per_gpu: int | None  # sequences per GPU per optimizer step; None: free
    micro_batches: tuple[int, ...]
    fixed_grad_accum: int | None

    def grad_accum(self, micro: int) -> int:
        if self.per_gpu is not None:
            return self.per_gpu // micro
        return self.fixed_grad_accum or 1


def global_batch_of(seq: int, gpus: int, global_batch: int | None, tokens_per_step: int | None) -> int | None:
    """The global batch in sequences: given, or ``tokens_per_step`` in whole sequences per GPU,
    rounded up (at least the tokens asked for); None when neither is given."""
    if tokens_per_step is not None:
        return math.ceil(tokens_per_step / (seq * gpus)) * gpus
    return global_batch


def batch_shape(seq: int, gpus: int, global_batch: int | None, tokens_per_step: int | None,
                batch: int | None, grad_accum: int | None) -> BatchShape:
    """Resolve ``--global-batch``/``--tokens-per-step`` and fixed ``--batch``/``--grad-accum``."""
    for name, v in (("seq", seq), ("global_batch", global_batch), ("tokens_per_step", tokens_per_step),
                    ("batch", batch), ("grad_accum", grad_accum)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise SpecError(f"{name} must be a positive integer; got {v!r}")
    if global_batch is not None and tokens_per_step is not None:
        raise SpecError("give the global batch in sequences (global_batch) or in tokens (tokens_per_step), not both")
    global_batch = global_batch_of(seq, gpus, global_batch, tokens_per_step)
    if global_batch is None and batch is not None and grad_accum is not None:
        global_batch = batch * grad_accum * gpus
    if global_batch is not None:
        if global_batch % gpus:
            raise SpecError(f"a global batch of {global_batch} sequences cannot be split evenly over {gpus} GPUs")
        per_gpu = global_batch // gpus
        if batch is not None and per_gpu % batch:
            raise SpecError(f"micro-batch {batch} does not divide the {per_gpu} sequences per GPU of the global batch")
        if grad_accum is not None and per_gpu % grad_accum:
            raise SpecError(f"grad accumulation {grad_accum} does not divide the {per_gpu} sequences per GPU")
        if batch is not None and grad_accum is not None and batch * grad_accum != per_gpu:
            raise SpecError(f"micro-batch {batch} x grad accumulation {grad_accum} x {gpus} GPUs "
                            f"is not the global batch {global_batch}")
        if batch is not None:
            micro: tuple[int, ...] = (batch,)
        elif grad_accum is not None:
            micro = (per_gpu // grad_accum,)
        else:
            micro = _divisors(per_gpu)
        return BatchShape(seq, per_gpu, micro, None)
    if batch is not None:
        return BatchShape(seq, None, (batch,), grad_accum)
    cap = max(1, min(MAX_FREE_MICRO_BATCH, MAX_FREE_MICRO_TOKENS // seq))
    micro = tuple(2**i for i in range(cap.bit_length()) if 2**i <= cap)
    return BatchShape(seq, None, micro, grad_accum)


def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))
