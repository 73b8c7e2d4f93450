"""Unsloth's ``unsloth_tiled_mlp=True`` as a setup knob (``Setup.tiled_mlp``, ``--tiled-mlp``): threaded
through like torchtune's ``compile`` (tests/test_torchtune_compile.py): the CLI option, the one-line
refusal with other frameworks, the plan's search (a saver for Unsloth), the plan file, ``plan --from``'s
kept knobs and the Unsloth writer. The memory it saves is the estimator's (estimator/tiled_mlp.py); these
check the plumbing only."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from vramplan import Setup, estimate, load_model, plan
from vramplan.cli import main
from vramplan.readers.common import ReadConfig
from vramplan.readers.planning import kept_knobs, plan_inputs
from vramplan.search.labels import savers_text
from vramplan.search.rank import extras
from vramplan.search.space import FIXABLE, saving
from vramplan.setup.wording import describe
from vramplan.util.errors import SpecError

UNSLOTH = Setup(framework="unsloth", loss="unsloth", method="qlora", checkpointing=True, seq=4096,
                optimizer="adamw-8bit")


def _json(output: str) -> dict:
    return json.loads(output[output.index("{"):])


def test_setup_omits_it_at_false_and_reads_it_back():
    assert "tiled_mlp" not in UNSLOTH.to_dict()
    tiled = UNSLOTH.replace(tiled_mlp=True)
    assert tiled.to_dict()["tiled_mlp"] is True
    assert Setup.from_dict(tiled.to_dict()) == tiled
    assert Setup.from_dict(UNSLOTH.to_dict()).tiled_mlp is False


def test_the_cli_option_round_trips():
    args = ["estimate", "llama-3.1-8b", "--framework", "unsloth", "--method", "qlora", "--checkpointing"]
    r = CliRunner().invoke(main, [*args, "--tiled-mlp", "--json"])
    assert r.exit_code == 0, r.output
    assert _json(r.output)["setup"]["tiled_mlp"] is True
    r = CliRunner().invoke(main, [*args, "--no-tiled-mlp", "--json"])
    assert r.exit_code == 0, r.output
    assert "tiled_mlp" not in _json(r.output)["setup"]  # omitted at its default


@pytest.mark.parametrize("framework", ["hf", "trl", "llamafactory", "torchtune"])
def test_tiled_mlp_elsewhere_is_refused_in_one_line(framework):
    with pytest.raises(SpecError, match="--tiled-mlp is modelled for Unsloth"):
        estimate(load_model("llama-3.2-1b"), Setup(framework=framework, method="lora", tiled_mlp=True))
    r = CliRunner().invoke(main, ["estimate", "llama-3.1-8b", "--framework", framework, "--method", "qlora",
                                  "--tiled-mlp"])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: --tiled-mlp")
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_plan_refuses_it_without_unsloth():
    r = CliRunner().invoke(main, ["plan", "llama-3.2-1b", "--gpu", "rtx-4090", "--tiled-mlp", "--json"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "--tiled-mlp is modelled for Unsloth" in r.output


def test_the_words_and_the_search_count_it_as_a_saver_and_an_extra():
    tiled = UNSLOTH.replace(tiled_mlp=True)
    assert "tiled MLP" in describe(tiled) and "tiled MLP" not in describe(UNSLOTH)
    assert "tiled MLP" in savers_text(tiled) and "tiled MLP" not in savers_text(UNSLOTH)
    assert extras(tiled) == extras(UNSLOTH) + 1  # taken only where the plain step does not fit
    assert saving(tiled) > saving(UNSLOTH)
    assert "tiled_mlp" in FIXABLE


def test_plan_fixes_it_either_way_for_unsloth():
    def plan_json(*extra):
        r = CliRunner().invoke(main, ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--framework", "unsloth",
                                      "--seq", "8192", "--json", *extra])
        assert r.exit_code == 0, r.output
        return _json(r.output)

    assert plan_json("--tiled-mlp")["setup"]["tiled_mlp"] is True
    assert "tiled_mlp" not in plan_json("--no-tiled-mlp")["setup"]
    # a plain step that fits takes no tiles (an extra: one more MLP forward per layer)
    assert "tiled_mlp" not in plan_json()["setup"]


def test_the_unsloth_writer_passes_unsloth_tiled_mlp(tmp_path):
    from vramplan.emit import render
    from vramplan.emit.unsloth import SCRIPT

    tiled = plan("llama-3.1-8b", "rtx-4090", seq=8192, framework="unsloth", tiled_mlp=True)
    assert tiled.setup.tiled_mlp
    files = render(tiled, ["unsloth"])
    assert yaml.safe_load(files["unsloth.yaml"])["unsloth_tiled_mlp"] is True
    assert files["unsloth_train.py"] == SCRIPT  # the script reads it from the config
    assert 'unsloth_tiled_mlp=cfg.get("unsloth_tiled_mlp", False)' in SCRIPT
    plain = plan("llama-3.1-8b", "rtx-4090", seq=8192, framework="unsloth", tiled_mlp=False)
    assert yaml.safe_load(render(plain, ["unsloth"])["unsloth.yaml"])["unsloth_tiled_mlp"] is False


def test_a_plan_file_keeps_it_and_emit_writes_it(tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--framework", "unsloth",
                                  "--seq", "8192", "--tiled-mlp", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["setup"]["tiled_mlp"] is True
    from vramplan.plans.planfile import load_plan

    assert load_plan(out).setup.tiled_mlp
    emitted = tmp_path / "emitted"
    r = CliRunner().invoke(main, ["emit", str(out), "--format", "unsloth", "--out", str(emitted)])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load((emitted / "unsloth.yaml").read_text())["unsloth_tiled_mlp"] is True


def test_plan_from_keeps_a_files_tiled_mlp():
    """No reader reads an Unsloth script (its config is written, never read): a read setup with
    tiled_mlp (as a reader would map it) keeps it among the plan's fixed knobs, like compile."""
    tiled = UNSLOTH.replace(tiled_mlp=True)
    assert kept_knobs(tiled)["tiled_mlp"] is True
    assert "tiled_mlp" not in kept_knobs(UNSLOTH)  # a file without it may get it as a saver
    read = ReadConfig(path="unsloth.yaml", format="hf", model="llama-3.1-8b", setup=tiled)
    src = plan_inputs(read)
    assert src.fixed["tiled_mlp"] is True and src.fixed["framework"] == "unsloth"
    p = plan(src.model, "rtx-4090", seq=src.seq, **src.fixed)
    assert p.setup.tiled_mlp and p.setup.framework == "unsloth"
