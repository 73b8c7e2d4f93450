"""Published real-GPU peaks as records (calibration/published/, issue 13): the records file holds
its schema, every comparable setup is a valid Setup for its model, every source row is a record,
build.py is deterministic, the summary arithmetic is right, and comparable rows do not silently
drop out. No accuracy bars are asserted here (benchmarks/published_accuracy.py prints them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vramplan.calibration import published as pub
from vramplan.specs import Setup

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "calibration" / "published"
RECORDS = FOLDER / "records.jsonl"
SHARED = Path("/work/shared/published-peaks")

#: comparable records when the records were last built; lower means rows dropped out silently
MIN_COMPARABLE = 11
MIN_RECORDS = 240


def _build_module():
    spec = importlib.util.spec_from_file_location("published_build", FOLDER / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return pub.load_records(RECORDS)


def test_records_parse_and_hold_the_schema(records):
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schemas = [json.loads(p.read_text()) for p in (ROOT / "docs" / "schema").glob("*.schema.json")]
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in schemas])
    schema = json.loads((ROOT / "docs" / "schema" / "published-record.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    for r in records:
        validator.validate(r)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) and ids == sorted(ids)
    # the schema rejects what a comparable record must not be
    bad = dict(next(r for r in records if r["comparable"]), exclusion="x")
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_every_comparable_setup_is_valid_for_its_model_and_gpu(records):
    comparable = [r for r in records if r["comparable"]]
    assert comparable
    for r in comparable:
        setup = Setup.from_dict(r["setup"])
        assert setup.to_dict() == r["setup"], r["id"]
        model = pub.resolve_model(r["model"])
        assert model.params_total > 0
        est = pub.estimate_record(r)  # raises SpecError for a setup vramplan refuses on this model
        assert getattr(est, pub.QUANTITY_FIELD[r["quantity"]]) > 0
        assert r["measured_bytes"] > 0 and not r["unexpressible"]


def test_every_excluded_record_says_why(records):
    for r in records:
        if not r["comparable"]:
            assert r["exclusion"] and r["exclusion"] == r["all_exclusions"][0], r["id"]
    listed = pub.excluded(records)
    assert {e.id for e in listed} == {r["id"] for r in records if not r["comparable"]}
    assert sum(n for _, n in pub.exclusion_counts(records)) == len(listed)


def test_every_source_row_is_a_record(records):
    build = _build_module()
    inputs = build.default_inputs() if SHARED.is_dir() else [str(FOLDER / "added.jsonl")]
    source_ids = {r["id"] for r in build.read_rows(inputs)}
    record_ids = {r["id"] for r in records}
    assert source_ids <= record_ids, sorted(source_ids - record_ids)[:5]
    if SHARED.is_dir():
        assert source_ids == record_ids, sorted(record_ids - source_ids)[:5]


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared published-peaks folder is not on this machine")
def test_build_is_deterministic(tmp_path):
    build = _build_module()
    assert build.main(["--out", str(tmp_path / "a")]) == 0
    assert build.main(["--out", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "records.jsonl").read_bytes()
    assert a == (tmp_path / "b" / "records.jsonl").read_bytes()
    assert a == RECORDS.read_bytes(), "records.jsonl is stale: run python calibration/published/build.py"


def test_summary_arithmetic_on_three_rows():
    """Errors +10 %, -5 %, -2 %: median |e| 5 %, p90 by linear interpolation 9 %, worst +10 %,
    one row of three under by more than 3 %."""
    def rec(i, est, meas, method):
        return {"id": f"r{i}", "comparable": True, "source": {"repo": "o/r"}, "model": "m", "quantity": "allocated",
                "setup": {"method": method}, "measured_bytes": meas, "est": est, "approximations": []}

    class Est:
        def __init__(self, n):
            self.peak_allocated_bytes, self.phase = n, "backward"

    recs = [rec(1, 1100, 1000, "full"), rec(2, 950, 1000, "lora"), rec(3, 980, 1000, "lora"),
            {"id": "x", "comparable": False, "source": {"repo": "o/r"}, "exclusion": "because"}]
    rows = pub.compare(recs, estimator=lambda r: Est(r["est"]), family=lambda r: "llama")
    assert [round(r.error, 6) for r in rows] == [0.1, -0.05, -0.02]
    summary = {(s.group, s.key): s for s in pub.summarize(rows)}
    s = summary[("all", "all")]
    assert s.rows == 3 and s.median_abs_error == pytest.approx(0.05)
    assert s.p90_abs_error == pytest.approx(0.05 + (0.1 - 0.05) * 0.8)
    assert s.worst_error == pytest.approx(0.1) and s.under_share == pytest.approx(1 / 3)
    lora = summary[("method", "lora")]
    assert lora.rows == 2 and lora.median_abs_error == pytest.approx(0.035) and lora.under_share == pytest.approx(0.5)
    assert summary[("method", "full")].under_share == 0
    assert pub.excluded(recs) == [pub.Excluded("x", "o/r", "because")]


def test_token_slopes_pair_rows_that_differ_only_in_the_micro_batch():
    """Two runs of one setup at batch 2 and 4 (seq 100): the slope is the byte difference over the
    200 added tokens, measured and estimated; a run differing in anything else (gpus) or of another
    quantity is not paired with them, and a lone run gives no slope."""
    def rec(i, batch, gpus, est, meas):
        return {"id": f"r{i}", "comparable": True, "source": {"repo": "o/r"}, "model": "m", "quantity": "allocated",
                "setup": {"method": "lora", "batch": batch, "seq": 100, "gpus": gpus, "fsdp": "none"},
                "measured_bytes": meas, "est": est, "approximations": [], "versions": {}}

    class Est:
        def __init__(self, n):
            self.peak_allocated_bytes, self.phase = n, "forward"

    recs = [rec(1, 2, 1, 1000, 1100), rec(2, 4, 1, 1400, 1700), rec(3, 4, 2, 900, 990)]
    rows = pub.compare(recs, estimator=lambda r: Est(r["est"]), family=lambda r: "llama")
    (slope,) = pub.token_slopes(recs, rows)
    assert slope.ids == ("r1", "r2") and slope.tokens == (200, 400) and slope.gpus == 1
    assert slope.measured_per_token == pytest.approx(3.0) and slope.estimated_per_token == pytest.approx(2.0)
    assert slope.excess_per_token == pytest.approx(1.0) and slope.error == pytest.approx(2 / 3 - 1)
    flat = pub.token_slopes([rec(4, 2, 1, 5, 5), rec(5, 4, 1, 5, 6)],
                            pub.compare([rec(4, 2, 1, 5, 5), rec(5, 4, 1, 5, 6)], estimator=lambda r: Est(r["est"]),
                                        family=lambda r: "llama"))
    assert flat[0].estimated_per_token == 0 and flat[0].error is None  # an optimizer-step peak: no token moves it


def test_comparable_rows_do_not_drop_out(records):
    comparable = sum(r["comparable"] for r in records)
    assert len(records) >= MIN_RECORDS
    assert comparable >= MIN_COMPARABLE, (
        f"{comparable} comparable records, {MIN_COMPARABLE} before: a row dropped out (see each record's exclusion)")
    assert comparable / len(records) >= MIN_COMPARABLE / MIN_RECORDS


@pytest.mark.slow  # the full tier
def test_validate_published_prints_and_emits_the_token_slopes():
    """`vramplan validate --published`: the slopes section in the text and `token_slopes` in --json,
    one per run configuration measured at two micro-batches (the fms Mistral LoRA 1-GPU pair among them)."""
    from click.testing import CliRunner

    from vramplan.cli import main

    text = CliRunner().invoke(main, ["validate", "--published"])
    assert text.exit_code == 0, text.output
    assert "per-token slopes" in text.output
    out = CliRunner().invoke(main, ["validate", "--published", "--json"])
    assert out.exit_code == 0, out.output
    slopes = json.loads(out.output)["token_slopes"]
    pair = ["fms-a100_80gb-16-Mistral-7B-v0.1-lora-g1-bs4", "fms-a100_80gb-csv34-Mistral-7B-v0.1-lora-g1-bs8"]
    (one,) = [t for t in slopes if t["ids"] == pair and t["quantity"] == "allocated"]
    assert one["tokens"] == [16384, 32768] and one["measured_per_token"] == pytest.approx(734762)
