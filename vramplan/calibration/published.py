"""Estimate vs published real-GPU peaks (calibration/published/records.jsonl; issue 13).

Pure functions, no torch, no printing: ``load_records`` reads the records, ``compare`` estimates
each comparable one and returns typed rows, ``summarize`` groups them (per source, method,
quantity, family), ``token_slopes`` pairs rows that differ only in the micro-batch (what one more
token costs, measured and estimated: per-token gaps apart from constant ones), ``step_intercepts``
their constant above the allocation after training (which moment of the step the peak is) and
``excluded`` lists the rows set aside with their reasons. The caller
(``benchmarks/published_accuracy.py``, ``vramplan validate --published``) prints.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..estimator import DEFAULT_CORRECTIONS, Corrections, estimate
from ..estimator.fsdp import fsdp_memory
from ..estimator.stack import stack_from_versions
from ..model.profiles import load_gpu, load_model
from ..specs import Breakdown, ModelSpec, Setup, SpecError

#: the records file in a source checkout (calibration/ does not ship in the wheel)
RECORDS = Path(__file__).resolve().parents[2] / "calibration" / "published" / "records.jsonl"

#: record quantity -> the Breakdown number it is compared with
QUANTITY_FIELD = {"allocated": "peak_allocated_bytes", "reserved": "peak_reserved_bytes",
                  "device_total": "device_total_bytes"}

#: an under-estimate beyond this share of the measurement counts against the estimator
UNDER = 0.03

#: a second number of the same run: secondary_measurements key -> (quantity, bytes per unit).
#: fms-acceleration publishes the nvidia-smi peak (MiB, mean over the run's GPUs) beside allocated.
SECONDARY = {"nvidia_smi_peak_memory_used_MiB_mean_over_devices": ("device_total", 2**20)}


@dataclass(frozen=True)
class PublishedRow:
    """One comparable record against its estimate. ``error`` = estimated / measured - 1."""

    id: str
    source: str  # repository
    model: str
    method: str
    quantity: str
    family: str  # model_type
    estimated_bytes: int
    measured_bytes: int
    phase: str
    approximated: bool  # the record lists approximations (knobs close to, not exactly, a Setup)

    @property
    def error(self) -> float:
        return self.estimated_bytes / self.measured_bytes - 1


@dataclass(frozen=True)
class Excluded:
    id: str
    source: str
    reason: str


@dataclass(frozen=True)
class Summary:
    """One group of rows: count, median and 90th percentile of |error|, the worst error (signed)
    and the share of rows under-estimated by more than ``UNDER``."""

    group: str  # source | method | quantity | family | approximated | all
    key: str
    rows: int
    median_abs_error: float
    p90_abs_error: float
    worst_error: float
    under_share: float


def load_records(path: str | Path | None = None) -> list[dict]:
    with open(path or RECORDS) as f:
        return [json.loads(line) for line in f if line.strip()]


def resolve_model(ref: str) -> ModelSpec:
    """A record's model: a shipped name, else a config added under profiles/models/ by HF id."""
    try:
        return load_model(ref)
    except SpecError:
        file = resources.files("vramplan.profile_data") / "models" / (ref.replace("/", "--") + ".json")
        if not file.is_file():
            raise
        return load_model(str(file))


def estimate_record(record: dict, corrections: Corrections = DEFAULT_CORRECTIONS) -> Breakdown:
    """The record's estimate, for the transformers version it states (estimator/stack.py), with
    ``corrections`` (the published device terms, the raw model, by default)."""
    return estimate(resolve_model(record["model"]), Setup.from_dict(record["setup"]), load_gpu(record["gpu"]),
                    corrections, stack=stack_from_versions(record.get("versions", {})))


def record_family(record: dict) -> str:
    return resolve_model(record["model"]).model_type


