"""`vramplan check`: exit codes 0/1/2, the baseline round trip, interrupted updates, the outputs.

Everything runs the real estimator through click's CliRunner (milliseconds per check); one test
runs the traced tier on a 2-layer SmolLM2 written as a config.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.budget import DEFAULT_TOLERANCE, load_specs, parse_tolerance, read_baseline
from vramplan.cli import main
from vramplan.plans.planfile import save_plan
from vramplan.specs import Plan, SpecError, truncate_config

FITS = """\
checks:
  - name: sft-8b
    model: llama-3.1-8b
    gpu: rtx-4090
    setup: {method: lora, lora_rank: 16, seq: 2048, batch: 1, checkpointing: true}
    must_fit: true
  - name: small-full
    model: qwen2-0.5b
    gpu_memory: 16GiB
    setup: {method: full, seq: 1024}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run(tmp_path: Path, *args: str):
    """``vramplan check`` with the baseline in tmp_path unless the test names one."""
    argv = ["check", *args]
    if "--baseline" not in args:
        argv += ["--baseline", str(tmp_path / "vram-baseline.json")]
    return CliRunner().invoke(main, argv)


def as_json(result) -> dict:
    return json.loads(result.stdout)


@pytest.fixture
def spec(tmp_path) -> Path:
    return write(tmp_path / "checks.yaml", FITS)


@pytest.fixture
def recorded(tmp_path, spec) -> Path:
    """A baseline recorded from ``spec``."""
    r = run(tmp_path, str(spec), "--update")
    assert r.exit_code == 0, r.output
    return tmp_path / "vram-baseline.json"


