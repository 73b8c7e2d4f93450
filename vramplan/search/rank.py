"""The objective: which fitting candidate a plan chooses, and which others it lists.

**Ranking**: the highest useful rate (tokens/s x FLOPs per token) wins, except that among
candidates within :data:`SPEED_TOLERANCE` of the best the highest :func:`quality` wins; equal
quality falls back to tokens/s, then to less memory. **Alternatives**: the Pareto front over
(memory, tokens/s, quality), at most :data:`MAX_PER_METHOD` per method and
:data:`MAX_ALTERNATIVES` in all. A new objective is a new ``choose`` (and ``front``) here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..specs import Setup
from .verdicts import Candidate

#: Plans within this fraction of the fastest count as equally fast; quality breaks the tie.
SPEED_TOLERANCE = 0.10
#: How many alternatives the plan lists, and at most how many of one method (base included).
MAX_ALTERNATIVES = 8
MAX_PER_METHOD = 3


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


def choose(bests: Sequence[Candidate], useful_rate: Callable[[Candidate], float]) -> Candidate | None:
    """The candidate a plan picks among the families' fastest fitting ones (None: none fits)."""
    if not bests:
        return None
    best_rate = max(useful_rate(c) for c in bests)
    close = [c for c in bests if useful_rate(c) >= (1 - SPEED_TOLERANCE) * best_rate]
    return max(close, key=lambda c: (quality(c.setup), c.tokens_per_s, -c.device_total_bytes))


def front(bests: Sequence[Candidate], chosen: Candidate) -> list[Candidate]:
    """The alternatives to ``chosen``: the Pareto front of ``bests`` over (memory, tokens/s,
    quality), ``chosen`` excluded, fastest first."""
    pts = [c for c in bests if c is not chosen]

    def dominated(a: Candidate) -> bool:
        for b in bests:
            if b is a:
                continue
            no_worse = (b.device_total_bytes <= a.device_total_bytes and b.tokens_per_s >= a.tokens_per_s
                        and quality(b.setup) >= quality(a.setup))
            better = (b.device_total_bytes < a.device_total_bytes or b.tokens_per_s > a.tokens_per_s
                      or quality(b.setup) > quality(a.setup))
            if no_worse and better:
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
