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
    from vramplan.model import profiles

    indexed = profiles._aliases()  # aliases.json indexes it now: take it out to test the unindexed path
    monkeypatch.setattr(profiles, "_aliases", lambda: {k: v for k, v in indexed.items()
                                                       if v != "mistralai/Mistral-7B-v0.1"})
    assert "mistralai/Mistral-7B-v0.1" in shipped_models()
    load_model.cache_clear()
    for name in ("mistralai/Mistral-7B-v0.1", "MISTRALAI/mistral-7b-v0.1"):
        spec = load_model(name)
        assert spec.name == "mistralai/Mistral-7B-v0.1" and spec.source == "profile:mistralai/Mistral-7B-v0.1"
        assert spec.params_total == 7_241_732_096  # the HF config's count (calibration/published/README.md)
    result = CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "rtx-4090", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "mistralai/Mistral-7B-v0.1"


# ---------------------------------------------------------------------------------------------
# The catalogue (issue 29 parts 1 and 4): every shipped config has a source and a checked count.

import importlib.resources as resources  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

from vramplan.model.architecture import FAMILIES  # noqa: E402
from vramplan.model.profiles import catalogue, resolve  # noqa: E402

DATA = resources.files("vramplan.profile_data")
SHIPPED = sorted(p.name[: -len(".json")].replace("--", "/", 1) for p in (DATA / "models").iterdir()
                 if p.name.endswith(".json"))
#: one config per family in the fast tier; the rest in the slow tier
SAMPLE = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-235B-A22B", "deepseek-ai/DeepSeek-V2", "google/gemma-3-270m",
          "microsoft/phi-4", "mistralai/Mixtral-8x22B-v0.1", "Qwen/Qwen2-57B-A14B", "allenai/OLMo-2-0325-32B",
          "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "CohereForAI/aya-23-8B", "bigcode/starcoder2-7b"]


