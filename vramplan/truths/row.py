"""One estimate-vs-truth comparison, the row every truth returns and ``vramplan validate`` prints."""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import Setup


@dataclass(frozen=True)
class Row:
    """One estimate-vs-truth comparison. ``truth`` names what measured it: ``trace`` (fake
    tensors), ``cpu-run`` (a real CPU step counted by LiveTensorCounter), ``deepspeed-N`` /
    ``fsdp-N`` (N real processes, per rank), ``measured`` (a GPU run). ``knob`` groups rows in the
    validate table; ``quantity`` says which headline number is compared (tensor_peak_bytes unless
    stated). A row whose truth could not run has ``verified=False`` and says ``why``."""

    model: str
    family: str
    setup: Setup
    traced_bytes: int  # the truth's bytes (named for the first truth, the tracer)
    estimated_bytes: int
    traced_phase: str
    estimated_phase: str
    truth: str = "trace"
    knob: str = ""
    quantity: str = "tensor_peak_bytes"
    verified: bool = True
    why: str = ""
    #: the estimate's four headline numbers (tensor peak, allocated, reserved, device total)
    estimate_headline: tuple[int, int, int, int] | None = None

    @property
    def truth_bytes(self) -> int:
        return self.traced_bytes

    @property
    def error(self) -> float:
        return self.estimated_bytes / self.traced_bytes - 1
