"""Numbers from input files, bounded before any arithmetic: every number any file vramplan reads
(a config, plan, baseline, checks file, coefficients, records, a framework's config) passes
:func:`check_numbers`, so a 400-digit integer or ``1e400`` is one ``SpecError`` line, never an
``OverflowError`` or an ``inf`` deep in a formula."""

from __future__ import annotations

import math
from typing import Any

from .errors import SpecError

#: The largest magnitude of any number in an input file: no byte count, token count, rank or price
#: vramplan reads comes near it, and every number within it stays exact and finite through the arithmetic.
MAX_NUMBER = 10**18


def count_shown(value: int | float) -> str:
    """A count for a message: exact when readable, else its order of magnitude."""
    if isinstance(value, int) and abs(value) < 10**18:
        return f"{value:,}"
    try:
        return f"{float(value):.3g}"
    except OverflowError:
        return f"a {len(str(abs(int(value))))}-digit number"


def check_numbers(data: Any, where: str) -> None:
    """Refuse any number beyond :data:`MAX_NUMBER` in magnitude, or not finite, anywhere in
    ``data`` (bools are not numbers here), naming where it sits: bounded before any arithmetic."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, at = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if abs(value) > MAX_NUMBER:
                raise SpecError(f"{where}: {count_shown(value)} at {at or 'the top'} is out of range "
                                f"(numbers in input files lie within ±10^18)")
        elif isinstance(value, float):
            if not math.isfinite(value) or abs(value) > MAX_NUMBER:
                raise SpecError(f"{where}: {value!r} at {at or 'the top'} is out of range "
                                f"(numbers in input files are finite and lie within ±10^18)")
        elif isinstance(value, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in value.items())
            stack.extend((k, at or "a key") for k in value if isinstance(k, (int, float)) and not isinstance(k, bool))
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
