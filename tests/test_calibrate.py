"""`vramplan calibrate`: least-squares fits recover known corrections, flag wrong formulas, and the
estimator applies what was fitted (with its error band).

The records are the shape `vramplan measure` writes, made from real estimates with "measured"
numbers generated from known coefficients (no GPU here), so every fitted number has a right answer.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from vramplan.bands import DEFAULT_ERROR_BANDS, HEADLINES
from vramplan.calibration import calibrate as cal
from vramplan.calibration.measure import RECORD_VERSION, append_record
from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.estimator.corrections import DEFAULT_CORRECTIONS, load_calibrated
from vramplan.model.profiles import load_gpu, load_model
from vramplan.specs import Setup

MiB = 2**20

TRUTH = {
    "sm90": {"ws": 64 * MiB, "rounding": 0.002, "frag": 0.07, "fixed": 20 * MiB, "context": 520 * MiB},
    "sm80": {"ws": 16 * MiB, "rounding": 0.001, "frag": 0.12, "fixed": 8 * MiB, "context": 430 * MiB},
}

SETUPS = [
    Setup(method="lora", batch=b, seq=s, checkpointing=c)
    for b in (1, 2, 4) for s in (512, 2048) for c in (False, True)
]


def _records(family: str, model: str = "llama-3.2-1b", noise: float = 0.002, factors: dict | None = None,
             torch: str = "2.8.0", seed: int = 0) -> list[dict]:
    """Records as `vramplan measure` writes them: measured = truth(family) applied to the
    estimate's components scaled by ``factors`` (a wrong formula), with relative noise."""
    rng = random.Random(seed)
    truth, factors = TRUTH[family], factors or {}
    spec = load_model(model)
    out = []
    for setup in SETUPS:
        est = estimate(spec, setup, None, DEFAULT_CORRECTIONS).to_json()
        present = [c for c in est["components"]
                   if c["name"] not in cal.DEVICE_COMPONENTS and est["phase"] in c["phases"]]
        share = est["tensor_peak_bytes"] / sum(c["bytes"] for c in present)
        tensor = sum(c["bytes"] * share * factors.get(c["name"], 1.0) for c in present)
        allocated = truth["ws"] + (1 + truth["rounding"]) * tensor
        reserved = truth["fixed"] + (1 + truth["frag"]) * allocated
        total = reserved + truth["context"]
        def jitter(x):
            return int(x * (1 + rng.uniform(-noise, noise)))
        out.append({
            "vramplan_measurement": RECORD_VERSION, "model": model, "setup": setup.to_dict(), "device": "cuda",
            "steps": 3, "estimate": est,
            "measured": {"tensor_peak_bytes": int(tensor), "peak_allocated_bytes": jitter(allocated),
                         "peak_reserved_bytes": jitter(reserved), "device_total_bytes": jitter(total),
                         "cuda_context_bytes": truth["context"] - 90 * MiB, "oom": False},
            "provenance": {"compute_capability": family[2] + "." + family[3], "versions": {"torch": torch}},
        })
    return out


def test_fit_recovers_known_corrections():
    result = cal.fit(_records("sm90"))
    g = result["groups"]["pooled"]
    t = TRUTH["sm90"]
    assert g["runs"] == len(SETUPS)
    assert g["workspace_bytes"] == pytest.approx(t["ws"], rel=0.15)
    assert g["fragmentation"] == pytest.approx(t["frag"], abs=0.01)
    assert g["cuda_context_bytes"] == pytest.approx(t["context"], rel=0.05)
    assert g["cuda_context_at_init_bytes"] == t["context"] - 90 * MiB
    # the band covers what the noise leaves, and is small when the formulas are right
    assert 0 < g["error_band"] < 0.02
    assert result["flags"] == []


def test_fit_per_gpu_family_and_estimator_applies_it(tmp_path):
    records = _records("sm90") + _records("sm80", seed=1)
    result = cal.fit(records)
    assert {"pooled", "sm90/torch-2.8", "sm80/torch-2.8"} <= set(result["groups"])
    assert result["groups"]["sm80/torch-2.8"]["fragmentation"] == pytest.approx(TRUTH["sm80"]["frag"], abs=0.01)
    path = cal.write(result, tmp_path / "coefficients.json")

    h100, a100 = load_gpu("h100-80gb"), load_gpu("a100-80gb")
    c90, c80 = load_calibrated(h100, path), load_calibrated(a100, path)
    assert c90.name == "calibrated:sm90/torch-2.8" and c80.name == "calibrated:sm80/torch-2.8"
    setup = Setup(method="lora", batch=2, seq=1024)
    spec = load_model("llama-3.2-1b")
    bd = estimate(spec, setup, a100, c80)
    truth = TRUTH["sm80"]
    allocated = truth["ws"] + (1 + truth["rounding"]) * bd.tensor_peak_bytes
    expected = truth["fixed"] + (1 + truth["frag"]) * allocated + truth["context"]
    assert bd.device_total_bytes == pytest.approx(expected, rel=0.01)
    assert bd.error_band == c80.bands and bd.error_band.device_total_bytes.high > 0
    assert bd.calibration is not None and bd.calibration.group == "sm80/torch-2.8" and bd.calibration.gpu_class_match
    # every CUDA run lies inside the band of each number it measured
    for r in records:
        if r["provenance"]["compute_capability"] != "8.0":
            continue
        pred = {"tensor_peak_bytes": r["estimate"]["tensor_peak_bytes"],
                **cal.predict(result["groups"]["sm80/torch-2.8"], r["estimate"]["tensor_peak_bytes"])}
        for key in HEADLINES:
            band = getattr(c80.bands, key)
            assert band.low - 1e-9 <= r["measured"][key] / pred[key] - 1 <= band.high + 1e-9, key
    raw = estimate(spec, setup, a100)  # the Python API is uncalibrated unless given corrections
    assert raw.error_band == DEFAULT_ERROR_BANDS and raw.calibration is None


