"""Refit the cost model's constants (:data:`vramplan.cost.model.CONSTANTS`) from published throughput: pure, torch-free.

Every fitted term of :func:`vramplan.cost.model.step_cost` is a count times one constant
(:func:`vramplan.cost.model.fit_features` gives the seconds per unit of each), so the step time is linear in
the constants: :func:`fit` solves linear least squares on the *relative* error of the step time over
the comparable records (``calibration/throughput/records.jsonl``), the terms that are not fitted held
as they are. A constant no row exercises keeps its committed value; one the solve makes negative is
fixed at 0 and the rest refitted. Used by ``benchmarks/throughput_accuracy.py`` (in-sample and
leave-one-out) and by tests/test_cost.py (the committed constants must equal the refit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from . import model as cost
from .throughput import Predictor, comparable, record_gpu_model, record_setup, record_stack


@dataclass(frozen=True)
class Fit:
    """Fitted constants, the rows each was fitted on, and per-row relative residuals of the step time."""

    constants: dict[str, float]
    rows_per_constant: dict[str, int] = field(default_factory=dict)
    residuals: dict[str, float] = field(default_factory=dict)


def _row(record: dict):
    model, gpu = record_gpu_model(record)
    setup, stack = record_setup(record), record_stack(record)
    k = cost.counts(model, setup, stack)
    step = cost.step_cost(model, setup, gpu, 1, k, stack)
    feats = cost.fit_features(model, setup, gpu, 1, k)
    fitted = sum(cost.CONSTANTS[name] * x for name, x in feats.items())
    measured = step.tokens_per_step / setup.gpus / float(record["tokens_per_s_per_gpu"])
    return feats, step.step_s - fitted, measured, (model, setup, gpu, stack)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares ``min |a x - b|`` by the normal equations (a handful of unknowns), pure Python."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b, strict=True))]
         for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0:
            raise ValueError("the records do not determine the constants (singular system)")
        for i in range(n):
            if i != c:
                f = m[i][c] / m[c][c]
                m[i] = [x - f * y for x, y in zip(m[i], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(records: Iterable[dict]) -> Fit:
    """Least squares of the constants over the comparable records: minimise
    ``sum(((predicted_step_s - measured_step_s) / measured_step_s)^2)``."""
    rows = {r["id"]: _row(r) for r in comparable(records)}
    if not rows:
        raise ValueError("no comparable records to fit")
    names = sorted({n for feats, *_ in rows.values() for n, x in feats.items() if x > 0})
    constants = dict(cost.CONSTANTS)
    free = list(names)
    while free:
        a, b = [], []
        for feats, known, measured, _ in rows.values():
            fixed = sum(constants[n] * x for n, x in feats.items() if n not in free)
            a.append([feats.get(n, 0.0) / measured for n in free])
            b.append((measured - known - fixed) / measured)
        sol = dict(zip(free, _solve(a, b), strict=True))
        neg = [n for n, v in sol.items() if v < 0]
        if not neg:
            constants.update(sol)
            break
        constants.update({n: 0.0 for n in neg})
        free = [n for n in free if n not in neg]
    residuals = {}
    for rid, (feats, known, measured, _) in rows.items():
        residuals[rid] = (known + sum(constants[n] * x for n, x in feats.items())) / measured - 1.0
    support = {n: sum(1 for feats, *_ in rows.values() if feats.get(n, 0.0) > 0) for n in names}
    return Fit(constants=constants, rows_per_constant=support, residuals=residuals)


def predictor(constants: dict[str, float]) -> Predictor:
    """A :data:`vramplan.cost.throughput.Predictor` of these constants."""

    def predict(model, setup, gpu, stack=cost.STACK):
        c = cost.step_cost(model, setup, gpu, 1, None, stack, constants)
        return c.tokens_per_s / setup.gpus, c.terms()

    return predict


def leave_one_out(records: list[dict]):
    """Each comparable row predicted by constants fitted on all the other rows."""
    from .throughput import compare

    comp = comparable(records)
    out = []
    for held in comp:
        f = fit([r for r in comp if r["id"] != held["id"]])
        out += compare([held], predictor(f.constants))
    return out
