"""pytest plugin (entry point ``pytest11``): GPU-memory budgets asserted in a project's own tests.

    def test_sft_fits(vram):
        bd = vram.assert_fits("llama-3.1-8b", {"method": "lora", "checkpointing": True}, gpu="rtx-4090")
        vram.compare_golden("sft-8b", bd)            # tests/vram_golden/sft-8b.json, 2 % tolerance

    @pytest.mark.vram_budget(gpu="rtx-4090")
    def test_every_estimate_fits(vram):
        vram.estimate("llama-3.1-8b", method="qlora", seq=4096)   # judged after the test

- ``vram.estimate(model, setup=None, gpu=None, **setup_keys)``: the analytic Breakdown (no torch);
  ``setup`` is a Setup or a mapping of plan-file setup keys; ``gpu`` a shipped name, a size
  (``"24GiB"``) or a GpuSpec, by default the ``vram_budget`` marker's.
- ``vram.assert_fits(...)``: the same, failing the test with the component table when it does not fit.
- ``vram.compare_golden(name, breakdown, tolerance=0.02)``: compare with ``vram_golden/<name>.json``
  next to the test file (ini ``vram_golden_dir`` to put them elsewhere); a headline number moved
  beyond the tolerance, either way, fails with the component diff. ``pytest --vram-update-golden``
  (re)writes the files.
- ``@pytest.mark.vram_budget(gpu=..., gpu_memory=...)``: every estimate the test makes must fit;
  a marked test that estimates nothing fails, since it would check nothing.

Torch is never imported: the plugin loads into every pytest session of an environment with vramplan.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

GOLDEN_FORMAT = 1


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vramplan", "GPU memory budgets (vramplan)")
    group.addoption("--vram-update-golden", action="store_true", default=False,
                    help="Write vramplan golden files (vram.compare_golden) instead of comparing with them.")
    parser.addini("vram_golden_dir", "Directory of vramplan golden files, relative to the rootdir "
                  "(default: vram_golden/ next to each test file).", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vram_budget(gpu=None, gpu_memory=None): every estimate the test makes with the `vram` fixture must fit "
        "this GPU (a shipped name like rtx-4090, or gpu_memory='24GiB').",
    )


def _gpu(gpu: Any):
    """A GpuSpec from a shipped name, a size string (``"24GiB"``), a byte count or a GpuSpec."""
    from .setup.inputs import resolve_gpu

    size = isinstance(gpu, int) or (isinstance(gpu, str) and gpu[:1].isdigit())
    return resolve_gpu(None, gpu, where="gpu") if size else resolve_gpu(gpu, None, where="gpu")


def _components(bd) -> dict[str, int]:
    from .budget import Record

    return Record.of(bd, {}).components


def _table(bd) -> str:
    from .budget import HEADLINE

    rows = [(name, b) for name, b in _components(bd).items()] + [(k, getattr(bd, k)) for k in HEADLINE]
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"  {n:<{width}}  {b / 1024**3:>9,.2f} GiB" for n, b in rows)


class Vram:
    """The ``vram`` fixture: estimates, fit assertions and golden-file comparisons for one test."""

    def __init__(self, budget=None, golden_dir: Path | None = None, update_golden: bool = False) -> None:
        self.budget = budget
        self.golden_dir = golden_dir or Path("vram_golden")
        self.update_golden = update_golden
        self.estimates: list = []  # every Breakdown this test asked for, judged by vram_budget

    def estimate(self, model, setup=None, gpu=None, **setup_keys):
        """The analytic Breakdown of ``setup`` (or ``setup_keys``) on ``model`` and ``gpu``."""
        from .estimator import estimate
        from .model.profiles import load_model
        from .setup.inputs import setup_from_mapping
        from .specs import ModelSpec, Setup

        if isinstance(setup, Setup):
            if setup_keys:
                setup = setup.replace(**setup_keys)
        else:
            setup = setup_from_mapping({**(setup or {}), **setup_keys}, "setup")
        spec = model if isinstance(model, ModelSpec) else load_model(model)
        gpu = _gpu(gpu) if gpu is not None else self.budget
        bd = estimate(spec, setup, gpu)  # checks the setup against the model and GPU first
        self.estimates.append(bd)
        return bd

    def assert_fits(self, model, setup=None, gpu=None, **setup_keys):
        """Estimate and fail the test, with the component table, unless it fits its GPU."""
        bd = self.estimate(model, setup, gpu, **setup_keys)
        if bd.gpu is None:
            pytest.fail("vram.assert_fits needs a GPU: pass gpu= or mark the test with vram_budget(gpu=...)",
                        pytrace=False)
        if not bd.fits:
            pytest.fail(fit_message(bd), pytrace=False)
        return bd

    def golden_path(self, name: str) -> Path:
        return self.golden_dir / f"{name}.json"

    def compare_golden(self, name: str, breakdown, tolerance: float | str = 0.02) -> None:
        """Fail when a headline number of ``breakdown`` moved beyond ``tolerance`` from the golden
        file ``<golden dir>/<name>.json``; ``--vram-update-golden`` writes the file instead."""
        from .budget import (
            HEADLINE,
            Record,
            breakdown_diff_lines,
            current_versions,
            parse_tolerance,
        )
        from .setup.inputs import loads_json, read_text
        from .specs import SpecError
        from .util.fileio import atomic_write_text

        tol = parse_tolerance(tolerance)
        path = self.golden_path(name)
        record = Record.of(breakdown, current_versions())
        if self.update_golden:
            atomic_write_text(path, json.dumps({"vramplan_golden": GOLDEN_FORMAT, **record.to_json()}, indent=2) + "\n")
            return
        if not path.is_file():
            pytest.fail(f"no vramplan golden file {path}; run pytest --vram-update-golden to record it", pytrace=False)
        try:
            golden = Record.from_json(loads_json(read_text(path, "golden file"), str(path)), str(path))
        except SpecError as exc:
            pytest.fail(f"vramplan golden file: {exc}", pytrace=False)
        moved = [k for k in HEADLINE if golden.numbers[k] and
                 abs(record.numbers[k] - golden.numbers[k]) > tol * golden.numbers[k]]
        if not moved:
            return
        worst = "device_total_bytes" if "device_total_bytes" in moved else \
            max(moved, key=lambda k: abs(record.numbers[k] / golden.numbers[k] - 1))
        change = record.numbers[worst] / golden.numbers[worst] - 1
        lines = [f"{breakdown.model}: {worst} moved {change:+.1%} from golden {path} (tolerance {tol:.1%})"]
        lines += ["  " + line for line in breakdown_diff_lines({**golden.numbers, **golden.components},
                                                                {**record.numbers, **record.components}, "golden")]
        lines.append("run pytest --vram-update-golden to accept the new numbers")
        pytest.fail("\n".join(lines), pytrace=False)


def fit_message(bd) -> str:
    """Why a Breakdown does not fit its GPU, with its components."""
    from .setup.wording import describe

    return (f"{bd.model} ({describe(bd.setup)}) does not fit on {bd.gpu.name}: needs "
            f"{bd.device_total_bytes / 1024**3:,.2f} GiB, {bd.gpu.usable_memory_bytes / 1024**3:,.2f} GiB usable "
            f"({-bd.headroom_bytes / 1024**3:,.2f} GiB short)\n{_table(bd)}")


def _budget(item: pytest.Item):
    marker = item.get_closest_marker("vram_budget")
    if marker is None:
        return None
    from .setup.inputs import resolve_gpu

    kwargs = dict(marker.kwargs)
    if marker.args:
        kwargs.setdefault("gpu", marker.args[0])
    unknown = sorted(set(kwargs) - {"gpu", "gpu_memory"})
    if unknown:
        pytest.fail(f"vram_budget: unknown argument {unknown[0]!r}; use gpu= or gpu_memory=")
    gpu = resolve_gpu(kwargs.get("gpu"), kwargs.get("gpu_memory"), where="vram_budget")
    if gpu is None:
        pytest.fail("vram_budget needs gpu='rtx-4090' or gpu_memory='24GiB'")
    return gpu


@pytest.fixture
def vram(request: pytest.FixtureRequest) -> Vram:
    """Estimate GPU memory (analytic tier) and assert budgets; see vramplan.pytest_plugin."""
    config = request.config
    configured = config.getini("vram_golden_dir")
    golden = Path(config.rootpath, configured) if configured else Path(request.path).parent / "vram_golden"
    return Vram(budget=_budget(request.node), golden_dir=golden,
                update_golden=config.getoption("vram_update_golden"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After a ``vram_budget`` test passes, judge every estimate it made against the budget."""
    result = yield
    if item.get_closest_marker("vram_budget") is None:
        return result
    vram = getattr(item, "funcargs", {}).get("vram")
    if vram is None or not vram.estimates:
        pytest.fail("vram_budget marks a test that made no estimate with the `vram` fixture, so it checks nothing",
                    pytrace=False)
    over = [bd for bd in vram.estimates if bd.fits is False]
    if over:
        pytest.fail(f"vram_budget: {len(over)} of {len(vram.estimates)} estimates do not fit\n"
                    + "\n".join(fit_message(bd) for bd in over), pytrace=False)
    return result
