"""Memory regression checks for CI: the logic behind ``vramplan check`` and the pytest plugin.

A *check* is one model, one setup and one GPU budget, read from a checks file or a plan file::

    # checks.yaml
    defaults: {gpu: rtx-4090, setup: {checkpointing: true}}   # optional, merged into every check
    checks:
      - name: sft-8b
        model: llama-3.1-8b
        gpu: rtx-4090            # or gpu_memory: 24GiB
        setup: {method: lora, lora_rank: 16, seq: 2048, batch: 1}
        must_fit: true           # default true: fail when device_total_bytes > the GPU's usable memory
        tolerance: 2%            # optional; growth beyond it against the baseline fails

A plan file (``vramplan_plan: 1``, see :mod:`vramplan.planfile`) is one check named after the file,
``must_fit: true``. Each check is estimated (or traced), judged against its GPU, and compared with
the *baseline* (``vram-baseline.json``): the four headline numbers and every component's bytes as
last recorded, with the versions they were recorded under (vramplan, its estimator's
``MODEL_VERSION``, torch, transformers, peft), so a run under other versions says so.

Everything here is pure (no printing, no torch on the analytic tier); ``vramplan/commands/check.py``
prints, and writes the baseline through :mod:`vramplan.fileio`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .fileio import atomic_write_text
from .specs import Breakdown, GpuSpec, Setup, SpecError
from .units import GiB

BASELINE_FORMAT = 1
RESULT_FORMAT = 1
DEFAULT_TOLERANCE = 0.02
HEADLINE = ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes")
#: Libraries whose versions a baseline records (read from package metadata, never imported).
LIBRARIES = ("torch", "transformers", "peft")
TIERS = ("analytic", "trace")
CHECK_KEYS = ("name", "model", "gpu", "gpu_memory", "setup", "must_fit", "tolerance")
STATUSES = ("over-budget", "grew", "shrank", "new", "ok")


# ----------------------------------------------------------------------------------------------
# Specs


@dataclass(frozen=True)
class CheckSpec:
    """One check as written by the user. ``tolerance`` None: the run's ``--tolerance``."""

    name: str
    model: str
    setup: Setup
    gpu: GpuSpec | None = None
    must_fit: bool = True
    tolerance: float | None = None
    source: str = ""
    line: int | None = None  # 1-based line of the check in its file, for annotations


