"""`vramplan validate`: the quick matrix runs, every verified row holds the 5 % bar, and every knob
that cannot be verified here says so, with why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.validate.matrix import KNOBS, matrix, summarize, unverified_rows

pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")


#: Every knob but the distributed ones, whose N-process truth has its own tests and time budget,
#: and the measured records (tested below on records written here).
SINGLE = [k for k in KNOBS if k not in ("zero", "fsdp", "ddp", "measured")]


@pytest.fixture(scope="module")
def quick_json():  # every knob's quick rows (~80 s): the full tier
    result = CliRunner().invoke(main, ["validate", "--quick", "--json", *(f"--knob={k}" for k in SINGLE)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_quick_matrix_holds_the_bar(quick_json):
    rows = [r for r in quick_json["rows"] if r["verified"]]
    # trl-*: dpo, grpo; placement: device_map's real transformers placement on the meta device;
    # tp-2 / fsdp2-2: transformers' tp_plan and accelerate's fully_shard on 2 gloo ranks; tp-fsdp2-4: both
    # at once, transformers' tp x fully_shard on 4 (vramplan/truths/tp_fsdp2.py); hsdp2-4: FSDP2 hybrid sharding as
    # 2 x 2 (vramplan/truths/hsdp_truth.py); cp-2: accelerate's FSDP2 + context parallelism, torch's ring
    # (truths/cp_truth.py); pp-2: torch.distributed.pipelining's GPipe/1F1B on 2 gloo ranks (truths/pipeline.py);
    # ep-2: transformers' ep_plan (AllToAllEP) beside tp == ep on 2 gloo ranks (truths/ep_truth.py)
    # (torchtune-cpu: torchtune's real step, where VRAMPLAN_TORCHTUNE_PYTHON names a Python that imports it)
    # (unsloth-tiled-cpu: Unsloth's own TiledMLP, where VRAMPLAN_UNSLOTH_ZOO names the unsloth-zoo wheel;
    # axolotl-tiled-cpu: axolotl's, where VRAMPLAN_AXOLOTL_WHEEL names its wheel; llamafactory-gc-cpu: LLaMA-Factory's
    # use_unsloth_gc, where VRAMPLAN_LLAMAFACTORY_WHEEL names its wheel)
    from vramplan.run import llamafactory_gc
    from vramplan.run.axolotl_tiled import find_wheel
    from vramplan.run.unsloth_tiled import find_source

    truths = {r["truth"] for r in rows}
    assert truths - {"torchtune-cpu", "unsloth-tiled-cpu", "axolotl-tiled-cpu", "llamafactory-gc-cpu"} == {
        "trace", "cpu-run", "trl-trace", "trl-cpu", "placement", "tp-2", "fsdp2-2", "tp-fsdp2-4", "hsdp2-4", "cp-2",
        "pp-2", "ep-2"}
    assert ("unsloth-tiled-cpu" in truths) == (find_source() is not None)
    assert ("axolotl-tiled-cpu" in truths) == (find_wheel() is not None)
    assert ("llamafactory-gc-cpu" in truths) == (llamafactory_gc.find_wheel() is not None)
    bad = [(r["knob"], r["setup_text"], r["quantity"], r["error"]) for r in rows if abs(r["error"]) > 0.05]
    assert not bad, bad
    canonical = [r for r in rows if r["knob"] == "canonical" and r["quantity"] == "tensor_peak_bytes"]
    assert canonical and all(abs(r["error"]) <= 0.02 for r in canonical)


@pytest.mark.slow
def test_unverifiable_knobs_are_listed_with_why(quick_json):
    summary = {s["knob"]: s for s in quick_json["summary"]}
    for knob in ("gptq_awq", "device_overheads"):
        assert summary[knob]["verified"] is False and summary[knob]["why"]
    assert set(summary) == set(SINGLE)
    unverified = [r for r in quick_json["rows"] if not r["verified"]]
    assert all(r["why"] and r["error"] is None for r in unverified)


def test_default_matrix_covers_every_knob_on_three_families():
    cases = matrix()
    for knob in ("canonical", "quantization", "optimizer", "precision", "attention", "grad_accum", "checkpointing",
                 "moe", "loss", "modules_to_save", "dora", "optimizer_in_backward"):
        assert len({c.model for c in cases if c.knob == knob}) >= 3, knob
    optimizers = {c.setup.optimizer for c in cases if c.knob == "optimizer"}
    assert optimizers == {"adamw-fused", "sgd", "adafactor", "adamw-8bit", "paged-adamw-8bit", "lion"}
    assert {c.setup.precision for c in cases if c.knob == "precision"} == {"fp32", "fp16", "bf16-mixed", "fp16-mixed"}
    assert {c.setup.quant for c in cases if c.knob == "quantization"} == {"nf4", "fp4", "int8"}
    assert set(KNOBS) >= {c.knob for c in cases}
    assert {r.knob for r in unverified_rows(knobs=("gptq_awq", "device_overheads"))} == {"gptq_awq", "device_overheads"}


def test_summary_median_and_worst():
    from vramplan.specs import Setup
    from vramplan.validate.accuracy import Row

    rows = [Row("m", "f", Setup(), 100, e, "backward", "backward", knob="optimizer") for e in (101, 97, 102)]
    rows.append(Row("m", "f", Setup(), 100, 150, "-", "-", knob="optimizer", quantity="weights_bytes"))
    (s,) = summarize(rows)
    assert (s.rows, s.median_abs_error, s.worst_error) == (3, pytest.approx(0.02), pytest.approx(-0.03))


def test_distributed_knobs_without_rows_are_listed(monkeypatch):
    """A distributed truth that returns no FSDP rows leaves FSDP listed as not verified, why given."""
    from vramplan.truths import distributed, fsdp

    monkeypatch.setattr(distributed, "zero_rows", lambda quick: [], raising=False)
    monkeypatch.setattr(fsdp, "fsdp_rows", lambda quick: [])
    rows = unverified_rows(True, ("zero", "fsdp"))
    assert {r.knob for r in rows} == {"zero", "fsdp"} and all(not r.verified and r.why for r in rows)


def test_a_distributed_launch_that_fails_becomes_unverified_rows(monkeypatch):
    """One crashed or timed-out N-process launch (here: every one) turns its setups into
    unverified rows naming the failure, instead of a traceback that loses the whole table."""
    from vramplan.truths import distributed, fsdp

    def fail(setups, world, base=None):
        raise RuntimeError("DeepSpeed workers did not finish within 600 s\n--- rank 0: ...")

    monkeypatch.setattr(distributed, "compare_setups", fail)
    monkeypatch.setattr(fsdp, "compare_setups", fail)
    rows = distributed.zero_rows(True) + fsdp.fsdp_rows(True)
    failed = [r for r in rows if r.why.startswith("the ")]
    assert {r.knob for r in failed} == {"zero", "fsdp", "ddp"}
    assert all(not r.verified and "did not finish within 600 s" in r.why and "\n" not in r.why for r in failed)
    assert len(failed) == sum(len(kws) for _, _, kws in distributed.zero_launches(True)) + sum(
        len(kws) for _, _, kws in fsdp.launches(True))


def test_unknown_knob_is_a_one_line_error():
    result = CliRunner().invoke(main, ["validate", "--knob", "flux"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: unknown knob 'flux'; knobs: " + ", ".join(KNOBS)]


def test_command_module_does_not_import_torch():
    code = ("import sys, vramplan.cli, vramplan.commands.validate, vramplan.validate.matrix; "
            "heavy = [m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules]; "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_measured_column_reads_the_records(tmp_path):
    from vramplan import estimate, load_gpu, load_model
    from vramplan.calibration.measure import Measurement, save
    from vramplan.specs import Setup
    from vramplan.validate.matrix import measured_rows

    empty = measured_rows(tmp_path / "none")
    assert len(empty) == 1 and not empty[0].verified and "vramplan measure" in empty[0].why

    setup = Setup(method="lora", checkpointing=True)
    est = estimate(load_model("qwen2-0.5b"), setup, load_gpu("h200")).to_json()
    measured = {"tensor_peak_bytes": est["tensor_peak_bytes"],
                "peak_allocated_bytes": int(est["peak_allocated_bytes"] * 1.02),
                "peak_reserved_bytes": int(est["peak_reserved_bytes"] * 0.9),
                "device_total_bytes": est["device_total_bytes"], "oom": False}
    for device, meas in (("cuda", measured),
                         ("cpu", {"tensor_peak_bytes": est["tensor_peak_bytes"] // 2, "oom": False}),
                         ("cuda", {"oom": True, "oom_phase": "backward"}), ("cuda", {"failed": True, "timeout": True})):
        save(Measurement("Qwen/Qwen2-0.5B", setup, device, 3, est, meas, {"gpu_name": "NVIDIA H200"}), tmp_path)
    rows = measured_rows(tmp_path)
    by = {(r.truth, r.quantity): r for r in rows}
    assert set(by) == {("measured", "tensor_peak_bytes"), ("measured", "peak_allocated_bytes"),
                       ("measured", "peak_reserved_bytes"), ("measured", "device_total_bytes"),
                       ("measured-cpu", "tensor_peak_bytes")}  # the OOM and the failed run are no comparison
    assert by[("measured", "peak_allocated_bytes")].error == pytest.approx(1 / 1.02 - 1, abs=1e-6)
    assert by[("measured-cpu", "tensor_peak_bytes")].error == pytest.approx(1.0, abs=1e-6)
    assert all(r.knob == "measured" and r.verified for r in rows)
    summary = {s.knob: s for s in summarize(rows)}
    assert summary["measured"].rows == 2  # the tensor peak of each complete run
