"""The planner: the fastest Setup that fits a target, the trade-offs around it, and why the others fail.

``plan(model, gpu, **constraints)`` searches every Setup knob the user left free, judging memory
with :func:`vramplan.estimator.estimate` only (never a formula of its own) and speed with
:mod:`vramplan.cost`. The space is not enumerated blindly:

1. **Families** (method x base quantization x LoRA rank) are searched one by one. Each family's
   memory-saving knobs (checkpointing, 8-bit optimizer, ZeRO stage, CPU/NVMe offload, attention)
   form *saver configurations*.
2. **Monotone feasibility**: within one ZeRO stage, turning a saver on never adds memory, so the
   configuration with every saver of that stage is estimated first at micro-batch 1; if it does not
   fit, no configuration of that stage can, and none is expanded.
3. **Branch and bound**: tokens/s never falls as the micro-batch grows (for a fixed global batch
   fewer micro-steps amortise the same work), so a configuration's speed at the largest allowed
   micro-batch bounds it from above, computed from the cost model alone. Configurations are visited
   fastest bound first and the visit stops once the bound is below the family's best found.
4. **Micro-batch**: memory rises with the micro-batch, so the largest fitting one is found by a
   bisection seeded with a linear extrapolation from micro-batches 1 and 2.

**Fit** means ``device_total * (1 + band) <= usable`` where ``band`` is the estimate's calibrated
error band, or :data:`DEFAULT_ERROR_BAND` until calibration exists. Only when nothing fits with
that margin is a plan accepted without it, and then it is marked tight.

**Ranking**: the highest tokens/s wins, except that among plans within :data:`SPEED_TOLERANCE` of
the fastest the highest quality wins (full > LoRA by rank > LoRA on an int8 base > QLoRA by rank,
:func:`quality`); equal quality falls back to speed, then to less memory. So the chosen plan is
never more than ``SPEED_TOLERANCE`` slower than the fastest that fits.

Knobs the search does not vary unless fixed by the user: the loss implementation (``hf``), LoRA
alpha/dropout/targets, double quantization, and optimizers that change the recipe (SGD, Lion,
Adafactor): the search keeps AdamW semantics (fused AdamW or bitsandbytes 8-bit AdamW, which
matches it in quality, Dettmers et al. 2022). Offload uses DeepSpeed's CPU Adam, so it goes with
AdamW only. On a GPU without bf16, full fine-tuning uses fp16 mixed precision and adapters an fp16
base.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

from . import cost
from .checks import check, fsdp_lora_crashes
from .estimator import estimate
from .specs import Alternative, Breakdown, GpuSpec, ModelSpec, Plan, Rejected, Setup, SpecError
from .units import GiB

#: Relative error assumed for an estimate until calibration provides ``Breakdown.error_band``
#: (the accuracy bar ``vramplan validate`` holds the estimator to).
DEFAULT_ERROR_BAND = 0.05
#: Plans within this fraction of the fastest count as equally fast; quality breaks the tie.
SPEED_TOLERANCE = 0.10
#: LoRA ranks the search tries when the rank is free.
LORA_RANKS = (8, 16, 32, 64, 128, 256)
#: Without a global batch the micro-batch is free up to this many sequences and tokens.
MAX_FREE_MICRO_BATCH = 64
MAX_FREE_MICRO_TOKENS = 65536
#: Share of host RAM offloaded state may take (the OS, the dataloader and the Python process need
#: the rest).
HOST_RAM_SHARE = 0.85
#: How many alternatives the plan lists, and at most how many of one method (base included).
MAX_ALTERNATIVES = 8
MAX_PER_METHOD = 3
#: Largest micro-batch probed when reporting "the biggest micro-batch that fits".
MAX_PROBED_MICRO_BATCH = 4096

#: Setup fields a user may fix; everything else of Setup is fixed by the target or the batch.
FIXABLE = ("method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "quant", "double_quant",
           "quant_bits", "quant_group_size",
           "precision", "optimizer", "checkpointing", "attn", "zero_stage", "offload_optimizer",
           "offload_params", "loss", "batch", "grad_accum", "fsdp")


# ----------------------------------------------------------------------------------------------
# quality


def quality(setup: Setup) -> int:
    """Ordinal quality of a method: full > LoRA (higher rank first) > LoRA on an int8 base > QLoRA."""
    if setup.method == "full":
        return 1000
    r = min(setup.lora_rank, 256)
    if setup.quant == "none":
        return 600 + r
    if setup.quant == "int8" or (setup.quant == "gptq" and setup.quant_bits == 8):
        return 300 + r
    return r


def quality_label(setup: Setup) -> str:
    if setup.method == "full":
        return "full"
    if setup.quant == "none":
        return f"lora r={setup.lora_rank}"
    if setup.method == "qlora" and setup.quant == "nf4":
        return f"qlora r={setup.lora_rank}"
    return f"lora r={setup.lora_rank} {setup.quant}"


def method_name(setup: Setup) -> str:
    """How a why-not line names a family: "full fine-tune", "LoRA r=64", "QLoRA r=16"."""
    if setup.method == "full":
        return "full fine-tune"
    if setup.quant == "none":
        return f"LoRA r={setup.lora_rank}"
    if setup.quant in ("nf4", "fp4") and setup.method == "qlora":
        return f"QLoRA r={setup.lora_rank}" + ("" if setup.quant == "nf4" else f" ({setup.quant})")
    return f"LoRA r={setup.lora_rank} on a {setup.quant} base"


def savers_text(setup: Setup) -> str:
    """The memory savers of a setup in words ("checkpointing, 8-bit AdamW, ZeRO-3, CPU offload")."""
    parts = []
    if setup.checkpointing:
        parts.append("checkpointing")
    if setup.optimizer != "adamw-fused":
        parts.append({"adamw-8bit": "8-bit AdamW", "paged-adamw-8bit": "paged 8-bit AdamW"}.get(setup.optimizer,
                                                                                              setup.optimizer))
    if setup.zero_stage:
        parts.append(f"ZeRO-{setup.zero_stage}")
    if setup.fsdp != "none":
        parts.append(f"FSDP {setup.fsdp.upper()}")
    offloaded = [w for w, v in (("optimizer", setup.offload_optimizer), ("params", setup.offload_params)) if v != "none"]
    if offloaded:
        kind = setup.offload_params if setup.offload_params != "none" else setup.offload_optimizer
        parts.append(f"{kind.upper() if kind == 'nvme' else 'CPU'} offload of {' and '.join(offloaded)}")
    if setup.attn != "auto":
        parts.append(f"{setup.attn} attention")
    return ", ".join(parts) or "no memory savers"


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# ----------------------------------------------------------------------------------------------
# the target and the batch


@dataclass(frozen=True)
class Target:
    """What the plan must fit: a GPU (``gpus`` of them over ``nodes``), host RAM, NVMe."""

    gpu: GpuSpec
    gpus: int = 1
    nodes: int = 1
    host_ram_bytes: int | None = None  # None: not checked
    nvme: bool = False

    def __post_init__(self) -> None:
        for name in ("gpus", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer; got {v!r}")
        if self.gpus % self.nodes:
            raise SpecError(f"{self.gpus} GPUs cannot be split evenly over {self.nodes} nodes")
        if self.host_ram_bytes is not None and self.host_ram_bytes <= 0:
            raise SpecError(f"host RAM must be positive; got {self.host_ram_bytes}")


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


def batch_shape(seq: int, gpus: int, global_batch: int | None, tokens_per_step: int | None,
                batch: int | None, grad_accum: int | None) -> BatchShape:
    """Resolve ``--global-batch``/``--tokens-per-step`` and fixed ``--batch``/``--grad-accum``."""
    for name, v in (("seq", seq), ("global_batch", global_batch), ("tokens_per_step", tokens_per_step),
                    ("batch", batch), ("grad_accum", grad_accum)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise SpecError(f"{name} must be a positive integer; got {v!r}")
    if global_batch is not None and tokens_per_step is not None:
        raise SpecError("give the global batch in sequences (global_batch) or in tokens (tokens_per_step), not both")
    if tokens_per_step is not None:
        # whole sequences per GPU, rounded up: at least the tokens asked for
        global_batch = math.ceil(tokens_per_step / (seq * gpus)) * gpus
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


# ----------------------------------------------------------------------------------------------
# candidates


@dataclass(frozen=True)
class Candidate:
    """One evaluated setup: its estimate, its speed, and whether it fits."""

    setup: Setup
    breakdown: Breakdown | None  # None: known not to fit without estimating (see _Search.judge)
    step: cost.StepCost
    fits: bool
    why: str = ""  # why it does not fit ("needs X > Y usable", "host RAM")

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s

    @property
    def device_total_bytes(self) -> int:
        return self.breakdown.device_total_bytes


class _Search:
    """One search over the free knobs for one target. Holds a cache of estimates."""

    def __init__(self, model: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any],
                 band: float | None, margin: bool = True):
        self.model, self.target, self.shape, self.fixed = model, target, shape, fixed
        self.band, self.margin = band, margin
        self.cache: dict[Setup, Breakdown] = {}
        self.failures: list[Candidate] = []  # estimated setups that did not fit
        self.fail_rank: dict[tuple, int] = {}  # setup but its rank -> lowest rank known to fail
        self.mb_hint: dict[tuple, int] = {}  # setup but its rank -> index of a lower rank's largest micro-batch
        self._counts: dict[tuple, cost.Counts] = {}

    # -- memory and speed -----------------------------------------------------------------------

    def estimate(self, setup: Setup) -> Breakdown:
        bd = self.cache.get(setup)
        if bd is None:
            bd = estimate(self.model, setup, self.target.gpu)
            self.cache[setup] = bd
        return bd

    def counts(self, setup: Setup) -> cost.Counts:
        key = _family_key(setup) + (setup.lora_targets, setup.double_quant)
        k = self._counts.get(key)
        if k is None:
            k = self._counts[key] = cost.counts(self.model, setup)
        return k

    def step(self, setup: Setup) -> cost.StepCost:
        return cost.step_cost(self.model, setup, self.target.gpu, self.target.nodes, self.counts(setup))

    def useful_rate(self, c: Candidate) -> float:
        """Training FLOP/s a candidate gets out of the hardware: tokens/s x its method's FLOPs per
        token (recompute excluded). Ranking on it compares how much of the card each plan spends
        on memory savers, not the FLOPs a better method costs by design (6N full vs 4N LoRA)."""
        return c.tokens_per_s * cost.train_flops_per_token(self.model, c.setup, self.counts(c.setup))

    def band_of(self, bd: Breakdown) -> float:
        if self.band is not None:
            return self.band
        return bd.error_band if bd.error_band is not None else DEFAULT_ERROR_BAND

    def host_need(self, setup: Setup, bd: Breakdown) -> int:
        """Host RAM per node the offloaded state needs (NVMe-offloaded state lives on disk)."""
        if "cpu" not in (setup.offload_optimizer, setup.offload_params):
            return 0
        return bd.host_bytes * (self.target.gpus // self.target.nodes)

    def judge(self, setup: Setup) -> Candidate:
        """Estimate ``setup`` and say whether it fits (failures are kept for the why-not lines).

        Memory grows with the LoRA rank, so a setup that fails at rank r fails at every higher
        rank: such setups are answered without an estimate (``breakdown`` None)."""
        key = _rank_key(setup) if setup.adapters else None
        if key is not None and setup.lora_rank >= self.fail_rank.get(key, 1 << 30):
            return Candidate(setup, None, self.step(setup), False, f"does not fit (rank {self.fail_rank[key]} already fails)")
        bd = self.estimate(setup)
        usable = self.target.gpu.usable_memory_bytes
        need = bd.device_total_bytes * ((1 + self.band_of(bd)) if self.margin else 1)
        why = ""
        if need > usable:
            why = f"needs {_gib(bd.device_total_bytes)} > {_gib(usable)} usable"
            if bd.device_total_bytes <= usable:
                why = (f"needs {_gib(bd.device_total_bytes)} of {_gib(usable)} usable, inside the "
                       f"±{self.band_of(bd):.0%} error band")
        else:
            host = self.host_need(setup, bd)
            ram = self.target.host_ram_bytes
            if ram is not None and host > ram * HOST_RAM_SHARE:
                why = f"offload needs {_gib(host)} of host RAM > {_gib(ram * HOST_RAM_SHARE)} available"
        c = Candidate(setup, bd, self.step(setup), not why, why)
        if why:
            self.failures.append(c)
            if key is not None:
                self.fail_rank[key] = min(setup.lora_rank, self.fail_rank.get(key, 1 << 30))
        return c

    def speed_bound(self, setup: Setup) -> float:
        big = setup.replace(batch=self.shape.micro_batches[-1],
                            grad_accum=self.shape.grad_accum(self.shape.micro_batches[-1]))
        return self.step(big).tokens_per_s

    def at_micro(self, setup: Setup, micro: int) -> Setup:
        return setup.replace(batch=micro, grad_accum=self.shape.grad_accum(micro))

    # -- the knobs --------------------------------------------------------------------------------

    def _choices(self, name: str, default: Iterable[Any]) -> tuple[Any, ...]:
        return (self.fixed[name],) if name in self.fixed else tuple(default)

    def families(self) -> list[Setup]:
        """One base Setup per (method, base quantization, rank); savers at their defaults."""
        f = self.fixed
        lora_knobs = any(k in f for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"))
        # a fixed LoRA knob means adapters unless the method is fixed too
        methods = self._choices("method", ("lora", "qlora") if lora_knobs else ("full", "lora", "qlora"))
        # the bases searched per method; a fixed --quant picks the methods it is valid for. GPTQ/AWQ
        # need a pre-quantized checkpoint: searched only when the user fixes --quant gptq|awq
        bases = {"full": ("none",), "lora": ("none",), "qlora": ("nf4",)}
        if "quant" in f:
            q = f["quant"]
            bases = {"full": (q,) if q == "none" else (),
                     "lora": (q,) if q in ("none", "int8", "gptq", "awq") or f.get("method") == "lora" else (),
                     "qlora": (q,) if q in ("nf4", "fp4") else ()}
        combos = [(method, q) for method in methods for q in bases[method]]
        gpu = self.target.gpu
        out = []
        for method, quant in combos:
            ranks = (16,) if method == "full" else self._choices("lora_rank", LORA_RANKS)
            if method == "full":
                precision = self._choices("precision", ("bf16",) if gpu.bf16 else ("fp16-mixed",))
            else:
                precision = self._choices("precision", ("bf16",) if gpu.bf16 else ("fp16",))
            for r in ranks:
                for p in precision:
                    values = {k: v for k, v in f.items() if k not in ("batch", "grad_accum")}
                    values.update(method=method, quant=quant, lora_rank=r if method != "full" else f.get("lora_rank", 16),
                                  precision=p, seq=self.shape.seq, gpus=self.target.gpus)
                    try:
                        s = Setup(**values)
                        check(self.model, s)
                    except SpecError:
                        continue
                    out.append(s)
        # ascending rank within a method, so failures at a low rank answer the higher ranks
        return sorted(out, key=lambda s: (s.method, s.quant, s.lora_rank))

    def placements(self) -> list[tuple[int, str, str, str]]:
        """(ZeRO stage, optimizer offload, parameter offload, FSDP sharding) worth trying on this
        target. Several GPUs also try PyTorch FSDP (FULL_SHARD, SHARD_GRAD_OP, FULL_SHARD with
        CPU offload) beside ZeRO; one GPU only when FSDP is asked for."""
        n, f = self.target.gpus, self.fixed
        offl = ("cpu", "nvme") if self.target.nvme else ("cpu",)
        fsdp = [(0, "none", "none", m) for m in ("full_shard", "shard_grad_op")] + [(0, "cpu", "cpu", "full_shard")]
        if any(k in f for k in ("zero_stage", "offload_optimizer", "offload_params", "fsdp")):
            allowed = [(z, o, p, "none") for z in (0, 1, 2, 3) for o in ("none", "cpu", "nvme") for p in ("none", "cpu", "nvme")]
            if n > 1 or "fsdp" in f:
                allowed += [(0, o, o, m) for m in ("full_shard", "shard_grad_op", "no_shard") for o in ("none", "cpu")]
        elif n == 1:
            allowed = [(0, "none", "none", "none")] + [(2, o, "none", "none") for o in offl] + [(3, o, o, "none") for o in offl]
        else:
            allowed = [(z, "none", "none", "none") for z in (0, 1, 2, 3)]
            allowed += [(2, o, "none", "none") for o in offl] + [(3, o, "none", "none") for o in offl]
            allowed += [(3, o, o, "none") for o in offl] + fsdp
        out = []
        for z, o, p, m in allowed:
            if (f.get("zero_stage", z) != z or f.get("offload_optimizer", o) != o or f.get("offload_params", p) != p
                    or f.get("fsdp", m) != m):
                continue
            if m == "none" and ((p != "none" and z != 3) or (o != "none" and z == 0)):
                continue
            out.append((z, o, p, m))
        return out

    def savers(self, family: Setup) -> list[Setup]:
        """Every saver configuration of a family (checkpointing, optimizer, placement, attention)."""
        gpu = self.target.gpu
        attns: tuple[str, ...] = ("auto",)
        cc = gpu.compute_capability
        if self.model.default_attn == "eager" and (cc is None or float(cc) >= 8.0):
            attns = ("auto", "flash")  # FlashAttention-2 keeps no s x s scores (needs Ampere+)
        out = []
        for z, o, p, m in self.placements():
            optimizers = ("adamw-fused",) if o != "none" else ("adamw-fused", "adamw-8bit")
            for opt in self._choices("optimizer", optimizers):
                if o != "none" and opt not in ("adamw", "adamw-fused"):
                    continue
                for ck in self._choices("checkpointing", (False, True)):
                    for attn in self._choices("attn", attns):
                        try:  # a GPTQ/AWQ base refuses ZeRO placements
                            s = family.replace(zero_stage=z, offload_optimizer=o, offload_params=p, fsdp=m,
                                               optimizer=opt, checkpointing=ck, attn=attn)
                        except SpecError:
                            continue
                        if "fsdp" not in self.fixed and fsdp_lora_crashes(self.model, s):
                            continue  # torch 2.13's FSDP1 fails on it (checks.py)
                        out.append(s)
        return out

    # -- the search ---------------------------------------------------------------------------------

    def largest_fitting(self, setup: Setup, first: Candidate, at: int) -> Candidate:
        """The largest allowed micro-batch that fits, given that ``mbs[at]`` does (``first``)."""
        mbs = self.shape.micro_batches
        best, lo, hi = first, at, len(mbs)  # mbs[lo] fits; mbs[hi] (if any) does not
        if lo + 1 >= hi:
            return best
        if lo:  # from a lower rank's answer: usually the next one fails (known without an estimate)
            return self._step_then_bisect(setup, best, lo, hi)
        second = self.judge(self.at_micro(setup, mbs[1]))
        if not second.fits:
            return best
        best, lo = second, 1
        # seed: extrapolate linearly from the first two
        slope = (second.device_total_bytes - first.device_total_bytes) / max(mbs[1] - mbs[0], 1)
        if slope > 0:
            margin = 1 + self.band_of(first.breakdown) if self.margin else 1
            room = self.target.gpu.usable_memory_bytes / margin - first.device_total_bytes
            guess_mb = mbs[0] + room / slope
            guess = max(i for i, m in enumerate(mbs) if i <= 1 or m <= guess_mb)
        else:
            guess = len(mbs) - 1
        if guess > lo:
            c = self.judge(self.at_micro(setup, mbs[guess]))
            if c.fits:
                best, lo = c, guess
            else:
                hi = guess
        return self._step_then_bisect(setup, best, lo, hi)

    def _step_then_bisect(self, setup: Setup, best: Candidate, lo: int, hi: int) -> Candidate:
        """Given ``mbs[lo]`` fits (``best``) and ``mbs[hi]`` does not (or is past the end): try the
        next micro-batch first (usually the answer), then bisect what is left."""
        mbs = self.shape.micro_batches
        if lo + 1 < hi:
            nxt = self.judge(self.at_micro(setup, mbs[lo + 1]))
            if not nxt.fits:
                return best
            best, lo = nxt, lo + 1
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            c = self.judge(self.at_micro(setup, mbs[mid]))
            if c.fits:
                best, lo = c, mid
            else:
                hi = mid
        return best

    def fitting_micro_batch(self, setup: Setup) -> Candidate | None:
        """``setup`` at its largest fitting micro-batch, or None if even the smallest fails.

        A lower rank's answer for the same setup is the first guess: memory grows with the rank,
        so the micro-batch above it is known to fail and, when the guess fits, one estimate does."""
        mbs = self.shape.micro_batches
        key = _rank_key(self.at_micro(setup, mbs[0])) if setup.adapters else None
        hint = self.mb_hint.get(key, 0) if key is not None else 0
        found = None
        if hint:
            guess = self.judge(self.at_micro(setup, mbs[hint]))
            if guess.fits:
                found = self.largest_fitting(setup, guess, hint)
        if found is None:
            first = self.judge(self.at_micro(setup, mbs[0]))
            if not first.fits:
                return None
            found = self.largest_fitting(setup, first, 0)
        if key is not None:
            self.mb_hint[key] = mbs.index(found.setup.batch)
        return found

    def family_best(self, family: Setup) -> tuple[Candidate | None, Candidate | None]:
        """(fastest fitting candidate of the family, its smallest-memory candidate at micro-batch 1)."""
        configs = self.savers(family)
        mb0 = self.shape.micro_batches[0]
        # monotone feasibility per placement: the config with every saver on is the floor there
        floors: dict[tuple, Setup] = {}
        for s in configs:
            key = _placement(s)
            if key not in floors or _saving(s) > _saving(floors[key]):
                floors[key] = s
        verdict: dict[tuple, bool] = {}
        lowest: Candidate | None = None

        def feasible(key: tuple) -> bool:
            nonlocal lowest
            if key not in verdict:
                judged = self.judge(self.at_micro(floors[key], mb0))
                verdict[key] = judged.fits
                if judged.breakdown is not None and (lowest is None or judged.device_total_bytes < lowest.device_total_bytes):
                    lowest = judged
            return verdict[key]

        best: Candidate | None = None
        ranked = sorted(((self.speed_bound(s), i, s) for i, s in enumerate(configs)), key=lambda t: (-t[0], t[1]))
        for bound, _, s in ranked:
            if best is not None and bound <= best.tokens_per_s:
                break
            if not feasible(_placement(s)):
                continue
            c = self.fitting_micro_batch(s)
            if c is not None and (best is None or c.tokens_per_s > best.tokens_per_s):
                best = c
        if best is None:  # infeasible: every floor was judged; report the smallest
            for key in floors:
                feasible(key)
        return best, lowest

    def run(self) -> _Result:
        families = self.families()
        if not families:
            raise SpecError("no setup satisfies the fixed options together; relax one of them")
        bests: list[Candidate] = []
        floors: list[Candidate] = []
        for fam in families:
            best, lowest = self.family_best(fam)
            if best is not None:
                bests.append(best)
            if lowest is not None:
                floors.append(lowest)
        return _Result(self, families, bests, floors)

    def biggest_micro_batch(self, setup: Setup) -> int:
        """The largest micro-batch (any integer) at which ``setup`` still fits, grad accum aside."""
        lo, hi = setup.batch, None
        while hi is None:
            trial = lo * 2
            if trial > MAX_PROBED_MICRO_BATCH:
                return lo
            if self.judge(setup.replace(batch=trial)).fits:
                lo = trial
            else:
                hi = trial
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if self.judge(setup.replace(batch=mid)).fits:
                lo = mid
            else:
                hi = mid
        return lo


_RANK_FREE = tuple(f.name for f in dataclasses.fields(Setup) if f.name not in ("lora_rank", "lora_alpha"))


def _rank_key(s: Setup) -> tuple:
    """Every field of a Setup but its rank (new Setup fields are included automatically)."""
    return tuple(getattr(s, name) for name in _RANK_FREE)


def _placement(s: Setup) -> tuple:
    """Saver configurations that share a placement are ordered by memory (see _saving)."""
    return (s.zero_stage, s.offload_optimizer, s.offload_params, s.fsdp, s.precision)


def _saving(s: Setup) -> tuple[int, int, int]:
    return (int(s.checkpointing), int(s.optimizer in ("adamw-8bit", "paged-adamw-8bit")), int(s.attn != "auto"))


@dataclass
class _Result:
    search: _Search
    families: list[Setup]
    bests: list[Candidate]  # per family, fitting
    floors: list[Candidate]  # per family, smallest memory seen

    def choose(self) -> Candidate | None:
        if not self.bests:
            return None
        best_rate = max(self.search.useful_rate(c) for c in self.bests)
        close = [c for c in self.bests if self.search.useful_rate(c) >= (1 - SPEED_TOLERANCE) * best_rate]
        return max(close, key=lambda c: (quality(c.setup), c.tokens_per_s, -c.device_total_bytes))

    def fastest(self) -> float | None:
        return max((c.tokens_per_s for c in self.bests), default=None)


# ----------------------------------------------------------------------------------------------
# the plan


def _resolve_model(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from .profiles import load_model

    return load_model(model)


def _resolve_gpu(gpu: GpuSpec | str | int) -> GpuSpec:
    if isinstance(gpu, GpuSpec):
        return gpu
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        return GpuSpec.custom(gpu)
    if isinstance(gpu, str):
        from .profiles import load_gpu

        return load_gpu(gpu)
    raise SpecError(f"gpu must be a GPU name, a GpuSpec or a size in bytes; got {gpu!r}")


def _check_fixed(model: ModelSpec, fixed: dict[str, Any], gpus: int, seq: int) -> None:
    """Reject fixed knobs that contradict each other, with Setup's own messages."""
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise SpecError(f"unknown constraint {unknown[0]!r}; fixable knobs: {', '.join(FIXABLE)}")
    probe = dict(fixed)
    if probe.get("quant", "none") != "none" and "method" not in probe:
        probe["method"] = "qlora" if probe["quant"] in ("nf4", "fp4") else "lora"
    if probe.get("offload_params", "none") != "none" and probe.get("fsdp", "none") == "none":
        probe.setdefault("zero_stage", 3)
    if probe.get("offload_optimizer", "none") != "none" and probe.get("fsdp", "none") == "none":
        probe.setdefault("zero_stage", 2)
    if probe.get("offload_optimizer", "none") != "none" and probe.get("optimizer", "adamw") not in ("adamw", "adamw-fused"):
        raise SpecError(f"--optimizer {probe['optimizer']} cannot be offloaded: DeepSpeed's offload runs its own "
                        "CPU Adam; use --optimizer adamw-fused or drop --offload-optimizer")
    if probe.get("method") == "qlora" and probe.get("quant") == "none":
        raise SpecError("qlora means a 4-bit base; drop --no-quant or use --method lora")
    setup = Setup(**probe, gpus=gpus, seq=seq)
    if any(k in fixed for k in ("lora_rank", "lora_targets")) and fixed.get("method") != "full":
        check(model, setup.replace(method="lora") if setup.method == "full" else setup)


