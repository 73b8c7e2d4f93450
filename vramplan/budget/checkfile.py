"""Checks files and plan files -> :class:`CheckSpec`: the ``vramplan check`` inputs, read
through :mod:`vramplan.setup.inputs` (size, depth and alias limits; YAML nodes kept for line numbers)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..setup.inputs import compose_yaml, construct_yaml, loads_json, read_text, resolve_gpu, setup_from_mapping
from ..specs import GpuSpec, Setup, SpecError

CHECK_KEYS = ("name", "model", "from", "format", "gpu", "gpu_memory", "setup", "must_fit", "tolerance",
              "transformers")


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
    #: a ``from:`` check's training config, and its reader's warnings (fields not modelled, values assumed)
    config: str | None = None
    warnings: tuple[str, ...] = ()
    #: a plan file's transformers version when it was planned under another than the default (5)
    #: (``plan --transformers``: its breakdown's ``modelled_versions``); ``check --transformers`` wins
    transformers: str | None = None


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
    if path.is_dir():
        raise SpecError(f"{path}: is a directory, not a checks or plan file")
    text = read_text(path, "file")
    if path.suffix.lower() == ".json":
        return loads_json(text, str(path)), {}
    import yaml

    node = compose_yaml(text, str(path))
    data = construct_yaml(node, str(path))
    lines: dict[int, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if getattr(key, "value", None) == "checks" and isinstance(value, yaml.SequenceNode):
                lines = {i: item.start_mark.line + 1 for i, item in enumerate(value.value)}
    return data, lines


def _transformers(value: Any, where: str) -> str | None:
    """A check's ``transformers:`` (the version its analytic estimate models, as ``check --transformers``):
    a version string (``"4.48.1"``), a whole major (``5``) or ``installed`` (this machine's). A YAML float
    is refused: ``4.10`` would read as 4.1."""
    from ..estimator.stack import transformers_stack

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SpecError(f"{where}: transformers must be a version in quotes like '4.48.1', or 5; got {value!r}")
    try:
        return transformers_stack(str(value)).transformers
    except ValueError as exc:
        raise SpecError(f"{where}: transformers: {exc}") from None


def _gpu(gpu: Any, gpu_memory: Any, where: str) -> GpuSpec | None:
    """``gpu: rtx-4090`` (a shipped name) or ``gpu_memory: 24GiB`` (a size or bytes), not both.
    A checks file names its GPU: a number or a mapping under ``gpu`` is refused."""
    if gpu is not None and gpu_memory is not None:
        raise SpecError(f"{where}: give gpu or gpu_memory, not both")
    if gpu is not None and not isinstance(gpu, str):
        raise SpecError(f"{where}: gpu must be a GPU name such as rtx-4090; got {gpu!r}")
    return resolve_gpu(gpu, gpu_memory, where=where)


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
    config, warnings = None, ()
    if "from" in entry:
        config, model, fields, warnings = _from_config(entry, path, where)
        merged.setdefault("model", model)
        setup_data = {**(defaults.get("setup") or {}), **fields, **(entry.get("setup") or {})}
        if merged.get("model") is None:
            raise SpecError(f"{where}: {config} names no model; give model")
    elif "format" in entry:
        raise SpecError(f"{where}: format goes with from (a training config)")
    for key in ("name", "model"):
        if merged.get(key) in (None, ""):
            raise SpecError(f"{where}: missing '{key}'")
    name = merged["name"]
    if not isinstance(name, str):
        raise SpecError(f"{where}: name must be a string; got {name!r}")
    must_fit = merged.get("must_fit", True)
    if not isinstance(must_fit, bool):
        raise SpecError(f"{where}: must_fit must be true or false; got {must_fit!r}")
    gpu = _gpu(merged.get("gpu"), merged.get("gpu_memory"), where)
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
        config=config,
        warnings=warnings,
        transformers=_transformers(merged.get("transformers"), where),
    )


def _from_config(entry: dict, path: Path, where: str) -> tuple[str, str | None, dict, tuple[str, ...]]:
    """A ``from:`` entry's training config, read relative to the checks file: (its path, the model
    it names, the Setup fields it determines, its reader's warnings). Errors name the entry."""
    from ..readers import read_config

    ref, fmt = entry["from"], entry.get("format")
    if not isinstance(ref, str) or not ref.strip():
        raise SpecError(f"{where}: from must be the path of a training config")
    if fmt is not None and not isinstance(fmt, str):
        raise SpecError(f"{where}: format must be a format name such as axolotl; got {fmt!r}")
    config = Path(ref).expanduser()
    if not config.is_absolute():
        config = path.parent / config
    if not config.is_file():
        raise SpecError(f"{where}: from: no such file {config}")
    try:
        read = read_config(config, fmt)
    except SpecError as exc:
        raise SpecError(f"{where}: from: {exc}") from None
    model = read.model
    if model is not None and not Path(model).is_absolute() and (config.parent / model).exists():
        model = str(config.parent / model)  # a model path in the config is relative to the config
    shown = tuple(f"{config}: {w}" for w in read.warnings if not (w.field == "model" and "model" in entry))
    return str(config), model, dict(read.fields), shown


def _check_from_plan(path: Path) -> CheckSpec:
    from ..plans.planfile import read_plan_data, recorded_transformers

    data = read_plan_data(path)  # the plan file's own shape checks and messages
    gpu_entry = data.get("gpu")
    if gpu_entry is None:
        raise SpecError(f"{path}: plan file has no gpu, so there is no budget to check")
    if isinstance(gpu_entry, dict) and str(gpu_entry.get("name", "")).startswith("custom-"):
        gpu = _gpu(None, gpu_entry.get("usable_memory_bytes"), str(path))
    else:
        gpu = _gpu(gpu_entry.get("name") if isinstance(gpu_entry, dict) else gpu_entry, None, str(path))
    return CheckSpec(name=path.stem, model=_model_ref(data["model"], path.parent, str(path)),
                     setup=setup_from_mapping(data["setup"], f"{path}: setup"), gpu=gpu, must_fit=True,
                     source=str(path), line=None, transformers=recorded_transformers(data.get("breakdown")))


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
            raise SpecError(f"{path}: unknown top-level key {unknown[0]!r}; "
                            "a checks file has 'checks' (and 'defaults')")
        checks, defaults = data.get("checks"), data.get("defaults") or {}
        if not isinstance(checks, list) or not checks:
            raise SpecError(f"{path}: 'checks' must be a non-empty list of checks")
        if not isinstance(defaults, dict):
            raise SpecError(f"{path}: 'defaults' must be a mapping")
        bad = sorted(set(defaults) - (set(CHECK_KEYS) - {"name", "model"}), key=str)
        if bad:
            raise SpecError(f"{path}: defaults: unknown key {bad[0]!r}; "
                            "defaults may set gpu, gpu_memory, setup, must_fit, tolerance, transformers")
        specs += [_check_from_entry(e, defaults, path, i, lines.get(i)) for i, e in enumerate(checks)]
    seen: dict[str, str] = {}
    for s in specs:
        if s.name in seen:
            raise SpecError(f"check name {s.name!r} is used twice ({seen[s.name]} and {s.source}); "
                            "names key the baseline")
        seen[s.name] = s.source
    return tuple(specs)
