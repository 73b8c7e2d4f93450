"""`--transformers VERSION` on plan and check, as on estimate (tests/test_house.py): every candidate
of the search is estimated and costed under that Stack, the plan and its file name the version, and
check estimates its budgets under it. Mixtral 8x7B QLoRA is the question whose answer the version
moves most: transformers 4.x builds its experts as per-expert nn.Linear that bitsandbytes quantizes
(estimator/moe_4x.py), transformers 5 fuses them into 3-D tensors it leaves in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.util.versions import MODELLED

OLD = "4.48.1"
MOE = "mixtral-8x7b"
CARD = "a100-80gb"
#: every knob fixed: the plan's chosen setup is the one estimate is asked about
FIXED = ("--method", "qlora", "--quant", "nf4", "--batch", "1", "--grad-accum", "1", "--checkpointing",
         "--optimizer", "adamw-8bit", "--attn", "sdpa", "--zero", "0", "--offload-optimizer", "none",
         "--offload-params", "none", "--no-liger", "--seq", "1024")
CHECKS = f"""\
checks:
  - name: moe-qlora
    model: {MOE}
    gpu: {CARD}
    setup: {{method: qlora, quant: nf4, seq: 1024, batch: 1, checkpointing: true}}
"""


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def ok_json(result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def weights(bd: dict) -> int:
    return sum(c["bytes"] for c in bd["components"] if c["name"] == "weights")


def test_plan_searches_under_the_version_asked_for_and_names_it():
    new = ok_json(run("plan", MOE, "--gpu", CARD, "--method", "qlora", "--json"))
    old = ok_json(run("plan", MOE, "--gpu", CARD, "--method", "qlora", "--transformers", OLD, "--json"))
    # 5: the fused experts stay fp32 and only an offloaded plan fits; 4.48.1: quantized, resident
    assert new["setup"]["offload_params"] == "cpu" and old["setup"]["offload_params"] == "none"
    assert old["breakdown"]["modelled_versions"]["transformers"] == OLD
    assert new["breakdown"]["modelled_versions"]["transformers"] == MODELLED["transformers"]
    assert any(n.startswith(f"models transformers {OLD}") for n in old["notes"])
    assert not any(n.startswith("models transformers") for n in new["notes"])
    text = run("plan", MOE, "--gpu", CARD, "--method", "qlora", "--transformers", OLD)
    assert text.exit_code == 0 and f"models transformers {OLD}" in " ".join(text.stdout.split())


def test_plan_breakdown_is_estimates_answer_under_the_same_stack():
    """The same question (every knob fixed) via plan and via estimate: the same Breakdown, whose
    weights are the quantized experts' under 4.48.1; the plan's speed is the cost model's under it."""
    from vramplan import load_gpu, load_model
    from vramplan.cost import model as cost
    from vramplan.estimator.stack import DEFAULT_STACK, Stack

    planned = ok_json(run("plan", MOE, "--gpu", CARD, *FIXED, "--transformers", OLD, "--json"))
    estimated = ok_json(run("estimate", MOE, "--gpu", CARD, *FIXED, "--transformers", OLD, "--json"))
    default = ok_json(run("plan", MOE, "--gpu", CARD, *FIXED, "--json"))["breakdown"]
    assert planned["breakdown"] == estimated
    assert weights(default) - weights(estimated) > 40 * 2**30  # 45B NF4 experts vs unquantized ones
    assert planned["fits"] and not default["fits"]
    # speed: the cost model's counts under the same stack (4.x dequantizes the experts too)
    from vramplan.setup.inputs import setup_from_mapping

    model, gpu = load_model(MOE), load_gpu(CARD)
    setup = setup_from_mapping(planned["setup"], "plan")
    under = cost.step_cost(model, setup, gpu, 1, cost.counts(model, setup, Stack(transformers=OLD))).tokens_per_s
    plain = cost.step_cost(model, setup, gpu, 1, cost.counts(model, setup, DEFAULT_STACK)).tokens_per_s
    assert planned["tokens_per_s"] == round(under, 1) != round(plain, 1)


def test_plan_api_takes_a_stack():
    from vramplan import plan
    from vramplan.estimator.stack import Stack

    old = plan(MOE, CARD, method="qlora", stack=Stack(transformers=OLD))
    new = plan(MOE, CARD, method="qlora")
    assert (old.transformers, new.transformers) == (OLD, None)
    assert old.setup.offload_params == "none" and new.setup.offload_params == "cpu"


def test_the_plan_file_records_the_version_and_check_keeps_it(tmp_path: Path):
    from vramplan.plans.planfile import load_plan

    out = tmp_path / "moe.json"
    r = run("plan", MOE, "--gpu", CARD, *FIXED, "--transformers", OLD, "--out", str(out))
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["breakdown"]["modelled_versions"]["transformers"] == OLD
    loaded = load_plan(out)
    assert loaded.transformers == OLD and loaded.breakdown.fits
    # an older file (no version, or the default one) loads as the default stack
    for versions in (None, dict(MODELLED)):
        old_file = tmp_path / f"old-{versions is None}.json"
        old_file.write_text(json.dumps({**data, "breakdown": {**data["breakdown"], "modelled_versions": versions}}))
        again = load_plan(old_file)
        assert again.transformers is None and not again.breakdown.fits
        assert again.breakdown.device_total_bytes > loaded.breakdown.device_total_bytes
    # check estimates the plan file under the version it was planned under, --transformers wins
    kept = run("check", str(out), "--baseline", str(tmp_path / "b.json"), "--json")
    assert kept.exit_code == 0, kept.output
    result = json.loads(kept.stdout)["results"][0]
    assert result["status"] == "new" and any(f"transformers {OLD}" in n for n in result["notes"])
    assert result["device_total_bytes"] == data["breakdown"]["device_total_bytes"]
    overridden = run("check", str(out), "--baseline", str(tmp_path / "b.json"), "--transformers", "5", "--json")
    assert overridden.exit_code == 1 and json.loads(overridden.stdout)["results"][0]["status"] == "over-budget"


