"""The search proper: per family, the fastest saver configuration at its largest fitting
micro-batch (monotone feasibility, branch and bound, seeded bisection; see the package docstring).

:class:`Search` walks the :class:`~vramplan.search.space.Space` and asks its
:class:`~vramplan.search.evaluate.Evaluator`; its own state is one hint per setup-but-its-rank
(the index of a lower rank's largest micro-batch). :class:`Result` is what a run found; which
of it is chosen is :mod:`vramplan.search.rank`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..specs import ModelSpec, Setup
from . import rank
from .evaluate import Evaluator
from .geometry import BatchShape, Target
from .space import Space, placement_key, rank_key, saving
from .verdicts import Candidate

#: Largest micro-batch probed when reporting "the biggest micro-batch that fits".
MAX_PROBED_MICRO_BATCH = 4096


class Search:
    """One search over the free knobs for one target."""

    def __init__(self, model: ModelSpec, target: Target, shape: BatchShape, fixed: dict[str, Any],
                 band: float | None, strict: bool = True, ranks: tuple[int, ...] | None = None,
                 brief: bool = False):
        self.space = Space(model, target, shape, fixed, ranks)
        self.ev = Evaluator(model, target, shape, band, strict)
        self.mb_hint: dict[tuple, int] = {}  # setup but its rank -> index of a lower rank's largest micro-batch
        #: only what the choice reads (a plan without its words): once a candidate fits at a placement
        #: (:func:`~.rank.placement`), the classes past it are not searched, nor an infeasible family's
        #: floors, since :func:`~.rank.tier_bests` keeps the best placement any candidate reaches
        self.brief = brief
        self.best_placement: int | None = None  # the best placement of a fitting candidate so far

    @property
    def shape(self) -> BatchShape:
        return self.space.shape

    @property
    def target(self) -> Target:
        return self.space.target

    # -- the micro-batch ------------------------------------------------------------------------

    def largest_fitting(self, setup: Setup, first: Candidate, at: int) -> Candidate:
        """The largest allowed micro-batch that fits, given that ``mbs[at]`` does (``first``)."""
        ev, mbs = self.ev, self.shape.micro_batches
        best, lo, hi = first, at, len(mbs)  # mbs[lo] fits; mbs[hi] (if any) does not
        if lo + 1 >= hi:
            return best
        if lo:  # from a lower rank's answer: usually the next one fails (known without an estimate)
            return self._step_then_bisect(setup, best, lo, hi)
        second = ev.judge(ev.at_micro(setup, mbs[1]))
        if not second.fits:
            return best
        best, lo = second, 1
        # seed: extrapolate linearly from the first two
        slope = (second.device_total_bytes - first.device_total_bytes) / max(mbs[1] - mbs[0], 1)
        if slope > 0:
            room = ev.limit(first.breakdown) - first.device_total_bytes
            guess_mb = mbs[0] + room / slope
            guess = max(i for i, m in enumerate(mbs) if i <= 1 or m <= guess_mb)
        else:
            guess = len(mbs) - 1
        if guess > lo:
            c = ev.judge(ev.at_micro(setup, mbs[guess]))
            if c.fits:
                best, lo = c, guess
            else:
                hi = guess
        return self._step_then_bisect(setup, best, lo, hi)

    def _step_then_bisect(self, setup: Setup, best: Candidate, lo: int, hi: int) -> Candidate:
        """Given ``mbs[lo]`` fits (``best``) and ``mbs[hi]`` does not (or is past the end): try the
        next micro-batch first (usually the answer), then bisect what is left."""
        ev, mbs = self.ev, self.shape.micro_batches
        if lo + 1 < hi:
            nxt = ev.judge(ev.at_micro(setup, mbs[lo + 1]))
            if not nxt.fits:
                return best
            best, lo = nxt, lo + 1
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            c = ev.judge(ev.at_micro(setup, mbs[mid]))
            if c.fits:
                best, lo = c, mid
            else:
                hi = mid
        return best

    def fitting_micro_batch(self, setup: Setup) -> Candidate | None:
        """``setup`` at its largest fitting micro-batch, or None if even the smallest fails.

        A lower rank's answer for the same setup is the first guess: memory grows with the rank,
        so the micro-batch above it is known to fail and, when the guess fits, one estimate does."""
        ev, mbs = self.ev, self.shape.micro_batches
        key = rank_key(ev.at_micro(setup, mbs[0])) if setup.adapters else None
        hint = self.mb_hint.get(key, 0) if key is not None else 0
        found = None
        if hint:
            guess = ev.judge(ev.at_micro(setup, mbs[hint]))
            if guess.fits:
                found = self.largest_fitting(setup, guess, hint)
        if found is None:
            first = ev.judge(ev.at_micro(setup, mbs[0]))
            if not first.fits:
                return None
            found = self.largest_fitting(setup, first, 0)
        if key is not None:
            self.mb_hint[key] = mbs.index(found.setup.batch)
        return found

    def biggest_micro_batch(self, setup: Setup) -> int:
        """The largest micro-batch (any integer) at which ``setup`` still fits, grad accum aside."""
        lo, hi = setup.batch, None
        while hi is None:
            trial = lo * 2
            if trial > MAX_PROBED_MICRO_BATCH:
                return lo
            if self.ev.judge(setup.replace(batch=trial)).fits:
                lo = trial
            else:
                hi = trial
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if self.ev.judge(setup.replace(batch=mid)).fits:
                lo = mid
            else:
                hi = mid
        return lo

    # -- families -------------------------------------------------------------------------------

    def family_best(self, family: Setup) -> tuple[list[Candidate], Candidate | None]:
        """(per residency class, the family's fastest fitting candidate; its smallest-memory
        candidate at micro-batch 1). Classes (:func:`~.rank.residency`: resident, an engine on one
        GPU, offload) are searched apart, so a faster offload plan never hides a resident one."""
        ev = self.ev
        configs = self.space.savers(family)
        mb0 = self.shape.micro_batches[0]
        # monotone feasibility per placement: a config with every saver it can take on is a floor there;
        # savers that exclude each other (Liger's kernels and TRL's activation offloading) give several
        floors = _floors(configs)
        verdict: dict[tuple, bool] = {}
        lowest: Candidate | None = None

        def feasible(key: tuple) -> bool:
            nonlocal lowest
            if key not in verdict:
                verdict[key] = False
                for floor in floors[key]:
                    judged = ev.judge(ev.at_micro(floor, mb0))
                    verdict[key] = verdict[key] or judged.fits
                    if judged.breakdown is not None and (lowest is None
                                                         or judged.device_total_bytes < lowest.device_total_bytes):
                        lowest = judged
            return verdict[key]

        bests: list[Candidate] = []
        classes = [rank.klass(s) for s in configs]
        for cls in sorted(set(classes)):  # (placement, extras): the best placement first
            if self.brief and self.best_placement is not None and cls[0] > self.best_placement:
                break
            best: Candidate | None = None
            group = [s for s, k in zip(configs, classes, strict=True) if k == cls]
            ranked = sorted(((ev.speed_bound(s), i, s) for i, s in enumerate(group)), key=lambda t: (-t[0], t[1]))
            for bound, _, s in ranked:
                if best is not None and bound <= best.tokens_per_s:
                    break
                if not feasible(placement_key(s)):
                    continue
                c = self.fitting_micro_batch(s)
                # equal speed: less memory (rank.order's last key), e.g. the smaller of two vLLM shares
                if c is not None and (best is None or (c.tokens_per_s, -c.device_total_bytes)
                                      > (best.tokens_per_s, -best.device_total_bytes)):
                    best = c
            if best is not None:
                bests.append(best)
                if self.brief:
                    self.best_placement = cls[0] if self.best_placement is None else min(self.best_placement, cls[0])
        if not bests and not (self.brief and self.best_placement is not None):
            for key in floors:  # infeasible: every floor was judged; report the smallest
                feasible(key)
        return bests, lowest

    def refine_micro_batch(self, c: Candidate) -> Candidate:
        """With the micro-batch free (no global batch, none fixed), the largest micro-batch that
        fits, not only the largest power of two, when it is faster (what the note names)."""
        if self.shape.per_gpu is not None or len(self.shape.micro_batches) < 2:
            return c
        cap = self.shape.micro_batches[-1]
        biggest = min(self.biggest_micro_batch(c.setup), cap)
        if biggest <= c.setup.batch:
            return c
        better = self.ev.judge(self.ev.at_micro(c.setup, biggest))
        return better if better.fits and better.tokens_per_s > c.tokens_per_s else c

    def smallest_micro_batch(self, c: Candidate) -> Candidate:
        """With the micro-batch free, ``c`` at the smallest micro-batch of the search (a tight plan's:
        the most headroom inside the card, the error band aside), when it fits."""
        if self.shape.per_gpu is not None or len(self.shape.micro_batches) < 2:
            return c
        smallest = self.shape.micro_batches[0]
        if c.setup.batch <= smallest:
            return c
        small = self.ev.judge(self.ev.at_micro(c.setup, smallest))
        return small if small.fits else c

    def run(self) -> Result:
        families = self.space.families()  # SpecError, saying why, when there are none
        bests: list[Candidate] = []
        floors: list[Candidate] = []
        for fam in families:
            found, lowest = self.family_best(fam)
            bests += found
            if lowest is not None:
                floors.append(lowest)
        return Result(self, families, bests, floors)


def _floors(configs: list[Setup]) -> dict[tuple, list[Setup]]:
    """Per placement, a config for each saver set no other set there includes (:func:`saving`, compared
    element by element), the lexicographically largest first: one, every saver on, unless two savers
    exclude each other."""
    by_key: dict[tuple, dict[tuple, Setup]] = {}
    for s in configs:
        by_key.setdefault(placement_key(s), {}).setdefault(saving(s), s)
    out: dict[tuple, list[Setup]] = {}
    for key, sets in by_key.items():
        def dominated(t: tuple, sets=sets) -> bool:
            return any(u != t and all(x >= y for x, y in zip(u, t, strict=True)) for u in sets)

        out[key] = [sets[t] for t in sorted(sets, reverse=True) if not dominated(t)]
    return out


@dataclass
class Result:
    """What one search found: the families it searched, each family's fastest fitting candidate
    and each family's smallest-memory candidate."""

    search: Search
    families: list[Setup]
    bests: list[Candidate]  # per family and residency class, fitting
    floors: list[Candidate]  # per family, smallest memory seen

    def choose(self) -> Candidate | None:
        """The chosen candidate (:func:`~.rank.choose`), at its largest fitting micro-batch. Each
        tier's best is refined first, so the tier rule (:func:`~.rank.pick_tier`) compares the
        speeds the plans would run at."""
        tiers = rank.tier_bests(self.bests)
        for c in tiers.values() if len(tiers) > 1 else ():
            self._replace(c, self.search.refine_micro_batch(c))
        chosen = rank.choose(self.bests)
        return None if chosen is None else self._replace(chosen, self.search.refine_micro_batch(chosen))

    def choose_tight(self) -> Candidate | None:
        """The choice when nothing fits inside the margins (a ``strict=False`` search): :meth:`choose`'s
        candidate, or a roomier one about as fast (:func:`~.rank.roomiest`), at its smallest micro-batch, so
        that the step keeps what headroom the card allows."""
        chosen = self.choose()
        if chosen is None:
            return None
        chosen = self._replace(chosen, self.search.smallest_micro_batch(chosen))
        pool = [self._replace(c, self.search.smallest_micro_batch(c)) for c in list(self.bests)]
        return rank.roomiest(pool, chosen, self.search.ev.target.gpu.usable_memory_bytes)

    def _replace(self, old: Candidate, new: Candidate) -> Candidate:
        """``new`` in ``old``'s place among the bests (a refined micro-batch of it)."""
        if new is not old:
            self.bests[self.bests.index(old)] = new
        return new

    def fastest(self) -> float | None:
        return max((c.tokens_per_s for c in self.bests), default=None)

    def gpu_floor(self) -> float | None:
        """The least GPU memory any estimated setup of this search needs, host-RAM failures
        aside (None when there was none)."""
        seen = [c for c in self.search.ev.failures if c.breakdown is not None and not c.host_ram_bound]
        return min((c.device_total_bytes for c in seen + self.bests), default=None)
