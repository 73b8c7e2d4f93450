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


def shipped_config_ids() -> list[str]:
    """HF id of every config in the package's models/ (indexed in aliases.json or not), sorted case-insensitively."""
    return sorted(_profile_files().values(), key=str.lower)


def shipped_models() -> dict[str, list[str]]:
    """HF id -> aliases of every shipped model profile."""
    return json.loads((_data() / "aliases.json").read_text())["aliases"]


@functools.lru_cache(maxsize=1)
def catalogue() -> dict:
    """profiles/catalogue.json: per shipped config its source, whether verbatim, the publisher's stated parameter
    count, its family and the Hub ids of variants that share the config (-Instruct, -Chat, -it, ...)."""
    return json.loads((_data() / "catalogue.json").read_text())


@functools.lru_cache(maxsize=1)
def _variants() -> dict[str, tuple[str, str]]:
    """lowercase variant id -> (variant id, HF id of the config it shares)."""
    return {v.lower(): (v, hf_id) for hf_id, e in catalogue()["models"].items() for v in e.get("variants", ())}


#: suffixes of pre-quantized uploads (unsloth's bitsandbytes uploads, GPTQ/AWQ, Qwen's -GPTQ-Int4/-Int8) -> the
#: Setup knobs training on such a checkpoint takes (adapters on the quantized base; the config is the base's). A
#: bitsandbytes upload stores NF4 with double quantization (unsloth's uploads' quantization_config).
_QUANT_SUFFIXES: dict[str, dict] = {
    "-unsloth-bnb-4bit": {"method": "qlora", "quant": "nf4"}, "-bnb-4bit": {"method": "qlora", "quant": "nf4"},
    "-4bit": {"method": "qlora", "quant": "nf4"}, "-bnb-8bit": {"method": "lora", "quant": "int8"},
    "-8bit": {"method": "lora", "quant": "int8"}, "-gptq-int4": {"method": "lora", "quant": "gptq", "quant_bits": 4},
    "-gptq-int8": {"method": "lora", "quant": "gptq", "quant_bits": 8},
    "-gptq": {"method": "lora", "quant": "gptq", "quant_bits": 4}, "-awq": {"method": "lora", "quant": "awq"},
    "-int4": {"method": "lora", "quant": "gptq", "quant_bits": 4},
    "-int8": {"method": "lora", "quant": "gptq", "quant_bits": 8}}


def _quant_suffix(repo: str) -> str:
    """The pre-quantized suffix ``repo`` (lowercase) ends with, or ""."""
    return next((x for x in _QUANT_SUFFIXES if repo.endswith(x) and len(repo) > len(x)), "")


def prequantized(name: str) -> dict:
    """The Setup knobs a pre-quantized upload's name implies (``unsloth/llama-3-8b-bnb-4bit``: QLoRA on NF4;
    ``Qwen/Qwen2.5-7B-Instruct-AWQ``: LoRA on AWQ 4-bit), for a name that resolves offline by inference; {}
    otherwise (a shipped config, a file, a Hub id: their own quantization_config decides)."""
    hit = resolve(name)
    if hit is None or not hit[2]:
        return {}
    return dict(_QUANT_SUFFIXES.get(_quant_suffix(name.strip().lower().split("/")[-1]), {}))


@functools.lru_cache(maxsize=1)
def _by_repo_name() -> dict[str, str | None]:
    """lowercase repo name (the part after the org) -> the id it names, for shipped ids and variants (None where two
    orgs share a repo name)."""
    out: dict[str, str | None] = {}
    for full in [*_profile_files().values(), *(v for v, _ in _variants().values())]:
        short = full.split("/", 1)[1].lower()
        out[short] = full if out.get(short, full) == full else None
    return out


