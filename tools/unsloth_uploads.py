"""Build profiles/unsloth_uploads.json: for every shipped Hub id and variant that Unsloth's model mapper
names, the 4-bit checkpoint ``FastLanguageModel.from_pretrained(name, load_in_4bit=True)`` loads in its
place, and Unsloth's plain bitsandbytes 4-bit upload of it where one exists.

Read from the unsloth wheel (``unsloth/models/mapper.py`` ``__INT_TO_FLOAT_MAPPER`` and
``unsloth/models/loader_utils.py`` ``BAD_MAPPINGS``), as ``__get_model_name`` resolves a 16-bit name under
``load_in_4bit``: to the key whose 16-bit names list it (a dynamic ``-unsloth-bnb-4bit`` upload where one
exists, which keeps some modules 16-bit), remapped by ``BAD_MAPPINGS``; an explicit ``-bnb-4bit`` name is kept.

    python tools/unsloth_uploads.py [WHEEL]   # default: pip download --no-deps unsloth==VERSION
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "2026.8.19"
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "profiles" / "unsloth_uploads.json"
DYNAMIC = "-unsloth-bnb-4bit"


def _plain(name: str) -> bool:
    """A plain bitsandbytes 4-bit upload's name (not a dynamic one)."""
    return name.lower().endswith("-bnb-4bit") and not name.lower().endswith(DYNAMIC)


def _assigned(source: str, name: str, lowered: bool = False):
    """The literal assigned to ``name`` at module level of ``source`` (``lowered``: a dict of strings written
    as ``"...".lower()`` calls, as ``BAD_MAPPINGS``)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = node.value
            if lowered:
                return {_lower_literal(k): _lower_literal(v) for k, v in zip(value.keys, value.values, strict=True)}
            return ast.literal_eval(value)
    raise SystemExit(f"error: {name} not found")


def _lower_literal(node) -> str:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "lower":
        return ast.literal_eval(node.func.value).lower()
    return ast.literal_eval(node).lower()


def _shipped_names() -> dict[str, str]:
    """lowercase Hub id or variant -> its spelling, for every shipped profile and catalogue variant."""
    sys.path.insert(0, str(ROOT))
    from vramplan.model.profiles import _profile_files, catalogue

    names = {hf_id.lower(): hf_id for hf_id in _profile_files().values()}
    for hf_id, entry in catalogue()["models"].items():
        names[hf_id.lower()] = hf_id
        names.update((v.lower(), v) for v in entry.get("variants", ()))
    return names


def build(wheel: Path) -> dict:
    z = zipfile.ZipFile(wheel)
    mapper = _assigned(z.read("unsloth/models/mapper.py").decode(), "__INT_TO_FLOAT_MAPPER")
    bad = _assigned(z.read("unsloth/models/loader_utils.py").decode(), "BAD_MAPPINGS", lowered=True)
    float_to_int: dict[str, str] = {}
    sixteen: dict[str, tuple] = {}
    for key, values in mapper.items():
        if isinstance(values, dict):
            values = values["16"]  # the FP8 names ("8") map to the same key; not shipped ids
        sixteen[key] = values
        for v in values:
            float_to_int[v.lower()] = key
    out = {}
    for lower, name in sorted(_shipped_names().items()):
        key = float_to_int.get(lower)
        if key is None:
            continue
        loads = bad.get(key.lower(), key)
        loads = next((k for k in mapper if k.lower() == loads), loads)  # keep the mapper's spelling
        plain = next((n for n in (key, *sixteen[key]) if _plain(n)), None)
        out[name] = {"loads": loads, "dynamic": loads.lower().endswith(DYNAMIC), "plain_4bit": plain}
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {"_source": {"package": f"unsloth=={VERSION}", "wheel_sha256": digest,
                        "files": ["unsloth/models/mapper.py (__INT_TO_FLOAT_MAPPER)",
                                  "unsloth/models/loader_utils.py (BAD_MAPPINGS, __get_model_name)"],
                        "built_by": "tools/unsloth_uploads.py"},
            "uploads": out}


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        if argv:
            wheel = Path(argv[0])
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            f"unsloth=={VERSION}"], check=True)
            wheel = next(Path(tmp).glob("unsloth-*.whl"))
        data = build(wheel)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{len(data['uploads'])} shipped names mapped -> {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
