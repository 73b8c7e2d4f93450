"""Baseline records: what ``vram-baseline.json`` keeps of each check (the four headline numbers,
every component's bytes, the versions behind them), read and written atomically."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..setup.inputs import loads_json, read_text
from ..specs import Breakdown, SpecError
from ..util.fileio import atomic_write_text
from ..util.versions import BASELINE_LIBRARIES, library_versions

BASELINE_FORMAT = 1
HEADLINE = ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes")


def current_versions() -> dict[str, Any]:
    """vramplan, its estimator's MODEL_VERSION, and the installed torch/transformers/peft
    (package metadata only: reading a version must not import torch)."""
    from .. import __version__
    from ..estimator.version import MODEL_VERSION

    return {"vramplan": __version__, "model_version": MODEL_VERSION, **library_versions(BASELINE_LIBRARIES)}


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
    if not path.exists():
        return None
    text = read_text(path, "baseline")
    try:
        data = loads_json(text, str(path))
    except SpecError as exc:  # the baseline's wording: "<path>: baseline is not valid JSON (...)"
        raise SpecError(str(exc).replace(f"{path}: not valid", f"{path}: baseline is not valid", 1)) from None
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
