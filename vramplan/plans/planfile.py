"""Plan files: the hand-off between ``plan`` and ``emit`` / ``measure`` / ``check``.

A plan file is one JSON object (``.json``) or the same mapping in YAML (``.yaml``/``.yml``)::

    vramplan_plan: 1              # format version
    vramplan_version: "0.1.0"
    model: meta-llama/Llama-3.1-8B   # anything load_model resolves
    gpu: {name: rtx-4090, usable_memory_bytes: 25390809088}   # or null
    nodes: 1
    fits: true
    setup: {method: lora, lora_rank: 16, ...}                 # Setup.to_dict()
    tokens_per_s: 2890.5
    step_time_s: 0.71
    global_batch: 16
    breakdown: {...}                                          # Breakdown.to_json() when planned
    alternatives: [{setup: {...}, device_total_bytes: ..., tokens_per_s: ..., quality: ..., note: ...}]
    rejected: [{setup: {...}, reason: "...", device_total_bytes: ..., kind: ..., limit_bytes: ..., misfit: ...}]
    notes: ["..."]
    note_kinds: ["micro_batch", ...]                          # each note's kind, in the order of notes
    host_ram: {bytes: 68719476736, source: profile}           # what CPU offload was checked against

``load_plan`` validates the file, resolves model and GPU again and re-estimates (milliseconds), and
keeps the file's own ``breakdown`` as ``Plan.recorded_estimate`` so a run can be compared with the
prediction it was made from. A plan made under ``--transformers`` names that version in its
breakdown's ``modelled_versions`` and is re-estimated under it (``Plan.transformers``); a file
naming transformers 5, or no version, is the default stack's. Every problem is a one-line
``SpecError``. No torch import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..setup.inputs import check_count, load_structured, resolve_gpu, setup_from_mapping, shown_value
from ..specs import Alternative, Plan, Rejected, Setup, SpecError
from ..util.fileio import atomic_write_text

FORMAT_VERSION = 1


def plan_to_json(plan: Plan) -> dict:
    """The plan as one JSON-ready mapping (what ``vramplan plan --json`` prints)."""
    from .. import __version__

    gpu = plan.gpu
    return {
        "vramplan_plan": FORMAT_VERSION,
        "vramplan_version": __version__,
        "model": plan.model,
        "gpu": None if gpu is None else {"name": gpu.name, "display_name": gpu.display_name,
                                         "usable_memory_bytes": gpu.usable_memory_bytes},
        "nodes": plan.nodes,
        "fits": plan.fits,
        "setup": plan.setup.to_dict(),
        "tokens_per_s": plan.tokens_per_s,
        "step_time_s": plan.step_time_s,
        "global_batch": plan.global_batch,
        "breakdown": _breakdown_json(plan),
        "alternatives": [a.to_json() for a in plan.alternatives],
        "rejected": [r.to_json() for r in plan.rejected],
        "notes": [str(n) for n in plan.notes],  # Note is a str: plain text for YAML
        "note_kinds": [n.kind for n in plan.notes],
        "host_ram": {"bytes": plan.host_ram_bytes, "source": plan.host_ram_source},
    }


def _breakdown_json(plan: Plan) -> dict:
    """The plan's Breakdown as JSON, its ``modelled_versions`` naming the transformers version the plan
    models when not the default (``--transformers``, as ``estimate --json`` does)."""
    data = plan.breakdown.to_json()
    if plan.transformers and data.get("modelled_versions"):
        data["modelled_versions"] = {**data["modelled_versions"], "transformers": plan.transformers}
    return data


def recorded_transformers(recorded: dict | None) -> str | None:
    """The transformers version a plan file's breakdown records in its ``modelled_versions`` when it
    is not the default stack's (transformers 5), else None; files without it model the default."""
    from ..estimator.stack import Stack

    versions = recorded.get("modelled_versions") if isinstance(recorded, dict) else None
    version = versions.get("transformers") if isinstance(versions, dict) else None
    if not isinstance(version, str):
        return None
    try:
        stack = Stack(transformers=version)
    except ValueError:
        return None
    return None if stack.is_default else stack.transformers


def dumps_plan(plan: Plan, fmt: str = "json") -> str:
    data = plan_to_json(plan)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(data, sort_keys=False, width=100)
    raise SpecError(f"unknown plan format {fmt!r}; use json or yaml")


