"""The house (issue 27): pinned and reported versions (constraints.txt, ``vramplan doctor``, the
versions an estimate names), every number of an input file bounded before arithmetic, and a
Python API that answers the same on every machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.util import versions
from vramplan.util.versions import BOUNDARIES, MODELLED, boundaries_crossed, drift, version_tuple

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "trl")


def run(*args: str):
    return CliRunner().invoke(main, list(args))


# ----------------------------------------------------------------------------------------------
# pinned versions


def _constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exactly: {line!r}"
            out[name.lower().replace("_", "-")] = version
    return out


def test_constraints_pin_the_modelled_versions():
    pins = _constraints()
    assert set(PINNED) <= set(MODELLED)
    for name in PINNED:
        assert pins[name] == MODELLED[name], name
    # the package's own ranges stay open for users: no == in pyproject's dependencies
    assert "==" not in (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]


def test_ci_and_the_readme_install_with_the_constraints():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"pip install .*-c constraints\.txt .*'\.\[test\]'", ci), ci
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c constraints.txt -e '.[test]'" in readme


def test_the_estimators_stack_names_the_same_versions():
    from vramplan.estimator.stack import MODELLED_VERSIONS

    for name, short in MODELLED_VERSIONS.items():
        if name in MODELLED:
            assert MODELLED[name].startswith(short), (name, short, MODELLED[name])


@pytest.mark.parametrize("text,want", [("2.13.0+cpu", (2, 13, 0)), ("5.0.0rc1", (5, 0, 0)), ("4.48.1", (4, 48, 1)),
                                       ("1.16.0.dev0", (1, 16, 0)), ("5", (5,)), ("dev", ())])
def test_version_tuple(text, want):
    assert version_tuple(text) == want


def test_drift_and_boundaries():
    assert drift(dict(MODELLED)) == {}
    assert drift({**MODELLED, "torch": "2.13.0+cpu"}) == {}  # a local build label is the same release
    assert drift({"transformers": "5.25.0"}) == {
        "transformers": "transformers 5.25.0 installed, estimates model 5.24.0"}
    assert drift({"transformers": None}) == {}  # not installed: the estimate path needs none
    crossed = boundaries_crossed({"transformers": "4.47.1"})
    # fused experts, reentrant default, SDPA's repeated K/V, the shifted copy
    assert {b.below for b, _ in crossed} == {(5,), (4, 54), (4, 49)}
    assert boundaries_crossed({"transformers": "4.45.0"}) == [(b, "4.45.0") for b in BOUNDARIES
                                                             if b.below in ((5,), (4, 54))]
    assert {b.key for b, _ in boundaries_crossed({"transformers": "4.54.0"})} == {"moe_experts_linear",
                                                                                "reentrant_checkpointing"}
    assert boundaries_crossed({"transformers": "5.99.0"}) == []


def test_doctor_prints_installed_against_modelled_and_exits_0():
    result = run("doctor")
    assert result.exit_code == 0, result.output
    for name in PINNED:
        assert re.search(rf"^{name}\s+\S+\s+{re.escape(MODELLED[name])}\s", result.stdout, re.M), name
    assert "version boundaries that change memory" in result.stdout
    assert "fused 3-D parameters" in result.stdout
    assert "torch build:" in result.stdout and "GPUs:" in result.stdout
    data = json.loads(run("doctor", "--json").stdout)
    assert {lib["name"] for lib in data["libraries"]} >= set(PINNED)
    assert set(data) >= {"drift", "boundaries_crossed", "torch_cuda", "gpus", "driver"}


def test_doctor_warns_on_drift(monkeypatch):
    real = versions.library_versions
    monkeypatch.setattr(versions, "library_versions",
                        lambda names=versions.LIBRARIES: {**real(names), "transformers": "4.47.0"})
    result = run("doctor")
    assert result.exit_code == 0
    assert re.search(r"^transformers\s+4\.47\.0\s+5\.24\.0\s+differs", result.stdout, re.M)
    assert "crossed: transformers 4.47.0" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "transformers 4.47.0 installed, estimates model 5.24.0" in warnings[0]


def test_estimates_name_the_versions_they_model():
    data = json.loads(run("estimate", "llama-3.2-1b", "--json").stdout)
    assert data["modelled_versions"] == MODELLED
    text = run("estimate", "llama-3.2-1b").stdout
    assert "models: torch 2.13.0, transformers 5.24.0" in " ".join(text.split())


# ----------------------------------------------------------------------------------------------
# every number of an input file is bounded


def _baseline(tmp_path: Path, old: str, new: str) -> str:
    text = (ROOT / "examples" / "ci" / "vram-baseline.json").read_text()
    assert old in text
    path = tmp_path / "baseline.json"
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old,new,fragment", [
    ('"device_total_bytes": ', '"device_total_bytes": ' + "9" * 400 + ', "was": ', "a 400-digit number"),
    ('"seq": 2048', '"seq": ' + "7" * 400, "setup.seq"),
    ('"gpu_usable_bytes": ', '"gpu_usable_bytes": 1e400, "was": ', "inf"),
    ('"tensor_peak_bytes": ', '"tensor_peak_bytes": -' + "1" * 30 + ', "was": ', "out of range"),
])
def test_check_refuses_an_absurd_number_in_the_baseline(tmp_path, old, new, fragment):
    baseline = _baseline(tmp_path, old, new)
    result = run("check", str(ROOT / "examples" / "ci" / "vram-checks.yaml"), "--baseline", baseline)
    assert_user_error(result, baseline, fragment)


def test_the_checks_file_plan_file_and_calibration_file_are_bounded(tmp_path):
    checks = tmp_path / "checks.yaml"
    checks.write_text("checks:\n  - name: a\n    model: llama-3.2-1b\n    gpu: rtx-4090\n"
                      "    setup: {seq: 1" + "0" * 40 + "}\n")
    assert_user_error(run("check", str(checks), "--baseline", str(tmp_path / "b.json")), "out of range")
    checks.write_text("checks:\n  - {name: a, model: llama-3.2-1b, gpu: rtx-4090, tolerance: .inf}\n")
    assert_user_error(run("check", str(checks), "--baseline", str(tmp_path / "b.json")), "out of range")
    plan_file = tmp_path / "plan.json"
    assert run("plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--out", str(plan_file)).exit_code == 0
    data = json.loads(plan_file.read_text())
    data["tokens_per_s"] = 10**30
    plan_file.write_text(json.dumps(data))
    assert_user_error(run("emit", str(plan_file), "--out", str(tmp_path / "out")), "tokens_per_s", "out of range")
    coeffs = tmp_path / "coefficients.json"
    coeffs.write_text(json.dumps({"vramplan_coefficients": 1, "groups": {"x": {"workspace_bytes": 10**19}}}))
    assert_user_error(run("estimate", "llama-3.2-1b", "--gpu", "rtx-4090", "--calibration", str(coeffs)),
                      "calibration file", "out of range")


def test_a_framework_config_is_bounded(tmp_path):
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text("base_model: meta-llama/Llama-3.2-1B\nadapter: lora\nlora_r: 16\nsequence_len: 2048\n"
                   "micro_batch_size: 1\ngradient_accumulation_steps: 1" + "0" * 30 + "\n")
    assert_user_error(run("estimate", str(cfg)), "out of range")


def test_measurement_records_are_bounded(tmp_path):
    from vramplan.calibration.measure import read_records
    from vramplan.specs import SpecError

    path = tmp_path / "runs.jsonl"
    path.write_text('{"vramplan_measurement": 1, "measured": {"peak": 1e999}}\n')
    with pytest.raises(SpecError, match=r"runs\.jsonl:1: inf at measured\.peak is out of range"):
        read_records(path)


# ----------------------------------------------------------------------------------------------
# the Python API does not read the machine it runs on


def test_plan_api_answers_the_same_on_every_machine(monkeypatch):
    from vramplan import plan
    from vramplan.util import machine

    before = plan("llama-3.1-8b", "rtx-4090")
    monkeypatch.setattr(machine, "local_gpu_names", lambda: ("NVIDIA GeForce RTX 4090",))
    monkeypatch.setattr(machine, "local_ram_bytes", lambda: 16 * 2**30)
    after = plan("llama-3.1-8b", "rtx-4090")
    assert after.host_ram_bytes == before.host_ram_bytes and after.host_ram_source == before.host_ram_source != "local"
    assert after.setup == before.setup
    given = plan("llama-3.1-8b", "rtx-4090", host_ram="16GiB")
    assert (given.host_ram_bytes, given.host_ram_source) == (16 * 2**30, "given")
    # the command reads the machine: this one "holds" an RTX 4090 with 16 GiB
    data = json.loads(run("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--json").stdout)
    assert data["host_ram"] == {"bytes": 16 * 2**30, "source": "local"}


def test_no_layer_split_is_proposed_past_one_machine():
    from vramplan import plan

    huge = plan("llama-3.1-8b", "rtx-4090", gpus=65536)
    assert huge.fits and huge.setup.device_map == "none"
    assert not any("layer split" in r.reason for r in huge.rejected)
    assert any("layer split" in r.reason for r in plan("llama-3.1-70b", "rtx-3090", gpus=2).rejected)


def test_estimate_follows_the_transformers_version_asked_for():
    """`--transformers VERSION|installed`: the stack the numbers follow, named in --json; a known
    boundary moves them (4.46-4.48's shifted fp32 logits copy, stated in a warning)."""
    base = ["estimate", "llama-3.2-1b", "--method", "lora", "--batch", "4", "--json"]
    old = run(*base, "--transformers", "4.47.0")
    assert old.exit_code == 0 and "applied: the loss's shifted fp32 logits copy" in old.stderr
    data = json.loads(old.stdout)
    assert data["modelled_versions"]["transformers"] == "4.47.0"
    new = json.loads(run(*base).stdout)  # the copy (1 GiB of fp32 logits here) makes the forward the peak
    assert data["tensor_peak_bytes"] > new["tensor_peak_bytes"] and (data["phase"], new["phase"]) == (
        "forward", "backward")
    installed = json.loads(run(*base, "--transformers", "installed").stdout)
    assert installed["modelled_versions"]["transformers"] == MODELLED["transformers"]  # pinned here: 5.24.0
    assert_user_error(run(*base, "--transformers", "banana"), "--transformers", "not a version")


def test_the_fused_experts_warning_is_transformers_5s():
    base = ["estimate", "mixtral-8x7b", "--method", "qlora", "--checkpointing"]
    assert "fused 3-D tensors that bitsandbytes" in run(*base).stderr
    old = run(*base, "--transformers", "4.48.1").stderr
    assert "fused 3-D tensors that bitsandbytes" not in old and "per-expert nn.Linear (quantized by bitsandbytes" in old
