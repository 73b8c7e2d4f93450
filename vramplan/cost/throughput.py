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

#: ``predictor(model, setup, gpu, stack, overrides=...) -> (tokens/s per GPU, {term: seconds per optimizer step})``;
#: ``stack`` is the record's library behaviour (:class:`vramplan.cost.model.Stack`, from its pinned versions),
#: ``overrides`` the constants the record's stack replaces (:func:`record_overrides`)
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
    def gpu_class(self) -> str:
        return gpu_class(self.gpu)

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


def sixteen_bit_adapters(record: dict) -> bool:
    """The run's LoRA adapters ran in 16 bits (peft < 0.12; ``config.adapter_dtype``), not peft 0.12+'s fp32."""
    return (record.get("config") or {}).get("adapter_dtype") == "bf16"


def record_overrides(record: dict) -> dict[str, float]:
    """The constants the record's stack replaces (:data:`vramplan.cost.constants.ADAPTER_16BIT_OVERRIDES`)."""
    from .constants import ADAPTER_16BIT_OVERRIDES

    return dict(ADAPTER_16BIT_OVERRIDES) if sixteen_bit_adapters(record) else {}


def gpu_class(gpu: str) -> str:
    """The GPU's class: its MFU class (:data:`vramplan.cost.constants.MFU_CLASS`), else the card itself."""
    from .constants import MFU_CLASS

    return MFU_CLASS.get(gpu, gpu)


def record_gpu_model(record: dict) -> tuple[ModelSpec, GpuSpec]:
    from ..model.profiles import load_gpu, load_model

    return load_model(record["model"]), load_gpu(record["gpu"])


def cost_model_predictor(model: ModelSpec, setup: Setup, gpu: GpuSpec, stack=None,
                         overrides=None) -> tuple[float, dict[str, float]]:
    """The shipped cost model: :func:`vramplan.cost.model.step_cost` on one node; tokens/s per GPU."""
    from .model import CONSTANTS, STACK, step_cost

    c = step_cost(model, setup, gpu, 1, None, stack or STACK, {**CONSTANTS, **(overrides or {})})
    return c.tokens_per_s / setup.gpus, c.terms()


def compare(records: Iterable[dict], predictor: Predictor | None = None) -> list[ThroughputRow]:
    """A :class:`ThroughputRow` per comparable record, in record order."""
    predictor = predictor or cost_model_predictor
    out = []
    for r in comparable(records):
        setup = record_setup(r)
        model, gpu = record_gpu_model(r)
        predicted, terms = predictor(model, setup, gpu, record_stack(r), overrides=record_overrides(r))
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


#: The bar per GPU class (issue 30): held-out median predicted/measured in this band, on at least
#: :data:`CLASS_BAR_MIN_ROWS` rows, on at least :data:`BAR_CLASSES` classes.
RATIO_BAND = (0.85, 1.15)
CLASS_BAR_MIN_ROWS = 2
BAR_CLASSES = 3


@dataclass(frozen=True)
class ClassSummary:
    """One GPU class: its rows in-sample and held out, and what its MFU is fitted on."""

    gpu_class: str
    gpus: tuple[str, ...]
    in_sample: ThroughputSummary
    #: each row predicted by constants fitted without it (:func:`vramplan.cost.fit.leave_one_out`)
    held_out: ThroughputSummary
    #: the class's MFU constant (``inv_mfu:<class>``), None where the class keeps the unfitted default
    constant: str | None
    mfu: float
    #: ids of the rows the class's MFU was fitted on (stage 1: the shared rows of the class)
    fitted_on: tuple[str, ...]
    #: ids of the class's rows no constant was fitted on (out-of-sample checks)
    checks: tuple[str, ...]

    @property
    def meets(self) -> bool:
        lo, hi = RATIO_BAND
        return self.held_out.rows >= CLASS_BAR_MIN_ROWS and lo <= self.held_out.median_ratio <= hi


def by_class(rows: Sequence[ThroughputRow], held_out: Sequence[ThroughputRow], fit) -> list[ClassSummary]:
    """Per GPU class (:func:`gpu_class`), most rows first: ``rows`` in-sample, ``held_out`` the same rows
    left out one at a time, ``fit`` the :class:`vramplan.cost.fit.Fit` that says what was fitted on what."""
    from .model import mfu

    loo = {r.id: r for r in held_out}
    classes: dict[str, list[ThroughputRow]] = {}
    for r in rows:
        classes.setdefault(r.gpu_class, []).append(r)
    out = []
    for cls, members in sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        key = f"inv_mfu:{cls}"
        fitted = key in fit.fitted_on
        ids = {r.id for r in members}
        out.append(ClassSummary(
            gpu_class=cls, gpus=tuple(sorted({r.gpu for r in members})), in_sample=summarize(members),
            held_out=summarize([loo[r.id] for r in members]), constant=key if fitted else None,
            mfu=mfu(_gpu(members[0].gpu), fit.constants),
            fitted_on=tuple(i for i in fit.fitted_on.get(key, ()) if i in ids),
            checks=tuple(r.id for r in members if fit.role.get(r.id) == "check")))
    return out


def _gpu(name: str) -> GpuSpec:
    from ..model.profiles import load_gpu

    return load_gpu(name)


def bar_met(classes: Sequence[ClassSummary]) -> bool:
    return sum(c.meets for c in classes) >= BAR_CLASSES


def coverage(rows: Sequence[ThroughputRow], fit) -> dict[str, list[str]]:
    """The shipped GPU profiles by what backs their tokens/s: ``measured`` (a comparable row on the card),
    ``class_only`` (no row, but in a fitted MFU class), ``none`` (the unfitted default MFU)."""
    from ..model.profiles import gpus
    from .model import mfu_key

    seen = {r.gpu for r in rows}
    out: dict[str, list[str]] = {"measured": [], "class_only": [], "none": []}
    for g in sorted(gpus(), key=lambda g: g.name):
        key = mfu_key(g)
        kind = "measured" if g.name in seen else ("class_only" if key and key in fit.fitted_on else "none")
        out[kind].append(g.name)
    return out
