"""Two tiers (issue 27). ``pytest -q`` (the README's test command) runs the fast tier: every test not
marked ``slow``: the unit tests, every truth at its smallest shape, and a sample of each matrix.
``pytest -q -m slow`` runs the full tier: the rest (.ci/run runs both). A matrix is sampled with
``@pytest.mark.sample(k)``: every k-th of its parametrizations (the first included) stays in the fast
tier and the others are marked ``slow`` here, before pytest's ``-m`` selects. A module fixture that
runs a matrix at once asks :func:`selected_params` which of its cases this session runs.

Tests that need CUDA are marked ``gpu`` and skipped without it."""

import importlib.util
from collections import defaultdict

import pytest


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "sample(k): every k-th parametrization runs in the fast tier, the others "
                            "are marked slow (the full tier)")


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects on the slow marks added here
def pytest_collection_modifyitems(config, items):
    seen: dict = defaultdict(int)
    for item in items:
        marker = item.get_closest_marker("sample")
        if marker is None or not hasattr(item, "callspec"):
            continue
        stride = int(marker.args[0])
        key = (item.module.__name__, item.originalname)
        index = seen[key]
        seen[key] += 1
        if index % stride:
            item.add_marker(pytest.mark.slow)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def selected(request, function: str) -> bool:
    """Whether this session runs test ``function`` of the requesting module (any of its cases)."""
    module = request.module.__name__
    return any(item.module.__name__ == module and item.originalname == function for item in request.session.items)


def selected_params(request, function: str, name: str) -> list:
    """The values of parameter ``name`` of test ``function`` (in the requesting module) that this
    session runs, in collection order: what a module fixture running a matrix at once runs."""
    module = request.module.__name__
    out = []
    for item in request.session.items:
        if item.module.__name__ == module and item.originalname == function and hasattr(item, "callspec"):
            value = item.callspec.params.get(name)
            if value not in out:
                out.append(value)
    return out


def selected_cases(request, function: str) -> list[dict]:
    """Every parametrization (its parameters by name) of test ``function`` of the requesting module
    that this session runs."""
    module = request.module.__name__
    return [dict(item.callspec.params) for item in request.session.items
            if item.module.__name__ == module and item.originalname == function and hasattr(item, "callspec")]