def _describe(setup: Setup) -> str:
    parts = [method_name(setup), f"micro-batch {setup.batch}"]
    if setup.grad_accum > 1:
        parts.append(f"grad accum {setup.grad_accum}")
    parts.append(savers_text(setup))
    return ", ".join(parts)


def _alternatives(result: _Result, chosen: Candidate) -> tuple[Alternative, ...]:
    """The Pareto front of the families' best plans over (memory, tokens/s, quality), chosen excluded."""
    pts = [c for c in result.bests if c is not chosen]

    def dominated(a: Candidate) -> bool:
        for b in result.bests:
            if b is a:
                continue
            no_worse = (b.device_total_bytes <= a.device_total_bytes and b.tokens_per_s >= a.tokens_per_s
                        and quality(b.setup) >= quality(a.setup))
            better = (b.device_total_bytes < a.device_total_bytes or b.tokens_per_s > a.tokens_per_s
                      or quality(b.setup) > quality(a.setup))
            if no_worse and better:
                return True
        return False

    front = [c for c in pts if not dominated(c)]
    # at most MAX_PER_METHOD per method, spanning it: the fastest, the smallest, the best quality
    kept: list[Candidate] = []
    for method in dict.fromkeys((c.setup.method, c.setup.quant) for c in front):
        group = [c for c in front if (c.setup.method, c.setup.quant) == method]
        picks = [max(group, key=lambda c: c.tokens_per_s), min(group, key=lambda c: c.device_total_bytes),
                 max(group, key=lambda c: quality(c.setup))]
        picks += sorted(group, key=lambda c: -c.tokens_per_s)
        unique = list({id(c): c for c in picks}.values())  # Candidates hold dicts: dedupe by identity
        kept += unique[:MAX_PER_METHOD]
    front = sorted(kept, key=lambda c: -c.tokens_per_s)[:MAX_ALTERNATIVES]
    out = []
    for c in front:
        rel = c.tokens_per_s / chosen.tokens_per_s - 1
        diff = (c.device_total_bytes - chosen.device_total_bytes) / GiB
        note = f"{rel:+.0%} tokens/s, {diff:+.1f} GiB"  # relative to the chosen plan
        host = result.search.host_need(c.setup, c.breakdown)
        if host:
            note += f", host RAM {_gib(host)}"
        out.append(Alternative(setup=c.setup, device_total_bytes=c.device_total_bytes, tokens_per_s=round(c.tokens_per_s, 1),
                               quality=quality_label(c.setup), note=note))
    return tuple(out)


