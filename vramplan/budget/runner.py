"""Running the checks: each one estimated (or traced), judged, and gathered into a :class:`CheckRun`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..specs import Breakdown, SpecError
from .baseline import Record, current_versions
from .checkfile import CheckSpec
from .compare import DEFAULT_TOLERANCE, STATUSES, CheckResult, compare

TIERS = ("analytic", "trace")


def measure(spec: CheckSpec, tier: str = "analytic",
            corrections: Callable[[Any], Any] | None = None) -> tuple[Breakdown, tuple[str, ...]]:
    """The check's Breakdown on the analytic tier (no torch) or the traced tier (imports torch),
    and the setup-vs-model warnings. ``corrections(gpu)``: the device terms of the analytic tier
    (the command passes the calibrated ones; None: the published defaults). The traced tier adds
    the published device terms (its own). Errors name the check."""
    from ..estimator import estimate
    from ..model.profiles import load_model
    from ..setup.checks import check

    if tier not in TIERS:
        raise SpecError(f"tier must be one of {', '.join(TIERS)}; got {tier!r}")
    try:
        model = load_model(spec.model)
        warnings = (*spec.warnings, *check(model, spec.setup, spec.gpu))
        if tier == "trace":
            from ..run.tracer import trace

            return trace(model, spec.setup, gpu=spec.gpu), warnings
        if corrections is None:
            return estimate(model, spec.setup, spec.gpu), warnings
        return estimate(model, spec.setup, spec.gpu, corrections(spec.gpu)), warnings
    except SpecError as exc:
        raise SpecError(f"{spec.source}: check {spec.name!r}: {exc}") from None


@dataclass(frozen=True)
class CheckRun:
    """All checks of one ``vramplan check`` invocation."""

    results: tuple[CheckResult, ...]
    tier: str
    tolerance: float
    versions: dict[str, Any]
    baseline_path: str | None = None
    baseline_found: bool = False
    stale: tuple[str, ...] = ()  # baseline entries no check of this run refers to
    require_baseline: bool = False

    def failures(self, accept_growth: bool = False) -> tuple[CheckResult, ...]:
        """Failed checks; with ``accept_growth`` (``--update``) only those over budget."""
        return tuple(r for r in self.results if r.over_budget or (not accept_growth and (
            r.grew or (self.require_baseline and r.status == "new"))))

    def exit_code(self, accept_growth: bool = False) -> int:
        return 1 if self.failures(accept_growth) else 0

    @property
    def drift(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(line for r in self.results for line in r.drift))

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for r in self.results:
            out[r.status] += 1
        return out


def run_checks(specs: Iterable[CheckSpec], baseline: dict[str, Record] | None, *, tier: str = "analytic",
               tolerance: float = DEFAULT_TOLERANCE, baseline_path: str | None = None,
               require_baseline: bool = False, corrections: Callable[[Any], Any] | None = None) -> CheckRun:
    """Measure and judge every check against ``baseline`` (None: no baseline file); ``corrections``
    as :func:`measure` takes it."""
    versions = current_versions()
    specs = tuple(specs)
    results = []
    for spec in specs:
        bd, warnings = measure(spec, tier, corrections)
        results.append(compare(spec, bd, (baseline or {}).get(spec.name), tolerance, versions, warnings))
    names = {s.name for s in specs}
    stale = tuple(sorted(n for n in (baseline or {}) if n not in names))
    return CheckRun(results=tuple(results), tier=tier, tolerance=tolerance, versions=versions,
                    baseline_path=baseline_path, baseline_found=baseline is not None, stale=stale,
                    require_baseline=require_baseline)


def updated_records(baseline: dict[str, Record] | None, run: CheckRun) -> dict[str, Record]:
    """The baseline after ``--update``: every check of the run re-recorded, other entries kept
    (they may belong to checks files not passed this time; ``stale`` lists them)."""
    records = dict(baseline or {})
    for r in run.results:
        records[r.spec.name] = r.record
    return records
