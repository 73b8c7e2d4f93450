"""Memos of pure functions of values, for a plan over many cards (``plan --gpu any``).

Such a plan estimates the same setups again on each card, and the card enters a step's tensor terms
only in a few places (estimator/step.py ``card_terms``); the rest (model states, activations, the
moments of each phase) is the same on every card. :func:`memoized` keeps such a function's answers per
the values it is computed from: for ``tensor_terms`` the ModelSpec, the Setup (with the type of each of
its fields, so that ``16`` and ``16.0`` are never one entry), the Stack, and the card and corrections
exactly when they were passed in. Every key is a frozen dataclass or a plain hashable value and the
function sees nothing but its arguments (no file, no environment variable), so no entry can go stale.
What is kept is never changed by a caller (each estimate builds its own Breakdown from it). The search
keeps its saver configurations and micro-batch setups the same way (search/space.py, search/evaluate.py).

:func:`disabled` runs without any of it, and the callers then compute on the real card (the estimate's
tensor terms, the saver configurations): the tests compare the two paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["MAXSIZE", "clear", "disabled", "enabled", "info", "memoized"]

#: Entries kept (least recently used dropped): a ``--gpu any`` plan of an 8B model needs about 3,000
MAXSIZE = 8192

_state = {"enabled": True}
_memos: list[Any] = []


def _field_types(value: Any) -> tuple[type, ...] | None:
    fields = getattr(value, "__dict__", None)
    return None if fields is None else tuple(map(type, fields.values()))


def memoized(typed: int = 1, maxsize: int = MAXSIZE) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn(*args)`` (positional, hashable arguments) kept per the arguments' values and the
    types of the fields of argument ``typed`` (the Setup); computed afresh while :func:`disabled`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.lru_cache(maxsize=maxsize)
        def kept(types: tuple[type, ...] | None, *args: Any) -> Any:
            return fn(*args)

        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            if not _state["enabled"]:
                return fn(*args)
            return kept(_field_types(args[typed]), *args)

        wrapper.cache_info = kept.cache_info  # type: ignore[attr-defined]
        _memos.append(kept)
        return wrapper

    return wrap


def enabled() -> bool:
    """Whether the memos are in use (not inside :func:`disabled`)."""
    return _state["enabled"]


def clear() -> None:
    """Drop every entry."""
    for m in _memos:
        m.cache_clear()


def info() -> list[Any]:
    """Hits, misses and size of each memo (functools' CacheInfo)."""
    return [m.cache_info() for m in _memos]


@contextmanager
def disabled() -> Iterator[None]:
    """Estimates computed afresh, nothing kept or read, inside the block."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before