#: At most this many why-not lines about the chosen family's faster settings.
MAX_SAME_FAMILY_REJECTIONS = 4


def _rejected(result: _Result, chosen: Candidate | None) -> tuple[Rejected, ...]:
    """Why-not lines: one per family of higher quality than the chosen (every family when nothing
    fits), naming the memory it needs as it would run fastest; then the chosen family's faster
    settings and the next micro-batch, which do not fit."""
    search = result.search
    q0 = quality(chosen.setup) if chosen else -1
    usable = search.target.gpu.usable_memory_bytes
    best_of = {_family_key(c.setup): c for c in result.bests}
    lowest_of = {_family_key(c.setup): c for c in result.floors}
    out: list[Rejected] = []
    for fam in sorted(result.families, key=lambda f: -quality(f)):
        if quality(fam) <= q0:
            continue
        key = _family_key(fam)
        fastest = max(search.savers(fam), key=search.speed_bound)
        plain = search.judge(search.at_micro(fastest, search.shape.micro_batches[0]))
        if plain.breakdown is None:  # answered by a lower rank's failure: estimate it for the number
            plain = dataclasses.replace(plain, breakdown=search.estimate(plain.setup))
        head = f"{method_name(fam)}: needs {_gib(plain.device_total_bytes)} > {_gib(usable)} usable"
        if plain.fits or plain.device_total_bytes <= usable:
            head = f"{method_name(fam)} ({savers_text(plain.setup)}): {plain.why or 'fits'}"
        if key in best_of:
            b = best_of[key]
            host = search.host_need(b.setup, b.breakdown)
            reason = (f"{head}; fits with {savers_text(b.setup)}, micro-batch {b.setup.batch}"
                      + (f" ({_gib(host)} of host RAM)" if host else "")
                      + f", at {b.tokens_per_s:,.0f} tokens/s, too slow for its quality")
        else:
            low = lowest_of.get(key)
            reason = head
            if low is not None and low.breakdown is not None and low.setup != plain.setup:
                reason += f"; {_gib(low.device_total_bytes)} even with {savers_text(low.setup)}"
                if low.why.startswith("offload"):
                    reason += f" ({low.why})"
        out.append(Rejected(setup=plain.setup, reason=reason, device_total_bytes=plain.device_total_bytes))
    if chosen is None:
        return tuple(out)
    # the chosen family's faster settings: other savers at the chosen micro-batch, the next micro-batch
    mbs = search.shape.micro_batches
    i = mbs.index(chosen.setup.batch)
    trials = [search.at_micro(s, chosen.setup.batch) for s in search.savers(chosen.setup)]
    if i + 1 < len(mbs):
        trials.append(search.at_micro(chosen.setup, mbs[i + 1]))
    same: list[Rejected] = []
    for s in sorted(trials, key=lambda s: -search.step(s).tokens_per_s):
        if len(same) == MAX_SAME_FAMILY_REJECTIONS or search.step(s).tokens_per_s <= chosen.tokens_per_s:
            break
        c = search.judge(s)
        if c.fits:
            continue
        bd = c.breakdown or search.estimate(s)
        why = c.why if c.breakdown is not None else f"needs {_gib(bd.device_total_bytes)} > {_gib(usable)} usable"
        same.append(Rejected(setup=s, reason=f"{_describe(s)}: {why}", device_total_bytes=bd.device_total_bytes))
    return tuple(out) + tuple(same)