def test_check_estimates_its_budgets_under_the_version(tmp_path: Path):
    checks = tmp_path / "checks.yaml"
    checks.write_text(CHECKS)
    baseline = tmp_path / "b.json"
    base = ("check", str(checks), "--baseline", str(baseline))
    new = run(*base, "--json")
    assert new.exit_code == 1  # transformers 5: the fp32 experts are over the A100's budget
    assert "fused 3-D tensors that bitsandbytes" in new.stderr
    old = run(*base, "--transformers", OLD, "--json")
    assert old.exit_code == 0, old.output
    assert "fused 3-D tensors that bitsandbytes" not in old.stderr  # 5's warning, not 4.x's
    data = json.loads(old.stdout)
    assert data["versions"]["modelled_transformers"] == OLD and "modelled_transformers" not in json.loads(
        new.stdout)["versions"]
    assert data["results"][0]["device_total_bytes"] * 3 < json.loads(new.stdout)["results"][0]["device_total_bytes"]
    table = run(*base, "--transformers", OLD)
    assert table.exit_code == 0 and f"models transformers {OLD}" in " ".join(table.stdout.split())
    # the baseline records the version; a run under the default says it moved
    assert run(*base, "--transformers", OLD, "--update").exit_code == 0
    assert json.loads(baseline.read_text())["checks"]["moe-qlora"]["recorded_with"]["modelled_transformers"] == OLD
    drifted = json.loads(run(*base, "--json").stdout)
    assert f"modelled transformers {OLD} -> 5 (--transformers: the version the estimate follows)" in drifted["drift"]


@pytest.mark.parametrize("argv", [("plan", MOE, "--gpu", CARD), ("plan", MOE, "--gpu", "a100-80gb,rtx-4090"),
                                  ("check", "CHECKS")])
def test_a_bad_version_is_one_error_line(tmp_path: Path, argv):
    checks = tmp_path / "checks.yaml"
    checks.write_text(CHECKS)
    argv = tuple(str(checks) if a == "CHECKS" else a for a in argv)
    if argv[0] == "check":
        argv += ("--baseline", str(tmp_path / "b.json"))
    assert_user_error(run(*argv, "--transformers", "banana"), "--transformers", "not a version")
    # 4.45's loss kept a shifted fp32 logits copy too, but no boundary was read below 4.46: no silent 5.x answer
    assert_user_error(run(*argv, "--transformers", "4.45.2"), "--transformers", "older than any version", "4.46")


def test_check_refuses_a_version_on_the_trace_tier(tmp_path: Path):
    checks = tmp_path / "checks.yaml"
    checks.write_text(CHECKS)
    assert_user_error(run("check", str(checks), "--baseline", str(tmp_path / "b.json"), "--tier", "trace",
                          "--transformers", OLD), "--transformers", "--tier analytic")


def test_one_option_and_help_text_for_the_three_commands():
    helps = [" ".join(run(cmd, "--help").stdout.split()) for cmd in ("estimate", "plan", "check")]
    line = "--transformers VERSION The transformers version the step runs on"
    assert all(line in h for h in helps)
    tails = [h[h.index(line):].split("`vramplan doctor`].")[0] for h in helps]
    assert tails[0] == tails[1] == tails[2]


def test_a_checks_file_names_the_version_per_check_or_in_its_defaults(tmp_path: Path):
    """``transformers:`` in a check (or its defaults) is ``--transformers`` for that check; the command
    line's wins; a YAML float (4.10 reads as 4.1) and a non-version are one error line each."""
    baseline = str(tmp_path / "b.json")

    def check(text: str, *extra: str):
        f = tmp_path / "checks.yaml"
        f.write_text(text)
        return run("check", str(f), "--baseline", baseline, "--json", *extra)

    per_check = check(CHECKS.replace("    gpu: ", f"    transformers: '{OLD}'\n    gpu: "))
    assert per_check.exit_code == 0, per_check.output  # 4.x: the quantized experts fit the A100
    assert json.loads(per_check.stdout)["results"][0]["device_total_bytes"] * 3 < json.loads(
        check(CHECKS).stdout)["results"][0]["device_total_bytes"]
    in_defaults = check(f"defaults:\n  transformers: '{OLD}'\n" + CHECKS)
    assert in_defaults.exit_code == 0
    a, b = json.loads(in_defaults.stdout), json.loads(per_check.stdout)
    assert a["results"][0]["device_total_bytes"] == b["results"][0]["device_total_bytes"]
    assert a["results"][0]["components"] == b["results"][0]["components"]
    assert check(f"defaults:\n  transformers: '{OLD}'\n" + CHECKS, "--transformers", "5").exit_code == 1
    for bad, fragment in (("4.10", "in quotes"), ("banana", "not a version")):
        assert_user_error(check(CHECKS.replace("    gpu: ", f"    transformers: {bad}\n    gpu: ")),
                          "transformers", fragment)
    traced = check(f"defaults:\n  transformers: '{OLD}'\n" + CHECKS, "--tier", "trace")
    assert f"transformers {OLD} is what the analytic tier models" in traced.stderr
