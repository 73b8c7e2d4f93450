"""Memory and speed of one setup for one target, with the caches a search needs.

:class:`Evaluator` holds a search's caches: the estimates it ran, the setups that failed (kept
for the why-not lines) and, per setup but its rank, the lowest rank known to fail.
Memory is :func:`vramplan.estimator.estimate` only (never a formula of its own); speed is
:mod:`vramplan.cost.model`; both under the target's library stack (``Target.stack``).
"""

from __future__ import annotations

from ..cost import model as cost
from ..cost import objectives as cost_objectives
from ..estimator import estimate
from ..estimator.cache import memoized
from ..estimator.vllm_share import vllm_share
from ..specs import Breakdown, ModelSpec, Setup
from .geometry import BatchShape, Target
from .space import family_key, rank_key
from .verdicts import Candidate, Misfit

#: Relative error assumed for an estimate until calibration provides ``Breakdown.error_band``
#: (the accuracy bar ``vramplan validate`` holds the estimator to).
DEFAULT_ERROR_BAND = 0.05
#: Bytes kept free beyond the high end of the error band for the caching allocator: blocks split
#: and cached across steps that the estimate's allocator_overhead (a share of what is allocated)
#: does not see in a long run. A judgement value until measurements calibrate it.
ALLOCATOR_ALLOWANCE_BYTES = 256 * 2**20
#: Share of host RAM offloaded state may take (the OS, the dataloader and the Python process need
#: the rest).
HOST_RAM_SHARE = 0.85

_NO_RANK = 1 << 30


