"""Frozen dataclasses that flow between the stages: ModelSpec, GpuSpec, Setup, Breakdown.

The model's own classes (ModelSpec, LinearSpec, MoeSpec, FamilyTraits) live in
``vramplan.model.modelspec`` and are re-exported here.

Setup lives in ``vramplan.setup.spec`` and SpecError in ``vramplan.util.errors``; both are re-exported
here. Every field carries its unit in its name where it has one (``*_bytes``, ``*_tflops``).
Validation lives in ``__post_init__`` and raises :class:`SpecError` with a message a user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, final

from .bands import CalibrationInfo, ErrorBands
from .model.modelspec import (
    FamilyTraits,
    LinearSpec,
    MlaDims,
    ModelSpec,
    MoeSpec,
    truncate_config,
)
from .setup.spec import (
    ATTENTIONS,
    DEVICE_MAPS,
    FSDP_MODES,
    GENERATIONS,
    LOSSES,
    METHODS,
    OBJECTIVES,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    PREQUANTIZED,
    QUANT_BITS,
    QUANT_GROUP_SIZES,
    QUANTS,
    REF_MODELS,
    Setup,
)
from .util.errors import SpecError
from .util.units import GiB
from .util.versions import MODELLED

__all__ = [
    "ATTENTIONS", "DEVICE_MAPS", "FSDP_MODES", "GENERATIONS", "LOSSES", "METHODS", "OBJECTIVES", "OFFLOADS",
    "OPTIMIZERS", "PHASES", "PRECISIONS", "PREQUANTIZED", "QUANTS", "QUANT_BITS", "QUANT_GROUP_SIZES", "REF_MODELS",
    "Alternative", "Breakdown", "Component",
    "FamilyTraits", "GpuSpec", "LinearSpec", "MlaDims", "ModelSpec", "MoeSpec", "Note", "NoteKind", "Plan",
    "RankPeak", "RejectKind", "Rejected", "Setup", "SpecError", "truncate_config",
]


PHASES = ("forward", "backward", "optimizer")


# ----------------------------------------------------------------------------------------------
# GPU


@dataclass(frozen=True)
class GpuSpec:
    name: str
    display_name: str
    usable_memory_bytes: int
    bf16: bool = True
    bf16_tflops_dense: float | None = None
    fp16_tflops_dense: float | None = None
    memory_bandwidth_gbps: float | None = None
    host_link_gbps: float | None = None
    interconnect: str | None = None
    interconnect_gbps: float | None = None
    vendor: str = "nvidia"
    architecture: str = ""
    compute_capability: str | None = None
    aliases: tuple[str, ...] = ()
    #: RAM of a typical host per GPU of this class (cloud instance shape or desktop build, named in
    #: ``host_ram_note``): what CPU offload is checked against when the user gives no --host-ram
    host_ram_per_gpu_bytes: int | None = None
    host_ram_note: str = ""
    #: board power (W): what an owned card's electricity costs per hour (cost/prices.py)
    tdp_watts: int | None = None

    def __post_init__(self) -> None:
        if self.usable_memory_bytes <= 0:
            raise SpecError(f"GPU memory must be positive; got {self.usable_memory_bytes}")

    @classmethod
    def custom(cls, memory_bytes: int) -> GpuSpec:
        return cls(name=f"custom-{memory_bytes / GiB:g}gib", display_name=f"custom GPU ({memory_bytes / GiB:.1f} GiB)",
                   usable_memory_bytes=memory_bytes)


# ----------------------------------------------------------------------------------------------
# Breakdown


@dataclass(frozen=True)
class Component:
    """One named memory term. ``phases`` lists the phases it is live in; ``where`` is gpu or host."""

    name: str
    bytes: int
    phases: tuple[str, ...] = PHASES
    where: str = "gpu"
    note: str = ""


@dataclass(frozen=True)
class RankPeak:
    """One GPU's headline numbers when the GPUs of a setup hold different shares (a layer split):
    the decoder layers it holds, its four numbers and the phase of its peak."""

    rank: int
    layers: tuple[int, ...]
    tensor_peak_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    phase: str

    def to_json(self) -> dict:
        return {"rank": self.rank, "layers": list(self.layers), "phase": self.phase,
                "tensor_peak_bytes": self.tensor_peak_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "device_total_bytes": self.device_total_bytes}


@dataclass(frozen=True)
class Breakdown:
    """Memory of one training step per GPU, by component and phase, with four headline numbers.

    - ``tensor_peak_bytes``: live tensors only, what a tensor-level trace measures;
    - ``peak_allocated_bytes``: like ``torch.cuda.max_memory_allocated`` (+ workspaces, rounding);
    - ``peak_reserved_bytes``: like ``torch.cuda.max_memory_reserved``;
    - ``device_total_bytes``: like nvidia-smi (+ CUDA context, NCCL); ``fits`` is judged on it.
    """

    model: str
    setup: Setup
    tier: str  # analytic | traced | measured
    components: tuple[Component, ...]
    phase_peaks_bytes: dict[str, int]
    phase: str
    tensor_peak_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    params_total: int
    params_trainable: int
    host_bytes: int = 0
    gpu: GpuSpec | None = None
    notes: tuple[str, ...] = ()
    #: per headline number, from calibration residuals (the default band when uncalibrated);
    #: None for a Breakdown no band was attached to (the traced tier, plan files read back)
    error_band: ErrorBands | None = None
    calibration: CalibrationInfo | None = None  # what calibration was applied (None: the raw model)
    #: each GPU's numbers when the GPUs differ (a layer split, ``device_map``); () when every GPU
    #: holds the same. The headline numbers and components are then the fullest GPU's.
    per_rank: tuple[RankPeak, ...] = ()

    @property
    def fits(self) -> bool | None:
        if self.gpu is None:
            return None
        return self.device_total_bytes <= self.gpu.usable_memory_bytes

    @property
    def headroom_bytes(self) -> int | None:
        if self.gpu is None:
            return None
        return self.gpu.usable_memory_bytes - self.device_total_bytes

    def component(self, name: str) -> int:
        return sum(c.bytes for c in self.components if c.name == name)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "tier": self.tier,
            "gpu": self.gpu.name if self.gpu else None,
            "gpu_usable_bytes": self.gpu.usable_memory_bytes if self.gpu else None,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "phase": self.phase,
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "host_bytes": self.host_bytes,
            "phase_peaks_bytes": dict(self.phase_peaks_bytes),
            "params_total": self.params_total,
            "params_trainable": self.params_trainable,
            "components": [
                {"name": c.name, "bytes": c.bytes, "phases": list(c.phases), "where": c.where, "note": c.note}
                for c in self.components
            ],
            "setup": self.setup.to_dict(),
            "notes": list(self.notes),
            "error_band": self.error_band.to_json() if self.error_band is not None else None,
            "calibration": self.calibration.to_json() if self.calibration is not None else None,
            # the library versions the analytic formulas are read off (util/versions.py MODELLED); a
            # trace ran on whatever is installed (``vramplan doctor``), so it names none
            "modelled_versions": dict(MODELLED) if self.tier == "analytic" else None,
            # only when the GPUs differ, so the JSON of every other setup is unchanged
            **({"per_rank": [r.to_json() for r in self.per_rank]} if self.per_rank else {}),
        }


# ----------------------------------------------------------------------------------------------
# Plan


#: What a plan note says, for code that branches on it (the words are for people):
#: ``no_fit`` the smallest setup and why it fails; ``gpu_only`` a setup that fits the GPU but not
#: host RAM; ``what_would_fit`` a relaxed target that fits; ``nothing_would_fit`` none does;
#: ``tight`` fits only without the error band as margin; ``quality`` chosen over a faster plan;
#: ``micro_batch`` the largest micro-batch; ``host_ram`` the host RAM offload needs;
#: ``flash_attn`` needs flash-attn; ``duration`` the run's time; ``speed_model`` how speed is
#: modelled; ``estimate`` a note of the estimate; ``text`` a note read back from a plan file;
#: ``lower_tier_faster`` a plan of a lower quality tier is much faster (named, not chosen);
#: ``higher_tier_slower`` a better tier fits but is over search.rank.TIER_SLOWDOWN_MAX slower (passed over);
#: ``offload`` the plan offloads because nothing resident fits; ``host_ram_source`` which host
#: RAM the plan was checked against; DPO/GRPO (search/explain_objectives.py): ``objective_speed`` the
#: step's time by phase, ``generation`` GRPO's engine and vLLM's share, ``reference`` DPO's reference;
#: ``layout`` why the plan took hybrid sharding or TP x FSDP2 (search/explain_parallel.py);
#: ``framework`` another framework trains in VRAM where this plan offloads (search/explain_framework.py).
NoteKind = Literal["no_fit", "gpu_only", "what_would_fit", "nothing_would_fit", "tight", "quality", "micro_batch",
                   "host_ram", "flash_attn", "duration", "speed_model", "estimate", "text", "lower_tier_faster",
                   "offload", "host_ram_source", "objective_speed", "generation", "reference",
                   "higher_tier_slower", "layout", "framework"]

#: What a why-not line says: ``too_big`` a family of a higher tier does not fit; ``needs_offload``
#: it fits only with CPU/NVMe offload (or, on one GPU, a distributed engine) while a resident plan
#: fits; ``tight`` it fits only inside the margins; ``faster_setting`` a faster setting of the
#: chosen family (other savers, the next micro-batch) does not fit; ``too_slow``: it fits but is
#: slower than the plan (tensor parallelism; a better tier over search.rank.TIER_SLOWDOWN_MAX).
RejectKind = Literal["too_big", "needs_offload", "tight", "faster_setting", "too_slow"]


@final
class Note(str):
    """One plan note: the text people read (it is a ``str``), and its :data:`NoteKind` for code.

    Plan files keep the text only, so a note read back from one has kind ``text``."""

    kind: NoteKind

    def __new__(cls, text: str, kind: NoteKind = "text") -> Note:
        note = super().__new__(cls, text)
        note.kind = kind
        return note


@dataclass(frozen=True)
class Rejected:
    """An option the search turned down, and why (``"full fine-tune: needs 129.3 GiB > 23.6 GiB usable"``).

    ``kind`` says what the line is about (None when read back from a plan file, which keeps the
    text); equality ignores it, the reason already says it."""

    setup: Setup
    reason: str
    device_total_bytes: int | None = None
    kind: RejectKind | None = field(default=None, compare=False)
    #: the limit the reason compares ``device_total_bytes`` with (usable GPU memory), and the
    #: misfit's kind ("gpu", "error_band", "headroom", "host_ram"; None: it fits the GPU)
    limit_bytes: float | None = field(default=None, compare=False)
    misfit: str | None = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {"setup": self.setup.to_dict(), "reason": self.reason, "device_total_bytes": self.device_total_bytes,
                "kind": self.kind, "limit_bytes": self.limit_bytes, "misfit": self.misfit}


@dataclass(frozen=True)
class Alternative:
    """A plan that fits but was not chosen: one point of the memory / speed / quality trade-off."""

    setup: Setup
    device_total_bytes: int
    tokens_per_s: float | None = None
    quality: str = ""  # e.g. "full", "lora r=64", "qlora r=16"
    note: str = ""

    def to_json(self) -> dict:
        return {"setup": self.setup.to_dict(), "device_total_bytes": self.device_total_bytes,
                "tokens_per_s": self.tokens_per_s, "quality": self.quality, "note": self.note}


@dataclass(frozen=True)
class Plan:
    """A Setup chosen for a model on a GPU: its Breakdown, estimated speed, the alternatives and the
    rejected options. The plan file (``vramplan.plans.planfile``) is this object as JSON/YAML; ``emit``,
    ``measure`` and ``check`` read it.

    ``model`` is the reference ``load_model`` resolves (HF id, alias, or a config path).
    ``setup.gpus`` is the total number of GPUs; ``nodes`` splits them evenly across machines.
    """

    model: str
    setup: Setup
    breakdown: Breakdown
    gpu: GpuSpec | None = None
    nodes: int = 1
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    alternatives: tuple[Alternative, ...] = ()
    rejected: tuple[Rejected, ...] = ()
    notes: tuple[Note, ...] = ()  # plain strings given are kept as Notes of kind "text"
    recorded_estimate: dict | None = None  # the estimate JSON stored in a loaded plan file
    #: host RAM per node the plan was checked against, and where that number came from: given
    #: (--host-ram), local (this machine), profile (the GPU profile's typical host), default
    host_ram_bytes: int | None = None
    host_ram_source: str | None = None
    #: the transformers version the estimates model when not the default (5: None), as ``--transformers``
    #: gave it (estimator/stack.py); the plan file records it in its breakdown's ``modelled_versions``
    transformers: str | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise SpecError(f"nodes must be a positive integer; got {self.nodes!r}")
        if self.setup.gpus % self.nodes:
            raise SpecError(f"{self.setup.gpus} GPUs cannot be split evenly over {self.nodes} nodes")
        if not all(isinstance(n, Note) for n in self.notes):
            object.__setattr__(self, "notes", tuple(n if isinstance(n, Note) else Note(n) for n in self.notes))

    @property
    def tight(self) -> bool:
        """It fits only without the estimate's error band as margin (a ``tight`` note says so)."""
        return any(n.kind == "tight" for n in self.notes)

    @property
    def fits(self) -> bool | None:
        return self.breakdown.fits

    @property
    def gpus_per_node(self) -> int:
        return self.setup.gpus // self.nodes

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x grad accumulation x data-parallel GPUs (a
        layer split is one process: its GPUs share one micro-batch, as tensor-parallel ones do)."""
        # tensor/context-parallel GPUs share one micro-batch too
        dp = 1 if self.setup.device_map != "none" else self.setup.gpus // (self.setup.tp * self.setup.cp)
        return self.setup.batch * self.setup.grad_accum * dp
