"""Calibration is on the CLI path (issue 13): `estimate`, `plan` and `check` apply the committed
coefficients by default, `--no-calibration` gives the raw model, a local
calibration/coefficients.json or `--calibration FILE` overrides the shipped copy, a corrupt file
is a warning (local) or a one-line error (given), and `calibrate` refits from the published rows.

The published fits are per GPU class (sm80: the fms-acceleration A100 rows); a class with no fit
keeps the published figures (calibration null)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from vramplan.calibration import calibrate as cal
from vramplan.calibration import published as pub
from vramplan.cli import main
from vramplan.estimator.corrections import shipped_coefficients

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "calibration" / "coefficients.json"
SM80 = "sm80/torch-2.4"


def cli(*args: str, cwd: Path | None = None, monkeypatch=None):
    if cwd is not None:
        monkeypatch.chdir(cwd)
    return CliRunner().invoke(main, list(args))


def as_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def coefficients() -> dict:
    return json.loads(COMMITTED.read_text())


def _expected_total(bd: dict, g: dict) -> int:
    """device_total from the raw estimate's allocated and the group's fitted terms (1 GPU, no
    paged states): reserved = allocated * (1 + f) + the fixed slack, plus the quoted context."""
    reserved = int(bd["peak_allocated_bytes"] * (1 + g["fragmentation"])) + g["fragmentation_fixed_bytes"]
    return reserved + g["cuda_context_bytes"]


@pytest.mark.slow  # the full tier
def test_shipped_copy_is_the_committed_file_and_a_refit_reproduces_it(coefficients):
    assert shipped_coefficients().read_bytes() == COMMITTED.read_bytes(), \
        "profiles/coefficients.json differs from calibration/coefficients.json: run `vramplan calibrate`"
    refit = cal.fit([], published=pub.load_records())
    g, r = coefficients["groups"][SM80], refit["groups"][SM80]
    # the device terms are measured against measured: independent of the estimator
    for k in ("fragmentation", "device_fixed_bytes", "runs", "fragmentation_fixed_bytes", "cuda_context_bytes"):
        assert g[k] == pytest.approx(r[k], rel=1e-6), k
    # the bands come from the estimator's residuals: stale when the estimator moved
    assert g["error_bands"] == r["error_bands"], "the estimator moved: run `vramplan calibrate` to refresh the bands"
    assert coefficients["fit_id"] == refit["fit_id"]


def test_estimate_applies_the_calibration_by_default_and_not_with_no_calibration(coefficients):
    args = ("estimate", "llama-3.1-8b", "--method", "lora", "--gpu", "a100-80gb", "--json")
    cal_bd, raw = as_json(cli(*args)), as_json(cli(*args, "--no-calibration"))
    g = coefficients["groups"][SM80]
    assert cal_bd["calibration"]["group"] == SM80 and raw["calibration"] is None
    assert set(cal_bd["calibration"]["fitted"]) == {"fragmentation", "device_fixed_bytes"}
    assert "nccl_bytes" in cal_bd["calibration"]["quoted"]
    # the tensor and allocated numbers are the model's; the device terms differ by exactly the fit
    for k in ("tensor_peak_bytes", "peak_allocated_bytes"):
        assert cal_bd[k] == raw[k]
    assert cal_bd["device_total_bytes"] == _expected_total(raw, g) != raw["device_total_bytes"]
    # the band: the fitted residuals when calibrated, the documented default when raw
    assert cal_bd["error_band"]["device_total_bytes"] == g["error_bands"]["device_total_bytes"]
    assert cal_bd["error_band"]["device_total_bytes"]["rows"] >= 3
    assert raw["error_band"]["device_total_bytes"] == {"low": -0.05, "high": 0.05, "rows": 0,
                                                       "basis": raw["error_band"]["device_total_bytes"]["basis"]}
    text = cli(*args[:-1]).stdout
    assert "calibration: sm80/torch-2.4" in text and "band " in text
    assert "calibration: none" in cli(*args[:-1], "--no-calibration").stdout


def test_a_gpu_class_without_a_fit_keeps_the_published_figures():
    bd = as_json(cli("estimate", "llama-3.2-1b", "--gpu", "h100-sxm", "--json"))
    assert bd["calibration"] is None and bd["error_band"]["device_total_bytes"]["rows"] == 0


def test_plan_applies_it_and_judges_fit_at_the_bands_high_end(coefficients):
    args = ("plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--method", "lora", "--json")
    cal_plan, raw_plan = as_json(cli(*args)), as_json(cli(*args, "--no-calibration"))
    bd = cal_plan["breakdown"]
    assert bd["calibration"]["group"] == SM80 and raw_plan["breakdown"]["calibration"] is None
    high = coefficients["groups"][SM80]["error_bands"]["device_total_bytes"]["high"]
    assert cal_plan["fits"] and bd["device_total_bytes"] * (1 + high) <= bd["gpu_usable_bytes"]


def test_plan_api_takes_the_corrections():
    from vramplan.estimator.corrections import calibration_for
    from vramplan.model.profiles import load_gpu
    from vramplan.search import plan

    corrections, _ = calibration_for(load_gpu("a100-80gb"))
    assert plan("llama-3.2-1b", "a100-80gb", method="lora", corrections=corrections).breakdown.calibration.group == SM80
    assert plan("llama-3.2-1b", "a100-80gb", method="lora").breakdown.calibration is None


def test_check_applies_it_and_not_with_no_calibration(tmp_path, monkeypatch, coefficients):
    spec = tmp_path / "checks.yaml"
    spec.write_text("checks:\n  - {name: a, model: llama-3.2-1b, gpu: a100-80gb, setup: {method: lora}}\n")
    run = ("check", str(spec), "--baseline", str(tmp_path / "b.json"), "--json")
    cal_r = json.loads(cli(*run).stdout)["results"][0]
    raw_r = json.loads(cli(*run, "--no-calibration").stdout)["results"][0]
    assert cal_r["peak_allocated_bytes"] == raw_r["peak_allocated_bytes"]
    assert cal_r["device_total_bytes"] == _expected_total(raw_r, coefficients["groups"][SM80])


def _local(tmp_path: Path, coefficients: dict, fragmentation: float) -> Path:
    data = json.loads(json.dumps(coefficients))
    data["groups"][SM80]["fragmentation"] = fragmentation
    (tmp_path / "calibration").mkdir()
    path = tmp_path / "calibration" / "coefficients.json"
    path.write_text(json.dumps(data))
    return path


def test_a_local_file_and_calibration_file_override_the_shipped_one(tmp_path, monkeypatch, coefficients):
    path = _local(tmp_path, coefficients, 0.5)
    monkeypatch.chdir(tmp_path)
    args = ("estimate", "llama-3.2-1b", "--gpu", "a100-80gb", "--json")
    bd = as_json(cli(*args))
    assert bd["calibration"]["source"] == str(Path("calibration") / "coefficients.json")
    g = dict(coefficients["groups"][SM80], fragmentation=0.5)
    raw = as_json(cli(*args, "--no-calibration"))
    assert bd["device_total_bytes"] == _expected_total(raw, g)
    other = tmp_path / "other.json"
    other.write_text(COMMITTED.read_text())
    given = as_json(cli(*args, "--calibration", str(other)))
    assert given["calibration"]["source"] == str(other)
    assert given["device_total_bytes"] == _expected_total(raw, coefficients["groups"][SM80])
    assert path.is_file()


def test_a_corrupt_file_is_a_warning_when_local_and_an_error_when_given(tmp_path, monkeypatch):
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "coefficients.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    args = ("estimate", "llama-3.2-1b", "--gpu", "a100-80gb", "--json")
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0 and "warning: calibration file" in r.stderr and "using the shipped" in r.stderr
    assert json.loads(r.stdout)["calibration"]["source"] == "shipped"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"groups": {}}))
    r = CliRunner().invoke(main, [*args, "--calibration", str(bad)])
    assert r.exit_code == 2 and r.stderr.startswith("error: calibration file") and len(r.stderr.splitlines()) == 1
    r = CliRunner().invoke(main, [*args, "--calibration", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and r.stderr.startswith("error: calibration file")
    r = CliRunner().invoke(main, [*args, "--calibration", str(bad), "--no-calibration"])
    assert r.exit_code == 2 and "not both" in r.stderr


def test_calibrate_refits_with_the_published_rows(tmp_path):
    out = tmp_path / "c.json"
    r = CliRunner().invoke(main, ["calibrate", "--records", str(tmp_path / "none"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["groups"][SM80]["source"] == "published" and data["published_pairs"] >= 30
    assert "from published rows only" in r.stderr
    r = CliRunner().invoke(main, ["calibrate", "--records", str(tmp_path / "none"), "--out", str(out),
                                  "--no-published"])
    assert r.exit_code == 0 and json.loads(out.read_text())["groups"] == {}
