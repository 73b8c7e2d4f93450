"""Without the `run` extra, the commands that need it say so in one line (exit 2) before anything
runs or is recorded; the torch-free commands do not need it."""

from __future__ import annotations

import importlib.util
import sys

from click.testing import CliRunner

from vramplan.cli import main


def test_trace_without_transformers_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    result = CliRunner().invoke(main, ["trace", "smollm2-135m"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: tracing needs the optional extra: pip install 'vramplan[run]' (transformers is missing)"]


def test_measure_without_the_extra_is_one_line_and_records_nothing(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("transformers", "peft") else real(name, *a))
    records = tmp_path / "records"
    result = CliRunner().invoke(main, ["measure", "smollm2-135m", "--method", "lora", "--device", "cpu",
                                       "--records", str(records)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: measuring needs the optional extra: pip install 'vramplan[run]' (transformers, peft are missing)"]
    assert not records.exists()