def scale_baseline(path: Path, name: str, factor: float) -> None:
    """Pretend the baseline recorded ``factor`` times the numbers (an older, smaller estimate)."""
    data = json.loads(path.read_text())
    rec = data["checks"][name]
    for key in ("tensor_peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        rec[key] = int(rec[key] * factor)
    rec["components"]["logits_loss"] = int(rec["components"]["logits_loss"] * factor)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------------------------
# Exit code 0


def test_within_budget_without_baseline_is_new_not_a_failure(tmp_path, spec):
    r = run(tmp_path, str(spec), "--json")
    assert r.exit_code == 0, r.output
    assert "warning: no baseline" in r.stderr
    data = as_json(r)
    assert data["ok"] and data["counts"]["new"] == 2
    assert [x["status"] for x in data["results"]] == ["new", "new"]
    assert all(x["fits"] for x in data["results"])
    assert not (tmp_path / "vram-baseline.json").exists()  # only --update writes it


def test_require_baseline_fails_new_checks(tmp_path, spec):
    r = run(tmp_path, str(spec), "--require-baseline", "--json")
    assert r.exit_code == 1, r.output
    assert [x["failed"] for x in as_json(r)["results"]] == [True, True]


def test_update_then_check_is_clean(tmp_path, spec, recorded):
    baseline = read_baseline(recorded)
    assert set(baseline) == {"sft-8b", "small-full"}
    rec = baseline["sft-8b"]
    from vramplan.estimator.corrections import calibration_for

    gpu = load_gpu("rtx-4090")  # `check` applies the card's calibration (sm89: the RTX 4090 rows)
    bd = estimate(load_model("llama-3.1-8b"), Setup(method="lora", checkpointing=True), gpu, calibration_for(gpu)[0])
    assert rec.numbers["device_total_bytes"] == bd.device_total_bytes
    assert rec.components["weights"] == bd.component("weights")
    assert rec.recorded_with["model_version"] >= 1 and "torch" in rec.recorded_with
    r = run(tmp_path, str(spec))
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert "2 ok" in r.stdout and "passed" in r.stdout
    data = as_json(run(tmp_path, str(spec), "--json"))
    assert [x["status"] for x in data["results"]] == ["ok", "ok"]
    assert all(d["delta_bytes"] == 0 for x in data["results"] for d in x["diff"]["numbers"])
    assert data["drift"] == []


def test_growth_within_tolerance_passes(tmp_path, spec, recorded):
    scale_baseline(recorded, "sft-8b", 0.99)
    r = run(tmp_path, str(spec), "--json")
    assert r.exit_code == 0, r.output
    assert as_json(r)["results"][0]["status"] == "ok"


def test_shrinkage_is_a_warning_not_a_failure(tmp_path, spec, recorded):
    scale_baseline(recorded, "sft-8b", 1.10)
    r = run(tmp_path, str(spec))
    assert r.exit_code == 0, r.output
    assert "shrank" in r.stdout
    gh = run(tmp_path, str(spec), "--format", "github", "--summary", "")
    assert gh.exit_code == 0
    assert any(line.startswith("::warning") and "sft-8b" in line and "shrank" in line
               for line in gh.stdout.splitlines())


# ----------------------------------------------------------------------------------------------
# Exit code 1


def test_over_budget_fails(tmp_path):
    spec = write(tmp_path / "c.yaml", "checks:\n  - {name: full-8b, model: llama-3.1-8b, gpu: rtx-4090}\n")
    r = run(tmp_path, str(spec), "--json")
    assert r.exit_code == 1, r.output
    res = as_json(r)["results"][0]
    assert res["status"] == "over-budget" and res["fits"] is False and res["failed"]
    assert "over budget" in res["reasons"][0] and "short" in res["reasons"][0]


def test_over_budget_allowed_when_must_fit_is_false(tmp_path):
    spec = write(tmp_path / "c.yaml",
                 "checks:\n  - {name: full-8b, model: llama-3.1-8b, gpu: rtx-4090, must_fit: false}\n")
    r = run(tmp_path, str(spec), "--json")
    assert r.exit_code == 0, r.output
    assert as_json(r)["results"][0]["fits"] is False


def test_growth_beyond_tolerance_fails_and_names_the_component(tmp_path, spec, recorded):
    scale_baseline(recorded, "sft-8b", 0.90)  # the numbers were ~10 % smaller when recorded
    r = run(tmp_path, str(spec))
    assert r.exit_code == 1, r.output
    assert "grew" in r.stdout and "beyond the 2.0% tolerance" in r.stdout
    assert "logits_loss" in r.stdout  # the component that moved
    data = as_json(run(tmp_path, str(spec), "--json"))
    res = data["results"][0]
    assert res["status"] == "grew" and data["exit_code"] == 1
    moved = {d["name"]: d for d in res["diff"]["components"]}
    assert moved["logits_loss"]["delta_bytes"] > 0
    assert data["results"][1]["status"] == "ok"
    # a wider tolerance (from the command line, or the check's own) lets it pass
    assert run(tmp_path, str(spec), "--tolerance", "15%").exit_code == 0
    own = write(tmp_path / "checks.yaml",
                FITS.replace("    must_fit: true\n", "    must_fit: true\n    tolerance: 0.15\n"))
    assert run(tmp_path, str(own)).exit_code == 0


def test_a_setup_change_that_grows_memory_fails_and_says_what_changed(tmp_path, spec, recorded):
    write(spec, FITS.replace("seq: 2048", "seq: 2304"))
    r = run(tmp_path, str(spec))
    assert r.exit_code == 1, r.output
    assert "setup changed: seq 2048 -> 2304" in " ".join(r.stdout.split())
    assert "logits_loss" in r.stdout


def test_update_accepts_growth_and_prints_the_diff(tmp_path, spec, recorded):
    scale_baseline(recorded, "sft-8b", 0.90)
    r = run(tmp_path, str(spec), "--update")
    assert r.exit_code == 0, r.output
    assert "grew" in r.stdout and "logits_loss" in r.stdout
    assert "baseline updated" in r.stdout and "1 changed" in r.stdout
    assert run(tmp_path, str(spec)).exit_code == 0


def test_update_still_fails_a_check_over_budget(tmp_path):
    spec = write(tmp_path / "c.yaml", "checks:\n  - {name: full-8b, model: llama-3.1-8b, gpu: rtx-4090}\n")
    r = run(tmp_path, str(spec), "--update")
    assert r.exit_code == 1
    assert "full-8b" in read_baseline(tmp_path / "vram-baseline.json")


def test_update_keeps_entries_of_other_checks_and_lists_them(tmp_path, spec, recorded):
    other = write(tmp_path / "other.yaml", "checks:\n  - {name: tiny, model: gpt2, gpu: rtx-4090}\n")
    assert run(tmp_path, str(other), "--update").exit_code == 0
    assert set(read_baseline(recorded)) == {"sft-8b", "small-full", "tiny"}
    data = as_json(run(tmp_path, str(other), "--json"))
    assert data["stale"] == ["sft-8b", "small-full"]


# ----------------------------------------------------------------------------------------------
# Interrupted update


@pytest.mark.parametrize("failure", ["disk-full", "interrupt"])
def test_baseline_survives_an_interrupted_update(tmp_path, spec, recorded, monkeypatch, failure):
    scale_baseline(recorded, "sft-8b", 0.5)
    before = recorded.read_bytes()

    if failure == "disk-full":
        def replace(*args, **kwargs):  # the new file is written, the rename fails
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "replace", replace)
    else:
        def fsync(fd):  # Ctrl-C while the new file is being flushed
            raise KeyboardInterrupt
        monkeypatch.setattr(os, "fsync", fsync)
    r = run(tmp_path, str(spec), "--update")
    monkeypatch.undo()
    if failure == "disk-full":  # a user-facing error: one line, exit 2
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and "No space left on device" in r.stderr
    else:  # Ctrl-C: one line and exit 130 (the shell's convention), never a regression's exit 1
        assert r.exit_code == 130 and r.stderr.strip() == "error: interrupted"
    assert recorded.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checks.yaml", "vram-baseline.json"]
    assert run(tmp_path, str(spec)).exit_code == 1  # the old (halved) baseline still judges