def compare(records: Iterable[dict], estimator: Callable[[dict], Breakdown] = estimate_record,
            family: Callable[[dict], str] = record_family) -> list[PublishedRow]:
    """Every comparable record against its estimate: the number for its quantity, and a second row
    for a second number of the same run (:data:`SECONDARY`: nvidia-smi beside allocated);
    ``estimator`` and ``family`` are seams for tests (and calibration passes its corrections)."""
    rows = []
    for r in records:
        if not r["comparable"]:
            continue
        est = estimator(r)
        measured = [(r["quantity"], int(r["measured_bytes"]))]
        for key, (quantity, unit) in SECONDARY.items():
            value = (r.get("secondary_measurements") or {}).get(key)
            if isinstance(value, (int, float)) and value > 0:
                measured.append((quantity, int(value * unit)))
        fam = family(r)
        for quantity, measured_bytes in measured:
            rows.append(PublishedRow(
                id=r["id"], source=r["source"]["repo"], model=r["model"], method=r["setup"]["method"],
                quantity=quantity, family=fam, estimated_bytes=int(getattr(est, QUANTITY_FIELD[quantity])),
                measured_bytes=measured_bytes, phase=est.phase, approximated=bool(r.get("approximations"))))
    return rows


def excluded(records: Iterable[dict]) -> list[Excluded]:
    return [Excluded(r["id"], r["source"]["repo"], r["exclusion"]) for r in records if not r["comparable"]]


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_of(group: str, key: str, rows: list[PublishedRow]) -> Summary:
    errs = [r.error for r in rows]
    absd = [abs(e) for e in errs]
    return Summary(group=group, key=key, rows=len(rows), median_abs_error=statistics.median(absd),
                   p90_abs_error=_percentile(absd, 0.9), worst_error=max(errs, key=abs),
                   under_share=sum(e < -UNDER for e in errs) / len(errs))


GROUPS: dict[str, Callable[[PublishedRow], str]] = {
    "source": lambda r: r.source,
    "method": lambda r: r.method,
    "quantity": lambda r: r.quantity,
    "family": lambda r: r.family,
    "approximated": lambda r: "approximated" if r.approximated else "exact",
}


def summarize(rows: list[PublishedRow]) -> list[Summary]:
    """All rows, then one summary per value of each group (keys sorted)."""
    if not rows:
        return []
    out = [summary_of("all", "all", rows)]
    for group, key in GROUPS.items():
        by: dict[str, list[PublishedRow]] = {}
        for r in rows:
            by.setdefault(key(r), []).append(r)
        out += [summary_of(group, k, by[k]) for k in sorted(by)]
    return out


@dataclass(frozen=True)
class TokenSlope:
    """Two comparable rows of one run configuration that differ only in the micro-batch (same
    source, model, quantity and every other Setup field): what one more token per GPU costs, as
    measured and as estimated. A gap here is a per-token term the estimate lacks (or adds); a row
    error with no slope gap is a constant one (weights, gathered units, device terms)."""

    ids: tuple[str, str]  # the fewer-token row, the more-token row
    source: str
    model: str
    family: str
    method: str
    quantity: str
    gpus: int
    fsdp: str
    tokens: tuple[int, int]  # per GPU: batch x seq of each row
    measured_per_token: float  # bytes per added token
    estimated_per_token: float
    phases: tuple[str, str]  # the estimate's peak phase of each row

    @property
    def excess_per_token(self) -> float:
        """Measured minus estimated bytes per token (> 0: the estimate misses a per-token term)."""
        return self.measured_per_token - self.estimated_per_token

    @property
    def error(self) -> float | None:
        """estimated / measured - 1; None where either slope is zero (an optimizer-step peak, which
        no token moves)."""
        if not self.measured_per_token or not self.estimated_per_token:
            return None
        return self.estimated_per_token / self.measured_per_token - 1


def _slope_key(record: dict, quantity: str) -> tuple:
    setup = {k: v for k, v in record["setup"].items() if k != "batch"}
    return (record["source"]["repo"], record["model"], quantity, json.dumps(setup, sort_keys=True),
            json.dumps(record.get("versions") or {}, sort_keys=True))


