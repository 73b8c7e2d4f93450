"""Per-GPU caps of a layer split (``--max-memory``), read as accelerate reads ``max_memory``.

``from_pretrained(device_map=..., max_memory={0: "20GiB", 1: "24GiB"})`` hands the mapping to
transformers 5.24's ``_get_device_map`` (integrations/accelerate.py), whose ``get_max_memory``
calls accelerate 1.15's (``accelerate/utils/modeling.py``): each string becomes bytes through
``convert_file_size_to_int``, GPU indices (ints) are sorted before ``"mps"``/``"cpu"``/``"disk"``,
and any other key is a ValueError. A cap given is taken as it is: transformers adds only the
allocator's reserved-but-unused bytes (none before the load) and keeps ``min(cap, that)``, so a
cap above a GPU's free memory is not lowered to it (the load then runs out of memory).

What vramplan takes (``Setup.max_memory``: one cap in bytes per GPU index 0..gpus-1):

- ``--max-memory 0=20GiB,1=24GiB``: ``INDEX=SIZE`` pairs, every GPU of ``--gpus`` once, sizes in
  accelerate's units (``GiB``/``MiB``/``KiB`` powers of 1024; ``GB``/``MB``/``KB`` powers of
  1000, and, as accelerate has it, a lower-case final ``b`` such as ``20Gb`` means bits: an
  eighth) or a plain number of bytes;
- refused, each with one line: a GPU index left out or given twice (accelerate would leave that
  GPU out of the split and make the next one the "main device" that keeps room for a layer), a
  cap of 0, ``cpu=``/``disk=``/``mps=`` budgets (they only say where layers that fit on no GPU
  go, and a split that offloads layers is not modelled: estimator/layer_split.py refuses it).

Torch-free.
"""

from __future__ import annotations

from ..util.errors import SpecError

__all__ = ["MAX_CAP_BYTES", "MAX_TEXT", "MIN_BARE_BYTES", "accelerate_size", "caps_text", "check_caps",
           "max_memory_map", "parse_max_memory"]

#: the largest cap accepted (1 PiB, as ``--gpu-memory``): beyond it a number is a typo
MAX_CAP_BYTES = 1 << 50
#: the longest ``--max-memory`` text read (65536 GPUs would not fit in it anyway: the count limit)
MAX_TEXT = 4096
#: a plain number below this is a missing unit (``0=20`` for 20GiB), not a cap in bytes
MIN_BARE_BYTES = 1 << 20
#: accelerate's offload budgets: not GPU caps
_OFFLOAD_KEYS = ("cpu", "disk", "mps")


def accelerate_size(text: str | int) -> int:
    """accelerate 1.15 ``convert_file_size_to_int``: ``"20GiB"`` -> bytes, suffixes matched
    case-insensitively, ``GB``/``MB``/``KB`` decimal and divided by 8 when the text ends in a
    lower-case ``b`` (bits). A plain number of bytes is what accelerate takes as an int. Raises
    ValueError (the message names the text) where accelerate would."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        size = text
    else:
        s = str(text).strip()
        upper = s.upper()
        size = -1
        try:
            if s.isdigit():
                size = int(s)
            elif upper.endswith(("GIB", "MIB", "KIB")):
                size = int(float(s[:-3]) * {"G": 2**30, "M": 2**20, "K": 2**10}[upper[-3]])
            elif upper.endswith(("GB", "MB", "KB")):
                size = int(float(s[:-2]) * {"G": 10**9, "M": 10**6, "K": 10**3}[upper[-2]])
                size = size // 8 if s.endswith("b") else size
        except (ValueError, OverflowError):
            size = -1
    if size < 0:
        shown = str(text)[:40]
        raise ValueError(f"{shown!r} is not a size accelerate reads: write e.g. 20GiB, 20GB, 512MiB or a number "
                         "of bytes")
    return size


def parse_max_memory(text: str, flag: str = "--max-memory") -> tuple[int, ...]:
    """``"0=20GiB,1=24GiB"`` -> one cap in bytes per GPU index, in index order. SpecError (one
    line naming ``flag``) for anything accelerate would not read or vramplan does not model."""
    if not isinstance(text, str):
        raise SpecError(f"{flag} must be INDEX=SIZE pairs such as 0=20GiB,1=24GiB")
    if len(text) > MAX_TEXT:
        raise SpecError(f"{flag} is longer than {MAX_TEXT} characters")
    caps: dict[int, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise SpecError(f"{flag}: {entry[:40]!r} is not INDEX=SIZE (e.g. 0=20GiB,1=24GiB)")
        if key.lower() in _OFFLOAD_KEYS:
            raise SpecError(f"{flag}: {key}= is accelerate's budget for layers offloaded off the GPUs, and a layer "
                            "split that offloads layers is not modelled: give GPU caps only (0=...,1=...)")
        if not key.isdigit() or len(key) > 6:
            raise SpecError(f"{flag}: {key[:40]!r} is not a GPU index (0, 1, ...; accelerate's keys are ints)")
        index = int(key)
        if index in caps:
            raise SpecError(f"{flag} gives GPU {index} twice")
        if value.isdigit() and int(value) < MIN_BARE_BYTES:
            raise SpecError(f"{flag}: GPU {index}: {value} bytes is a size without its unit; did you mean {value}GiB?")
        try:
            caps[index] = accelerate_size(value)
        except ValueError as exc:
            raise SpecError(f"{flag}: GPU {index}: {exc}") from None
    return check_caps(tuple(caps[i] if i in caps else -1 for i in range(max(caps) + 1)), flag)


def check_caps(caps: tuple, flag: str = "max_memory") -> tuple[int, ...]:
    """``caps`` as Setup keeps them (a tuple of ints, GPU 0 first), or SpecError. A missing index
    is -1 here (from :func:`parse_max_memory`)."""
    for i, cap in enumerate(caps):
        if isinstance(cap, bool) or not isinstance(cap, int):
            raise SpecError(f"{flag} must be one integer of bytes per GPU; GPU {i} has {str(cap)[:40]!r}")
        if cap == -1:
            raise SpecError(f"{flag} leaves out GPU {i}: give every GPU 0..{len(caps) - 1} a cap (accelerate would "
                            "leave it out of the split, which vramplan does not model)")
        if cap <= 0:
            raise SpecError(f"{flag} gives GPU {i} no memory ({cap} bytes): split over fewer --gpus instead")
        if cap > MAX_CAP_BYTES:
            raise SpecError(f"{flag}: GPU {i}'s cap is more than 1 PiB")
    return tuple(caps)


def max_memory_map(caps: tuple[int, ...]) -> dict[int, int]:
    """The ``max_memory`` mapping from_pretrained gets: GPU index -> bytes (data, never text)."""
    return {i: int(c) for i, c in enumerate(caps)}


def caps_text(caps: tuple[int, ...]) -> str:
    """``0=20GiB,1=24GiB``: the caps as ``--max-memory`` takes them back (exact: GiB or MiB
    when whole, else bytes)."""
    def one(c: int) -> str:
        return f"{c >> 30}GiB" if c % 2**30 == 0 else f"{c >> 20}MiB" if c % 2**20 == 0 else str(c)
    return ",".join(f"{i}={one(c)}" for i, c in enumerate(caps))
