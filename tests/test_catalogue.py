"""Models users name resolve offline (issue 29): a Hub id whose config.json ships in the package
resolves to it without the Hub, whether or not aliases.json indexes it."""

from __future__ import annotations

import json

from click.testing import CliRunner

from vramplan import load_model
from vramplan.cli import main
from vramplan.model.profiles import shipped_models


def test_a_shipped_but_unindexed_config_resolves_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the Hub: the package's own file
    assert "mistralai/Mistral-7B-v0.1" not in shipped_models()  # only a published record loaded it before
    load_model.cache_clear()
    for name in ("mistralai/Mistral-7B-v0.1", "MISTRALAI/mistral-7b-v0.1"):
        spec = load_model(name)
        assert spec.name == "mistralai/Mistral-7B-v0.1" and spec.source == "profile:mistralai/Mistral-7B-v0.1"
        assert spec.params_total == 7_241_732_096  # the HF config's count (calibration/published/README.md)
    result = CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "rtx-4090", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "mistralai/Mistral-7B-v0.1"
