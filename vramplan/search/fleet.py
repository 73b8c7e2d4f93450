"""Which GPU, how many, how long, how much (issue 30): the best plan on each card and GPU count for a whole
run, its hours and dollars, and the cheapest and the fastest.

``compare(model, cards, dataset_tokens=N, epochs=E, prices=...)`` plans ``model`` (:func:`planner.plan`,
everything the user fixed kept) on each card at 1, 2, 4 and 8 GPUs (``max_gpus``; beyond 8, whole nodes of
8), and for every plan that fits: ``hours = N * E / tokens_per_s / 3600`` and ``usd = hours * gpus *
usd_per_gpu_hour`` (:mod:`vramplan.cost.prices`: the shipped table's rent, an owned GeForce card's
electricity, or the user's price). ``rank_by`` ``cost`` orders the rows by dollars (then hours), ``time``
by hours (then dollars); ``budget`` (USD) and ``deadline`` (hours) drop the rows over them and say how
many. The band of the cost model is not on the figures yet (issue 30 part 4)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost.prices import PriceTable, price_of
from ..setup.wording import describe
from ..specs import GpuSpec, Plan, Setup, SpecError

__all__ = ["CLASSES", "Fleet", "FleetOption", "cards_for", "compare", "counts", "option_of"]

#: ``--gpu any``/``consumer``/``cloud``: the cards each names (``any``: every card the price table rents
#: plus the common owned GeForce cards)
CLASSES = {
    "consumer": ("rtx-3060-12gb", "rtx-4060-ti-16gb", "rtx-3090", "rtx-4090", "rtx-5090"),
    "cloud": ("t4", "l4", "a10g", "rtx-a6000", "l40s", "a100-40gb", "a100-80gb", "h100-sxm", "h200"),
}
RANKS = ("cost", "time")


@dataclass(frozen=True)
class FleetOption:
    """One card and count: its plan in one line, its speed, and the run's hours and dollars."""

    gpu: str
    gpu_display: str
    gpus: int
    nodes: int
    setup: Setup
    plan_line: str
    tokens_per_s: float
    hours: float
    usd: float | None
    usd_per_gpu_hour: float | None
    price_kind: str | None
    price_source: str | None

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "gpu_display": self.gpu_display, "gpus": self.gpus, "nodes": self.nodes,
                "setup": self.setup.to_dict(), "plan": self.plan_line, "tokens_per_s": self.tokens_per_s,
                "hours": round(self.hours, 4), "usd": None if self.usd is None else round(self.usd, 2),
                "usd_per_gpu_hour": self.usd_per_gpu_hour, "price_kind": self.price_kind,
                "price_source": self.price_source}


@dataclass(frozen=True)
class Fleet:
    """The rows (best first by ``rank_by``), the cheapest and the fastest (indices into ``options``),
    and what was left out and why."""

    model: str
    dataset_tokens: int
    epochs: int
    rank_by: str
    options: tuple[FleetOption, ...]
    cheapest: int | None
    fastest: int | None
    price_date: str
    cut: tuple[str, ...]
    no_fit: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "dataset_tokens": self.dataset_tokens, "epochs": self.epochs,
                "rank_by": self.rank_by, "options": [o.to_json() for o in self.options],
                "cheapest": self.cheapest, "fastest": self.fastest, "price_date": self.price_date,
                "cut": list(self.cut), "no_fit": list(self.no_fit)}


