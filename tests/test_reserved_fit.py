"""Device terms of a GPU class from published reserved-only rows (calibration/reserved_fit.py): the
RTX 3090/4090 rows of Answer.AI's fsdp_qlora benchmarks (calibration/published/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from vramplan.calibration import published as pub
from vramplan.calibration.reserved_fit import MIN_ROWS, fit_reserved_group, reserved_groups, reserved_rows
from vramplan.cli import main

RECORDS = Path(__file__).resolve().parents[1] / "calibration" / "published" / "records.jsonl"


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines()]


def test_the_consumer_classes_have_reserved_rows(records):
    groups = reserved_groups(records, {"sm80/torch-2.4"})
    assert sorted(groups) == ["sm86/torch-unknown", "sm89/torch-unknown"]
    assert len(groups["sm89/torch-unknown"]) >= MIN_ROWS
    assert {r["gpu"] for r in groups["sm89/torch-unknown"]} == {"NVIDIA GeForce RTX 4090"}
    assert not reserved_groups(records, {"sm89/torch-2.2", "sm86/torch-2.1", "sm80/torch-2.4"})  # covered: no refit


def test_the_slope_is_the_least_squares_one_through_the_origin(records):
    rows = reserved_groups(records, set())["sm89/torch-unknown"]
    coef = fit_reserved_group(rows)
    a = [pub.estimate_record(r["record"]).peak_allocated_bytes for r in rows]
    m = [r["record"]["measured_bytes"] for r in rows]
    slope = sum(x * y for x, y in zip(a, m, strict=True)) / sum(x * x for x in a)
    assert coef["fragmentation"] == pytest.approx(slope - 1, abs=1e-6)
    assert coef["fragmentation_fixed_bytes"] == 0 and coef["runs"] == len(rows)
    band = coef["error_bands"]["device_total_bytes"]
    assert band["rows"] == len(rows) and band["low"] <= 0 <= band["high"]
    assert coef["error_bands"]["peak_allocated_bytes"]["rows"] == 0  # no row measured it: the default


def test_only_comparable_completed_reserved_rows_count(records):
    ids = {r["id"] for r in reserved_rows(records)}
    for r in records:
        if r["id"] in ids:
            assert r["comparable"] and r["quantity"] == "reserved" and not r["oom"]
    assert not any(i.startswith("unsloth-nb") for i in ids)  # Unsloth's notebooks: lengths not exact


def test_an_rtx_4090_estimate_carries_a_band_fitted_on_measured_rows():
    """Issue 28's bar: the RTX 4090's device total band comes from at least 5 measured rows."""
    out = CliRunner().invoke(main, ["estimate", "llama-3.1-8b", "--gpu", "rtx-4090", "--method", "lora",
                                    "--checkpointing", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["error_band"]["device_total_bytes"]["rows"] >= 5
    assert data["calibration"]["group"].startswith("sm89/")
    t4 = json.loads(CliRunner().invoke(main, ["estimate", "llama-3.1-8b", "--gpu", "t4", "--method", "lora",
                                              "--json"]).stdout)
    assert t4["calibration"] is None  # no class fit for a T4: the published figures, said so
