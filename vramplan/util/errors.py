"""The one error type of user input, and the checks every spec module shares.

:class:`SpecError` carries a message fit to print as the one line of a CLI error
(``error: ...``, exit 2). Torch-free; imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SpecError", "check_choice", "check_positive"]


class SpecError(ValueError):
    """Invalid user input: a message fit to print as the one line of a CLI error."""


def check_choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    """Refuse ``value`` of field ``name`` unless it is one of ``options``."""
    if value not in options:
        raise SpecError(f"{name} must be one of {', '.join(options)}; got {value!r}")


def check_positive(name: str, value: Any) -> None:
    """Refuse ``value`` of field ``name`` unless it is a positive int (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{name} must be a positive integer; got {value!r}")
