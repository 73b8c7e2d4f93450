"""The objective: which fitting candidate a plan chooses, and which others it lists.

**Choice**, in this order (each step keeps the candidates that are best at it):

1. **GPU-resident first** (:func:`residency`): a plan without CPU/NVMe offload, and on one GPU
   without a distributed engine (DeepSpeed, FSDP), wins whenever one fits at any tier; offload is
   a last resort (unless the user fixed it, when every candidate offloads), and NVMe offload
   (``--nvme``) one past CPU offload (:func:`placement`).
2. **Quality tier** (:func:`tier`): full > LoRA on a 16-bit base > LoRA on an 8-bit base > QLoRA
   (a 4-bit base), while the better tier is at most :data:`TIER_SLOWDOWN_MAX` times slower than
   the fastest plan of a lower tier at the same placement (:func:`pick_tier`); a better tier that
   costs more is passed over, and the plan's note says so (``--method full``, ``--quant none``
   fix the tier). LoRA rank is not part of it: the rank is the user's (``--lora-rank``, default
   16); a range lets the search pick inside it by speed alone.
3. **Least time**: the most tokens/s (the user's tokens in the least time); equal speed falls
   back to the higher rank, then to less memory.

Tight plans (inside the margins) are never in the same choice as non-tight ones: the planner
searches with the margins first and without them only when nothing fits (``planner.py``); a tight plan
then trades a little speed for headroom (:func:`roomiest`).
At equal speed a plain transformers stack is chosen before Liger's kernels; Liger's kernels, vLLM for
GRPO's generation, DPO's precomputed reference log-probs and the optimizer in backward (:func:`extras`) each must buy
:data:`LIGER_MIN_GAIN` over the plan without them. **Alternatives**: the
Pareto front over (memory, tokens/s, quality, residency, no Liger), at most
:data:`MAX_PER_METHOD` per method and :data:`MAX_ALTERNATIVES` in all.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..specs import Setup
from .verdicts import Candidate

#: How many alternatives the plan lists, and at most how many of one method (base included).
MAX_ALTERNATIVES = 8
MAX_PER_METHOD = 3
#: A plan of a lower tier this much faster than the chosen one is named in a note (never chosen).
MUCH_FASTER = 0.25
#: A better quality tier is chosen only while its plan is at most this many times slower (tokens/s)
#: than the fastest plan of any lower tier at the same placement. Why 2: the tiers' quality gaps are
#: modest for instruction tuning (QLoRA matches 16-bit LoRA, Dettmers et al. 2023, arXiv:2305.14314;
#: full fine-tuning leads LoRA mostly on code/math continued pre-training, Biderman et al. 2024,
#: arXiv:2405.09673), while a run that takes more than twice as long halves the experiments a
#: practitioner can run in the same GPU-hours. Over the shipped profiles (7-72B on RTX 3090/4090,
#: A100-80GB, H100; 1, 2 and 8 GPUs) an ordinary full fine-tune runs at 0.7-1.9x the time of the
#: fastest lower tier in the cost model and stays full; what 2x passes over is full fine-tuning or a
#: 16-bit base that fits only through NVMe (5-34x), a 70B gathered by ZeRO-3 over 8 GPUs (5-6x),
#: GRPO with HF generate beside LoRA (2.3-2.4x). ``--method full`` (``--method lora --quant none``)
#: keeps the tier.
TIER_SLOWDOWN_MAX = 2.0
#: Liger's kernels are an extra dependency (liger-kernel, Triton, CUDA only): a plan takes them only
#: when they buy at least this much speed over the best plan without them at the same residency and
#: quality tier (a larger micro-batch, checkpointing off), never for a few per cent
LIGER_MIN_GAIN = 0.10

#: Quality tiers, best first: what each tier number means.
TIERS = {3: "full fine-tuning", 2: "LoRA on a 16-bit base", 1: "LoRA on an 8-bit base", 0: "QLoRA (a 4-bit base)"}


def tier(setup: Setup) -> int:
    """The quality tier of a setup's method (:data:`TIERS`): 3 full, 2 LoRA on a 16-bit base,
    1 LoRA on an 8-bit base (LLM.int8, 8-bit GPTQ), 0 a 4-bit or smaller base (QLoRA, GPTQ, AWQ)."""
    if setup.method == "full":
        return 3
    if setup.quant == "none":
        return 2
    if setup.quant == "int8" or (setup.quant == "gptq" and setup.quant_bits == 8):
        return 1
    return 0


def quality(setup: Setup) -> int:
    """An ordinal for the Pareto front: the tier, then the LoRA rank within it."""
    return tier(setup) * 1000 + (0 if setup.method == "full" else min(setup.lora_rank, 999))


def offloads(setup: Setup) -> bool:
    return setup.offload_optimizer != "none" or setup.offload_params != "none"


def engine(setup: Setup) -> bool:
    """A distributed engine runs the step (DeepSpeed ZeRO or PyTorch FSDP)."""
    return setup.zero_stage > 0 or setup.fsdp != "none"


def residency(setup: Setup) -> int:
    """0: GPU-resident (no offload; on one GPU no distributed engine), 1: a distributed engine on
    one GPU without offload, 2: CPU/NVMe offload. Lower is preferred."""
    if offloads(setup):
        return 2
    return 1 if setup.gpus == 1 and engine(setup) else 0


def placement(setup: Setup) -> int:
    """:func:`residency`, with NVMe offload one step past CPU offload (3): ZeRO-Infinity swaps the
    state through a local NVMe drive, slower than host RAM and one more thing to set up, so a plan
    takes it only when no plan with CPU offload fits (host RAM) at any tier. Lower is preferred."""
    r = residency(setup)
    return 3 if r == 2 and "nvme" in (setup.offload_optimizer, setup.offload_params) else r


def extras(setup: Setup) -> int:
    """How many non-default parts a plan adds to the run: Liger's kernels (liger-kernel, Triton, CUDA),
    vLLM for GRPO's generation (another engine beside the trainer), DPO's reference log-probs
    precomputed (a pass over the data before training), the optimizer stepped in backward (one optimizer
    per parameter, no gradient clipping or accumulation), torchtune's ``compile: True`` (minutes of
    compilation before the first step; its speed-up is not modelled), Unsloth's ``unsloth_tiled_mlp=True``
    (one more MLP forward per layer: taken only where the plain step does not fit)."""
    return (int(setup.liger) + int(setup.generation != "hf") + int(setup.ref_model == "precomputed")
            + int(setup.optimizer_in_backward) + int(setup.compile) + int(setup.tiled_mlp))


def klass(setup: Setup) -> tuple[int, int]:
    """The classes a family's candidates are searched in apart: :func:`placement` (CPU and NVMe
    offload apart), then the extra parts (:func:`extras`), so a faster Liger or vLLM plan never
    hides the plain one from the alternatives."""
    return placement(setup), extras(setup)


def order(c: Candidate) -> tuple:
    """Sort key of the choice, best last: residency, tier, tokens/s, without Liger's kernels at
    equal speed (one dependency fewer), rank, less memory. Liger is a GPU-resident saver: reached
    for before offload and before a lower tier."""
    return (-residency(c.setup), tier(c.setup), c.tokens_per_s, -int(c.setup.liger), -int(c.setup.compile),
            -int(c.setup.tiled_mlp), -int(c.setup.unsloth_gc), c.setup.lora_rank if c.setup.adapters else 0,
            -c.device_total_bytes)


def best_of_class(bests: Sequence[Candidate]) -> Candidate | None:
    """The best of candidates of one placement and tier by :func:`order`, unless its extra parts
    (:func:`extras`: Liger's kernels, vLLM, precomputed reference log-probs) buy less than
    :data:`LIGER_MIN_GAIN` over the best candidate with fewer of them."""
    best = max(bests, key=order, default=None)
    if best is not None and extras(best.setup):
        plain = [c for c in bests if extras(c.setup) < extras(best.setup)]
        alt = max(plain, key=order, default=None)
        if alt is not None and best.tokens_per_s < (1 + LIGER_MIN_GAIN) * alt.tokens_per_s:
            return alt
    return best


def tier_bests(bests: Sequence[Candidate]) -> dict[int, Candidate]:
    """Per quality tier, the best candidate (:func:`best_of_class`) at the best :func:`placement`
    any candidate reaches; best tier first."""
    if not bests:
        return {}
    res = min(placement(c.setup) for c in bests)
    pool = [c for c in bests if placement(c.setup) == res]
    tiers = sorted({tier(c.setup) for c in pool}, reverse=True)
    return {t: best_of_class([c for c in pool if tier(c.setup) == t]) for t in tiers}


def pick_tier(per_tier: dict[int, Candidate]) -> int | None:
    """The best tier whose plan is at most :data:`TIER_SLOWDOWN_MAX` times slower than the fastest
    plan of every lower tier (None: no tier)."""
    for t in sorted(per_tier, reverse=True):
        lower = [c.tokens_per_s for u, c in per_tier.items() if u < t]
        if not lower or TIER_SLOWDOWN_MAX * per_tier[t].tokens_per_s >= max(lower):
            return t
    return None


def choose(bests: Sequence[Candidate]) -> Candidate | None:
    """The candidate a plan picks among the fitting ones (None: none fits): at the best placement,
    the best quality tier no more than :data:`TIER_SLOWDOWN_MAX` times slower than a lower one
    (:func:`pick_tier`), and in it the best by :func:`order` with :func:`best_of_class`'s rule for
    the extra parts."""
    per_tier = tier_bests(bests)
    t = pick_tier(per_tier)
    return None if t is None else per_tier[t]


#: A tight plan (it fits only without the margins, a ``strict=False`` search) trades up to this much speed for
#: memory: among the candidates of its placement and quality tier at most this much slower, it takes the one
#: needing the least device memory, when that frees at least :data:`TIGHT_MIN_ROOM` of the card. The headroom
#: is what such a plan lacks; the same share an extra dependency must buy in speed (:data:`LIGER_MIN_GAIN`).
TIGHT_SPEED_TOLERANCE = LIGER_MIN_GAIN
TIGHT_MIN_ROOM = 0.01


def roomiest(bests: Sequence[Candidate], chosen: Candidate, usable_bytes: int) -> Candidate:
    """For a tight plan: ``chosen`` or, at its placement and tier, the candidate needing the least memory among
    those at most :data:`TIGHT_SPEED_TOLERANCE` slower, when it frees :data:`TIGHT_MIN_ROOM` of ``usable_bytes``
    or more (e.g. Liger's kernels beside TRL's activation offloading at the same speed, 0.4 GiB less)."""
    pool = [c for c in bests if placement(c.setup) == placement(chosen.setup) and tier(c.setup) == tier(chosen.setup)
            and c.tokens_per_s * (1 + TIGHT_SPEED_TOLERANCE) >= chosen.tokens_per_s]
    best = min(pool, key=lambda c: (c.device_total_bytes, -c.tokens_per_s), default=chosen)
    return best if chosen.device_total_bytes - best.device_total_bytes >= TIGHT_MIN_ROOM * usable_bytes else chosen


def fastest_lower(bests: Sequence[Candidate], c: Candidate) -> Candidate | None:
    """The fastest of the tiers' bests (:func:`tier_bests`) below ``c``'s tier: what
    :func:`pick_tier` measured ``c`` by."""
    return max((b for t, b in tier_bests(bests).items() if t < tier(c.setup)), key=lambda b: b.tokens_per_s,
               default=None)


def passed_over(bests: Sequence[Candidate], chosen: Candidate) -> list[Candidate]:
    """The best plans of better tiers than ``chosen``'s at its placement: fitting, but more than
    :data:`TIER_SLOWDOWN_MAX` times slower than a lower tier, best tier first."""
    if placement(chosen.setup) != min((placement(c.setup) for c in bests), default=placement(chosen.setup)):
        return []
    return [c for t, c in tier_bests(bests).items() if t > tier(chosen.setup)]


def much_faster_lower_tier(bests: Sequence[Candidate], chosen: Candidate) -> Candidate | None:
    """The fastest candidate of a lower tier and no worse residency, when it is
    :data:`MUCH_FASTER` faster than ``chosen`` (a note names it; it is not chosen)."""
    lower = [c for c in bests if tier(c.setup) < tier(chosen.setup)
             and residency(c.setup) <= residency(chosen.setup)]
    quick = max(lower, key=lambda c: c.tokens_per_s, default=None)
    if quick is not None and quick.tokens_per_s >= (1 + MUCH_FASTER) * chosen.tokens_per_s:
        return quick
    return None


def front(bests: Sequence[Candidate], chosen: Candidate) -> list[Candidate]:
    """The alternatives to ``chosen``: the Pareto front of ``bests`` over (memory, tokens/s,
    quality, residency), ``chosen`` excluded, fastest first."""
    pts = [c for c in bests if c is not chosen]

    def key(c: Candidate) -> tuple:
        # larger is better in every coordinate
        return (-c.device_total_bytes, c.tokens_per_s, quality(c.setup), -residency(c.setup), -int(c.setup.liger))

    def dominated(a: Candidate) -> bool:
        ka = key(a)
        for b in bests:
            if b is a:
                continue
            kb = key(b)
            if all(x >= y for x, y in zip(kb, ka, strict=True)) and kb != ka:
                return True
        return False

    on_front = [c for c in pts if not dominated(c)]
    # at most MAX_PER_METHOD per method, spanning it: the fastest, the smallest, the best quality
    kept: list[Candidate] = []
    for method in dict.fromkeys((c.setup.method, c.setup.quant) for c in on_front):
        group = [c for c in on_front if (c.setup.method, c.setup.quant) == method]
        picks = [max(group, key=lambda c: c.tokens_per_s), min(group, key=lambda c: c.device_total_bytes),
                 max(group, key=lambda c: quality(c.setup))]
        picks += sorted(group, key=lambda c: -c.tokens_per_s)
        unique = list({id(c): c for c in picks}.values())  # Candidates hold dicts: dedupe by identity
        kept += unique[:MAX_PER_METHOD]
    return sorted(kept, key=lambda c: -c.tokens_per_s)[:MAX_ALTERNATIVES]
