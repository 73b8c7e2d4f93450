"""The pytest plugin (``vram`` fixture, ``vram_budget`` marker, golden files), run on user test
files through ``pytester``. The inner sessions load the plugin with ``-p`` and plugin autoloading
off, so they test this checkout's module whatever is installed; ``test_entry_point`` checks the
``pytest11`` registration that makes ``pip install vramplan`` enable it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_user(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    def run(*args: str):
        # the outer session has imported the plugin already: its asserts need no rewriting
        return pytester.runpytest("-p", "vramplan.pytest_plugin", "-p", "no:cacheprovider",
                                  "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)

    return run


def test_entry_point():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        pytest.skip("tomllib needs Python 3.11")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["entry-points"]["pytest11"] == {"vramplan": "vramplan.pytest_plugin"}


def test_assert_fits_passes_and_fails_with_the_breakdown(pytester, run_user):
    pytester.makepyfile(test_user="""
        def test_lora_fits(vram):
            bd = vram.assert_fits("llama-3.1-8b", {"method": "lora", "checkpointing": True}, gpu="rtx-4090")
            assert bd.fits and bd.setup.method == "lora"

        def test_kwargs_and_sizes(vram):
            bd = vram.estimate("qwen2-0.5b", method="lora", seq=512, gpu="24GiB")
            assert bd.fits and bd.setup.seq == 512

        def test_full_does_not_fit(vram):
            vram.assert_fits("llama-3.1-8b", gpu="rtx-4090")
    """)
    result = run_user()
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*meta-llama/Llama-3.1-8B (full*) does not fit on rtx-4090: "
                                 "needs * GiB, 23.63 GiB usable (* GiB short)"])
    for line in ("optimizer_states", "device_total_bytes", "weights"):
        assert line in out
    assert "Traceback" not in out


def test_vram_budget_marker(pytester, run_user):
    pytester.makepyfile(test_user="""
        import pytest

        @pytest.mark.vram_budget(gpu="rtx-4090")
        def test_qlora_fits(vram):
            vram.estimate("llama-3.1-8b", method="qlora", checkpointing=True)

        @pytest.mark.vram_budget(gpu="rtx-4090")
        def test_one_of_two_does_not_fit(vram):
            vram.estimate("llama-3.1-8b", method="qlora", checkpointing=True)
            vram.estimate("llama-3.1-8b", method="full")

        @pytest.mark.vram_budget(gpu_memory="80GiB")
        def test_assert_fits_uses_the_budget(vram):
            assert vram.assert_fits("llama-3.1-8b", method="lora").gpu.usable_memory_bytes == 80 * 1024**3

        @pytest.mark.vram_budget(gpu="rtx-4090")
        def test_marked_but_checks_nothing(vram):
            pass
    """)
    result = run_user("-v")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*test_qlora_fits PASSED*",
        "*test_one_of_two_does_not_fit FAILED*",
        "*test_assert_fits_uses_the_budget PASSED*",
        "*test_marked_but_checks_nothing FAILED*",
    ])
    result.stdout.fnmatch_lines(["*vram_budget: 1 of 2 estimates do not fit*", "*(full*does not fit on rtx-4090*"])
    result.stdout.fnmatch_lines(["*made no estimate with the `vram` fixture*"])


def test_golden_files(pytester, run_user):
    pytester.makepyfile(test_user="""
        def test_golden(vram):
            bd = vram.estimate("llama-3.1-8b", method="lora", checkpointing=True, gpu="rtx-4090")
            vram.compare_golden("sft-8b", bd)
    """)
    golden = pytester.path / "vram_golden" / "sft-8b.json"

    missing = run_user()
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*no vramplan golden file*sft-8b.json; run pytest --vram-update-golden*"])

    run_user("--vram-update-golden").assert_outcomes(passed=1)
    data = json.loads(golden.read_text())
    assert data["vramplan_golden"] == 1 and data["components"]["weights"] > 0
    run_user().assert_outcomes(passed=1)

    for key in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        data[key] = int(data[key] * 0.9)
    data["components"]["logits_loss"] //= 2
    golden.write_text(json.dumps(data))
    moved = run_user()
    moved.assert_outcomes(failed=1)
    moved.stdout.fnmatch_lines([
        "*meta-llama/Llama-3.1-8B: device_total_bytes moved +11.1% from golden *sft-8b.json (tolerance 2.0%)",
        "*golden*now*change*",
        "*device_total_bytes*GiB*GiB*GiB (+11.1%)",
        "*logits_loss*GiB*GiB*GiB (+100.0%)",
        "*run pytest --vram-update-golden to accept the new numbers*",
    ])

    run_user("--vram-update-golden").assert_outcomes(passed=1)
    run_user().assert_outcomes(passed=1)


def test_golden_dir_from_ini(pytester, run_user):
    pytester.makeini("[pytest]\nvram_golden_dir = memory/golden\n")
    pytester.makepyfile(test_user="""
        def test_golden(vram):
            vram.compare_golden("tiny", vram.estimate("gpt2", seq=128))
    """)
    run_user("--vram-update-golden").assert_outcomes(passed=1)
    assert (pytester.path / "memory" / "golden" / "tiny.json").is_file()


def test_bad_budget_is_reported(pytester, run_user):
    pytester.makepyfile(test_user="""
        import pytest

        @pytest.mark.vram_budget(gpu="rtx-9999")
        def test_unknown_gpu(vram):
            vram.estimate("gpt2")
    """)
    result = run_user()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*unknown GPU 'rtx-9999'*"])