# ----------------------------------------------------------------------------------------------
# Exit code 2: malformed input


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("checks:\n  - name: a\n    model: [\n", ["not valid YAML", "line"]),
        ("- just a list\n", ["expected a mapping"]),
        ("checks: []\n", ["non-empty list"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, setup: {bogus: 1}}\n",
         ["unknown setup key 'bogus'", "check 'a'"]),
        ("checks:\n  - {name: a, model: no-such-model-xyz, gpu: rtx-4090}\n", ["unknown model 'no-such-model-xyz'"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-9999}\n", ["unknown GPU 'rtx-9999'"]),
        ("checks:\n  - {model: gpt2, gpu: rtx-4090}\n", ["missing 'name'"]),
        ("checks:\n  - {name: a, gpu: rtx-4090}\n", ["missing 'model'"]),
        ("checks:\n  - {name: a, model: gpt2}\n", ["must_fit needs a budget"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, gpu_memory: 24GiB}\n", ["not both"]),
        ("checks:\n  - {name: a, model: gpt2, gpu_memory: lots}\n", ["gpu_memory", "lots"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, setup: {seq: '2048'}}\n", ["seq must be an integer"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, setup: {batch: 0}}\n", ["batch"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, colour: red}\n", ["unknown key 'colour'"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, tolerance: 5}\n", ["tolerance"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090}\n  - {name: a, model: gpt2, gpu: rtx-4090}\n",
         ["used twice"]),
        ("checks:\n  - {name: a, model: gpt2, gpu: rtx-4090, setup: {method: lora, lora_rank: 4096}}\n",
         ["--lora-rank 4096"]),
        ("check:\n  - {name: a, model: gpt2, gpu: rtx-4090}\n", ["unknown top-level key 'check'"]),
    ],
    ids=["bad-yaml", "not-a-mapping", "no-checks", "unknown-setup-key", "unknown-model", "unknown-gpu",
         "missing-name", "missing-model", "missing-gpu", "two-gpus", "bad-size", "wrong-type", "bad-value",
         "unknown-key", "bad-tolerance", "duplicate-name", "rank-too-wide", "misspelt-checks"],
)
def test_malformed_spec_is_one_error_line(tmp_path, text, fragments):
    spec = write(tmp_path / "bad.yaml", text)
    assert_user_error(run(tmp_path, str(spec)), *fragments)


def test_other_bad_inputs(tmp_path, spec):
    assert_user_error(run(tmp_path, str(tmp_path / "missing.yaml")), "no such file")
    assert_user_error(run(tmp_path, str(spec), "--tolerance", "lots"), "--tolerance")
    write(tmp_path / "vram-baseline.json", "{not json")
    assert_user_error(run(tmp_path, str(spec)), "baseline is not valid JSON")
    write(tmp_path / "vram-baseline.json", '{"checks": {}}')
    assert_user_error(run(tmp_path, str(spec)), "not a vramplan baseline")
    assert CliRunner().invoke(main, ["check"]).exit_code == 2  # SPEC is required


def test_parse_tolerance():
    assert parse_tolerance("2%") == pytest.approx(0.02)
    assert parse_tolerance(0.05) == 0.05 and parse_tolerance("0.1") == 0.1
    assert DEFAULT_TOLERANCE == 0.02
    for bad in ("-1%", 2, "100%", True, None):
        with pytest.raises(SpecError):
            parse_tolerance(bad)


# ----------------------------------------------------------------------------------------------
# Spec sources: defaults, plan files, relative config paths


