"""Published fine-tuning throughput vs the cost model: pure functions, torch-free, no printing.

The records are ``calibration/throughput/records.jsonl`` (built by ``calibration/throughput/build.py``
from the published tables it cites; ``docs/schema/throughput_record.json``). For every comparable
record :func:`compare` predicts tokens/s per GPU with a cost model (by default
:func:`vramplan.cost.model.step_cost`) and returns a :class:`ThroughputRow`; :func:`summarize` gives the
median predicted/measured ratio, its spread, and how many same-model pairs the prediction orders as
the measurements do.

A **pair** is every two comparable rows with the same model, the same GPU and the same GPU count whose
measured tokens/s per GPU differ by more than :data:`PAIR_MIN_GAP` (the larger over the smaller above
1.05; closer rows are within the noise of one published run). A pair is **ordered** when the
prediction puts the two rows in the same order as the measurement; a predicted tie is not ordered.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..specs import GpuSpec, ModelSpec, Setup

#: the records shipped with the repository
RECORDS_PATH = Path(__file__).resolve().parents[2] / "calibration" / "throughput" / "records.jsonl"
#: measured throughputs closer than this (relative) do not make a pair
PAIR_MIN_GAP = 0.05

#: ``predictor(model, setup, gpu, stack) -> (tokens/s per GPU, {term: seconds per optimizer step})``;
#: ``stack`` is the record's library behaviour (:class:`vramplan.cost.model.Stack`, from its pinned versions)
Predictor = Callable[..., tuple[float, dict[str, float]]]


@dataclass(frozen=True)
class ThroughputRow:
    """One comparable published row: measured and predicted tokens/s per GPU."""

    id: str
    model: str
    gpu: str
    gpus: int
    setup: Setup
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    terms_s: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """predicted / measured"""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s

    @property
    def group(self) -> tuple[str, str, int]:
        """What two rows must share to make a pair: model, GPU, GPU count."""
        return (self.model, self.gpu, self.gpus)


@dataclass(frozen=True)
class Pair:
    a: ThroughputRow
    b: ThroughputRow

    @property
    def ordered(self) -> bool:
        dm = self.a.measured_tokens_per_s - self.b.measured_tokens_per_s
        dp = self.a.predicted_tokens_per_s - self.b.predicted_tokens_per_s
        return dp != 0 and (dm > 0) == (dp > 0)


@dataclass(frozen=True)
class ThroughputSummary:
    rows: int
    median_ratio: float
    min_ratio: float
    max_ratio: float
    #: max_ratio / min_ratio
    spread: float
    pairs: int
    pairs_ordered: int

    @property
    def pair_share(self) -> float:
        """Share of pairs ordered as measured (1.0 when there are no pairs)."""
        return self.pairs_ordered / self.pairs if self.pairs else 1.0


def load_records(path: Path | str | None = None) -> list[dict]:
    """Every record of the JSONL file (default :data:`RECORDS_PATH`), in file order."""
    text = Path(path or RECORDS_PATH).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def comparable(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("comparable")]


def record_setup(record: dict) -> Setup:
    return Setup(**record["setup"])


def record_stack(record: dict):
    """The :class:`vramplan.cost.model.Stack` of the record's pinned library versions."""
    from .model import stack_of

    return stack_of(record.get("software"))


def record_gpu_model(record: dict) -> tuple[ModelSpec, GpuSpec]:
    from ..model.profiles import load_gpu, load_model

    return load_model(record["model"]), load_gpu(record["gpu"])


def cost_model_predictor(model: ModelSpec, setup: Setup, gpu: GpuSpec, stack=None) -> tuple[float, dict[str, float]]:
    """The shipped cost model: :func:`vramplan.cost.model.step_cost` on one node; tokens/s per GPU."""
    from .model import STACK, step_cost

    c = step_cost(model, setup, gpu, 1, None, stack or STACK)
    return c.tokens_per_s / setup.gpus, c.terms()


def compare(records: Iterable[dict], predictor: Predictor | None = None) -> list[ThroughputRow]:
    """A :class:`ThroughputRow` per comparable record, in record order."""
    predictor = predictor or cost_model_predictor
    out = []
    for r in comparable(records):
        setup = record_setup(r)
        model, gpu = record_gpu_model(r)
        predicted, terms = predictor(model, setup, gpu, record_stack(r))
        out.append(ThroughputRow(id=r["id"], model=r["model"], gpu=r["gpu"], gpus=setup.gpus, setup=setup,
                                 measured_tokens_per_s=float(r["tokens_per_s_per_gpu"]),
                                 predicted_tokens_per_s=float(predicted), terms_s=dict(terms)))
    return out


def pairs(rows: Sequence[ThroughputRow], min_gap: float = PAIR_MIN_GAP) -> list[Pair]:
    """Every two rows of the same model, GPU and GPU count whose measurements differ by more than
    ``min_gap`` (larger / smaller > 1 + min_gap), in row order."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a.group != b.group:
                continue
            hi = max(a.measured_tokens_per_s, b.measured_tokens_per_s)
            lo = min(a.measured_tokens_per_s, b.measured_tokens_per_s)
            if hi > lo * (1.0 + min_gap):
                out.append(Pair(a, b))
    return out


def summarize(rows: Sequence[ThroughputRow], min_gap: float = PAIR_MIN_GAP) -> ThroughputSummary:
    if not rows:
        raise ValueError("no comparable rows to summarize")
    ratios = [r.ratio for r in rows]
    ps = pairs(rows, min_gap)
    lo, hi = min(ratios), max(ratios)
    return ThroughputSummary(rows=len(rows), median_ratio=statistics.median(ratios), min_ratio=lo, max_ratio=hi,
                             spread=hi / lo, pairs=len(ps), pairs_ordered=sum(p.ordered for p in ps))
