"""What every reader shares: the typed result (:class:`ReadConfig`, :class:`ReadWarning`), a
type-checked view of a config's fields (:class:`Fields`), the tables of names the frameworks
share (transformers' optimizer and attention names), and the resolution of files a config names.

Torch-free: yaml and json only, through :mod:`vramplan.setup.inputs` (its size and depth limits).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..specs import Setup, SpecError

__all__ = ["ATTN", "OPTIM", "TORCH_COMPILE_WHY", "Fields", "Mapped", "ReadConfig", "ReadWarning", "attn_from_name",
           "optimizer_from_name", "resolve_file"]

#: What every reader says of ``torch_compile``/``compile``: not modelled (no compiled-step truth on
#: this machine: the live-tensor counter does not see inductor's own buffers), and the direction.
#: AOTAutograd's partitioner (torch 2.13 ``_functorch/partitioners.py``,
#: ``min_cut_rematerialization_partition``, inductor's default) recomputes cheap ops in backward
#: instead of saving them and inductor fuses elementwise chains, so fewer activations are saved;
#: torchtune 0.6.1's configs say of ``compile: True``: "increases speed + decreases memory".
TORCH_COMPILE_WHY = ("torch.compile is not modelled: eager kernels assumed; a compiled step usually saves fewer "
                     "activations (inductor's min-cut partitioner recomputes cheap ops), so the estimate is likely "
                     "an upper bound (mode=reduce-overhead's CUDA graphs can add memory)")


@dataclass(frozen=True)
class ReadWarning:
    """One field of a config that vramplan does not model (``kind="ignored"``) or a value it had
    to assume because the config leaves it to the launch (``kind="assumed"``)."""

    field: str
    value: Any
    why: str
    kind: str = "ignored"

    def __str__(self) -> str:
        return f"{self.kind}: {self.field} ({self.why})"


@dataclass(frozen=True)
class ReadConfig:
    """What a training config says about memory: the model it trains (as written: a Hub id, a
    path, or None when the config does not name one), the Setup, the GPU count when the config
    fixes it (an accelerate ``num_processes``), the warnings, and the format it was read as."""

    path: str
    format: str
    model: str | None
    setup: Setup
    gpus: int | None = None
    warnings: tuple[ReadWarning, ...] = ()
    #: the Setup fields the config (or the framework's default) determined, before Setup's own
    #: defaults filled the rest
    fields: dict = field(default_factory=dict)


@dataclass
class Mapped:
    """A reader's working result: setup keys, model, gpus, warnings (mutable while reading)."""

    setup: dict = field(default_factory=dict)
    model: str | None = None
    gpus: int | None = None
    warnings: list[ReadWarning] = field(default_factory=list)
    #: autocast precision a launch file asks for (accelerate's ``mixed_precision``)
    amp: str | None = None

    def ignore(self, name: str, value: Any, why: str) -> None:
        self.warnings.append(ReadWarning(name, value, why))

    def assume(self, name: str, value: Any, why: str) -> None:
        self.warnings.append(ReadWarning(name, value, why, kind="assumed"))


_MISSING = object()


class Fields:
    """A config mapping whose reads check types and name the file and field when they fail."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a mapping")
        self.data, self.where, self.prefix = data, where, prefix

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def bad(self, key: str, kind: str, value: Any) -> SpecError:
        return SpecError(f"{self.where}: {self.prefix}{key} must be {kind}; got {value!r}")

    def bool(self, key: str, default: Any = False, *, extra: tuple = ()) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, str) and value.lower() in ("true", "false"):  # argparse-style strings
            return value.lower() == "true"
        if isinstance(value, bool) or value in extra:
            return value
        shown = "true or false" + "".join(f" or {e!r}" for e in extra)
        raise self.bad(key, shown, value)

    def int(self, key: str, default: Any = None, *, auto_ok: bool = False) -> Any:
        value = self.data.get(key)
        if value is None or (auto_ok and value == "auto"):
            return default
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value)):
            raise self.bad(key, "an integer", value)
        return int(value)

    def float(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(key, "a finite number", value)
        return float(value)

    def str(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.bad(key, "a string", value)
        return value

    def names(self, key: str, default: Any = None) -> Any:
        """A list of module names or one comma-separated string, as a tuple of names."""
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, str):
            return tuple(n.strip() for n in value.split(",") if n.strip())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise self.bad(key, "a list of names", value)

    def sub(self, key: str) -> Fields | None:
        value = self.data.get(key)
        if value is None:
            return None
        return Fields(value, self.where, f"{self.prefix}{key}.")


#: transformers 5.24 ``OptimizerNames`` (training_args.py) -> vramplan's optimizer; the inverse of
#: ``vramplan.emit.trainer.TRAINER_OPTIM``, plus the aliases of the same optimizer.
OPTIM = {
    "adamw_torch": "adamw",
    "adamw_hf": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "paged-adamw-8bit",
    "adafactor": "adafactor",
    "sgd": "sgd",
    "lion_32bit": "lion",
}


def optimizer_from_name(name: str, m: Mapped, key: str, table: dict | None = None) -> str:
    """vramplan's optimizer for a framework's optimizer name; an unmodelled one is a warning
    and the estimate falls back to torch AdamW (the usual default), named in it."""
    table = table or OPTIM
    if name in table:
        return table[name]
    m.ignore(key, name, f"optimizer {name!r} is not modelled: torch AdamW assumed")
    return "adamw"


#: transformers' ``attn_implementation`` names -> vramplan's attention
ATTN = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flash_attention_3": "flash"}


def attn_from_name(name: str | None, m: Mapped, key: str) -> str:
    if name is None:
        return "auto"
    if name in ATTN:
        return ATTN[name]
    m.ignore(key, name, f"attention {name!r} is not modelled: transformers' default assumed")
    return "auto"


def resolve_file(name: str, config_path: Path) -> Path:
    """A file a config names (a DeepSpeed JSON): absolute, or relative to the config's folder,
    or to one of its parents (frameworks write paths relative to the repository root they run
    from, e.g. LLaMA-Factory's ``examples/deepspeed/ds_z3_config.json``)."""
    p = Path(name).expanduser()
    if p.is_absolute():
        return p
    folder = config_path.resolve().parent
    for base in (folder, *folder.parents):
        if (base / p).is_file():
            return base / p
    return folder / p


def setup_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(Setup))
