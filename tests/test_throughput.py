"""Published throughput records (calibration/throughput/) and the comparison arithmetic of
vramplan.cost.throughput, the refit (vramplan.cost.fit) and `vramplan validate --throughput`. The accuracy
bar itself is guarded in tests/test_cost.py and printed by benchmarks/throughput_accuracy.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vramplan import estimate
from vramplan.cost.throughput import (
    RECORDS_PATH,
    ThroughputRow,
    comparable,
    compare,
    load_records,
    pairs,
    record_setup,
    summarize,
)
from vramplan.model.profiles import load_gpu, load_model
from vramplan.specs import Setup

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "calibration" / "throughput" / "build.py"
SCHEMAS = ROOT / "docs" / "schema"
#: comparable rows collected so far (fms-acceleration refs/a100_80gb.csv): fewer means a source or a
#: mapping was lost
MIN_COMPARABLE = 19


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_records()


def _build_module():
    spec = importlib.util.spec_from_file_location("throughput_build", BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_hold_the_schema(records):
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    schema = json.loads((SCHEMAS / "throughput_record.json").read_text())
    setup = json.loads((SCHEMAS / "setup.schema.json").read_text())
    registry = referencing.Registry().with_resources(
        [(s["$id"], referencing.Resource.from_contents(s)) for s in (schema, setup)])
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    for r in records:
        validator.validate(r)
    assert len({r["id"] for r in records}) == len(records), "record ids must be unique"


def test_every_comparable_setup_is_valid_for_its_model(records):
    for r in comparable(records):
        setup = record_setup(r)
        assert setup.to_dict() == r["setup"], r["id"]  # no key dropped or defaulted differently
        assert setup.gpus == r["gpu_count"], r["id"]
        load_gpu(r["gpu"])
        estimate(load_model(r["model"]), setup)  # raises on a setup the model cannot take


def test_build_is_deterministic_and_matches_the_committed_records():
    build = _build_module()
    first, second = build.render(build.build_records()), build.render(build.build_records())
    assert first == second
    assert first == RECORDS_PATH.read_text(), "records.jsonl is stale: run python calibration/throughput/build.py"


def test_comparable_rows_do_not_drop_below_what_was_collected(records):
    rows = comparable(records)
    assert len(rows) >= MIN_COMPARABLE, f"{len(rows)} comparable rows, collected {MIN_COMPARABLE}"
    assert all(r["tokens_per_s_per_gpu"] and r["exclusion"] is None for r in rows)
    assert all(r["exclusion"] for r in records if not r["comparable"])


def _row(i: int, model: str, gpus: int, measured: float, predicted: float) -> ThroughputRow:
    return ThroughputRow(id=f"r{i}", model=model, gpu="a100-80gb", gpus=gpus, setup=Setup(gpus=gpus),
                         measured_tokens_per_s=measured, predicted_tokens_per_s=predicted)


def test_pairs_median_and_ordering_on_a_hand_made_example():
    rows = [
        _row(0, "m", 1, 100.0, 90.0),   # ratio 0.90
        _row(1, "m", 1, 104.0, 80.0),   # within 5 % of r0: no pair with it; ratio 0.769
        _row(2, "m", 1, 120.0, 132.0),  # pairs with r0 (ordered) and r1 (ordered); ratio 1.10
        _row(3, "m", 1, 80.0, 95.0),    # pairs with r0 and r1 (both not ordered), r2 (ordered); ratio 1.1875
        _row(4, "m", 2, 50.0, 50.0),    # other GPU count: no pair with the above; ratio 1.0
        _row(5, "n", 1, 200.0, 90.0),   # other model: no pair; ratio 0.45
        _row(6, "m", 2, 60.0, 50.0),    # pairs with r4, predicted tie: not ordered; ratio 0.833
    ]
    ps = pairs(rows)
    assert [(p.a.id, p.b.id) for p in ps] == [("r0", "r2"), ("r0", "r3"), ("r1", "r2"), ("r1", "r3"), ("r2", "r3"),
                                              ("r4", "r6")]
    assert [p.ordered for p in ps] == [True, False, True, False, True, False]
    s = summarize(rows)
    assert (s.pairs, s.pairs_ordered) == (6, 3)
    assert s.pair_share == pytest.approx(0.5)
    assert s.median_ratio == pytest.approx(0.90)  # sorted: .45 .769 .833 .90 1.0 1.10 1.1875
    assert (s.min_ratio, s.max_ratio) == (pytest.approx(0.45), pytest.approx(1.1875))
    assert s.spread == pytest.approx(1.1875 / 0.45)


def test_compare_predicts_every_comparable_row(records):
    rows = compare(records)
    assert len(rows) == len(comparable(records))
    assert all(r.predicted_tokens_per_s > 0 and r.measured_tokens_per_s > 0 for r in rows)


def test_cost_fit_refits_and_predicts(records):
    from vramplan.cost import fit as cost_fit
    from vramplan.cost import model as cost

    fit = cost_fit.fit(records)
    assert set(fit.constants) == set(cost.CONSTANTS)
    assert all(v >= 0 for v in fit.constants.values())
    assert set(fit.residuals) == {r["id"] for r in comparable(records)}
    rows = compare(records, cost_fit.predictor(fit.constants))
    assert len(rows) == len(comparable(records))
    loo = cost_fit.leave_one_out(records)
    assert [r.id for r in loo] == [r.id for r in rows]
    assert summarize(loo).median_ratio != summarize(rows).median_ratio  # held-out rows are predicted, not fitted


def test_normal_equations_solve_a_known_system():
    from vramplan.cost.fit import _solve

    a = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
    x = (3.0, -1.0)
    b = [sum(c * v for c, v in zip(r, x, strict=True)) for r in a]
    assert _solve(a, b) == pytest.approx(list(x))


def test_validate_throughput_prints_the_table_without_torch():
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from vramplan.cli import main; "
            "r = CliRunner().invoke(main, ['validate', '--throughput']); print(r.output); "
            "print('TORCH', 'torch' in sys.modules); sys.exit(r.exit_code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "TORCH False" in out.stdout
    assert "fms-a100_80gb-r008" in out.stdout and "median predicted/measured" in out.stdout
    assert "pairs ordered as measured 28/28" in out.stdout


def test_validate_throughput_json():
    from click.testing import CliRunner

    from vramplan.cli import main

    r = CliRunner().invoke(main, ["validate", "--throughput", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert len(data["rows"]) == len(comparable(load_records()))
    s = data["summary"]
    assert s["meets_bar"] is (0.85 <= s["median_ratio"] <= 1.15 and s["pair_share"] >= 0.85)
    row = data["rows"][0]
    assert row["ratio"] == pytest.approx(row["predicted_tokens_per_s"] / row["measured_tokens_per_s"], rel=1e-3)