def _family_key(s: Setup) -> tuple:
    return (s.method, s.quant, s.lora_rank if s.adapters else 0, s.precision)


def plan(model: ModelSpec | str, gpu: GpuSpec | str | int, *, gpus: int = 1, nodes: int = 1,
         host_ram: int | str | None = None, nvme: bool = False, seq: int = 2048, global_batch: int | None = None,
         tokens_per_step: int | None = None, dataset_tokens: int | None = None, error_band: float | None = None,
         relax: bool = True, **fixed: Any) -> Plan:
    """The fastest Setup of ``model`` that fits ``gpu`` (see the module docstring for how).

    ``fixed`` pins Setup knobs (``method="lora"``, ``lora_rank=64``, ``quant="none"``,
    ``checkpointing=False``, ``zero_stage=3``, ``batch=4``...); every other knob is searched.
    ``host_ram`` (bytes or "64GiB") bounds CPU offload per node; ``nvme`` allows NVMe offload.
    When nothing fits, the Plan has ``fits`` False and notes saying what would (``relax``).
    """
    spec = _resolve_model(model)
    card = _resolve_gpu(gpu)
    if isinstance(host_ram, str):
        from .units import parse_bytes

        try:
            host_ram = parse_bytes(host_ram)
        except ValueError as exc:
            raise SpecError(f"host RAM: {exc}") from None
    if dataset_tokens is not None and (isinstance(dataset_tokens, bool) or not isinstance(dataset_tokens, int)
                                       or dataset_tokens <= 0):
        raise SpecError(f"dataset_tokens must be a positive integer; got {dataset_tokens!r}")
    if error_band is not None and not 0 <= error_band < 1:
        raise SpecError(f"error_band must be in [0, 1); got {error_band!r}")
    target = Target(card, gpus, nodes, host_ram, nvme)
    fixed = {k: v for k, v in fixed.items() if v is not None}
    _check_fixed(spec, {k: v for k, v in fixed.items() if k not in ("batch", "grad_accum")}, gpus, seq)
    shape = batch_shape(seq, gpus, global_batch, tokens_per_step, fixed.get("batch"), fixed.get("grad_accum"))
    search = _Search(spec, target, shape, fixed, error_band)
    result = search.run()
    chosen = result.choose()
    notes: list[str] = []
    tight = False
    if chosen is None:
        loose = _Search(spec, target, shape, fixed, error_band, margin=False)
        loose_result = loose.run()
        if loose_result.choose() is not None:
            result, search, chosen, tight = loose_result, loose, loose_result.choose(), True
    name = spec.name
    if chosen is None:
        # report the smallest setup that fails on the GPU itself, so the plan's own fit is False
        judged = [c for c in search.failures if c.breakdown is not None]
        on_gpu = [c for c in judged if not c.breakdown.fits]
        if not on_gpu:  # only host RAM stands in the way, and the fixed knobs force the offload
            h = min(judged, key=lambda c: c.device_total_bytes)
            raise SpecError(f"nothing fits: {_describe(h.setup)} fits the GPU but {h.why}; "
                            "raise --host-ram or drop the fixed offload")
        floor = min(on_gpu, key=lambda c: c.device_total_bytes)
        notes.append(f"does not fit: the smallest setup, {_describe(floor.setup)}, {floor.why}")
        host_only = [c for c in judged if c.breakdown.fits and c.why.startswith("offload")]
        if host_only:
            h = min(host_only, key=lambda c: c.device_total_bytes)
            notes.append(f"{_describe(h.setup)} would fit the GPU ({_gib(h.device_total_bytes)}) but {h.why}")
        if relax:
            # no setup that respects the host RAM needs less GPU memory than this, on any card: host
            # need does not depend on the card, and a placement's floor is its smallest setup
            gpu_floor = min((c.device_total_bytes for c in judged if not c.why.startswith("offload")), default=0)
            notes += _what_would(spec, target, shape, fixed, error_band, global_batch, tokens_per_step, seq,
                                 gpu_floor)
        return Plan(model=name, setup=floor.setup, breakdown=floor.breakdown, gpu=card, nodes=nodes,
                    step_time_s=round(floor.step.step_s, 4), tokens_per_s=round(floor.tokens_per_s, 1),
                    alternatives=(), rejected=_rejected(result, None), notes=tuple(notes))

    bd = chosen.breakdown
    band = search.band_of(bd)
    if tight:
        notes.append(f"tight: needs {_gib(bd.device_total_bytes)} of {_gib(card.usable_memory_bytes)} usable; within "
                     f"the ±{band:.0%} error band of the estimate the step may run out of memory")
    fastest = result.fastest()
    if fastest and chosen.tokens_per_s < fastest:
        quick = max(result.bests, key=lambda c: c.tokens_per_s)
        notes.append(f"chose {quality_label(chosen.setup)} over the {fastest / chosen.tokens_per_s - 1:.0%} faster "
                     f"{quality_label(quick.setup)} for quality: it uses the card within {SPEED_TOLERANCE:.0%} as well "
                     "(tokens/s x FLOPs per token)")
    biggest = search.biggest_micro_batch(chosen.setup)
    if biggest > chosen.setup.batch:
        notes.append(f"largest micro-batch that fits this setup: {biggest} (the global batch allows {chosen.setup.batch})"
                     if shape.per_gpu is not None or "batch" in fixed else
                     f"largest micro-batch that fits this setup: {biggest}")
    else:
        notes.append(f"largest micro-batch that fits this setup: {biggest}")
    if "cpu" in (chosen.setup.offload_optimizer, chosen.setup.offload_params):
        need = search.host_need(chosen.setup, bd)
        notes.append(f"CPU offload needs {_gib(need)} of host RAM per node"
                     + ("" if host_ram is not None else " (not checked: pass host_ram / --host-ram)"))
    if chosen.setup.attn == "flash":
        notes.append("attn flash needs the flash-attn package (FlashAttention-2)")
    if dataset_tokens:
        secs = dataset_tokens / chosen.tokens_per_s
        notes.append(f"{dataset_tokens:,} tokens take about {_duration(secs)} at {chosen.tokens_per_s:,.0f} tokens/s")
    notes.append(f"speed: first-order cost model (vramplan.cost: {cost.MFU:.0%} MFU of the card's dense TFLOP/s, "
                 "offload and communication over its links); memory: the analytic estimate")
    notes += [n for n in bd.notes if n not in notes]
    return Plan(model=name, setup=chosen.setup, breakdown=bd, gpu=card, nodes=nodes,
                step_time_s=round(chosen.step.step_s, 4), tokens_per_s=round(chosen.tokens_per_s, 1),
                alternatives=_alternatives(result, chosen), rejected=_rejected(result, chosen), notes=tuple(notes))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _summary(c: Candidate) -> str:
    return f"{_describe(c.setup)} ({_gib(c.device_total_bytes)}, ~{c.tokens_per_s:,.0f} tokens/s)"