def test_defaults_merge_into_every_check(tmp_path):
    spec = write(tmp_path / "c.yaml", """\
defaults: {gpu: rtx-4090, setup: {method: lora, checkpointing: true}, tolerance: 5%}
checks:
  - {name: a, model: llama-3.1-8b}
  - {name: b, model: llama-3.1-8b, gpu_memory: 80GiB, setup: {seq: 4096}}
""")
    a, b = load_specs([spec])
    assert a.gpu.name == "rtx-4090" and a.setup.method == "lora" and a.setup.checkpointing and a.tolerance == 0.05
    assert b.gpu.usable_memory_bytes == 80 * 1024**3 and b.setup.seq == 4096 and b.setup.method == "lora"
    assert (a.line, b.line) == (3, 4)


def test_plan_file_is_one_must_fit_check(tmp_path):
    model, gpu = load_model("qwen2-0.5b"), load_gpu("rtx-4090")
    setup = Setup(method="lora", checkpointing=True, batch=2)
    from vramplan.estimator.corrections import calibration_for

    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu, calibration_for(gpu)[0]), gpu=gpu)
    path = save_plan(plan, tmp_path / "sft-plan.yaml")
    (spec,) = load_specs([path])
    assert spec.name == "sft-plan" and spec.must_fit and spec.setup == setup and spec.gpu == gpu
    r = run(tmp_path, str(path), "--json")
    assert r.exit_code == 0, r.output
    res = as_json(r)["results"][0]
    assert res["device_total_bytes"] == plan.breakdown.device_total_bytes


def test_relative_config_path_is_read_next_to_the_checks_file(tmp_path, monkeypatch):
    sub = tmp_path / "ci"
    (sub / "tiny").mkdir(parents=True)
    (sub / "tiny" / "config.json").write_text(json.dumps(truncate_config(load_model("gpt2").config, 2)))
    spec = write(sub / "c.yaml", "checks:\n  - {name: tiny, model: tiny, gpu_memory: 8GiB}\n")
    monkeypatch.chdir(tmp_path)
    (loaded,) = load_specs([spec])
    assert Path(loaded.model) == sub / "tiny"
    assert run(tmp_path, str(spec)).exit_code == 0


# ----------------------------------------------------------------------------------------------
# Version drift and output formats


def test_version_drift_is_reported(tmp_path, spec, recorded):
    data = json.loads(recorded.read_text())
    for rec in data["checks"].values():
        rec["recorded_with"].update(torch="1.0.0", model_version=0)
    recorded.write_text(json.dumps(data))
    r = run(tmp_path, str(spec))
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "baseline recorded under other versions" in out
    from vramplan.estimator.version import MODEL_VERSION

    assert "torch 1.0.0 ->" in out and f"model_version 0 -> {MODEL_VERSION}" in out
    data = as_json(run(tmp_path, str(spec), "--json"))
    assert any(line.startswith("torch 1.0.0 ->") for line in data["drift"])
    gh = run(tmp_path, str(spec), "--format", "github", "--summary", "").stdout
    assert "::warning title=vramplan baseline versions::" in gh