class Evaluator:
    """Judges setups of ``model`` on ``target``: fits with margins (``strict``; False: anything
    under the usable memory fits, and such plans are tight), or why not. ``band`` None: each
    estimate's own band, or the default.

    **Fit** (strict): the high end of the estimate's error band plus the allocator allowance is
    within the usable memory, and the headroom is at least ``target.margin`` of it::

        device_total * (1 + band) + ALLOCATOR_ALLOWANCE_BYTES <= usable
        device_total <= usable * (1 - margin)
    """

    def __init__(self, model: ModelSpec, target: Target, shape: BatchShape, band: float | None,
                 strict: bool = True):
        self.model, self.target, self.shape = model, target, shape
        self.band, self.strict = band, strict
        self.cache: dict[Setup, Breakdown] = {}
        self.failures: list[Candidate] = []  # estimated setups that did not fit
        self.fail_rank: dict[tuple, int] = {}  # setup but its rank -> lowest rank known to fail
        self._counts: dict[tuple, cost.Counts] = {}
        self._steps: dict[Setup, cost.StepCost] = {}

    # -- memory and speed -----------------------------------------------------------------------

    def estimate(self, setup: Setup) -> Breakdown:
        bd = self.cache.get(setup)
        if bd is None:
            bd = estimate(self.model, setup, self.target.gpu, self.target.corrections, self.target.stack)
            self.cache[setup] = bd
        return bd

    def counts(self, setup: Setup) -> cost.Counts:
        key = family_key(setup) + (setup.lora_targets, setup.double_quant)
        k = self._counts.get(key)
        if k is None:
            k = self._counts[key] = cost.counts(self.model, setup, self.target.stack)
        return k

    def step(self, setup: Setup) -> cost.StepCost:
        # DPO/GRPO: the policy's rows plus the reference forward and generation (vramplan/cost/objectives.py)
        c = self._steps.get(setup)
        if c is None:
            c = self._steps[setup] = cost_objectives.step_cost(self.model, setup, self.target.gpu, self.target.nodes,
                                                               self.counts(setup))
        return c

    def band_of(self, bd: Breakdown) -> float:
        """The one place the search reads an estimate's error band."""
        if self.band is not None:
            return self.band
        # the high end of the device total's band (calibrated, or the documented default)
        return bd.error_band.device_total_bytes.high if bd.error_band is not None else DEFAULT_ERROR_BAND

    def limits(self, bd: Breakdown) -> tuple[float, float]:
        """(largest device total within the error band and allocator allowance, largest one that
        leaves the headroom margin), in bytes."""
        usable = self.target.gpu.usable_memory_bytes
        return ((usable - ALLOCATOR_ALLOWANCE_BYTES) / (1 + self.band_of(bd)), usable * (1 - self.target.margin))

    def limit(self, bd: Breakdown) -> float:
        """The largest device total that fits (strict: both margins; else the usable memory)."""
        return min(self.limits(bd)) if self.strict else self.target.gpu.usable_memory_bytes

    def host_need(self, setup: Setup, bd: Breakdown) -> int:
        """Host RAM per node the offloaded state needs: ``Breakdown.host_bytes`` per GPU, CPU offload's
        state, activation offloading's pinned copies and, under NVMe offload, the pinned buffers
        ZeRO-Infinity keeps in host RAM (the state on NVMe is not host RAM: estimator/distributed.py)."""
        return bd.host_bytes * (self.target.gpus // self.target.nodes)

    def speed_bound(self, setup: Setup) -> float:
        """Tokens/s of ``setup`` at the largest allowed micro-batch: an upper bound on its speed."""
        return self.step(self.at_micro(setup, self.shape.micro_batches[-1])).tokens_per_s

    def at_micro(self, setup: Setup, micro: int) -> Setup:
        return _at_micro(setup, micro, self.shape.grad_accum(micro))

    # -- the verdict ----------------------------------------------------------------------------

    def misfit(self, setup: Setup, bd: Breakdown) -> Misfit | None:
        """Why ``setup`` (estimated as ``bd``) does not fit the target, or None when it does."""
        usable = self.target.gpu.usable_memory_bytes
        total = bd.device_total_bytes
        if setup.objective == "grpo" and setup.generation == "vllm-colocate":
            share = vllm_share(self.model, setup, self.target.gpu)  # vLLM starts only if one sequence fits its cache
            if not share.starts:
                return Misfit("vllm", share.non_kv_bytes + share.kv_per_seq_bytes, share.share_bytes)
        if total > usable:
            return Misfit("gpu", total, usable)
        if self.strict:
            band_limit, margin_limit = self.limits(bd)
            if total > band_limit:
                return Misfit("error_band", total, usable, band=self.band_of(bd), allowance=ALLOCATOR_ALLOWANCE_BYTES)
            if total > margin_limit:
                return Misfit("headroom", total, usable, margin=self.target.margin)
        host = self.host_need(setup, bd)
        ram = self.target.host_ram_bytes
        if ram is not None and host > ram * HOST_RAM_SHARE:
            return Misfit("host_ram", host, ram * HOST_RAM_SHARE)
        return None

    def judge(self, setup: Setup) -> Candidate:
        """Estimate ``setup`` and say whether it fits (failures are kept for the why-not lines).

        Memory grows with the LoRA rank, so a setup that fails at rank r fails at every higher
        rank: such setups are answered without an estimate (``breakdown`` None)."""
        key = rank_key(setup) if setup.adapters else None
        if key is not None and setup.lora_rank >= self.fail_rank.get(key, _NO_RANK):
            return Candidate(setup, None, self.step(setup), Misfit("lower_rank", rank=self.fail_rank[key]))
        bd = self.estimate(setup)
        misfit = self.misfit(setup, bd)
        c = Candidate(setup, bd, self.step(setup), misfit)
        if misfit is not None:
            self.failures.append(c)
            if key is not None:
                self.fail_rank[key] = min(setup.lora_rank, self.fail_rank.get(key, _NO_RANK))
        return c


@memoized(typed=0)
def _at_micro(setup: Setup, micro: int, grad_accum: int) -> Setup:
    """``setup`` at micro-batch ``micro`` (a search asks for the same ones again on every card: kept per value)."""
    return setup.replace(batch=micro, grad_accum=grad_accum)