def parse_tolerance(value: Any, where: str = "tolerance") -> float:
    """``"2%"`` -> 0.02, ``0.02`` -> 0.02. A bare number above 1 is refused: it is ambiguous."""
    if isinstance(value, bool):
        raise SpecError(f"{where} must be a percentage like 2% or a fraction like 0.02; got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise SpecError(f"{where} must be a percentage like 2% or a fraction like 0.02; got {value!r}") from None
    elif isinstance(value, (int, float)):
        number = float(value)
    else:
        raise SpecError(f"{where} must be a percentage like 2% or a fraction like 0.02; got {value!r}")
    if not 0.0 <= number < 1.0:  # NaN fails this too
        raise SpecError(f"{where} must be between 0% and 100% (write 2% or 0.02); got {value!r}")
    return number


def _read_mapping(path: Path) -> tuple[Any, dict[int, int]]:
    """The file's data, and for a YAML ``checks`` list the 1-based line of each item."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a checks or plan file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read ({exc})") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text), {}
        except json.JSONDecodeError as exc:
            raise SpecError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        detail = f"line {mark.line + 1}: {problem}" if mark is not None and problem else " ".join(str(exc).split())
        raise SpecError(f"{path}: not valid YAML ({detail})") from None
    finally:
        loader.dispose()
    lines: dict[int, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if getattr(key, "value", None) == "checks" and isinstance(value, yaml.SequenceNode):
                lines = {i: item.start_mark.line + 1 for i, item in enumerate(value.value)}
    return data, lines


def setup_from_mapping(data: Any, where: str) -> Setup:
    """A Setup from a mapping of setup keys, with value types checked against the dataclass's
    defaults (a YAML ``seq: "2048"`` or ``checkpointing: "yes"`` is an error, not a surprise)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{where} must be a mapping of setup keys")
    defaults = {f.name: f.default for f in dataclasses.fields(Setup)}
    for key, value in data.items():
        if key not in defaults:
            continue  # Setup.from_dict names it with the known keys
        default = defaults[key]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[type(default)]
            raise SpecError(f"{where}: {key} must be {kind}; got {value!r}")
    try:
        return Setup.from_dict(data)
    except (SpecError, TypeError) as exc:
        raise SpecError(f"{where}: {exc}") from None


def gpu_from_entry(gpu: Any, gpu_memory: Any, where: str) -> GpuSpec | None:
    """``gpu: rtx-4090`` (a shipped name) or ``gpu_memory: 24GiB`` (a size or bytes), not both."""
    from .profiles import load_gpu
    from .units import parse_bytes

    if gpu is not None and gpu_memory is not None:
        raise SpecError(f"{where}: give gpu or gpu_memory, not both")
    if gpu is not None:
        if not isinstance(gpu, str):
            raise SpecError(f"{where}: gpu must be a GPU name such as rtx-4090; got {gpu!r}")
        try:
            return load_gpu(gpu)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None
    if gpu_memory is not None:
        try:
            return GpuSpec.custom(parse_bytes(gpu_memory))
        except (ValueError, OverflowError) as exc:
            raise SpecError(f"{where}: gpu_memory: {exc}") from None
    return None


def _model_ref(model: Any, base: Path, where: str) -> str:
    """The model reference: a relative path that exists next to the checks file is read from
    there (CI runs from the repository root, the checks file may live anywhere in it)."""
    if not isinstance(model, str) or not model.strip():
        raise SpecError(f"{where}: model must be a model name, Hub id or config path")
    candidate = base / model
    if not Path(model).is_absolute() and candidate.exists():
        return str(candidate)
    return model


def _check_from_entry(entry: Any, defaults: dict, path: Path, index: int, line: int | None) -> CheckSpec:
    where = f"{path}: checks[{index}]"
    if not isinstance(entry, dict):
        raise SpecError(f"{where} must be a mapping with name, model, gpu and setup")
    if isinstance(entry.get("name"), str) and entry["name"].strip():
        where = f"{path}: check {entry['name']!r}"
    unknown = sorted(set(entry) - set(CHECK_KEYS), key=str)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(CHECK_KEYS)}")
    merged = {**defaults, **entry}
    if "gpu" in entry or "gpu_memory" in entry:  # a check's own GPU replaces the default one
        merged["gpu"], merged["gpu_memory"] = entry.get("gpu"), entry.get("gpu_memory")
    for part in (defaults.get("setup"), entry.get("setup")):
        if part is not None and not isinstance(part, dict):
            raise SpecError(f"{where}: setup must be a mapping of setup keys")
    setup_data = {**(defaults.get("setup") or {}), **(entry.get("setup") or {})}
    for key in ("name", "model"):
        if merged.get(key) in (None, ""):
            raise SpecError(f"{where}: missing '{key}'")
    name = merged["name"]
    if not isinstance(name, str):
        raise SpecError(f"{where}: name must be a string; got {name!r}")
    must_fit = merged.get("must_fit", True)
    if not isinstance(must_fit, bool):
        raise SpecError(f"{where}: must_fit must be true or false; got {must_fit!r}")
    gpu = gpu_from_entry(merged.get("gpu"), merged.get("gpu_memory"), where)
    if must_fit and gpu is None:
        raise SpecError(f"{where}: must_fit needs a budget: give gpu (e.g. rtx-4090) or gpu_memory (e.g. 24GiB)")
    tolerance = merged.get("tolerance")
    return CheckSpec(
        name=name.strip(),
        model=_model_ref(merged["model"], path.parent, where),
        setup=setup_from_mapping(setup_data, f"{where}: setup"),
        gpu=gpu,
        must_fit=must_fit,
        tolerance=None if tolerance is None else parse_tolerance(tolerance, f"{where}: tolerance"),
        source=str(path),
        line=line,
    )