def cards_for(text: str) -> list[GpuSpec]:
    """``any``, ``consumer``, ``cloud`` or a comma-separated list of GPU names -> the cards (each once)."""
    from ..model.profiles import load_gpu

    names: list[str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "any":
            names += [*CLASSES["cloud"], *CLASSES["consumer"]]
        elif item in CLASSES:
            names += CLASSES[item]
        else:
            names.append(item)
    if not names:
        raise SpecError("--gpu: name a GPU, a comma-separated list, or any / consumer / cloud")
    cards = [load_gpu(n) for n in names]
    return list({c.name: c for c in cards}.values())


def counts(max_gpus: int) -> list[int]:
    """1, 2, 4, 8 up to ``max_gpus``; beyond a node, whole nodes of 8 (16, 32, ...)."""
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise SpecError(f"--max-gpus must be a positive integer; got {max_gpus!r}")
    out = [n for n in (1, 2, 4, 8) if n <= max_gpus]
    n = 16
    while n <= max_gpus:
        out.append(n)
        n *= 2
    return out


def option_of(p: Plan, card: GpuSpec, gpus: int, nodes: int, tokens: int, prices: PriceTable) -> FleetOption:
    """One fitting plan as a row: hours for ``tokens`` (dataset x epochs) and dollars at the card's price."""
    hours = tokens / p.tokens_per_s / 3600
    price = price_of(prices, card)
    usd = None if price is None else hours * gpus * price.usd_per_gpu_hour
    return FleetOption(card.name, card.display_name or card.name, gpus, nodes, p.setup, describe(p.setup),
                       p.tokens_per_s, hours, usd, None if price is None else round(price.usd_per_gpu_hour, 4),
                       None if price is None else price.kind, None if price is None else price.source)


def _order(rank_by: str) -> Callable[[FleetOption], tuple]:
    inf = float("inf")
    if rank_by == "time":
        return lambda o: (o.hours, inf if o.usd is None else o.usd)
    return lambda o: (inf if o.usd is None else o.usd, o.hours)


def compare(model: str, cards: Sequence[GpuSpec], *, dataset_tokens: int, epochs: int = 1, max_gpus: int = 8,
            prices: PriceTable, rank_by: str = "cost", budget: float | None = None, deadline: float | None = None,
            plan_one: Callable[..., Plan], **fixed: Any) -> Fleet:
    """The rows of every card and count that fits (module docstring). ``plan_one(model, card, gpus=,
    nodes=, relax=, details=, **fixed)`` plans one (the command passes :func:`planner.plan` with the card's
    calibration); a row reads only the plan's setup, fit and speed, so it is asked for no alternatives,
    why-not lines or notes (``details=False``)."""
    if rank_by not in RANKS:
        raise SpecError(f"--rank-by must be one of {', '.join(RANKS)}; got {rank_by!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise SpecError(f"--epochs must be a positive integer; got {epochs!r}")
    for name, value in (("--budget", budget), ("--deadline", deadline)):
        if value is not None and not (value > 0 and value < float("inf")):
            raise SpecError(f"{name} must be a positive number; got {value!r}")
    tokens = dataset_tokens * epochs
    options, no_fit = [], []
    for card in cards:
        for n in counts(max_gpus):
            nodes = max(1, n // 8)
            p = plan_one(model, card, gpus=n, nodes=nodes, relax=False, details=False, **fixed)
            if p.fits and p.tokens_per_s:
                options.append(option_of(p, card, n, nodes, tokens, prices))
            else:
                no_fit.append(f"{card.name} x {n}")
    cut = []
    if budget is not None:
        over = [o for o in options if o.usd is not None and o.usd > budget]
        options = [o for o in options if o not in over]
        if over:
            cut.append(f"{len(over)} over the ${budget:,.2f} budget")
    if deadline is not None:
        late = [o for o in options if o.hours > deadline]
        options = [o for o in options if o not in late]
        if late:
            cut.append(f"{len(late)} over the {deadline:g} h deadline")
    options.sort(key=_order(rank_by))
    priced = [i for i, o in enumerate(options) if o.usd is not None]
    cheapest = min(priced, key=lambda i: (options[i].usd, options[i].hours), default=None)
    fastest = min(range(len(options)), key=lambda i: (options[i].hours, options[i].usd or 0.0), default=None)
    return Fleet(model=model, dataset_tokens=dataset_tokens, epochs=epochs, rank_by=rank_by,
                 options=tuple(options), cheapest=cheapest, fastest=fastest, price_date=prices.date,
                 cut=tuple(cut), no_fit=tuple(no_fit))