def test_wrong_component_formula_is_flagged_not_hidden():
    records = _records("sm90", factors={"activations": 1.15})
    result = cal.fit(records)
    comps = result["groups"]["pooled"]["components"]
    assert comps["activations"]["factor"] == pytest.approx(1.15, abs=0.02)
    assert comps["weights"]["factor"] == pytest.approx(1.0, abs=0.02)
    assert any("activations" in f for f in result["flags"])
    assert not any("component weights" in f for f in result["flags"])


def test_oom_failed_cpu_and_multi_gpu_records_are_not_fitted():
    records = _records("sm90")
    bad = [dict(records[0], measured={**records[0]["measured"], "oom": True}),
           dict(records[1], measured={**records[1]["measured"], "failed": True}),
           dict(records[2], device="cpu"),
           dict(records[3], setup={**records[3]["setup"], "gpus": 2})]
    result = cal.fit(bad + records[4:])
    assert result["runs"] == len(records) - 4 and result["records_seen"] == len(records)


def test_no_cuda_records_is_an_empty_fit_with_a_flag(tmp_path):
    result = cal.fit([])
    assert result["groups"] == {} and "nothing to fit" in result["flags"][0]
    path = cal.write(result, tmp_path / "c.json")
    assert load_calibrated(None, path) is None
    assert load_calibrated(None, tmp_path / "missing.json") is None


def test_cli_calibrate_reads_records_and_writes_coefficients(tmp_path):
    records_dir = tmp_path / "measurements"
    for r in _records("sm90"):
        append_record(records_dir / "nvidia-h200.jsonl", r)
    out = tmp_path / "coefficients.json"
    result = CliRunner().invoke(main, ["calibrate", "--records", str(records_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "error band" in result.output and "written to" in result.output
    data = json.loads(out.read_text())
    assert data["groups"]["pooled"]["runs"] == len(SETUPS)


def _published(c: float, f: float, n: int = 8, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Published-style records (allocated + the nvidia-smi peak of the same run) whose device
    total is ``allocated * (1 + f) + c`` (+ the quoted NCCL on 2 GPUs), with relative noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gpus = 1 + i % 2
        allocated = (8 + 7 * i) * 2**30
        total = allocated * (1 + f) + c + (DEFAULT_CORRECTIONS.nccl_bytes if gpus > 1 else 0)
        total *= 1 + rng.uniform(-noise, noise)
        out.append({"id": f"p{i}", "comparable": False, "oom": False, "quantity": "allocated", "gpu": "a100-80gb",
                    "measured_bytes": allocated, "setup": {"gpus": gpus},
                    "secondary_measurements": {cal.SMI_KEY: total / 2**20},
                    "versions": {"torch": {"version": "2.4.1", "how": "test"}}})
    # an OOM row and a row without nvidia-smi are not pairs
    out.append(dict(out[0], id="oom", oom=True))
    out.append(dict(out[0], id="no-smi", secondary_measurements={}))
    return out


def test_published_pairs_recover_the_device_terms_and_say_what_is_quoted():
    c, f = 3 * 2**30, 0.07
    result = cal.fit([], published=_published(c, f))
    assert set(result["groups"]) == {"pooled", "sm80/torch-2.4"} and result["published_pairs"] == 8
    g = result["groups"]["sm80/torch-2.4"]
    assert g["fragmentation"] == pytest.approx(f, abs=1e-6)
    assert g["device_fixed_bytes"] == pytest.approx(c, rel=1e-6)
    assert g["fragmentation_fixed_bytes"] + g["cuda_context_bytes"] == g["device_fixed_bytes"]
    assert g["cuda_context_bytes"] == DEFAULT_CORRECTIONS.cuda_context_bytes  # quoted: not separable here
    fitted = {k for k, t in g["terms"].items() if t["fitted"]}
    assert fitted == {"fragmentation", "device_fixed_bytes"}
    assert {"nccl_bytes", "cudnn_workspace", "expandable_segments", "cuda_context_bytes"} <= set(g["terms"]) - fitted
    # no comparable row: the bands are the documented default, said so
    assert g["error_bands"]["device_total_bytes"]["rows"] == 0
    corr = load_calibrated(load_gpu("a100-80gb"), cal.write(result, Path(tempfile.mkdtemp()) / "c.json"))
    assert corr.calibration.fitted == ("device_fixed_bytes", "fragmentation")
    assert "nccl_bytes" in corr.calibration.quoted


def test_band_spans_every_residual_and_includes_zero():
    b = cal.band_of([0.02, 0.05, 0.11], "x")
    assert (b.low, b.high, b.rows) == (0.0, 0.11, 3)
    b = cal.band_of([-0.04, 0.01, -0.2], "x")
    assert (b.low, b.high) == (-0.2, 0.01)
    assert cal.band_of([0.3, 0.3], "x") == DEFAULT_ERROR_BANDS.device_total_bytes  # too few rows