def _check_from_plan(path: Path) -> CheckSpec:
    from .planfile import read_plan_data

    data = read_plan_data(path)  # the plan file's own shape checks and messages
    gpu_entry = data.get("gpu")
    if gpu_entry is None:
        raise SpecError(f"{path}: plan file has no gpu, so there is no budget to check")
    if isinstance(gpu_entry, dict) and str(gpu_entry.get("name", "")).startswith("custom-"):
        gpu = gpu_from_entry(None, gpu_entry.get("usable_memory_bytes"), str(path))
    else:
        gpu = gpu_from_entry(gpu_entry.get("name") if isinstance(gpu_entry, dict) else gpu_entry, None, str(path))
    return CheckSpec(name=path.stem, model=_model_ref(data["model"], path.parent, str(path)),
                     setup=setup_from_mapping(data["setup"], f"{path}: setup"), gpu=gpu, must_fit=True,
                     source=str(path), line=None)


def load_specs(paths: Iterable[str | os.PathLike]) -> tuple[CheckSpec, ...]:
    """Every check in the given checks and plan files; names must be unique across them."""
    specs: list[CheckSpec] = []
    for p in paths:
        path = Path(p)
        data, lines = _read_mapping(path)
        if not isinstance(data, dict):
            raise SpecError(f"{path}: expected a mapping with 'checks' (or a plan file), got {type(data).__name__}")
        if "vramplan_plan" in data:
            specs.append(_check_from_plan(path))
            continue
        unknown = sorted(set(data) - {"checks", "defaults"}, key=str)
        if unknown:
            raise SpecError(f"{path}: unknown top-level key {unknown[0]!r}; a checks file has 'checks' (and 'defaults')")
        checks, defaults = data.get("checks"), data.get("defaults") or {}
        if not isinstance(checks, list) or not checks:
            raise SpecError(f"{path}: 'checks' must be a non-empty list of checks")
        if not isinstance(defaults, dict):
            raise SpecError(f"{path}: 'defaults' must be a mapping")
        bad = sorted(set(defaults) - (set(CHECK_KEYS) - {"name", "model"}), key=str)
        if bad:
            raise SpecError(f"{path}: defaults: unknown key {bad[0]!r}; defaults may set gpu, gpu_memory, setup, must_fit, tolerance")
        specs += [_check_from_entry(e, defaults, path, i, lines.get(i)) for i, e in enumerate(checks)]
    seen: dict[str, str] = {}
    for s in specs:
        if s.name in seen:
            raise SpecError(f"check name {s.name!r} is used twice ({seen[s.name]} and {s.source}); names key the baseline")
        seen[s.name] = s.source
    return tuple(specs)


# ----------------------------------------------------------------------------------------------
# Baseline records


def current_versions() -> dict[str, Any]:
    """vramplan, its estimator's MODEL_VERSION, and the installed torch/transformers/peft
    (package metadata only: reading a version must not import torch)."""
    from . import __version__
    from .estimator.version import MODEL_VERSION

    versions: dict[str, Any] = {"vramplan": __version__, "model_version": MODEL_VERSION}
    for lib in LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    return versions


def _component_key(c) -> str:
    return c.name if c.where == "gpu" else f"{c.name}@{c.where}"


