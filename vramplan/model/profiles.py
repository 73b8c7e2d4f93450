"""Shipped data (profiles/): model configs under the names users type, and GPU specs.

MODEL may be a shipped HF id or alias (case-insensitive), a path to a config.json, a model
directory holding one, or a Hub id resolved with huggingface_hub (config.json only, cached; never
weights). Data is read lazily and cached; nothing here imports torch.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from importlib import resources
from pathlib import Path

from ..specs import GpuSpec, ModelSpec, SpecError
from .architecture import model_spec_from_config


def _data():
    return resources.files("vramplan.profile_data")


@functools.lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    """lowercase name or alias -> HF id, for every shipped model."""
    raw = json.loads((_data() / "aliases.json").read_text())["aliases"]
    table: dict[str, str] = {}
    for hf_id, names in raw.items():
        table[hf_id.lower()] = hf_id
        for n in names:
            table[n.lower()] = hf_id
    return table


@functools.lru_cache(maxsize=1)
def _profile_files() -> dict[str, str]:
    """lowercase HF id -> HF id of every config in the package's models/ (the indexed ones and those
    only a published record loads, e.g. mistralai/Mistral-7B-v0.1): a Hub id whose config ships
    resolves offline whether or not aliases.json lists it."""
    out = {}
    for entry in (_data() / "models").iterdir():
        name = entry.name
        if name.endswith(".json") and "--" in name:
            hf_id = name[: -len(".json")].replace("--", "/", 1)
            out[hf_id.lower()] = hf_id
    return out


def shipped_models() -> dict[str, list[str]]:
    """HF id -> aliases of every shipped model profile."""
    return json.loads((_data() / "aliases.json").read_text())["aliases"]


def _close(name: str, options) -> str:
    close = difflib.get_close_matches(name.lower(), list(options), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else "; `vramplan models` lists the shipped ones"


def _read_config(path: Path) -> dict:
    """A config.json through the input layer (size, UTF-8, JSON limits, value kinds)."""
    from .rawinput import read_model_config

    return read_model_config(path)


@functools.lru_cache(maxsize=64)
def load_model(name: str) -> ModelSpec:
    """Resolve MODEL (shipped name, alias, config.json path, directory or Hub id) to a ModelSpec."""
    if not name or not name.strip():
        raise SpecError("model name is empty")
    key = name.strip()
    hf_id = _aliases().get(key.lower()) or _profile_files().get(key.lower())
    if hf_id is not None:
        file = _data() / "models" / (hf_id.replace("/", "--") + ".json")
        cfg = json.loads(file.read_text())
        return model_spec_from_config(cfg, name=hf_id, source=f"profile:{hf_id}")
    path = Path(os.path.expanduser(key))
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SpecError(f"{key} is a directory without a config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise SpecError(f"no such file: {key}")
        return model_spec_from_config(_read_config(path), name=str(path), source=str(path))
    if key.count("/") == 1 and not key.startswith((".", "/")):
        cfg = _hub_config(key)
        return model_spec_from_config(cfg, name=key, source=f"hub:{key}")
    raise SpecError(f"unknown model {key!r}{_close(key, _aliases())}")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One short TCP connect to the Hub endpoint, so an offline machine fails in a second
    instead of waiting out huggingface_hub's retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hub_config(repo_id: str) -> dict:
    """config.json of a Hub repo through huggingface_hub's cache; never downloads weights."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
        from huggingface_hub.utils import logging as hf_logging
    except ImportError:
        raise SpecError(
            f"{repo_id!r} is not a shipped model; resolving Hub ids needs huggingface_hub: "
            "pip install 'vramplan[hub]'" + _close(repo_id, _aliases())
        ) from None
    offline = (
        f"{repo_id!r} is not shipped and the Hub cannot be reached (offline, nothing cached); "
        "pass a local config.json instead" + _close(repo_id, _aliases())
    )
    hf_logging.set_verbosity_error()  # its retry warnings would break the one-line error rule
    try:
        try:
            path = hf_hub_download(repo_id, "config.json", local_files_only=True)
        except LocalEntryNotFoundError:
            if not _hub_reachable():
                raise SpecError(offline) from None
            path = hf_hub_download(repo_id, "config.json")
    except SpecError:
        raise
    except LocalEntryNotFoundError:
        raise SpecError(offline) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"cannot fetch config.json of {repo_id!r} from the Hub: {first}") from None
    return _read_config(Path(path))


# ----------------------------------------------------------------------------------------------
# GPUs


@functools.lru_cache(maxsize=1)
def _gpu_table() -> tuple[dict[str, GpuSpec], dict[str, str]]:
    raw = json.loads((_data() / "gpus.json").read_text())["gpus"]
    by_name: dict[str, GpuSpec] = {}
    index: dict[str, str] = {}
    for g in raw:
        spec = GpuSpec(
            name=g["name"],
            display_name=g["display_name"],
            usable_memory_bytes=int(g["usable_memory_bytes"]),
            bf16=bool(g["bf16"]),
            bf16_tflops_dense=g.get("bf16_tflops_dense"),
            fp16_tflops_dense=g.get("fp16_tflops_dense"),
            memory_bandwidth_gbps=g.get("memory_bandwidth_gbps"),
            host_link_gbps=g.get("host_link_gbps"),
            interconnect=g.get("interconnect"),
            interconnect_gbps=g.get("interconnect_gbps"),
            vendor=g.get("vendor", "nvidia"),
            architecture=g.get("architecture", ""),
            compute_capability=g.get("compute_capability"),
            aliases=tuple(g.get("aliases", ())),
            host_ram_per_gpu_bytes=g.get("host_ram_per_gpu_bytes"),
            host_ram_note=g.get("host_ram_note", ""),
        )
        by_name[spec.name] = spec
        for n in (spec.name, *spec.aliases):
            index[n.lower()] = spec.name
    return by_name, index


def gpus() -> list[GpuSpec]:
    return list(_gpu_table()[0].values())


def load_gpu(name: str) -> GpuSpec:
    by_name, index = _gpu_table()
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = key.removeprefix("nvidia-")
    if key in index:
        return by_name[index[key]]
    raise SpecError(f"unknown GPU {name!r}{_close(key, index)} (or pass --gpu-memory 24GiB)")
