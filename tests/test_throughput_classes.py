"""Throughput on GPU classes beyond the A100 (issue 30 item 4): the fsdp_qlora and L40 rows normalised by
calibration/throughput/build.py, the per-class MFU of vramplan/cost/constants.py (stage 2 of
vramplan/cost/fit.py) and the per-class bar `vramplan validate --throughput` judges. Torch-free, ~2 s."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vramplan.cost import fit as cost_fit
from vramplan.cost import model as cost
from vramplan.cost.constants import SHARED_FIT_SOURCES
from vramplan.cost.throughput import (
    BAR_CLASSES,
    RATIO_BAND,
    RECORDS_PATH,
    bar_met,
    by_class,
    comparable,
    compare,
    cost_model_predictor,
    gpu_class,
    load_records,
    record_overrides,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "calibration" / "throughput" / "build.py"
FSDP_QLORA_MD = ROOT / "calibration" / "throughput" / "sources" / "fsdp_qlora" / "benchmarks_03_2024.md"
#: comparable rows per GPU class collected so far: fewer means a source or a mapping was lost
MIN_ROWS = {"a100": 22, "rtx-3090": 13, "rtx-4090": 11, "rtx-6000-ada": 2}


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_records()


@pytest.fixture(scope="module")
def fitted(records):
    rows, fit = compare(records), cost_fit.fit(records)
    loo = cost_fit.leave_one_out(records)
    return rows, fit, loo, by_class(rows, loo, fit)


def _build():
    spec = importlib.util.spec_from_file_location("throughput_build_classes", BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_rerun_gives_the_committed_records_byte_for_byte():
    build = _build()
    text = build.render(build.build_records())
    assert text == build.render(build.build_records())
    assert text == RECORDS_PATH.read_text(), "records.jsonl is stale: run python calibration/throughput/build.py"


def test_fsdp_qlora_rows_read_their_values_from_the_source_copy(records):
    lines = FSDP_QLORA_MD.read_text().splitlines()
    rows = [r for r in records if r["source"]["repo"] == "AnswerDotAI/fsdp_qlora"]
    assert len(rows) == 33  # 13 RTX 3090, 11 RTX 4090, 9 of the hardware table
    for r in rows:
        cells = [c.strip() for c in lines[r["source"]["line"] - 1].strip("|").split("|")]
        assert f"{r['published']['value']:,.0f}" in cells, r["id"]  # the Time (s) cell, as written
    by_line = {r["source"]["line"]: r for r in rows}
    # the article's own tokens/s for its two Mistral rows (line 168: "from 2,200 tokens/second to 1,615")
    assert by_line[163]["tokens_per_s_per_gpu"] == pytest.approx(2200, rel=0.02)
    assert by_line[164]["tokens_per_s_per_gpu"] == pytest.approx(1615, rel=0.005)
    # 1024 samples, 2 ranks of 512, 2048 tokens each, 4,830 s
    assert by_line[90]["tokens_per_s_per_gpu"] == pytest.approx(512 * 2048 / 4830, abs=0.05)
    assert {r["gpu"] for r in rows if not r["comparable"]} == {"rtx-a5000"}
    assert all(r["config"]["adapter_dtype"] == "bf16" and record_overrides(r) for r in rows)


def test_l40_rows_are_kept_but_not_compared_without_a_gpu_profile(records):
    l40 = [r for r in records if r["gpu"] == "l40"]
    valued = [r for r in l40 if r["tokens_per_s_per_gpu"]]
    assert len(l40) == 48 and len(valued) == 20
    assert all(r["published"]["tokens_per_sequence_check"] == 4096.0 for r in valued)  # per-GPU, 20 steps
    assert not any(r["comparable"] for r in l40)
    assert all("no vramplan GPU profile" in r["exclusion"] for r in valued)


def test_each_class_keeps_its_rows(fitted):
    _, _, _, classes = fitted
    rows = {c.gpu_class: c.in_sample.rows for c in classes}
    for cls, n in MIN_ROWS.items():
        assert rows.get(cls, 0) >= n, (cls, rows)


def test_per_class_bar_held_out(fitted):
    """>= 3 GPU classes with >= 2 rows each, held-out median predicted/measured within 0.85-1.15."""
    _, _, _, classes = fitted
    lo, hi = RATIO_BAND
    meeting = [c for c in classes if c.meets]
    assert len(meeting) >= BAR_CLASSES, [(c.gpu_class, c.held_out) for c in classes]
    assert bar_met(classes)
    for c in meeting:
        assert c.held_out.rows >= 2 and lo <= c.held_out.median_ratio <= hi, c
    for name in ("a100", "rtx-3090", "rtx-4090"):
        assert next(c for c in classes if c.gpu_class == name).meets, name


def test_the_bar_can_fail(records, fitted):
    """The same arithmetic on a model 30 % too fast misses the bar (so the test above can fail)."""
    _, fit, _, _ = fitted

    def fast(model, setup, gpu, stack=None, overrides=None):
        tps, terms = cost_model_predictor(model, setup, gpu, stack, overrides)
        return tps * 1.3, terms

    rows = compare(records, fast)
    assert not bar_met(by_class(rows, rows, fit))


def test_a100_figures_do_not_regress(records, fitted):
    """The A100 rows the shared constants are fitted on: median 1.013 (0.844-1.130), 28/28 pairs, as before."""
    rows, _, _, classes = fitted
    shared = {r["id"] for r in records if (r["source"]["repo"], r["source"]["path"]) in SHARED_FIT_SOURCES}
    s = summarize([r for r in rows if r.id in shared])
    assert s.rows == 19 and s.median_ratio == pytest.approx(1.013, abs=0.005)
    assert (s.pairs, s.pairs_ordered) == (28, 28)
    a100 = next(c for c in classes if c.gpu_class == "a100")
    assert len(a100.checks) == 3  # fsdp_qlora's A100-40GB rows: predicted, never fitted
    assert all(RATIO_BAND[0] <= next(r for r in rows if r.id == i).ratio <= RATIO_BAND[1] for i in a100.checks)


def test_class_constants_are_fitted_on_their_class_only(records, fitted):
    _, fit, _, _ = fitted
    by_id = {r["id"]: r for r in records}
    for key, ids in fit.fitted_on.items():
        if key.startswith("inv_mfu:") and key != "inv_mfu:a100":
            assert len(ids) >= 2 and {gpu_class(by_id[i]["gpu"]) for i in ids} == {key.split(":", 1)[1]}, key
        else:  # stage 1: the shared source only
            assert all((by_id[i]["source"]["repo"], by_id[i]["source"]["path"]) in SHARED_FIT_SOURCES for i in ids)
    # the other classes' rows do not move the shared constants
    shared_only = cost_fit.fit([r for r in comparable(records)
                                if (r["source"]["repo"], r["source"]["path"]) in SHARED_FIT_SOURCES])
    for key in ("inv_mfu:a100", "lora_passes", "kbit_passes", "dequant_inefficiency", "shard_comm_exposure"):
        assert shared_only.constants[key] == pytest.approx(fit.constants[key], rel=1e-9), key
    for key in fit.fitted_on:
        assert cost.CONSTANTS[key] == pytest.approx(fit.constants[key], rel=2e-3), key  # committed = refit


def test_held_out_rows_are_predicted_not_fitted(fitted):
    rows, fit, loo, _ = fitted
    held = {r.id: r for r in loo}
    for r in rows:
        if fit.role[r.id] == "class":
            assert held[r.id].ratio != pytest.approx(r.ratio, rel=1e-6), r.id
        elif fit.role[r.id] == "check":
            assert held[r.id].ratio == pytest.approx(r.ratio, rel=1e-3), r.id  # (committed vs refit digits)


def test_one_row_classes_are_not_fitted(fitted):
    _, fit, _, classes = fitted
    h100 = next(c for c in classes if c.gpu_class == "h100-sxm")
    assert h100.in_sample.rows == 1 and h100.constant is None and not h100.meets
    assert "inv_mfu:h100-sxm" not in fit.constants and h100.mfu == cost.MFU


def test_sixteen_bit_adapters_drop_the_fp32_lora_term(records):
    r = next(r for r in comparable(records) if r["id"] == "fsdp-qlora-bench-l125")
    _, with_override = compare([r])[0], compare([r])[0].terms_s
    assert with_override.get("lora", 0.0) == 0.0
    plain = {**r, "config": {**r["config"], "adapter_dtype": None}}
    assert compare([plain])[0].terms_s["lora"] > 0  # a plan (peft 0.21's fp32 adapters) keeps it


def test_validate_throughput_json_reports_classes_and_what_was_fitted():
    from click.testing import CliRunner

    from vramplan.cli import main

    r = CliRunner().invoke(main, ["validate", "--throughput", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    classes = {c["gpu_class"]: c for c in data["classes"]}
    assert data["bar"]["met"] is (data["bar"]["classes_meeting"] >= 3)
    assert data["bar"]["met"]
    assert len(classes["rtx-4090"]["fitted_on"]) == classes["rtx-4090"]["rows"] >= 2
    assert classes["h100-sxm"]["constant"] is None
    assert data["constants"]["inv_mfu:rtx-3090"]["fitted_on"]
    assert {row["fit_role"] for row in data["rows"]} == {"shared", "class", "check"}
    assert "h100-pcie" in data["coverage"]["none"] and "rtx-4090" in data["coverage"]["measured"]


def test_committed_class_bands_are_the_held_out_ranges(fitted):
    from vramplan.cost.constants import CLASS_BANDS

    _, _, _, classes = fitted
    got = {c.gpu_class: (round(c.held_out.min_ratio, 3), round(c.held_out.max_ratio, 3)) for c in classes
           if c.constant}
    assert got == {k: tuple(v) for k, v in CLASS_BANDS.items()}