def _stated(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([MB])", text)
    assert m, f"stated_params {text!r} is not like 8B / 0.49B / 135M"
    return float(m.group(1)) * {"M": 1e6, "B": 1e9}[m.group(2)]


def _check_count(hf_id: str) -> None:
    entry = catalogue()["models"][hf_id]
    spec = load_model(hf_id)
    assert spec.model_type in FAMILIES, f"{hf_id}: {spec.model_type} needs torch (run/meta.py) to estimate"
    off = abs(spec.params_total - _stated(entry["stated_params"])) / _stated(entry["stated_params"])
    assert off <= 0.02 or entry.get("explain"), (
        f"{hf_id}: {spec.params_total:,} is {off:.1%} off the stated {entry['stated_params']} with no explanation")


def test_every_shipped_config_has_a_catalogue_entry_with_a_source():
    models = catalogue()["models"]
    assert set(models) == set(SHIPPED), "profiles/models and profiles/catalogue.json must list the same ids"
    assert len(SHIPPED) >= 100
    for hf_id, e in models.items():
        src = e["source"]
        assert src and ("repo" in src and "commit" in src and "path" in src or "url" in src or "path" in src), hf_id
        assert isinstance(e["verbatim"], bool) and e["family"] and e["stated_in"], hf_id
        if not e["verbatim"]:
            assert "url" in src or e.get("note"), f"{hf_id}: a rebuilt config says how"
        for v in e.get("variants", ()):
            assert v.lower() not in {s.lower() for s in SHIPPED}, f"{v} is shipped and a variant"


@pytest.mark.parametrize("hf_id", SAMPLE)
def test_sampled_counts_match_the_stated_ones(hf_id):
    _check_count(hf_id)


@pytest.mark.slow
@pytest.mark.parametrize("hf_id", [h for h in SHIPPED if h not in SAMPLE])
def test_every_count_matches_the_stated_one(hf_id):
    _check_count(hf_id)


def test_variants_and_reuploads_resolve_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    load_model.cache_clear()
    cases = {  # name -> (name reported, config read, by inference)
        "meta-llama/Meta-Llama-3-8B-Instruct":
            ("meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B", False),
        "Qwen/Qwen2.5-32B-Instruct": ("Qwen/Qwen2.5-32B-Instruct", "Qwen/Qwen2.5-32B", False),
        "qwen/qwen2-0.5b-instruct": ("Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2-0.5B", False),
        "Qwen/Qwen3-4B-Instruct-2507": ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Instruct-2507", False),
        "NousResearch/Meta-Llama-3-8B": ("NousResearch/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B", True),
        "unsloth/Meta-Llama-3.1-8B-Instruct": ("unsloth/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B", True),
        "unsloth/llama-3-8b-bnb-4bit": ("unsloth/llama-3-8b-bnb-4bit", "meta-llama/Meta-Llama-3-8B", True),
        "LLM-Research/Meta-Llama-3-8B-Instruct":
            ("LLM-Research/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B", True),
    }
    for name, (shown, config, inferred) in cases.items():
        spec = load_model(name)
        assert (spec.name, spec.source) == (shown, f"profile:{config}"), name
        assert spec.params_total == load_model(config).params_total
        assert bool(resolve(name)[2]) == inferred, name
    assert "bnb-4bit quantization read from the name" in resolve("unsloth/llama-3-8b-bnb-4bit")[2]  # test_prequantized
    assert resolve("unsloth/no-such-model") is None and resolve("someone/Meta-Llama-3-8B") is None
    result = CliRunner().invoke(main, ["estimate", "unsloth/Meta-Llama-3.1-8B-Instruct", "--method", "lora", "--json"])
    assert result.exit_code == 0, result.output


def test_models_search_family_and_json():
    runner = CliRunner()
    rows = json.loads(runner.invoke(main, ["models", "--search", "QWEN3", "--json"]).stdout)
    assert rows and all("qwen3" in " ".join([r["hf_id"], *r["aliases"], *r["variants"]]).lower() for r in rows)
    assert {"Qwen/Qwen3-8B", "Qwen/Qwen3-235B-A22B"} <= {r["hf_id"] for r in rows}
    rows = json.loads(runner.invoke(main, ["models", "--family", "gemma2", "--json"]).stdout)
    assert {r["hf_id"] for r in rows} == {"google/gemma-2-2b", "google/gemma-2-9b", "google/gemma-2-27b"}
    assert {r["hf_id"] for r in json.loads(runner.invoke(main, ["models", "--family", "Llama 3.1", "--json"]).stdout)} \
        == {"meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B"}
    everything = json.loads(runner.invoke(main, ["models", "--json"]).stdout)
    assert len(everything) == len(SHIPPED)
    for r in everything:
        assert set(r) >= {"hf_id", "aliases", "model_type", "family", "params_total", "source", "stated_params"}
        assert r["source"], r["hf_id"]
    text = runner.invoke(main, ["models", "--search", "no-such-model-anywhere"])
    assert text.exit_code == 0 and "no shipped model matches" in text.output


@pytest.mark.parametrize("name, suggestion", [
    ("llama-3.1-8bb", "llama-3.1-8b"),
    ("Qwen/Qwen3-4B-Instruct-2057", "Qwen/Qwen3-4B-Instruct-2507"),
    ("mistral-nemo-12", "mistral-nemo-12b"),
])
def test_a_misspelled_model_gets_did_you_mean(name, suggestion, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["estimate", name])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "did you mean" in lines[0], result.output
    assert suggestion in lines[0]


def assert_estimates_without_torch(names, *args: str, then: str = "") -> None:
    """In a fresh interpreter, ``estimate NAME ARGS`` for each of ``names`` (offline) succeeds and neither torch
    nor transformers gets imported; ``then``: more CLI code run in the same interpreter first."""
    code = f"""
        import sys
        from click.testing import CliRunner
        from vramplan.cli import main
        for name in {list(names)!r}:
            r = CliRunner().invoke(main, ["estimate", name, *{list(args)!r}])
            assert r.exit_code == 0, r.output
        {then}
        heavy = [m for m in ("torch", "transformers") if m in sys.modules]
        assert not heavy, heavy
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]


def test_estimating_catalogue_names_does_not_import_torch():
    assert_estimates_without_torch(("unsloth/llama-3-8b-bnb-4bit", "Qwen/Qwen3-235B-A22B", "google/gemma-3-270m-it"),
                                   "--method", "lora",
                                   then='r = CliRunner().invoke(main, ["models", "--json"]); '
                                        'assert r.exit_code == 0, r.output')
