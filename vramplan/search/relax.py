""""What would fit": when nothing fits, the search again under relaxed targets (more GPUs of the
card, a bigger shipped card, a shorter sequence, NVMe offload, more host RAM, the fixed knobs
dropped), each answer a typed :class:`Relaxation` (its words: :func:`vramplan.search.explain.relaxation_note`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..specs import Breakdown, GpuSpec, ModelSpec, Setup, SpecError
from .core import Search
from .evaluate import HOST_RAM_SHARE, Evaluator
from .geometry import BatchShape, Target, batch_shape, retarget
from .verdicts import Candidate

#: The relaxed target a line is about; ``nothing``: none of them fits.
RelaxKind = Literal["more_gpus", "bigger_card", "shorter_seq", "nvme", "host_ram", "unpinned", "nothing"]
#: The most GPUs of the card tried.
MAX_GPUS = 64
#: Sequences are halved down to this many tokens.
MIN_SEQ = 128
#: A tight plan's longest sequence that fits with the margins is a multiple of this many tokens.
SEQ_STEP = 256
#: Fixed knobs that do not change what fits (never reported as "without the fixed ...").
NOT_PINNING = ("lora_alpha", "lora_dropout", "lora_targets", "double_quant", "loss")


@dataclass(frozen=True)
class Relaxation:
    """A relaxed target under which ``candidate`` fits. ``gpu``: the card (``more_gpus``: the
    target's, ``bigger_card``: the bigger one); ``gpus``, ``seq``, ``host_ram_bytes``: the relaxed
    number; ``unpinned``: the fixed knobs dropped."""

    kind: RelaxKind
    candidate: Candidate | None = None
    gpu: GpuSpec | None = None
    gpus: int = 0
    seq: int = 0
    host_ram_bytes: float = 0
    unpinned: tuple[str, ...] = ()


def fit_and_floor(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any],
                  band: float | None, ranks: tuple[int, ...] | None = None) -> tuple[Candidate | None, float]:
    """The chosen candidate under a relaxed target (None if nothing fits), and the least GPU memory
    any setup there needs (host-RAM failures aside; infinite when nothing was estimated)."""
    try:
        result = Search(spec, target, shape, fixed, band, ranks=ranks).run()
    except SpecError:
        return None, math.inf
    floor = result.gpu_floor()
    return result.choose(), math.inf if floor is None else floor


def first_fit(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any],
              band: float | None, ranks: tuple[int, ...] | None = None) -> Candidate | None:
    """The candidate a plan would choose under ``target`` (None if nothing fits)."""
    return fit_and_floor(spec, target, shape, fixed, band, ranks)[0]


def more_host_ram(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any], band: float | None,
                  ranks: tuple[int, ...] | None = None) -> list[Relaxation]:
    """Host RAM unchecked: the plan chosen there and, when NVMe is allowed and the offload is not
    fixed, the plan with both offloads on NVMe when it needs under half its host RAM (ZeRO-Infinity
    pins buffers where CPU offload holds the whole state)."""
    unchecked = dataclasses.replace(target, host_ram_bytes=None, host_ram_source="unchecked")
    c = first_fit(spec, unchecked, shape, fixed, band, ranks)
    if c is None:
        return []
    ev = Evaluator(spec, target, shape, band)
    need = ev.host_need(c.setup, c.breakdown)
    out = [Relaxation("host_ram", c, host_ram_bytes=need / HOST_RAM_SHARE)]
    placement = {"zero_stage", "offload_optimizer", "offload_params", "fsdp"}
    if target.nvme and not placement & fixed.keys() and "nvme" not in (c.setup.offload_optimizer,
                                                                          c.setup.offload_params):
        on_nvme = {**fixed, "zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}
        n = first_fit(spec, unchecked, shape, on_nvme, band, ranks)
        if n is not None and ev.host_need(n.setup, n.breakdown) < need / 2:
            out.append(Relaxation("host_ram", n, host_ram_bytes=ev.host_need(n.setup, n.breakdown) / HOST_RAM_SHARE))
    return out


def what_would(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any], band: float | None,
               global_batch: int | None, gpu_floor: float, ranks: tuple[int, ...] | None = None) -> list[Relaxation]:
    """Re-run the search under relaxed constraints and say what would fit.

    ``global_batch``: the global batch in sequences (None: free); ``gpu_floor``: the least GPU
    memory any setup respecting host RAM needs on the target (host need does not depend on the
    card, and a placement's floor is its smallest setup, so no card below it can fit)."""
    out: list[Relaxation] = []
    gb, seq = global_batch, shape.seq
    # more GPUs of the same card; ZeRO-3 memory per GPU is a + b/n, so two counts give the limit a:
    # once even infinitely many GPUs would not fit, stop
    n, floors = target.gpus, {target.gpus: gpu_floor}
    while n < MAX_GPUS:
        n *= 2
        if gb is not None and gb % n:
            continue
        try:
            s = batch_shape(seq, n, gb, None, fixed.get("batch") if gb is None else None, None)
        except SpecError:
            continue
        nodes = target.nodes if n % target.nodes == 0 else 1
        c, floors[n] = fit_and_floor(spec, retarget(target, gpus=n, nodes=nodes), s,
                                     {k: v for k, v in fixed.items() if k != "grad_accum"}, band, ranks)
        if c is not None:
            out.append(Relaxation("more_gpus", c, gpu=target.gpu, gpus=n))
            break
        # (from 2 GPUs up, where ZeRO-3 is among the placements on both sides)
        if n // 2 >= 2 and n // 2 in floors and 2 * floors[n] - floors[n // 2] > target.gpu.usable_memory_bytes:
            break
    # a bigger card
    from ..model.profiles import gpus as shipped

    for card in sorted(shipped(), key=lambda g: g.usable_memory_bytes):
        # skip cards below the floor (10 % slack: the device overheads may differ per card)
        if card.usable_memory_bytes <= max(target.gpu.usable_memory_bytes, 0.9 * gpu_floor):
            continue
        c = first_fit(spec, retarget(target, gpu=card), shape, fixed, band, ranks)
        if c is not None:
            out.append(Relaxation("bigger_card", c, gpu=card))
            break
    # a shorter sequence
    short = seq // 2
    while short >= MIN_SEQ:
        try:
            s = batch_shape(short, target.gpus, gb, None, fixed.get("batch"), fixed.get("grad_accum"))
        except SpecError:
            break
        c = first_fit(spec, target, s, fixed, band, ranks)
        if c is not None:
            out.append(Relaxation("shorter_seq", c, seq=short))
            break
        short //= 2
    # offload the knobs the target ruled out
    if not target.nvme:
        c = first_fit(spec, dataclasses.replace(target, nvme=True), shape, fixed, band, ranks)
        if c is not None:
            out.append(Relaxation("nvme", c))
    if target.host_ram_bytes is not None:
        out += more_host_ram(spec, target, shape, fixed, band, ranks)
    pinned = tuple(k for k in fixed if k not in NOT_PINNING)
    if pinned:
        c = first_fit(spec, target, shape, {k: v for k, v in fixed.items() if k not in pinned}, band,
                      None if "lora_rank" in pinned else ranks)
        if c is not None:
            out.append(Relaxation("unpinned", c, unpinned=pinned))
    if not out:
        out.append(Relaxation("nothing"))
    return out


def longest_seq(ev: Evaluator, setup: Setup) -> tuple[int, Breakdown | None, int, Breakdown | None]:
    """For a tight plan's ``setup``: the longest sequence below its own (a multiple of :data:`SEQ_STEP`,
    at least :data:`MIN_SEQ`) at which the same setup fits with both margins, and the longest at which it
    keeps the headroom margin alone, each with its estimate (0, None: none does). Bisection: memory grows
    with the sequence."""

    def longest(ok: Callable[[Breakdown], bool]) -> tuple[int, Breakdown | None]:
        best: tuple[int, Breakdown | None] = (0, None)
        bd = ev.estimate(dataclasses.replace(setup, seq=MIN_SEQ))
        if not ok(bd):
            return best
        best = (MIN_SEQ, bd)
        lo, hi = 1, (setup.seq - 1) // SEQ_STEP
        while lo <= hi:
            mid = (lo + hi) // 2
            bd = ev.estimate(dataclasses.replace(setup, seq=mid * SEQ_STEP))
            if ok(bd):
                best, lo = (mid * SEQ_STEP, bd), mid + 1
            else:
                hi = mid - 1
        return best

    both = longest(lambda bd: bd.device_total_bytes <= min(ev.limits(bd)))
    headroom = longest(lambda bd: bd.device_total_bytes <= ev.limits(bd)[1])
    return (*both, *headroom)


def with_margins(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any], band: float | None,
                 ranks: tuple[int, ...] | None = None) -> list[Relaxation]:
    """What fits *with the margins* when the plan is tight: the next shipped card up, and the plan
    without the fixed knobs (the shorter sequence: :func:`longest_seq`, over the chosen setup)."""
    out: list[Relaxation] = []
    from ..model.profiles import gpus as shipped

    for card in sorted(shipped(), key=lambda g: g.usable_memory_bytes):
        if card.usable_memory_bytes <= target.gpu.usable_memory_bytes:
            continue
        c = first_fit(spec, retarget(target, gpu=card), shape, fixed, band, ranks)
        if c is not None:
            out.append(Relaxation("bigger_card", c, gpu=card))
            break
    # the framework stays: the framework notes name the others (explain_framework.py)
    pinned = tuple(k for k in fixed if k not in NOT_PINNING and k != "framework")
    if pinned:
        c = first_fit(spec, target, shape, {k: v for k, v in fixed.items() if k not in pinned}, band,
                      None if "lora_rank" in pinned else ranks)
        if c is not None:
            out.append(Relaxation("unpinned", c, unpinned=pinned))
    return out
