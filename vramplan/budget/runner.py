"""Running the checks: each one estimated (or traced), judged, and gathered into a :class:`CheckRun`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..specs import Breakdown, SpecError
from .baseline import Record, current_versions
from .checkfile import CheckSpec
from .compare import DEFAULT_TOLERANCE, STATUSES, CheckResult, compare

TIERS = ("analytic", "trace")


def stack_of(spec: CheckSpec, stack: Any = None, tier: str = "analytic") -> Any:
    """The library stack (estimator/stack.py) the check is estimated under: ``stack`` when given
    (``check --transformers``), else the one its plan file was planned under, else the default;
    None on the traced tier, which runs the installed libraries."""
    from ..estimator.stack import DEFAULT_STACK, Stack

    if tier != "analytic":
        return None
    if stack is not None:
        return stack
    return Stack(transformers=spec.transformers) if spec.transformers else DEFAULT_STACK


def measure(spec: CheckSpec, tier: str = "analytic", corrections: Callable[[Any], Any] | None = None,
            stack: Any = None) -> tuple[Breakdown, tuple[str, ...]]:
    """The check's Breakdown on the analytic tier (no torch) or the traced tier (imports torch),
    and the setup-vs-model warnings. ``corrections(gpu)``: the device terms of the analytic tier
    (the command passes the calibrated ones; None: the published defaults); ``stack``: its library
    versions (:func:`stack_of`). The traced tier adds the published device terms (its own) and runs
    the installed libraries. Errors name the check."""
    from ..estimator import DEFAULT_CORRECTIONS, estimate
    from ..estimator.step import setup_warnings
    from ..model.profiles import load_model
    from ..setup.checks import check

    if tier not in TIERS:
        raise SpecError(f"tier must be one of {', '.join(TIERS)}; got {tier!r}")
    try:
        model = load_model(spec.model)
        if tier == "trace":
            from ..run.tracer import trace

            warnings = (*spec.warnings, *check(model, spec.setup, spec.gpu))
            return trace(model, spec.setup, gpu=spec.gpu), warnings
        modelled = stack_of(spec, stack, tier)  # its warnings too: 4.x quantizes per-expert Linears
        warnings = (*spec.warnings, *setup_warnings(model, spec.setup, spec.gpu, modelled))
        terms = DEFAULT_CORRECTIONS if corrections is None else corrections(spec.gpu)
        return estimate(model, spec.setup, spec.gpu, terms, modelled), warnings
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
               require_baseline: bool = False, corrections: Callable[[Any], Any] | None = None,
               stack: Any = None) -> CheckRun:
    """Measure and judge every check against ``baseline`` (None: no baseline file); ``corrections``
    and ``stack`` as :func:`measure` takes them. A stack other than the default is named in the
    versions (``modelled_transformers``): the run's when given, each record's as it was estimated."""
    versions = with_stack(current_versions(), stack)
    specs = tuple(specs)
    results = []
    for spec in specs:
        bd, warnings = measure(spec, tier, corrections, stack)
        modelled = stack_of(spec, stack, tier)
        result = compare(spec, bd, (baseline or {}).get(spec.name), tolerance, with_stack(versions, modelled),
                         warnings)
        if stack is None and modelled is not None and not modelled.is_default:  # a plan file's --transformers
            result = replace(result, notes=(*result.notes, f"estimated under transformers {modelled.transformers}, "
                                            "as its plan file was planned (check --transformers to change)"))
        results.append(result)
    names = {s.name for s in specs}
    stale = tuple(sorted(n for n in (baseline or {}) if n not in names))
    return CheckRun(results=tuple(results), tier=tier, tolerance=tolerance, versions=versions,
                    baseline_path=baseline_path, baseline_found=baseline is not None, stale=stale,
                    require_baseline=require_baseline)


def with_stack(versions: dict[str, Any], stack: Any) -> dict[str, Any]:
    """``versions`` naming ``stack``'s transformers version as ``modelled_transformers`` when it is
    not the default stack (transformers 5); unchanged otherwise."""
    if stack is None or stack.is_default:
        return versions
    return {**versions, "modelled_transformers": stack.transformers}


def updated_records(baseline: dict[str, Record] | None, run: CheckRun) -> dict[str, Record]:
    """The baseline after ``--update``: every check of the run re-recorded, other entries kept
    (they may belong to checks files not passed this time; ``stale`` lists them)."""
    records = dict(baseline or {})
    for r in run.results:
        records[r.spec.name] = r.record
    return records