def resolve(name: str) -> tuple[str, str, str] | None:
    """A shipped name -> (the id to report, the HF id whose config it reads, a note when it resolves by inference);
    None when nothing shipped matches. Exact: an HF id or alias, a config in models/, a variant in catalogue.json.
    By inference: a re-upload (catalogue.json `reuploaders`: NousResearch/*, unsloth/*, ModelScope's LLM-Research/*,
    TheBloke/*) whose repo name, less a pre-quantized suffix, names a shipped id, variant or alias."""
    key = name.strip().lower()
    hf_id = _aliases().get(key) or _profile_files().get(key)
    if hf_id is not None:
        return hf_id, hf_id, ""
    if key in _variants():
        variant, hf_id = _variants()[key]
        return variant, hf_id, ""
    if key.count("/") != 1:
        return None
    org, repo = key.split("/")
    suffix = _quant_suffix(repo)
    stripped = repo[: len(repo) - len(suffix)]
    if org in {r.lower() for r in catalogue().get("reuploaders", ())}:
        target = _by_repo_name().get(stripped) or _aliases().get(stripped)
    elif suffix:  # the publisher's own quantized upload (Qwen/Qwen2.5-7B-Instruct-AWQ): its org's base id
        base = f"{org}/{stripped}"
        target = _aliases().get(base) or _profile_files().get(base) or (_variants().get(base) or (None,))[0]
    else:
        return None
    if target is None:
        return None
    hf_id = _variants()[target.lower()][1] if target.lower() in _variants() else target
    knobs = _QUANT_SUFFIXES.get(suffix)
    quant = (f"; its {repo[len(stripped) + 1:]} quantization read from the name: "
             + ", ".join(f"{k} {v}" for k, v in knobs.items()) + " unless given") if knobs else ""
    if suffix == "-unsloth-bnb-4bit":
        quant += (" (an Unsloth dynamic 4-bit upload: some modules kept in 16 bits, listed in its config.json, "
                  "not read offline and not counted; Unsloth states under 10 % more memory than bitsandbytes 4-bit)")
    note = f"{name.strip()} read as {'a re-upload' if org != target.split('/')[0].lower() else 'an upload'} of " \
           f"{target} (its config.json: {hf_id}){quant}"
    return name.strip(), hf_id, note


@functools.lru_cache(maxsize=1)
def _unsloth_uploads() -> dict[str, dict]:
    """lowercase shipped id or variant -> profiles/unsloth_uploads.json's entry (tools/unsloth_uploads.py)."""
    return {k.lower(): v for k, v in json.loads((_data() / "unsloth_uploads.json").read_text())["uploads"].items()}


def unsloth_upload(name: str) -> dict | None:
    """The 4-bit checkpoint Unsloth 2026.8.19 loads for ``name`` under ``load_in_4bit=True`` (its mapper,
    profiles/unsloth_uploads.json): ``{"loads", "dynamic", "plain_4bit"}``; None for a name the mapper does not
    map, or one that names a pre-quantized upload itself (Unsloth keeps an explicit ``-bnb-4bit`` name)."""
    hit = resolve(name) if name and name.strip() else None
    if hit is None or _quant_suffix(name.strip().lower().split("/")[-1]):
        return None
    uploads = _unsloth_uploads()
    return uploads.get(hit[0].lower()) or uploads.get(hit[1].lower())


def unsloth_checkpoint_note(name: str) -> str:
    """Where Unsloth's default 4-bit checkpoint for ``name`` is not what the estimate counts: a dynamic
    ``-unsloth-bnb-4bit`` upload keeps some modules in 16 bits (listed per checkpoint in its config.json, not
    read offline); ""."""
    up = unsloth_upload(name)
    if not up or not up["dynamic"]:
        return ""
    name = resolve(name)[0]  # the Hub id Unsloth is given (an alias resolved)
    counted = up["plain_4bit"] or "the 16-bit checkpoint quantized on load"
    return (f"Unsloth loads {up['loads']} for {name} with load_in_4bit=True: its dynamic 4-bit upload, which "
            f"keeps some modules in 16 bits (not read offline, not counted; Unsloth states under 10 % more memory "
            f"than bitsandbytes 4-bit). The estimate counts plain NF4: {counted}, loaded with "
            f"use_exact_model_name=True, as `vramplan emit` writes it")


def model_note(name: str) -> str:
    """How ``name`` resolved when it resolved by inference (a re-upload, a pre-quantized upload); ""."""
    hit = resolve(name) if name and name.strip() else None
    return hit[2] if hit else ""


def model_warning(name: str) -> str:
    """What the estimate of a shipped model leaves out or assumes, from its catalogue entry's ``warning``
    (gpt-oss's MXFP4 experts, Gemma 3's vision tower, remote-code families); "" for anything else."""
    hit = resolve(name) if name and name.strip() else None
    return catalogue()["models"].get(hit[1], {}).get("warning", "") if hit else ""


