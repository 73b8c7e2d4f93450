"""The band of a setup without CPU offload (calibration/reserved_fit.py ``error_bands_resident``): fitted on the
published rows of its GPU class that offload nothing, where five or more exist; an offloading setup keeps every
row's band (issue 28: the RTX 4090 rows with FSDP's CPU offload reserve up to 19.6 % more than estimated, the
resident ones at most 9.6 %)."""

from __future__ import annotations

import json
from pathlib import Path

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.calibration.reserved_fit import MIN_ROWS, fit_reserved_group, is_resident, reserved_rows
from vramplan.estimator.corrections import calibration_for

ROOT = Path(__file__).resolve().parents[1]


def _records() -> list[dict]:
    rows = []
    for path in sorted((ROOT / "calibration/published").glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def test_resident_is_no_offload_of_parameters_or_optimizer():
    assert is_resident({"offload_optimizer": "none", "offload_params": "none", "fsdp": "full_shard"})
    assert is_resident({})
    assert not is_resident({"offload_optimizer": "cpu", "offload_params": "cpu"})
    assert not is_resident({"offload_optimizer": "nvme", "offload_params": "none"})


def test_the_resident_band_is_the_resident_rows_spread():
    rows = [r for r in reserved_rows(_records()) if r["group"] == "sm89/torch-unknown"]
    coef = fit_reserved_group(rows)
    resident = [r for r in rows if is_resident(r["record"]["setup"])]
    assert len(resident) >= MIN_ROWS and len(resident) < len(rows)
    every, own = coef["error_bands"]["device_total_bytes"], coef["error_bands_resident"]["device_total_bytes"]
    assert own["rows"] == len(resident) and every["rows"] == len(rows)
    assert own["high"] < every["high"] and own["low"] >= every["low"]  # a subset's spread
    assert "without CPU offload" in own["basis"]
    # a fit on one offload-free row set alone has no second band
    assert "error_bands_resident" not in fit_reserved_group(resident)


def test_estimates_carry_the_band_of_their_placement():
    m, g = load_model("llama-3.1-8b"), load_gpu("rtx-4090")
    corrections, _ = calibration_for(g)
    resident = estimate(m, Setup(method="lora", checkpointing=True), g, corrections)
    offload = estimate(m, Setup(method="lora", checkpointing=True, zero_stage=2, offload_optimizer="cpu"), g,
                       corrections)
    band, wide = resident.error_band.device_total_bytes, offload.error_band.device_total_bytes
    assert band.rows >= MIN_ROWS and band.high < 0.10 < wide.high
    assert wide.rows > band.rows
    # a class whose rows do not split (every extreme resident) keeps its band
    g86 = load_gpu("rtx-3090")
    c86, _ = calibration_for(g86)
    assert c86.bands_resident is not None
    assert c86.bands_resident.device_total_bytes.high == c86.bands.device_total_bytes.high


def test_a_cards_name_picks_its_class_calibration():
    """``calibration_for("rtx-4090")`` (a name, as the Python API takes one) finds the card's class, as the
    commands' resolved GpuSpec does, instead of silently answering the uncalibrated defaults."""
    from vramplan.estimator.corrections import calibration_for
    from vramplan.setup.inputs import resolve_gpu

    by_name, _ = calibration_for("rtx-4090")
    by_spec, _ = calibration_for(resolve_gpu("rtx-4090"))
    assert by_name == by_spec and by_name.calibration.group.startswith("sm89/")
