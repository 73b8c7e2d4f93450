"""Hostile input (issue 14): malformed config.json, plan files, checks files and baselines, absurd
sizes and click's usage errors all end in one ``error:`` line and exit 2, never a traceback, and
answer quickly (the limits are at the input layer, vramplan/setup/inputs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = json.loads((ROOT / "profiles" / "models" / "HuggingFaceTB--SmolLM2-135M.json").read_text())


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def _config_dir(tmp_path: Path, name: str, text: str | bytes) -> str:
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(d)


def _with(**changes) -> str:
    return json.dumps({**BASE_CONFIG, **changes})


_BASE_TEXT = json.dumps(BASE_CONFIG)
MALFORMED_CONFIGS = {
    "nan": (_BASE_TEXT.replace('"hidden_size": 576', '"hidden_size": NaN'), "NaN"),
    "infinity": (_BASE_TEXT.replace('"hidden_size": 576', '"hidden_size": Infinity'), "Infinity"),
    "huge-int": (_BASE_TEXT.replace('"hidden_size": 576', '"hidden_size": 1' + "0" * 400), "hidden_size"),
    "string-size": (_with(max_position_embeddings="big"), "max_position_embeddings"),
    "list-model-type": (_with(model_type=["llama"]), "model_type"),
    "fraction": (_with(hidden_size=576.5), "hidden_size"),
    "zero-kv-heads": (_with(num_key_value_heads=0), "num_key_value_heads"),
    "bool-size": (_with(vocab_size=True), "vocab_size"),
    "string-flag": (_with(tie_word_embeddings="false"), "tie_word_embeddings"),
    "too-many-layers": (_with(num_hidden_layers=10**9), "num_hidden_layers"),
    "moe-active": (_with(model_type="mixtral", num_local_experts=8, num_experts_per_tok=9), "num_experts_per_tok"),
    "not-utf8": (b'{"model_type": "\xff\xfe"}', "UTF-8"),
    "deep": ("[" * 100_000 + "]" * 100_000, "nested"),
    "not-object": ("[1, 2]", "object"),
    "empty": ("", "JSON"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CONFIGS))
def test_malformed_config_is_one_line(tmp_path, case):
    text, fragment = MALFORMED_CONFIGS[case]
    path = _config_dir(tmp_path, case, text)
    assert_user_error(run("estimate", path), fragment, "config.json")


def test_config_dict_from_python_is_checked_too():
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.specs import SpecError

    with pytest.raises(SpecError, match="hidden_size"):
        model_spec_from_config({**BASE_CONFIG, "hidden_size": float("nan")})


def test_markup_in_a_model_path_is_printed_as_text(tmp_path):
    d = tmp_path / "[" / "nope]"
    d.mkdir(parents=True)
    (d / "config.json").write_text(_BASE_TEXT)
    r = run("estimate", str(d))
    assert r.exit_code == 0, r.output
    assert "[/nope]" in r.stdout or "nope]" in r.stdout


# ----------------------------------------------------------------------------------------------
# plan files


def _plan_file(tmp_path: Path, **changes) -> str:
    data = {"vramplan_plan": 1, "model": "smollm2-135m", "gpu": {"name": "l4"},
            "setup": {"method": "lora", "seq": 512}}
    for key, value in changes.items():
        if key.startswith("setup_"):
            data["setup"][key[6:]] = value
        else:
            data[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("changes,fragment", [
    ({"setup_lora_targets": 7}, "lora_targets"),
    ({"setup_zero_stage": True}, "zero_stage"),
    ({"setup_batch": 10**300}, "batch"),
    ({"setup_gpus": 10**12}, "gpus"),
    ({"setup_lora_alpha": "big"}, "lora_alpha"),
    ({"notes": 5}, "notes"),
    ({"alternatives": 5}, "alternatives"),
    ({"rejected": 5}, "rejected"),
    ({"alternatives": [{"setup": {}, "device_total_bytes": "many"}]}, "device_total_bytes"),
    ({"tokens_per_s": "fast"}, "tokens_per_s"),
    ({"vramplan_plan": True}, "vramplan_plan"),
    ({"nodes": 10**9}, "nodes"),
    ({"breakdown": 3}, "breakdown"),
    ({"model": ""}, "model"),
])
def test_malformed_plan_file_is_one_line(tmp_path, changes, fragment):
    path = _plan_file(tmp_path, **changes)
    assert_user_error(run("emit", path, "--out", str(tmp_path / "out")), fragment)
    assert not (tmp_path / "out").exists()


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    path = tmp_path / "plan.yaml"
    path.write_text("vramplan_plan: 1\nmodel: smollm2-135m\nsetup: {}\n" + bomb)
    assert_user_error(run("emit", str(path), "--out", str(tmp_path / "out")), "aliases")
    checks = tmp_path / "checks.yaml"
    checks.write_text(bomb + "checks: [{name: *i, model: smollm2-135m}]\n")
    assert_user_error(run("check", str(checks), "--baseline", str(tmp_path / "b.json")), "aliases")


def test_deep_checks_file_and_baseline(tmp_path):
    checks = tmp_path / "checks.json"
    checks.write_text('{"checks": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert_user_error(run("check", str(checks), "--baseline", str(tmp_path / "b.json")), "nested")
    good = tmp_path / "good.yaml"
    good.write_text("checks:\n  - {name: a, model: smollm2-135m, gpu: l4, setup: {seq: 256}}\n")
    base = tmp_path / "base.json"
    base.write_text("[" * 100_000 + "]" * 100_000)
    assert_user_error(run("check", str(good), "--baseline", str(base)), "nested")


# ----------------------------------------------------------------------------------------------
# absurd sizes and usage errors


HUGE = "9" * 300


@pytest.mark.parametrize("args,fragment", [
    (["estimate", "smollm2-135m", "--gpus", "1000000000000"], "--gpus"),
    (["estimate", "smollm2-135m", "--batch", HUGE], "--batch"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--seq", HUGE], "--seq"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--gpus", HUGE], "--gpus"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--grad-accum", HUGE], "--grad-accum"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--global-batch", "1e18"], "--global-batch"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--tokens-per-step", "1e30"], "--tokens-per-step"),
    (["plan", "smollm2-135m", "--gpu", "l4", "--nodes", HUGE], "--nodes"),
    (["estimate", "smollm2-135m", "--gpu-memory", "24"], "24GiB"),
    (["estimate"], "MODEL"),
    (["plan", "smollm2-135m", "--bogus"], "--bogus"),
    (["estimate", "smollm2-135m", "--method", "nope"], "--method"),
    (["nope"], "nope"),
])
def test_bad_arguments_are_one_line(args, fragment):
    assert_user_error(run(*args), fragment)


def test_ambiguous_gpu_alias_says_which_card():
    r = run("estimate", "smollm2-135m", "--gpu", "a100", "--json")
    assert r.exit_code == 0, r.output
    assert "using a100-80gb" in r.stderr and "a100-40gb" in r.stderr
    assert "a100-80gb" in json.dumps(json.loads(r.stdout)["gpu"])
    r = run("estimate", "smollm2-135m", "--gpu", "a100-40gb", "--json")
    assert "could mean" not in r.stderr


def _subprocess(*args: str, shell_pipe: str | None = None) -> subprocess.CompletedProcess:
    cmd = " ".join([f"'{sys.executable}'", "-m", "vramplan", *args])
    if shell_pipe:
        cmd = f"set -o pipefail; {cmd} | {shell_pipe}"
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["gpus"], ["plan", "smollm2-135m", "--gpu", "l4"], ["models"],
                                  ["estimate", "smollm2-135m", "--json"]])
def test_a_closed_pipe_is_not_an_error(args):
    r = _subprocess(*args, shell_pipe="head -1 >/dev/null")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "" or "Traceback" not in r.stderr and "error" not in r.stderr, r.stderr


def test_check_regression_still_exits_1_into_dev_null(tmp_path):
    checks = tmp_path / "c.yaml"
    checks.write_text("checks:\n  - {name: big, model: llama-3.1-8b, gpu: t4, must_fit: true}\n")
    r = _subprocess("check", str(checks), "--baseline", str(tmp_path / "b.json"), ">/dev/null")
    assert r.returncode == 1, r.stderr


def test_usage_error_from_the_real_command_is_one_line():
    r = _subprocess("plan")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: "), r.stderr


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch):
    import vramplan.model.profiles

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(vramplan.model.profiles, "load_model", interrupted)
    r = run("estimate", "smollm2-135m")
    assert r.exit_code == 130 and "Traceback" not in r.output
    assert r.stderr.strip() == "error: interrupted"


@pytest.mark.parametrize("model,gpu", [("smollm2-135m", "l4"), ("llama-3.1-8b", "a100-80gb")])
def test_sgd_fsdp_offload_plan_answers(model, gpu):
    """FSDP's CPU offload steps any torch optimizer on the host: SGD with it is a plan, not a crash
    (it was `min() arg is an empty sequence`: DeepSpeed's AdamW-only offload rule excluded it)."""
    r = run("plan", model, "--optimizer", "sgd", "--fsdp", "full_shard", "--offload-params", "cpu", "--gpu", gpu,
            "--json")
    assert r.exit_code == 0, r.output
    setup = json.loads(r.output)["setup"]
    assert (setup["optimizer"], setup["fsdp"], setup["offload_params"]) == ("sgd", "full_shard", "cpu")


def test_a_large_yaml_file_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("vramplan_plan: 1\nmodel: smollm2-135m\nsetup: {}\nnotes:\n" + "- xxxxxxxxxxxxxxxxxxxx\n" * 60_000)
    assert_user_error(run("emit", str(path), "--out", str(tmp_path / "out")), "too large")