def _first_fit(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict, band: float | None) -> Candidate | None:
    return _fit_and_floor(spec, target, shape, fixed, band)[0]


def _fit_and_floor(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict,
                   band: float | None) -> tuple[Candidate | None, float]:
    """The chosen candidate under a relaxed target (None if nothing fits), and the least GPU memory
    any setup there needs (host-RAM failures aside)."""
    try:
        search = _Search(spec, target, shape, fixed, band)
        result = search.run()
    except SpecError:
        return None, math.inf
    seen = [c for c in search.failures if c.breakdown is not None and not c.why.startswith("offload")]
    floor = min((c.device_total_bytes for c in seen + result.bests), default=math.inf)
    return result.choose(), floor


def _what_would(spec: ModelSpec, target: Target, shape: BatchShape, fixed: dict, band: float | None,
                global_batch: int | None, tokens_per_step: int | None, seq: int, gpu_floor: int) -> list[str]:
    """Re-run the search under relaxed constraints and say, with numbers, what would fit."""
    out: list[str] = []
    gb = global_batch if global_batch is not None else (
        math.ceil(tokens_per_step / (seq * target.gpus)) * target.gpus if tokens_per_step else None)
    # more GPUs of the same card
    # more GPUs of the same card; ZeRO-3 memory per GPU is a + b/n, so two counts give the limit a:
    # once even infinitely many GPUs would not fit, stop
    n, floors = target.gpus, {target.gpus: gpu_floor}
    while n < 64:
        n *= 2
        if gb is not None and gb % n:
            continue
        try:
            s = batch_shape(seq, n, gb, None, fixed.get("batch") if gb is None else None, None)
        except SpecError:
            continue
        nodes = target.nodes if n % target.nodes == 0 else 1
        c, floors[n] = _fit_and_floor(spec, dataclasses.replace(target, gpus=n, nodes=nodes), s,
                                      _without(fixed, "grad_accum"), band)
        if c is not None:
            out.append(f"with {n} x {target.gpu.display_name}: {_summary(c)}")
            break
        # (from 2 GPUs up, where ZeRO-3 is among the placements on both sides)
        if n // 2 >= 2 and n // 2 in floors and 2 * floors[n] - floors[n // 2] > target.gpu.usable_memory_bytes:
            break
    # a bigger card
    from .profiles import gpus as shipped

    for card in sorted(shipped(), key=lambda g: g.usable_memory_bytes):
        # skip cards below the floor (10 % slack: the device overheads may differ per card)
        if card.usable_memory_bytes <= max(target.gpu.usable_memory_bytes, 0.9 * gpu_floor):
            continue
        c = _first_fit(spec, dataclasses.replace(target, gpu=card), shape, fixed, band)
        if c is not None:
            out.append(f"on {card.display_name} ({_gib(card.usable_memory_bytes)} usable): {_summary(c)}")
            break
    # a shorter sequence
    short = seq // 2
    while short >= 128:
        try:
            s = batch_shape(short, target.gpus, gb, None, fixed.get("batch"), fixed.get("grad_accum"))
        except SpecError:
            break
        c = _first_fit(spec, target, s, fixed, band)
        if c is not None:
            out.append(f"with seq {short}: {_summary(c)}")
            break
        short //= 2
    # offload the knobs the target ruled out
    if not target.nvme:
        c = _first_fit(spec, dataclasses.replace(target, nvme=True), shape, fixed, band)
        if c is not None:
            out.append(f"with NVMe offload (--nvme): {_summary(c)}")
    if target.host_ram_bytes is not None:
        c = _first_fit(spec, dataclasses.replace(target, host_ram_bytes=None), shape, fixed, band)
        if c is not None:
            s = _Search(spec, target, shape, fixed, band)
            need = s.host_need(c.setup, c.breakdown)
            out.append(f"with {_gib(need / HOST_RAM_SHARE)} of host RAM: {_summary(c)}")
    pinned = [k for k in fixed if k not in ("lora_alpha", "lora_dropout", "lora_targets", "double_quant", "loss")]
    if pinned:
        c = _first_fit(spec, target, shape, {k: v for k, v in fixed.items() if k not in pinned}, band)
        if c is not None:
            flags = ", ".join(pinned)
            out.append(f"without the fixed {flags}: {_summary(c)}")
    if not out:
        out.append("nothing tried fits: no bigger shipped card, up to 64 GPUs, shorter sequences or offload")
    return out


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}
