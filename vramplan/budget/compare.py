"""One check judged: its Breakdown against its GPU budget and its baseline record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..specs import Breakdown, Setup
from ..util.units import fmt_bytes
from ..util.versions import BASELINE_LIBRARIES
from .baseline import HEADLINE, Record
from .checkfile import CheckSpec

DEFAULT_TOLERANCE = 0.02
STATUSES = ("over-budget", "grew", "shrank", "new", "ok")


@dataclass(frozen=True)
class Delta:
    """One number, as recorded in the baseline and as computed now."""

    name: str
    baseline_bytes: int
    current_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.current_bytes - self.baseline_bytes

    @property
    def relative(self) -> float | None:
        return None if self.baseline_bytes == 0 else self.delta_bytes / self.baseline_bytes

    def to_json(self) -> dict:
        return {"name": self.name, "baseline_bytes": self.baseline_bytes, "current_bytes": self.current_bytes,
                "delta_bytes": self.delta_bytes, "delta_rel": self.relative}


#: The note of a check without a baseline entry (``vramplan check`` prints nothing more for it).
NO_BASELINE_NOTE = "new check: no baseline entry (vramplan check --update records one)"


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict. ``status`` is the most serious of: over-budget, grew (both fail),
    shrank (a warning), new (no baseline entry), ok. ``reasons`` says why it failed, ``notes``
    what a reader should know (shrinkage, a new check, changed inputs, version drift)."""

    spec: CheckSpec
    breakdown: Breakdown
    record: Record
    baseline: Record | None
    tolerance: float
    status: str
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # from vramplan.setup.checks.check (setup vs model)
    drift: tuple[str, ...] = ()
    numbers: tuple[Delta, ...] = ()  # headline numbers vs the baseline (empty without one)
    components: tuple[Delta, ...] = ()  # components that changed, largest change first

    @property
    def over_budget(self) -> bool:
        return self.spec.must_fit and self.breakdown.fits is False

    @property
    def grew(self) -> bool:
        return any(d.relative is not None and d.relative > self.tolerance for d in self.numbers)

    @property
    def device_total(self) -> Delta | None:
        return next((d for d in self.numbers if d.name == "device_total_bytes"), None)


def signed_gib(n: int) -> str:
    """A byte change in GiB with its sign: ``+1.96 GiB``, ``-0.50 GiB``."""
    return f"{'+' if n >= 0 else '-'}{fmt_bytes(abs(n))}"


def version_drift(recorded: dict[str, Any], current: dict[str, Any], tier: str) -> tuple[str, ...]:
    """One line per version that differs between the baseline's record and this run (with the
    transformers version the analytic tier modelled, ``modelled_transformers``, when either names one)."""
    lines = []
    old, new = recorded.get("modelled_transformers"), current.get("modelled_transformers")
    if old != new:  # estimated under another check --transformers (or plan --transformers: a plan file's)
        lines.append(f"modelled transformers {old or 5} -> {new or 5} (--transformers: the version the estimate "
                     "follows)")
    for key in ("model_version", "vramplan", *BASELINE_LIBRARIES):
        if key not in recorded or recorded.get(key) == current.get(key):
            continue
        old, new = recorded.get(key), current.get(key)
        line = f"{key} {old if old is not None else 'not installed'} -> {new if new is not None else 'not installed'}"
        if key == "model_version":
            line += " (the estimator's formulas changed)"
        elif key in BASELINE_LIBRARIES and tier == "analytic":
            line += " (the analytic tier does not run it)"
        lines.append(line)
    return tuple(lines)


def _input_changes(record: Record, baseline: Record) -> list[str]:
    notes = []
    if baseline.model and baseline.model != record.model:
        notes.append(f"model changed: {baseline.model} -> {record.model}")
    if baseline.gpu != record.gpu:
        notes.append(f"gpu changed: {baseline.gpu} -> {record.gpu}")
    defaults = Setup().to_dict()
    changed = [
        f"{k} {baseline.setup.get(k, defaults[k])!r} -> {v!r}"
        for k, v in record.setup.items() if baseline.setup.get(k, defaults.get(k)) != v
    ]
    if changed:
        notes.append("setup changed: " + ", ".join(changed))
    return notes


def compare(spec: CheckSpec, bd: Breakdown, baseline: Record | None, tolerance: float, versions: dict[str, Any],
            warnings: tuple[str, ...] = ()) -> CheckResult:
    """Judge one Breakdown against its budget and its baseline record."""
    record = Record.of(bd, versions)
    tol = spec.tolerance if spec.tolerance is not None else tolerance
    reasons: list[str] = []
    notes: list[str] = []
    if spec.must_fit and bd.fits is False:
        reasons.append(f"over budget: needs {fmt_bytes(bd.device_total_bytes)}, {spec.gpu.name} has "
                       f"{fmt_bytes(spec.gpu.usable_memory_bytes)} usable ({fmt_bytes(-bd.headroom_bytes)} short)")
    numbers: tuple[Delta, ...] = ()
    components: tuple[Delta, ...] = ()
    drift: tuple[str, ...] = ()
    shrank = False
    if baseline is not None and baseline.tier != bd.tier:
        notes.append(f"new check on the {bd.tier} tier: its baseline entry was recorded on the {baseline.tier} "
                     "tier, so it is not compared (vramplan check --update records this tier)")
        baseline = None
    elif baseline is None:
        notes.append(NO_BASELINE_NOTE)
    else:
        numbers = tuple(Delta(k, baseline.numbers[k], record.numbers[k]) for k in HEADLINE)
        names = list(dict.fromkeys([*baseline.components, *record.components]))
        moved = [Delta(n, baseline.components.get(n, 0), record.components.get(n, 0)) for n in names]
        components = tuple(sorted((d for d in moved if d.delta_bytes), key=lambda d: -abs(d.delta_bytes)))
        grown = [d for d in numbers if d.relative is not None and d.relative > tol]
        shrunk = [d for d in numbers if d.relative is not None and d.relative < -tol]
        if grown:
            worst = _reported(grown)
            cause = (f"; largest component change: {components[0].name} {signed_gib(components[0].delta_bytes)}"
                     if components else "")
            reasons.append(f"grew {worst.relative:.1%} beyond the {tol:.1%} tolerance "
                           f"({worst.name} {fmt_bytes(worst.baseline_bytes)} -> {fmt_bytes(worst.current_bytes)})"
                           f"{cause}")
        elif shrunk:
            shrank, worst = True, _reported(shrunk)
            notes.append(f"shrank {-worst.relative:.1%} beyond the {tol:.1%} tolerance "
                         f"({worst.name} {fmt_bytes(worst.baseline_bytes)} -> {fmt_bytes(worst.current_bytes)}); "
                         "vramplan check --update records the new numbers")
        notes += _input_changes(record, baseline)
        drift = version_drift(baseline.recorded_with, versions, bd.tier)
    if reasons:
        status = "over-budget" if spec.must_fit and bd.fits is False else "grew"
    elif shrank:
        status = "shrank"
    elif baseline is None:
        status = "new"
    else:
        status = "ok"
    return CheckResult(spec=spec, breakdown=bd, record=record, baseline=baseline, tolerance=tol, status=status,
                       reasons=tuple(reasons), notes=tuple(notes), warnings=tuple(warnings), drift=drift,
                       numbers=numbers, components=components)


def _reported(moved: list[Delta]) -> Delta:
    """The number a one-line message names: device_total_bytes (what the fit is judged on) when
    it moved, else the one that moved most."""
    return next((d for d in moved if d.name == "device_total_bytes"), None) or max(moved, key=lambda d: abs(d.relative))