def _format_for(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return "json"
    if suffix in (".yaml", ".yml"):
        return "yaml"
    raise SpecError(f"{path}: a plan file ends in .json, .yaml or .yml")


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write the plan atomically as JSON or YAML, chosen by the file's extension."""
    return atomic_write_text(path, dumps_plan(plan, _format_for(path)))


def read_plan_data(path: str | os.PathLike) -> dict:
    """The raw mapping of a plan file, checked for shape; errors name the file and the problem."""
    _format_for(path)  # .json, .yaml or .yml
    data = load_structured(path, "plan file")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a plan file holds one mapping, got {type(data).__name__}")
    version = data.get("vramplan_plan")
    if type(version) is not int or version != FORMAT_VERSION:  # `true == 1` is not a version
        raise SpecError(f"{path}: not a vramplan plan file (missing 'vramplan_plan: {FORMAT_VERSION}')")
    for key in ("model", "setup"):
        if key not in data:
            raise SpecError(f"{path}: plan file has no '{key}'")
    if not isinstance(data["model"], str) or not data["model"].strip():
        raise SpecError(f"{path}: 'model' must be a model name or path")
    if not isinstance(data["setup"], dict):
        raise SpecError(f"{path}: 'setup' must be a mapping of setup keys")
    return data


def _setup_from(data, path, where: str = "setup") -> Setup:
    if not isinstance(data, dict):
        raise SpecError(f"{path}: '{where}' must be a mapping")
    return setup_from_mapping(data, f"{path}: {where}")


def _entries(data: dict, key: str, path) -> list:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{path}: '{key}' must be a list; got {type(value).__name__}")
    return value


def _number(value, path, where: str, *, integer: bool = False, optional: bool = True):
    """A non-negative finite number (an int when ``integer``) from a plan file, or None."""
    if value is None and optional:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (0 <= value < 1 << 62) or value != value:
        what = "a non-negative integer" if integer else "a non-negative number"
        raise SpecError(f"{path}: {where} must be {what}; got {shown_value(value)}")
    return value


def _text(value, path, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SpecError(f"{path}: {where} must be a string; got {shown_value(value)}")
    return value


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan file, resolve its model and GPU, and re-estimate its setup."""
    from ..estimator import DEFAULT_CORRECTIONS, estimate
    from ..estimator.stack import DEFAULT_STACK, Stack
    from ..model.profiles import load_model

    data = read_plan_data(path)
    setup = _setup_from(data["setup"], path)
    entry = data.get("gpu")
    if entry is not None and not isinstance(entry, (str, dict)):  # not a size: plan files name their GPU
        raise SpecError(f"{path}: 'gpu' must be a GPU name or a mapping with 'name'")
    gpu = resolve_gpu(entry, where=str(path))
    nodes = data.get("nodes", 1)
    if type(nodes) is not int or nodes < 1:
        raise SpecError(f"{path}: 'nodes' must be a positive integer; got {shown_value(nodes)}")
    check_count("nodes", nodes, f"{path}: nodes")
    alternatives = []
    for i, a in enumerate(_entries(data, "alternatives", path)):
        if not isinstance(a, dict):
            raise SpecError(f"{path}: alternatives[{i}] must be a mapping")
        at = f"alternatives[{i}]"
        alternatives.append(Alternative(
            setup=_setup_from(a.get("setup"), path, f"{at}.setup"),
            device_total_bytes=_number(a.get("device_total_bytes"), path, f"{at}.device_total_bytes",
                                       integer=True) or 0,
            tokens_per_s=_number(a.get("tokens_per_s"), path, f"{at}.tokens_per_s"),
            quality=_text(a.get("quality"), path, f"{at}.quality"), note=_text(a.get("note"), path, f"{at}.note")))
    rejected = []
    for i, r in enumerate(_entries(data, "rejected", path)):
        if not isinstance(r, dict):
            raise SpecError(f"{path}: rejected[{i}] must be a mapping")
        at = f"rejected[{i}]"
        rejected.append(Rejected(setup=_setup_from(r.get("setup"), path, f"{at}.setup"),
                                 reason=_text(r.get("reason"), path, f"{at}.reason"),
                                 device_total_bytes=_number(r.get("device_total_bytes"), path,
                                                            f"{at}.device_total_bytes", integer=True)))
    notes = tuple(_text(n, path, f"notes[{i}]") for i, n in enumerate(_entries(data, "notes", path)))
    step_time_s = _number(data.get("step_time_s"), path, "step_time_s")
    tokens_per_s = _number(data.get("tokens_per_s"), path, "tokens_per_s")
    recorded = data.get("breakdown")
    if recorded is not None and not isinstance(recorded, dict):
        raise SpecError(f"{path}: 'breakdown' must be a mapping; got {type(recorded).__name__}")
    model = load_model(data["model"])
    host_ram = data.get("host_ram") if isinstance(data.get("host_ram"), dict) else {}
    transformers = recorded_transformers(recorded)  # the stack the plan was made under (--transformers)
    stack = Stack(transformers=transformers) if transformers else DEFAULT_STACK
    return Plan(
        model=data["model"],
        setup=setup,
        breakdown=estimate(model, setup, gpu, DEFAULT_CORRECTIONS, stack),
        gpu=gpu,
        nodes=nodes,
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        alternatives=tuple(alternatives),
        rejected=tuple(rejected),
        notes=notes,
        recorded_estimate=recorded,
        host_ram_bytes=host_ram.get("bytes") if isinstance(host_ram.get("bytes"), int) else None,
        host_ram_source=host_ram.get("source") if isinstance(host_ram.get("source"), str) else None,
        transformers=transformers,
    )
