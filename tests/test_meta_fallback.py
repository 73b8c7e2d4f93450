"""The meta-device fallback for model types without a recipe: architectures vramplan cannot model
(encoder-decoder, pure state-space) are refused with one line before transformers is imported; the
ones it reads say nothing of transformers' own (transformers 5.24)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.run.meta import unsupported_reason

T5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "d_ff": 128,
      "num_layers": 2, "num_heads": 4, "vocab_size": 128, "is_encoder_decoder": True}
BART = {"model_type": "bart", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "vocab_size": 128}
MAMBA = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "vocab_size": 128, "state_size": 16}
# a type no list names, refused by its architecture: a Mamba class and no attention heads
CUSTOM_SSM = {"model_type": "my_ssm", "architectures": ["MyMambaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "vocab_size": 128}
# transformers validates the special token ids against the vocabulary and logs when they fall outside;
# OLMo's clip_qkv has no recipe in model/architecture.py, so this config takes the meta-device fallback
OLMO = {"model_type": "olmo", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 128, "intermediate_size": 128, "eos_token_id": 50279, "clip_qkv": 8.0}


def _config(tmp_path: Path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, fragment", [(T5, "encoder-decoder"), (BART, "encoder-decoder"),
                                              (MAMBA, "state-space"), (CUSTOM_SSM, "state-space")],
                         ids=["t5", "bart", "mamba", "custom-ssm"])
def test_unsupported_architectures_are_one_line(tmp_path, config, fragment):
    result = CliRunner().invoke(main, ["estimate", _config(tmp_path, config)])
    assert_user_error(result, fragment, repr(config["model_type"]))


def test_refusal_comes_before_transformers_is_imported(tmp_path):
    """No torch, no transformers: the refusal is read from config.json's keys alone."""
    code = ("import json, sys; from vramplan.model.architecture import model_spec_from_config\n"
            "from vramplan.specs import SpecError\nfor c in json.loads(sys.argv[1]):\n"
            "    try: model_spec_from_config(c)\n    except SpecError: pass\n    else: sys.exit('accepted')\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([T5, BART, MAMBA, CUSTOM_SSM])],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_hybrids_with_attention_are_left_to_transformers():
    jamba = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "num_attention_heads": 4,
             "mamba_d_state": 16}
    assert unsupported_reason(jamba) is None
    assert unsupported_reason({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}) is None


def test_fallback_prints_nothing_of_transformers(tmp_path):
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "vramplan", "estimate", _config(tmp_path, OLMO)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "params:" in out.stdout
    assert out.stderr == ""


def test_fallback_restores_transformers_verbosity():
    transformers = pytest.importorskip("transformers")
    from vramplan.model.architecture import model_spec_from_config

    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        spec = model_spec_from_config(OLMO)
        assert transformers.logging.get_verbosity() == transformers.logging.INFO
    finally:
        transformers.logging.set_verbosity(before)
    assert spec.family == "generic" and spec.num_layers == 2
