"""The search's typed verdicts: one evaluated setup (:class:`Candidate`) and, when it does not
fit, why (:class:`Misfit`: a kind and its numbers). Code branches on ``Misfit.kind``, never on
words; the words are rendered by :func:`vramplan.search.explain.misfit_text` alone.

A new reason a setup can fail (e.g. a host RAM floor for the weights) is a new ``MisfitKind``,
set where :class:`vramplan.search.evaluate.Evaluator` judges, and one branch of ``misfit_text``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..cost import model as cost
from ..specs import Breakdown, Setup

#: ``gpu``: the device total is over the GPU's usable memory; ``error_band``: it is under it but
#: the high end of the estimate's error band plus the allocator allowance is not; ``headroom``: it
#: leaves less free than the margin kept (``--margin``); ``host_ram``: it fits the GPU but the
#: offloaded state is over the host RAM available; ``lower_rank``: known without an estimate, a
#: lower LoRA rank fails; ``vllm``: GRPO with vLLM colocated, whose share of the card cannot hold its
#: weights, profile peak and one sequence's KV cache (vLLM would refuse to start: estimator/vllm_share.py).
MisfitKind = Literal["gpu", "error_band", "headroom", "host_ram", "lower_rank", "vllm"]


@dataclass(frozen=True)
class Misfit:
    """Why a setup does not fit, with the numbers a line about it names.

    ``need_bytes``/``limit_bytes``: device total and usable GPU memory (``gpu``, ``error_band``,
    ``headroom``), or the host RAM the offload needs and the share of host RAM available
    (``host_ram``), or what vLLM needs to start and its share of the card (``vllm``). ``band`` and
    ``allowance``: the error band and allocator allowance (``error_band``); ``margin``: the share of
    usable memory kept free (``headroom``); ``rank``: the lowest rank known to fail (``lower_rank``).
    """

    kind: MisfitKind
    need_bytes: float = 0
    limit_bytes: float = 0
    band: float = 0.0
    rank: int = 0
    margin: float = 0.0
    allowance: float = 0.0

    @property
    def on_gpu(self) -> bool:
        """The GPU's memory is what stands in the way (not host RAM)."""
        return self.kind != "host_ram"

    @property
    def tight(self) -> bool:
        """It fits under the usable memory, but not with the margins kept."""
        return self.kind in ("error_band", "headroom")


@dataclass(frozen=True)
class Candidate:
    """One evaluated setup: its estimate, its speed, and why it does not fit (None: it fits)."""

    setup: Setup
    breakdown: Breakdown | None  # None: known not to fit without estimating (Misfit "lower_rank")
    step: cost.StepCost
    misfit: Misfit | None = None

    @property
    def fits(self) -> bool:
        return self.misfit is None

    @property
    def host_ram_bound(self) -> bool:
        """It fits the GPU, and only host RAM stands in the way."""
        return self.misfit is not None and not self.misfit.on_gpu

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s

    @property
    def device_total_bytes(self) -> int:
        return self.breakdown.device_total_bytes
