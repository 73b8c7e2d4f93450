"""Injection (issue 14): values that come from a user (a model directory's name, a check name)
never leave their place in what vramplan emits: comments stay one line in launch.sh, train.py and
accelerate_config.yaml, the printed ``run:`` hint quotes paths, and GitHub workflow commands cannot
be forged from a check name. launch.sh is run for real, with stub launchers on PATH."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.emit.common import one_line

ROOT = Path(__file__).resolve().parents[1]
CONFIG = (ROOT / "profiles" / "models" / "HuggingFaceTB--SmolLM2-135M.json").read_text()

NAMES = [
    "m\ntouch PWNED\nx",
    "m\r\ntouch PWNED",
    "m\u2028touch PWNED",
    "m\x85touch PWNED",
    "m $(touch PWNED) `touch PWNED`",
    "m'; touch PWNED; '",
    "m\"\nimport os; os.system('touch PWNED')\nx",
]


def _stub_launchers(bin_dir: Path, log: Path) -> dict:
    bin_dir.mkdir()
    for name in ("python", "deepspeed", "accelerate", "torchrun"):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


@pytest.mark.parametrize("name", NAMES, ids=range(len(NAMES)))
@pytest.mark.parametrize("extra", [[], ["--method", "full", "--zero", "3", "--gpus", "2"]], ids=["one", "zero3"])
def test_a_hostile_model_path_stays_in_its_comment(tmp_path, name, extra):
    model_dir = tmp_path / "models" / name
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(CONFIG)
    out = tmp_path / "run dir $(touch PWNED)"
    r = CliRunner().invoke(main, ["plan", str(model_dir), "--gpu", "a100-80gb", "--seq", "512", *extra,
                                  "--emit", str(out)])
    assert r.exit_code == 0, r.output
    hint = [line for line in r.stderr.splitlines() if line.startswith("run: ")]
    assert hint and "'" in hint[0], r.stderr  # the directory is shell-quoted
    py_compile.compile(str(out / "train.py"), doraise=True)
    yaml.safe_load((out / "accelerate_config.yaml").read_text())
    if (out / "ds_config.json").exists():
        json.loads((out / "ds_config.json").read_text())
    for f in ("train.py", "launch.sh", "accelerate_config.yaml"):
        for line in (out / f).read_text().splitlines():
            assert "touch PWNED" not in line or line.lstrip().startswith("#") or "PLAN" in f, (f, line)
    log = tmp_path / "launch.log"
    env = _stub_launchers(tmp_path / "bin", log)
    done = subprocess.run(["bash", str(out / "launch.sh"), "--max-steps", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().count("\n") == 1 and "train.py" in log.read_text()
    assert not list(tmp_path.rglob("PWNED")), "an injected command ran"


def test_one_line_escapes_every_line_break():
    for ch in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029\x00\x1b":
        text = one_line(f"a{ch}b")
        assert len(text.splitlines()) == 1 and ch not in text, repr(text)
    assert one_line("plain · text ü") == "plain · text ü"


def test_github_output_cannot_be_forged_from_a_check_name(tmp_path):
    checks = tmp_path / "checks.yaml"
    checks.write_text(yaml.safe_dump({"checks": [
        {"name": "evil\n::error file=evil::injected", "model": "llama-3.1-8b", "gpu": "t4", "must_fit": True},
        {"name": "new\r\n::warning::forged", "model": "smollm2-135m", "gpu": "l4", "setup": {"seq": 256}},
    ]}))
    r = CliRunner().invoke(main, ["check", str(checks), "--baseline", str(tmp_path / "b.json"), "--format", "github",
                                  "--summary", str(tmp_path / "summary.md")])
    assert r.exit_code == 1, r.output
    for line in r.output.splitlines():
        if line.startswith("::"):
            assert line.startswith(("::error file=", "::warning file=", "::warning title=")), line
    assert "injected" in r.output  # the name is there, escaped, inside its own annotation
    summary = (tmp_path / "summary.md").read_text()
    assert "\n::" not in summary


def test_markup_in_a_check_name_is_text(tmp_path):
    checks = tmp_path / "checks.yaml"
    checks.write_text("checks:\n  - {name: '[/]evil[bold]', model: smollm2-135m, gpu: l4, setup: {seq: 256}}\n")
    r = CliRunner().invoke(main, ["check", str(checks), "--baseline", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert "[/]evil[bold]" in r.stdout