@dataclass(frozen=True)
class Record:
    """What a baseline keeps of one check: the inputs, the numbers, and the versions behind them."""

    model: str
    gpu: str | None
    gpu_usable_bytes: int | None
    tier: str
    setup: dict
    numbers: dict[str, int]  # the four HEADLINE numbers
    components: dict[str, int]  # component name (``name@host`` off the GPU) -> bytes
    recorded_with: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, bd: Breakdown, versions: dict[str, Any]) -> Record:
        components: dict[str, int] = {}
        for c in bd.components:
            components[_component_key(c)] = components.get(_component_key(c), 0) + c.bytes
        return cls(model=bd.model, gpu=bd.gpu.name if bd.gpu else None,
                   gpu_usable_bytes=bd.gpu.usable_memory_bytes if bd.gpu else None, tier=bd.tier,
                   setup=bd.setup.to_dict(), numbers={k: getattr(bd, k) for k in HEADLINE},
                   components=components, recorded_with=dict(versions))

    def to_json(self) -> dict:
        return {"model": self.model, "gpu": self.gpu, "gpu_usable_bytes": self.gpu_usable_bytes, "tier": self.tier,
                "setup": dict(self.setup), **self.numbers, "components": dict(self.components),
                "recorded_with": dict(self.recorded_with)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Record:
        if not isinstance(data, dict):
            raise SpecError(f"{where} must be a mapping")
        for key in HEADLINE:
            if not isinstance(data.get(key), int) or isinstance(data.get(key), bool) or data[key] < 0:
                raise SpecError(f"{where}: '{key}' must be a non-negative integer")
        components = data.get("components", {})
        if not isinstance(components, dict) or not all(isinstance(v, int) for v in components.values()):
            raise SpecError(f"{where}: 'components' must map component names to bytes")
        setup = data.get("setup", {})
        recorded = data.get("recorded_with", {})
        if not isinstance(setup, dict) or not isinstance(recorded, dict):
            raise SpecError(f"{where}: 'setup' and 'recorded_with' must be mappings")
        return cls(model=str(data.get("model", "")), gpu=data.get("gpu"), gpu_usable_bytes=data.get("gpu_usable_bytes"),
                   tier=str(data.get("tier", "analytic")), setup=setup, numbers={k: data[k] for k in HEADLINE},
                   components=dict(components), recorded_with=recorded)


def read_baseline(path: str | os.PathLike) -> dict[str, Record] | None:
    """The baseline's records by check name; None when the file does not exist."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read baseline ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: baseline is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or data.get("vramplan_baseline") != BASELINE_FORMAT:
        raise SpecError(f"{path}: not a vramplan baseline (missing 'vramplan_baseline: {BASELINE_FORMAT}')")
    checks = data.get("checks")
    if not isinstance(checks, dict):
        raise SpecError(f"{path}: baseline 'checks' must map check names to records")
    return {name: Record.from_json(rec, f"{path}: checks.{name}") for name, rec in checks.items()}


def dumps_baseline(records: dict[str, Record]) -> str:
    """The baseline file's text: checks sorted by name so a diff in review shows only what moved."""
    data = {"vramplan_baseline": BASELINE_FORMAT,
            "checks": {name: records[name].to_json() for name in sorted(records)}}
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def write_baseline(path: str | os.PathLike, records: dict[str, Record]) -> Path:
    """Write the baseline atomically: an interrupted update leaves the old file whole."""
    return atomic_write_text(path, dumps_baseline(records))


# ----------------------------------------------------------------------------------------------
# Comparison


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
    warnings: tuple[str, ...] = ()  # from vramplan.checks.check (setup vs model)
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


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def version_drift(recorded: dict[str, Any], current: dict[str, Any], tier: str) -> tuple[str, ...]:
    """One line per version that differs between the baseline's record and this run."""
    lines = []
    for key in ("model_version", "vramplan", *LIBRARIES):
        if key not in recorded or recorded.get(key) == current.get(key):
            continue
        old, new = recorded.get(key), current.get(key)
        line = f"{key} {old if old is not None else 'not installed'} -> {new if new is not None else 'not installed'}"
        if key == "model_version":
            line += " (the estimator's formulas changed)"
        elif key in LIBRARIES and tier == "analytic":
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
        reasons.append(f"over budget: needs {_gib(bd.device_total_bytes)}, {spec.gpu.name} has "
                       f"{_gib(spec.gpu.usable_memory_bytes)} usable ({_gib(-bd.headroom_bytes)} short)")
    numbers: tuple[Delta, ...] = ()
    components: tuple[Delta, ...] = ()
    drift: tuple[str, ...] = ()
    shrank = False
    if baseline is not None and baseline.tier != bd.tier:
        notes.append(f"new check on the {bd.tier} tier: its baseline entry was recorded on the {baseline.tier} "
                     "tier, so it is not compared (vramplan check --update records this tier)")
        baseline = None
    elif baseline is None:
        notes.append("new check: no baseline entry (vramplan check --update records one)")
    else:
        numbers = tuple(Delta(k, baseline.numbers[k], record.numbers[k]) for k in HEADLINE)
        names = list(dict.fromkeys([*baseline.components, *record.components]))
        moved = [Delta(n, baseline.components.get(n, 0), record.components.get(n, 0)) for n in names]
        components = tuple(sorted((d for d in moved if d.delta_bytes), key=lambda d: -abs(d.delta_bytes)))
        grown = [d for d in numbers if d.relative is not None and d.relative > tol]
        shrunk = [d for d in numbers if d.relative is not None and d.relative < -tol]
        if grown:
            worst = _reported(grown)
            cause = f"; largest component change: {components[0].name} {_signed_gib(components[0].delta_bytes)}" if components else ""
            reasons.append(f"grew {worst.relative:.1%} beyond the {tol:.1%} tolerance "
                           f"({worst.name} {_gib(worst.baseline_bytes)} -> {_gib(worst.current_bytes)}){cause}")
        elif shrunk:
            shrank, worst = True, _reported(shrunk)
            notes.append(f"shrank {-worst.relative:.1%} beyond the {tol:.1%} tolerance "
                         f"({worst.name} {_gib(worst.baseline_bytes)} -> {_gib(worst.current_bytes)}); "
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


def _signed_gib(n: int) -> str:
    return f"{'+' if n >= 0 else '-'}{_gib(abs(n))}"


def measure(spec: CheckSpec, tier: str = "analytic") -> tuple[Breakdown, tuple[str, ...]]:
    """The check's Breakdown on the analytic tier (no torch) or the traced tier (imports torch),
    and the setup-vs-model warnings. Errors name the check."""
    from .checks import check
    from .estimator import estimate
    from .profiles import load_model

    if tier not in TIERS:
        raise SpecError(f"tier must be one of {', '.join(TIERS)}; got {tier!r}")
    try:
        model = load_model(spec.model)
        warnings = tuple(check(model, spec.setup, spec.gpu))
        if tier == "trace":
            from .tracer import trace

            return trace(model, spec.setup, gpu=spec.gpu), warnings
        return estimate(model, spec.setup, spec.gpu), warnings
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
               require_baseline: bool = False) -> CheckRun:
    """Measure and judge every check against ``baseline`` (None: no baseline file)."""
    versions = current_versions()
    specs = tuple(specs)
    results = []
    for spec in specs:
        bd, warnings = measure(spec, tier)
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


# ----------------------------------------------------------------------------------------------
# Machine-readable output


def result_to_json(r: CheckResult, failed: bool) -> dict:
    """One check in ``check --json``; ``failed`` as the run judged it (``--update`` accepts growth,
    ``--require-baseline`` fails new checks)."""
    bd = r.breakdown
    return {
        "name": r.spec.name,
        "source": r.spec.source,
        "line": r.spec.line,
        "model": bd.model,
        "gpu": r.spec.gpu.name if r.spec.gpu else None,
        "gpu_usable_bytes": r.spec.gpu.usable_memory_bytes if r.spec.gpu else None,
        "must_fit": r.spec.must_fit,
        "fits": bd.fits,
        "headroom_bytes": bd.headroom_bytes,
        "tier": bd.tier,
        "status": r.status,
        "failed": failed,
        "tolerance": r.tolerance,
        "setup": r.spec.setup.to_dict(),
        **{k: getattr(bd, k) for k in HEADLINE},
        "components": dict(r.record.components),
        "baseline": None if r.baseline is None else {**r.baseline.numbers, "components": dict(r.baseline.components),
                                                     "recorded_with": dict(r.baseline.recorded_with)},
        "diff": {"numbers": [d.to_json() for d in r.numbers], "components": [d.to_json() for d in r.components]},
        "reasons": list(r.reasons),
        "notes": list(r.notes),
        "warnings": list(r.warnings),
        "drift": list(r.drift),
    }


def run_to_json(run: CheckRun, *, updated: bool = False) -> dict:
    """What ``vramplan check --json`` prints (docs/schema/check-result.schema.json)."""
    code = run.exit_code(accept_growth=updated)
    failed = {id(r) for r in run.failures(accept_growth=updated)}
    return {
        "vramplan_check": RESULT_FORMAT,
        "ok": code == 0,
        "exit_code": code,
        "tier": run.tier,
        "tolerance": run.tolerance,
        "baseline": {"path": run.baseline_path, "found": run.baseline_found, "updated": updated},
        "versions": dict(run.versions),
        "counts": run.counts(),
        "drift": list(run.drift),
        "stale": list(run.stale),
        "results": [result_to_json(r, id(r) in failed) for r in run.results],
    }


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(run: CheckRun, *, updated: bool = False) -> list[str]:
    """GitHub Actions workflow commands: ``::error`` per failed check, ``::warning`` per shrunk
    or new check and for version drift; each points at the check's file and line."""
    failed = {id(r) for r in run.failures(accept_growth=updated)}
    lines = []
    for r in run.results:
        props = []
        if r.spec.source:
            props.append(f"file={_escape_property(r.spec.source)}")
            if r.spec.line:
                props.append(f"line={r.spec.line}")
        props.append(f"title={_escape_property('vramplan check ' + r.spec.name)}")
        if id(r) in failed:
            why = "; ".join(r.reasons) or "new check without a baseline entry (--require-baseline)"
            lines.append(f"::error {','.join(props)}::{_escape_data(f'{r.spec.name}: {why}')}")
        elif r.status in ("shrank", "new"):
            lines.append(f"::warning {','.join(props)}::{_escape_data(f'{r.spec.name}: ' + '; '.join(r.notes))}")
    for line in run.drift:
        lines.append(f"::warning title=vramplan baseline versions::{_escape_data('baseline recorded under other versions: ' + line)}")
    return lines


_ICON = {"over-budget": "❌ over budget", "grew": "❌ grew", "shrank": "⚠️ shrank", "new": "🆕 new", "ok": "✅ ok"}


def markdown_summary(run: CheckRun, *, updated: bool = False) -> str:
    """A Markdown report for ``$GITHUB_STEP_SUMMARY`` (or a PR comment)."""
    failures = run.failures(accept_growth=updated)
    head = (f"{len(failures)} of {len(run.results)} checks failed" if failures
            else f"all {len(run.results)} checks passed")
    where = f"`{run.baseline_path}`{'' if run.baseline_found else ' (not found)'}{' (updated)' if updated else ''}"
    out = [f"### vramplan check: {head}", "", f"{run.tier} tier · tolerance {run.tolerance:.1%} · baseline {where}", "",
           "| check | model | GPU | device total | usable | vs baseline | status |",
           "|---|---|---|---:|---:|---:|---|"]
    for r in run.results:
        bd = r.breakdown
        usable = _gib(r.spec.gpu.usable_memory_bytes) if r.spec.gpu else "-"
        dt = r.device_total
        vs = _pct(dt.relative) if dt is not None and dt.relative is not None else "-"
        out.append(f"| {r.spec.name} | {bd.model} | {r.spec.gpu.name if r.spec.gpu else '-'} | "
                   f"{_gib(bd.device_total_bytes)} | {usable} | {vs} | {_ICON[r.status]} |")
    for r in run.results:
        if not (r.reasons or r.notes or r.components):
            continue
        out += ["", f"<details><summary>{r.spec.name}: {_ICON[r.status]}</summary>", ""]
        out += [f"- {line}" for line in (*r.reasons, *r.notes, *r.warnings)]
        if r.components:
            out += ["", "| component | baseline | now | change |", "|---|---:|---:|---:|"]
            out += [f"| {d.name} | {_gib(d.baseline_bytes)} | {_gib(d.current_bytes)} | {_signed_gib(d.delta_bytes)} |"
                    for d in r.components]
        out += ["", "</details>"]
    if run.drift:
        out += ["", "**Baseline recorded under other versions:** " + "; ".join(run.drift)]
    if run.stale:
        out += ["", "Baseline entries no check refers to: " + ", ".join(f"`{n}`" for n in run.stale)]
    return "\n".join(out) + "\n"


def breakdown_diff_lines(old: dict[str, int], new: dict[str, int], old_label: str = "baseline") -> list[str]:
    """A plain-text table of the numbers that differ between two {name: bytes} mappings (used by
    the pytest plugin's failure messages)."""
    names = list(dict.fromkeys([*old, *new]))
    rows = [(n, old.get(n, 0), new.get(n, 0)) for n in names if old.get(n, 0) != new.get(n, 0)]
    if not rows:
        return []
    width = max(len(n) for n, _, _ in rows)
    lines = [f"{'':<{width}}  {old_label:>12}  {'now':>12}  {'change':>12}"]
    for n, a, b in rows:
        rel = f" ({(b - a) / a:+.1%})" if a else ""
        lines.append(f"{n:<{width}}  {_gib(a):>12}  {_gib(b):>12}  {_signed_gib(b - a):>12}{rel}")
    return lines