def test_github_format_annotates_the_failing_line_and_writes_the_summary(tmp_path, spec, recorded, monkeypatch):
    scale_baseline(recorded, "sft-8b", 0.90)
    summary = write(tmp_path / "summary.md", "earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    r = run(tmp_path, str(spec), "--format", "github")
    assert r.exit_code == 1
    errors = [line for line in r.stdout.splitlines() if line.startswith("::error")]
    assert len(errors) == 1
    assert f"file={str(spec).replace(':', '%3A')},line=2," in errors[0] and "grew" in errors[0]
    assert "%25" in errors[0]  # a literal % is escaped for the workflow command
    text = summary.read_text()
    assert text.startswith("earlier step\n### vramplan check: 1 of 2 checks failed")
    assert "| sft-8b |" in text and "❌ grew" in text and "| logits_loss |" in text
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_table_and_json_agree(tmp_path, spec, recorded):
    table = run(tmp_path, str(spec)).stdout
    data = as_json(run(tmp_path, str(spec), "--format", "json"))
    for res in data["results"]:
        assert res["name"] in table
        assert f"{res['device_total_bytes'] / 1024**3:,.2f}" in table


def test_trace_tier_on_a_tiny_model(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(truncate_config(load_model("smollm2-135m").config, 2)))
    spec = write(tmp_path / "c.yaml", "checks:\n  - {name: tiny, model: tiny, gpu_memory: 4GiB, setup: {seq: 64}}\n")
    r = run(tmp_path, str(spec), "--tier", "trace", "--update")
    assert r.exit_code == 0, r.output
    assert read_baseline(tmp_path / "vram-baseline.json")["tiny"].tier == "traced"
    # a traced baseline is not compared with an analytic run
    data = as_json(run(tmp_path, str(spec), "--json"))
    assert data["results"][0]["status"] == "new" and "recorded on the traced tier" in data["results"][0]["notes"][0]
    refused = write(tmp_path / "q.yaml",
                    "checks:\n  - {name: q, model: tiny, gpu_memory: 4GiB, setup: {method: qlora}}\n")
    assert_user_error(run(tmp_path, str(refused), "--tier", "trace"), "check 'q'")


def test_ci_example_is_consistent():
    """examples/ci: the workflow runs `vramplan check` on every push over the example checks, and
    every example check has a baseline entry. (Exit 1 would mean the estimator moved since the
    baseline was recorded: re-record it with --update and bump MODEL_VERSION.)"""
    import yaml

    root = Path(__file__).resolve().parents[1] / "examples" / "ci"
    workflow = yaml.safe_load((root / "vram-check.yml").read_text())
    assert "push" in workflow[True]  # YAML 1.1 reads the key `on` as True
    steps = workflow["jobs"]["vram"]["steps"]
    command = " ".join(s.get("run", "") for s in steps)
    assert "vramplan check examples/ci/vram-checks.yaml" in command and "--format github" in command
    r = CliRunner().invoke(main, ["check", str(root / "vram-checks.yaml"),
                                  "--baseline", str(root / "vram-baseline.json"), "--json"])
    # strict: the shipped workflow fails on exit 1, so a moved estimate must re-record the baseline
    assert r.exit_code == 0, r.output
    data = as_json(r)
    assert data["counts"]["new"] == 0 and data["stale"] == []


CONFIGS = Path(__file__).parent / "data" / "configs"


def test_from_entry_reads_a_training_config_relative_to_the_checks_file(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "lora.yml").write_text((CONFIGS / "axolotl/lora-1b.yml").read_text())
    spec = write(tmp_path / "checks.yaml", """\
checks:
  - name: axo
    from: cfg/lora.yml
    model: llama-3.2-1b
    gpu: rtx-4090
    setup: {seq: 1024}
""")
    (check,) = load_specs([spec])
    read_setup = Setup(method="lora", lora_rank=16, lora_alpha=32, lora_dropout=0.05, batch=2, grad_accum=2,
                       lora_targets="gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj", seq=1024,
                       optimizer="adamw-8bit", checkpointing=True, attn="flash", precision="bf16",
                       padding_free=True, framework="axolotl")  # sample_packing with flash attention
    assert check.setup == read_setup  # the file's setup with the entry's override
    assert check.config == str(tmp_path / "cfg" / "lora.yml") and check.model == "llama-3.2-1b"
    assert any("assumed: bf16" in w for w in check.warnings)
    result = CliRunner().invoke(main, ["check", str(spec), "--baseline", str(tmp_path / "b.json"), "--json",
                                       "--no-calibration"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["results"]
    assert any("assumed: bf16" in w for w in row["warnings"])
    direct = estimate(load_model("llama-3.2-1b"), read_setup, load_gpu("rtx-4090"))
    assert row["device_total_bytes"] == direct.device_total_bytes


@pytest.mark.parametrize(
    "entry, fragments",
    [
        ("from: nowhere.yml\n    model: x\n", ("check 'c'", "from: no such file", "nowhere.yml")),
        ("from: cfg.yml\n", ("check 'c'", "names no model", "give model")),
        ("from: cfg.yml\n    model: llama-3.2-1b\n    format: trl\n", ("check 'c'", "reads as axolotl", "not trl")),
        ("model: llama-3.2-1b\n    format: axolotl\n", ("check 'c'", "format goes with from")),
        ("from: 3\n    model: x\n", ("check 'c'", "from must be the path")),
    ],
)
def test_from_entry_errors_name_the_file_and_the_entry(tmp_path, entry, fragments):
    write(tmp_path / "cfg.yml", "micro_batch_size: 1\n")  # axolotl, naming no model
    spec = write(tmp_path / "checks.yaml", f"checks:\n  - name: c\n    gpu: rtx-4090\n    {entry}")
    result = CliRunner().invoke(main, ["check", str(spec), "--baseline", str(tmp_path / "b.json")])
    assert_user_error(result, str(spec), *fragments)
