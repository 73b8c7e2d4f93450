"""Refit the cost model's constants (:data:`vramplan.cost.model.CONSTANTS`) from published throughput: pure, torch-free.

Every fitted term of :func:`vramplan.cost.model.step_cost` is a count times one constant
(:func:`vramplan.cost.model.fit_features` gives the seconds per unit of each), so the step time is linear in
the constants: :func:`fit` solves linear least squares on the *relative* error of the step time, the
terms that are not fitted held as they are, in two stages (vramplan/cost/constants.py): the shared
constants on the rows of :data:`~vramplan.cost.constants.SHARED_FIT_SOURCES`, then each GPU class's
``inv_mfu:<class>`` on that class's rows alone, the shared ones held. A constant no row exercises keeps
its committed value; one the solve makes negative is fixed at 0 and the rest refitted. Used by
``vramplan validate --throughput`` and ``benchmarks/throughput_accuracy.py`` (in-sample and
leave-one-out) and by tests/test_cost.py (the committed constants must equal the refit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from . import model as cost
from .constants import CLASS_MIN_ROWS, SHARED_FIT_SOURCES
from .throughput import Predictor, comparable, record_gpu_model, record_overrides, record_setup, record_stack


@dataclass(frozen=True)
class Fit:
    """Fitted constants, the rows each was fitted on, and per-row relative residuals of the step time."""

    constants: dict[str, float]
    rows_per_constant: dict[str, int] = field(default_factory=dict)
    residuals: dict[str, float] = field(default_factory=dict)
    #: constant -> the ids of the rows it was fitted on
    fitted_on: dict[str, list[str]] = field(default_factory=dict)
    #: row id -> "shared" (stage 1), "class" (its class's inv_mfu fitted on it), "check" (fitted on none)
    role: dict[str, str] = field(default_factory=dict)


def _row(record: dict):
    model, gpu = record_gpu_model(record)
    setup, stack = record_setup(record), record_stack(record)
    overrides = record_overrides(record)
    k = cost.counts(model, setup, stack)
    step = cost.step_cost(model, setup, gpu, 1, k, stack, {**cost.CONSTANTS, **overrides})
    feats = cost.fit_features(model, setup, gpu, 1, k)
    fitted = sum(cost.CONSTANTS[name] * x for name, x in feats.items() if name not in overrides)
    feats = {n: x for n, x in feats.items() if n not in overrides}  # held at the override: not fitted here
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


def _lsq(rows: dict, names: list[str], constants: dict[str, float]) -> None:
    """Least squares of ``names`` over ``rows`` (``_row`` tuples) into ``constants``, the rest held:
    minimise ``sum(((predicted_step_s - measured_step_s) / measured_step_s)^2)``."""
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
            return
        constants.update({n: 0.0 for n in neg})
        free = [n for n in free if n not in neg]


def _mfu_key(feats: dict[str, float]) -> str | None:
    return next((n for n, x in feats.items() if n.startswith("inv_mfu:") and x > 0), None)


def fit(records: Iterable[dict], classes: Iterable[str] | None = None, min_class_rows: int = CLASS_MIN_ROWS) -> Fit:
    """The two-stage least squares (module docstring). ``classes``: the ``inv_mfu:<class>`` keys stage 2
    may fit (default: every class with at least ``min_class_rows`` rows outside stage 1)."""
    comp = comparable(records)
    if not comp:
        raise ValueError("no comparable records to fit")
    rows = {r["id"]: _row(r) for r in comp}
    shared_ids = [r["id"] for r in comp if (r["source"]["repo"], r["source"]["path"]) in SHARED_FIT_SOURCES]
    shared = {i: rows[i] for i in shared_ids}
    constants = dict(cost.CONSTANTS)
    fitted_on: dict[str, list[str]] = {}
    role = {i: "check" for i in rows}
    if shared:
        names = sorted({n for feats, *_ in shared.values() for n, x in feats.items() if x > 0})
        _lsq(shared, names, constants)
        for n in names:
            fitted_on[n] = [i for i in shared_ids if shared[i][0].get(n, 0.0) > 0]
        role.update({i: "shared" for i in shared_ids})
    by_class: dict[str, list[str]] = {}
    for i, (feats, *_) in rows.items():
        key = _mfu_key(feats)
        if i not in shared and key and key not in fitted_on:
            by_class.setdefault(key, []).append(i)
    allowed = set(classes) if classes is not None else None
    for key, ids in sorted(by_class.items()):
        if (allowed is not None and key not in allowed) or len(ids) < (min_class_rows if allowed is None else 1):
            continue
        _lsq({i: rows[i] for i in ids}, [key], constants)
        fitted_on[key] = ids
        role.update({i: "class" for i in ids})
    residuals = {}
    for rid, (feats, known, measured, _) in rows.items():
        residuals[rid] = (known + sum(constants[n] * x for n, x in feats.items())) / measured - 1.0
    support = {n: len(ids) for n, ids in fitted_on.items()}
    return Fit(constants=constants, rows_per_constant=support, residuals=residuals, fitted_on=fitted_on, role=role)


def predictor(constants: dict[str, float]) -> Predictor:
    """A :data:`vramplan.cost.throughput.Predictor` of these constants."""

    def predict(model, setup, gpu, stack=cost.STACK, overrides=None):
        c = cost.step_cost(model, setup, gpu, 1, None, stack, {**constants, **(overrides or {})})
        return c.tokens_per_s / setup.gpus, c.terms()

    return predict


def leave_one_out(records: list[dict]):
    """Each comparable row predicted by constants fitted on all the other rows (a class fitted on all its
    rows is refitted on the others, however few). A row no constant was fitted on is predicted as in-sample."""
    from .throughput import compare

    comp = comparable(records)
    classes = [k for k in fit(comp).fitted_on if k.startswith("inv_mfu:")]
    out = []
    for held in comp:
        f = fit([r for r in comp if r["id"] != held["id"]], classes=classes)
        out += compare([held], predictor(f.constants))
    return out