def token_slopes(records: Iterable[dict], rows: Iterable[PublishedRow]) -> list[TokenSlope]:
    """Per run configuration measured at two or more micro-batches, the slope between its fewest-
    and most-token rows (per quantity). ``rows``: :func:`compare`'s output for ``records``."""
    by_id = {r["id"]: r for r in records}
    groups: dict[tuple, list[PublishedRow]] = {}
    for row in rows:
        groups.setdefault(_slope_key(by_id[row.id], row.quantity), []).append(row)
    out = []
    for members in groups.values():
        def tokens(row: PublishedRow) -> int:
            s = by_id[row.id]["setup"]
            return int(s["batch"]) * int(s["seq"])

        members = sorted(members, key=lambda row: (tokens(row), row.id))
        lo, hi = members[0], members[-1]
        dn = tokens(hi) - tokens(lo)
        if dn <= 0:
            continue
        setup = by_id[lo.id]["setup"]
        out.append(TokenSlope(
            ids=(lo.id, hi.id), source=lo.source, model=lo.model, family=lo.family, method=lo.method,
            quantity=lo.quantity, gpus=int(setup["gpus"]), fsdp=str(setup["fsdp"]), tokens=(tokens(lo), tokens(hi)),
            measured_per_token=(hi.measured_bytes - lo.measured_bytes) / dn,
            estimated_per_token=(hi.estimated_bytes - lo.estimated_bytes) / dn, phases=(lo.phase, hi.phase)))
    return sorted(out, key=lambda t: (t.quantity, t.family, t.method, t.gpus, t.ids))


#: secondary_measurements key of the allocation after training (fms-acceleration's
#: ``mem_torch_mem_alloc_in_bytes``: the resting weights and optimizer states)
AFTER_TRAIN = "torch_alloc_after_train_bytes"


@dataclass(frozen=True)
class StepIntercept:
    """A :class:`TokenSlope` of allocated peaks whose records also publish the allocation after
    training: the step's constant above the resting states, ``peak - after - slope x tokens``
    (the same from either row), beside what FSDP1 holds unsharded at a moment one layer unit is
    gathered (estimator/fsdp.py ``fsdp_memory``: the root unit and one layer unit; 0 on one GPU).
    Equal: the peak is a moment with exactly one layer unit gathered, so a decoder layer's
    backward under reentrant checkpointing (no prefetch, ``fsdp_phase_peaks``); one layer unit
    more: a prefetched one; the root alone: the loss."""

    ids: tuple[str, str]
    gpus: int
    fsdp: str
    measured_bytes: float
    one_layer_bytes: int  # root + one layer unit, unsharded (FSDP1); 0 without FSDP
    layer_bytes: int  # one layer unit, unsharded (the step between one and two gathered)

    @property
    def excess_bytes(self) -> float:
        return self.measured_bytes - self.one_layer_bytes


def step_intercepts(records: Iterable[dict], slopes: Iterable[TokenSlope]) -> list[StepIntercept]:
    """:class:`StepIntercept` of each allocated slope whose two records publish :data:`AFTER_TRAIN`."""
    by_id = {r["id"]: r for r in records}
    out = []
    for t in slopes:
        if t.quantity != "allocated" or t.error is None:  # an optimizer-step peak has no per-token slope
            continue
        lo = by_id[t.ids[0]]
        after = (lo.get("secondary_measurements") or {}).get(AFTER_TRAIN)
        if not isinstance(after, (int, float)) or after <= 0:
            continue
        setup = Setup.from_dict(lo["setup"])
        root = layer = 0
        if setup.fsdp != "none" and setup.fsdp_version == 1:
            fm = fsdp_memory(resolve_model(lo["model"]), setup)
            root, layer = fm.root, fm.layer
        measured = int(lo["measured_bytes"]) - after - t.measured_per_token * t.tokens[0]
        out.append(StepIntercept(ids=t.ids, gpus=t.gpus, fsdp=t.fsdp, measured_bytes=measured,
                                 one_layer_bytes=root + layer, layer_bytes=layer))
    return out


def exclusion_counts(records: Iterable[dict]) -> list[tuple[str, int]]:
    """How many records each first exclusion reason sets aside, most first (ties by reason)."""
    counts: dict[str, int] = {}
    for e in excluded(records):
        counts[e.reason] = counts.get(e.reason, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
