"""The one input layer: everything a user hands vramplan (a GPU name or size, a setup mapping, a
YAML or JSON file) is read and checked here, and every failure is a one-line ``SpecError``.

Limits keep hostile files from taking the machine: a file over ``MAX_FILE_BYTES`` is refused
before it is parsed, nesting deeper than ``MAX_DEPTH`` is refused, and a YAML document whose
aliases would expand to more than ``MAX_NODES`` nodes (a "billion laughs" file) is refused from
its node graph, before anything walks the expanded data. JSON's ``NaN``/``Infinity`` are refused
(no byte count, rank or length is ever one). Torch-free; yaml is imported only to read YAML.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from ..model.rawinput import (  # re-exported: the readers that need no shipped data
    MAX_DEPTH,
    MAX_FILE_BYTES,
    check_model_config,
    check_numbers,
    count_shown,
    loads_json,
    read_model_config,
    read_text,
    shown_value,
)
from ..specs import GpuSpec, Setup, SpecError

__all__ = ["MAX_COUNTS", "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_GPU_BYTES", "MAX_NODES", "MAX_YAML_BYTES", "MIN_GPU_BYTES",
           "ambiguous_gpu_alias", "check_count", "check_model_config", "check_numbers", "compose_yaml",
           "construct_yaml", "count_shown", "load_structured", "loads_json", "loads_yaml", "read_model_config",
           "read_text", "resolve_gpu", "setup_from_mapping", "shown_value"]

MAX_NODES = 200_000
#: YAML is parsed node by node (a composed graph is checked before it is built): 1 MiB keeps the
#: worst file under a second; vramplan's own plan and checks files are a few kB.
MAX_YAML_BYTES = 1024 * 1024

#: The largest value each count accepts, wherever it enters (CLI options, plan files, checks
#: files, Python's ``plan()``): beyond these a number is a typo, and the search's work stays
#: bounded. Field or option name -> limit.
MAX_COUNTS: dict[str, int] = {
    "batch": 1 << 16,            # micro-batch per GPU
    "epochs": 10_000,            # passes over --dataset-tokens
    "max-gpus": 1024,            # the most GPUs a row of `plan --gpu any` uses (each count is planned)
    "seq": 1 << 24,              # 16M tokens per sequence
    "grad_accum": 1 << 16,
    "gpus": 1 << 16,             # GPUs in all
    "nodes": 1 << 16,
    "lora_rank": 1 << 16,
    "lora_alpha": 1 << 24,
    "global_batch": 1 << 24,     # sequences per optimizer step
    "tokens_per_step": 1 << 40,  # ~1.1T tokens per optimizer step
    "dataset_tokens": 10**16,
    "eval_batch": 1 << 16,
    "tp": 1 << 10,
    "cp": 1 << 10,
    "pp": 1 << 10,
    "ep": 1 << 10,
    "dp_replicate": 1 << 16,
    "max_prompt_length": 1 << 24,
    "max_completion_length": 1 << 24,
    "num_generations": 1 << 12,
    "checkpoint_every": 1 << 16,  # layers
}


def check_count(name: str, value: Any, flag: str | None = None) -> Any:
    """``value`` when within :data:`MAX_COUNTS` (None and non-ints pass: others check them)."""
    limit = MAX_COUNTS.get(name)
    if limit is not None and isinstance(value, int) and not isinstance(value, bool) and value > limit:
        raise SpecError(f"{flag or name} must be at most {limit:,}; got {count_shown(value)}")
    return value

# ----------------------------------------------------------------------------------------------
# GPUs


def resolve_gpu(gpu: Any = None, gpu_memory: Any = None, *, where: str | None = None) -> GpuSpec | None:
    """The GpuSpec a user means, or None when neither is given.

    ``gpu``: a GpuSpec, a shipped name or alias (``rtx-4090``), a positive size in bytes, or a
    plan file's mapping (``{name: custom-24gib, usable_memory_bytes: ...}`` or ``{name: rtx-4090}``).
    ``gpu_memory``: a size (``24GiB``, ``80GB``) or bytes. ``where`` prefixes error messages
    (a file and entry); without it they name the CLI flags.
    """
    from ..model.profiles import load_gpu
    from ..util.units import parse_bytes

    def fail(message: str) -> SpecError:
        return SpecError(f"{where}: {message}" if where else message)

    gpu_flag, mem_flag = ("gpu", "gpu_memory") if where else ("--gpu", "--gpu-memory")
    if gpu is not None and gpu_memory is not None:
        return _raise(fail(f"pass {gpu_flag} or {mem_flag}, not both"))
    if isinstance(gpu, GpuSpec):
        return gpu
    if isinstance(gpu, bool):
        return _raise(fail(f"{gpu_flag} must be a GPU name such as rtx-4090; got {gpu!r}"))
    if isinstance(gpu, int):
        return _custom(gpu, fail, gpu_flag)
    if isinstance(gpu, dict):
        name = gpu.get("name")
        if not isinstance(name, str) or not name:
            return _raise(fail(f"{gpu_flag} must be a GPU name or a mapping with 'name'"))
        if name.startswith("custom-"):
            size = gpu.get("usable_memory_bytes")
            if isinstance(size, bool) or not isinstance(size, int):
                return _raise(fail("custom GPU needs a positive integer 'usable_memory_bytes'"))
            return _custom(size, fail, "usable_memory_bytes")
        gpu = name
    if isinstance(gpu, str):
        try:
            return load_gpu(gpu)
        except SpecError as exc:
            raise fail(str(exc)) from None
    if gpu is not None:
        return _raise(fail(f"{gpu_flag} must be a GPU name such as rtx-4090; got {type(gpu).__name__}"))
    if gpu_memory is not None:
        if isinstance(gpu_memory, bool):
            return _raise(fail(f"{mem_flag} must be a size such as 24GiB; got {gpu_memory!r}"))
        try:
            size = parse_bytes(gpu_memory)
        except (ValueError, OverflowError, TypeError) as exc:
            text = str(exc) or f"cannot read {gpu_memory!r}"
            raise fail(f"{mem_flag}: {text}") from None
        if 0 < size < MIN_GPU_BYTES:
            text = str(gpu_memory).strip()
            bare = text.replace(".", "", 1).isdigit()
            hint = f"; did you mean {text}GiB?" if bare else ""
            raise fail(f"{mem_flag} {text} is {size:,} bytes, less than any GPU (at least 64 MiB){hint}")
        return _custom(size, fail, mem_flag)
    return None


#: The smallest ``--gpu-memory`` accepted: below it a size is a missing unit (``24`` for 24GiB).
MIN_GPU_BYTES = 64 << 20


def ambiguous_gpu_alias(name: str) -> tuple[str, list[str]] | None:
    """``(chosen, others)`` when a shipped alias such as ``a100`` names one of several cards (it
    resolves to ``chosen``, the most common one; ``others`` are the cards it could also mean), else
    None. The command line warns with both, so the card is never picked silently."""
    from ..model.profiles import gpus, load_gpu

    try:
        chosen = load_gpu(name).name
    except SpecError:
        return None
    key = name.strip().lower().replace(" ", "-").replace("_", "-").removeprefix("nvidia-")
    if key == chosen:
        return None
    keys = (key, "rtx-" + key)  # a bare "3080" or "4060-ti" names the RTX card

    def variant(g: str) -> bool:  # the same card with other memory (a100-40gb / a100-80gb), not a -ti/-super/laptop
        rest = next((g[len(k) + 1:] for k in keys if g.startswith(k + "-")), None)
        return rest is not None and rest.split("-")[0] not in _OTHER_CARDS

    others = [g.name for g in gpus() if g.name != chosen and (variant(g.name) or g.name in keys)]
    return (chosen, others) if others else None


#: name parts that make another card of the same number (an RTX 3060 Ti is not an RTX 3060)
_OTHER_CARDS = frozenset({"ti", "super", "laptop", "mobile", "max", "ada"})


#: The largest GPU memory accepted (1 PiB): beyond it a number is a typo, not a card.
MAX_GPU_BYTES = 1 << 50


def _custom(size: int, fail, flag: str) -> GpuSpec:
    if size <= 0 or size > MAX_GPU_BYTES:
        shown = str(size) if abs(size) < 10**18 else f"{float(size):.3g}" if abs(size) < 10**300 else "a huge number"
        raise fail(f"{flag} must be between 1 byte and 1 PiB; got {shown}")
    return GpuSpec.custom(size)


def _raise(exc: Exception):
    raise exc


# ----------------------------------------------------------------------------------------------
# Setups


def setup_from_mapping(data: Any, where: str) -> Setup:
    """A Setup from a mapping of setup keys, with value types checked against the dataclass's
    defaults (a YAML ``seq: "2048"`` or ``checkpointing: "yes"`` is an error, not a surprise)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{where} must be a mapping of setup keys")
    defaults = {f.name: f.default for f in dataclasses.fields(Setup)}
    for key, value in data.items():
        if not isinstance(key, str):
            raise SpecError(f"{where}: setup keys are names; got {key!r}")
        if key not in defaults:
            continue  # Setup.from_dict names it with the known keys
        default = defaults[key]
        if key == "lora_alpha" and value is not None:
            default = 0  # an int or null
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
            raise SpecError(f"{where}: {key} must be {kind}; got {shown_value(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"{where}: {key} must be a finite number; got {value!r}")
        check_count(key, value, f"{where}: {key}")
    try:
        return Setup.from_dict(data)
    except (SpecError, TypeError) as exc:
        raise SpecError(f"{where}: {exc}") from None


# ----------------------------------------------------------------------------------------------
# Files


def compose_yaml(text: str, where: str):
    """The YAML document's root node (or None for an empty document), after the limits: depth
    and the size its aliases expand to are computed on the node graph, without expanding it."""
    import yaml

    if len(text) > MAX_YAML_BYTES:
        raise SpecError(f"{where}: {len(text):,} bytes is too large for YAML (limit {MAX_YAML_BYTES:,}; "
                        "plan and checks files are a few kB)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # libyaml's parser where installed: 10x faster
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: not valid YAML ({_yaml_detail(exc)})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
    if node is not None:
        _check_node_graph(node, where)
    return node


def construct_yaml(node, where: str) -> Any:
    """The data of a node from ``compose_yaml`` (already within the limits)."""
    import yaml

    if node is None:
        return None
    loader = yaml.SafeLoader("")
    try:
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: not valid YAML ({_yaml_detail(exc)})") from None
    finally:
        loader.dispose()
    check_numbers(data, where)
    return data


def loads_yaml(text: str, where: str) -> Any:
    """YAML text to data, within the limits (see the module's docstring)."""
    return construct_yaml(compose_yaml(text, where), where)


def load_structured(path: str | os.PathLike, what: str = "file") -> Any:
    """A JSON (``.json``) or YAML (anything else) file's data, within the limits."""
    text = read_text(path, what)
    if Path(path).suffix.lower() == ".json":
        return loads_json(text, str(path))
    return loads_yaml(text, str(path))


def _yaml_detail(exc: Exception) -> str:
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}: {problem}"
    return " ".join(str(exc).split())


def _check_node_graph(root, where: str) -> None:
    """Depth and expanded size of a composed YAML graph. Aliases make it a DAG (or, with
    recursive anchors, a cyclic graph, which is refused): sizes are memoised per node, so a
    billion-laughs document costs as many steps as it has distinct nodes."""
    import yaml

    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    # iterative post-order walk: (node, children expanded?)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children: list = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
            if sizes[key] > MAX_NODES:
                raise SpecError(f"{where}: its aliases expand to over {MAX_NODES:,} values; refused")
            if depths[key] > MAX_DEPTH:
                raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise SpecError(f"{where}: a YAML anchor refers to itself; refused")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
        if len(on_path) > MAX_DEPTH + 1:
            raise SpecError(f"{where}: nested deeper than {MAX_DEPTH} levels")
