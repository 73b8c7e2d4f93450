"""ModelScope as the model hub (``VRAMPLAN_HUB=modelscope``): a repo id's ``config.json`` fetched over its
HTTP file API, cached, and read through the same input checks as a local file; never weights.

Where the Hugging Face Hub is unreachable users pull the same models from ModelScope (``modelscope download
--model LLM-Research/Meta-Llama-3-8B``). The file API is the one the ``modelscope`` package's
``model_file_download`` uses: ``GET {endpoint}/api/v1/models/{model_id}/repo?Revision=master&FilePath=config.json``;
the endpoint is ``https://`` + ``MODELSCOPE_DOMAIN`` (the package's variable; ``www.modelscope.cn`` by
default) or ``VRAMPLAN_MODELSCOPE_ENDPOINT`` (a full URL: a mirror or a proxy). No ``modelscope`` import:
one request with a time-out, the answer capped at 1 MiB, cached under ``VRAMPLAN_CACHE`` (default
``~/.cache/vramplan``) ``/modelscope/<org>--<name>/config.json`` (written atomically), so a second run is
offline. Every failure is one ``SpecError`` line.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..specs import SpecError
from ..util.net import reachable

__all__ = ["CONNECT_TIMEOUT_S", "MAX_CONFIG_BYTES", "READ_TIMEOUT_S", "cache_path", "endpoint", "fetch_config",
           "use_modelscope"]

#: seconds to reach the endpoint before the machine counts as offline
CONNECT_TIMEOUT_S = 3.0
#: seconds the whole request may take
READ_TIMEOUT_S = 15.0
#: the largest config.json read (a real one is a few KB)
MAX_CONFIG_BYTES = 1 << 20


def use_modelscope() -> bool:
    """Whether repo ids resolve on ModelScope (``VRAMPLAN_HUB=modelscope``) instead of the Hugging Face Hub."""
    hub = os.environ.get("VRAMPLAN_HUB", "huggingface").strip().lower()
    if hub not in ("huggingface", "hf", "modelscope", "ms"):
        raise SpecError(f"VRAMPLAN_HUB must be huggingface or modelscope; got {hub!r}")
    return hub in ("modelscope", "ms")


def endpoint() -> str:
    """The ModelScope endpoint (no trailing slash)."""
    given = os.environ.get("VRAMPLAN_MODELSCOPE_ENDPOINT")
    if given:
        return given.rstrip("/")
    return "https://" + os.environ.get("MODELSCOPE_DOMAIN", "www.modelscope.cn").strip("/")


def cache_path(repo_id: str) -> Path:
    """Where ``repo_id``'s config.json is cached."""
    root = Path(os.environ.get("VRAMPLAN_CACHE") or Path.home() / ".cache" / "vramplan")
    return root / "modelscope" / repo_id.replace("/", "--") / "config.json"


def fetch_config(repo_id: str) -> Path:
    """The cached config.json of ``repo_id`` on ModelScope, fetched first when not cached."""
    from urllib.error import HTTPError, URLError
    from urllib.parse import quote
    from urllib.request import urlopen

    cached = cache_path(repo_id)
    if cached.is_file():
        return cached
    base = endpoint()
    if not reachable(base, CONNECT_TIMEOUT_S):
        raise SpecError(f"{repo_id!r} is not shipped and ModelScope ({base}) cannot be reached (offline, nothing "
                        "cached); pass a local config.json instead")
    url = f"{base}/api/v1/models/{quote(repo_id, safe='/')}/repo?Revision=master&FilePath=config.json"
    try:
        with urlopen(url, timeout=READ_TIMEOUT_S) as answer:  # noqa: S310 (https, or the endpoint the user set)
            body = answer.read(MAX_CONFIG_BYTES + 1)
    except HTTPError as exc:
        raise SpecError(f"cannot fetch config.json of {repo_id!r} from ModelScope: HTTP {exc.code}"
                        + (" (no such model, or it is private)" if exc.code in (401, 403, 404) else "")) from None
    except (URLError, OSError, ValueError) as exc:
        raise SpecError(f"cannot fetch config.json of {repo_id!r} from ModelScope: "
                        f"{getattr(exc, 'reason', exc)}") from None
    if len(body) > MAX_CONFIG_BYTES:
        raise SpecError(f"config.json of {repo_id!r} from ModelScope is over {MAX_CONFIG_BYTES} bytes: not a config")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".config.json.{os.getpid()}.tmp")
    tmp.write_bytes(body)
    os.replace(tmp, cached)  # atomic: a reader never sees half a file
    return cached