@functools.lru_cache(maxsize=1)
def _all_names() -> dict[str, str]:
    """Every name that resolves offline, lowercase -> as spelled: aliases, HF ids, configs in models/, variants."""
    out = {k: k for k in _aliases()}
    out.update({k: v for k, v in _aliases().items() if k == v.lower()})
    out.update(_profile_files())
    out.update({k: v for k, (v, _) in _variants().items()})
    return out


def _close(name: str, options) -> str:
    """`; did you mean ...?` from difflib over ``options`` (lowercase names; a dict shows its values)."""
    close = difflib.get_close_matches(name.lower(), list(options), n=3, cutoff=0.6)
    if isinstance(options, dict):
        close = [options[c] for c in close]
    return f"; did you mean {', '.join(close)}?" if close else "; `vramplan models` lists the shipped ones"


def _read_config(path: Path) -> dict:
    """A config.json through the input layer (size, UTF-8, JSON limits, value kinds)."""
    from .rawinput import read_model_config

    return read_model_config(path)


@functools.lru_cache(maxsize=64)
def load_model(name: str) -> ModelSpec:
    """Resolve MODEL (shipped name, alias, variant, re-upload, config.json path, directory or Hub id) to a
    ModelSpec. A variant or re-upload keeps its own id as the name (what train.py loads) and reads the config it
    shares: ``source`` is ``profile:<that HF id>``."""
    if not name or not name.strip():
        raise SpecError("model name is empty")
    key = name.strip()
    hit = resolve(key)
    if hit is not None:
        shown, hf_id, _note = hit  # (the commands print the note: model_note)
        file = _data() / "models" / (hf_id.replace("/", "--") + ".json")
        cfg = json.loads(file.read_text())
        return model_spec_from_config(cfg, name=shown, source=f"profile:{hf_id}")
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
        from .modelscope import fetch_config, use_modelscope

        if use_modelscope():  # VRAMPLAN_HUB=modelscope: its file API, cached (model/modelscope.py)
            cached = fetch_config(key)
            try:
                cfg = _read_config(cached)
            except SpecError:
                cached.unlink(missing_ok=True)  # not a config: never reused from the cache
                raise
            return model_spec_from_config(cfg, name=key, source=f"modelscope:{key}")
        cfg = _hub_config(key)
        return model_spec_from_config(cfg, name=key, source=f"hub:{key}")
    raise SpecError(f"unknown model {key!r}{_close(key, _all_names())}")


def shipped_summary(hf_id: str) -> tuple[str, int]:
    """``(model_type, exact parameter count)`` of the shipped config ``hf_id`` (an id of
    :func:`shipped_config_ids`), for ``vramplan models``: its family's builder alone, without the traits
    and the input checks a config from elsewhere goes through (tests/test_catalogue_models.py estimates
    every shipped config through :func:`load_model`, whose count this equals)."""
    from .architecture import FAMILIES

    cfg = json.loads((_data() / "models" / (hf_id.replace("/", "--") + ".json")).read_text())
    builder = FAMILIES.get(cfg["model_type"])
    spec = builder(cfg, hf_id, f"profile:{hf_id}") if builder else load_model(hf_id)
    return spec.model_type, spec.params_total


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One short TCP connect to the Hub endpoint (``HF_ENDPOINT``: a mirror), so an offline machine fails in a
    second instead of waiting out huggingface_hub's retries."""
    from ..util.net import reachable

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    return reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout_s)


def _hub_config(repo_id: str) -> dict:
    """config.json of a Hub repo through huggingface_hub's cache; never downloads weights."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
        from huggingface_hub.utils import logging as hf_logging
    except ImportError:
        raise SpecError(
            f"{repo_id!r} is not a shipped model; resolving Hub ids needs huggingface_hub: "
            "pip install 'vramplan[hub]'" + _close(repo_id, _all_names())
        ) from None
    offline = (
        f"{repo_id!r} is not shipped and the Hub cannot be reached (offline, nothing cached); "
        "pass a local config.json instead" + _close(repo_id, _all_names())
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
            tdp_watts=g.get("tdp_watts"),
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
    raise SpecError(f"unknown GPU {name!r}{_close(key, list(index))} (or pass --gpu-memory 24GiB)")
