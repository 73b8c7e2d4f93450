"""The catalogue's models (issue 29): every shipped config estimates offline, torch-free; the model
types added to the torch-free builder (smollm3, granite, glm, glm4, phi, olmo) count exactly what transformers
builds on the meta device and estimate within the accuracy bar of the fake-tensor trace."""

from __future__ import annotations

import importlib.resources as resources
import json

import pytest
from click.testing import CliRunner

from vramplan import load_model
from vramplan.cli import main
from vramplan.model.architecture import FAMILIES, with_layers
from vramplan.model.profiles import resolve

DATA = resources.files("vramplan.profile_data")
SHIPPED = sorted((p.name[: -len(".json")].replace("--", "/", 1) for p in (DATA / "models").iterdir()
                  if p.name.endswith(".json")), key=str.lower)

#: one shipped config per model type the builder learned with the catalogue's growth
NEW_TYPES = {
    "smollm3": "HuggingFaceTB/SmolLM3-3B",
    "granite": "ibm-granite/granite-3.1-2b-base",
    "glm": "THUDM/glm-4-9b-chat-hf",
    "glm4": "THUDM/GLM-4-9B-0414",
    "phi": "microsoft/phi-2",
    "olmo": "allenai/OLMo-1B-hf",
}


def test_the_catalogue_holds_the_models_frameworks_name():
    assert len(SHIPPED) >= 170
    assert set(NEW_TYPES) <= set(FAMILIES)
    for model_type, hf_id in NEW_TYPES.items():
        assert load_model(hf_id).model_type == model_type


@pytest.mark.parametrize("model_type", sorted(NEW_TYPES))
def test_new_types_count_what_their_publisher_states(model_type):
    """The fast tier's sample of tests/test_catalogue.py's check, for every config of the new model types."""
    from test_catalogue import _check_count

    for hf_id in SHIPPED:
        if load_model(hf_id).model_type == model_type:
            _check_count(hf_id)


@pytest.mark.parametrize("hf_id", SHIPPED)
def test_every_shipped_model_estimates_qlora_on_a_4090_offline(hf_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["estimate", hf_id, "--gpu", "rtx-4090", "--method", "qlora", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["model"] == hf_id
    assert out["params_total"] == load_model(hf_id).params_total
    assert 0 < out["params_trainable"] < out["params_total"] and out["tensor_peak_bytes"] > 0


@pytest.mark.parametrize("name, config", [
    ("HuggingFaceTB/SmolLM3-3B-Base", "HuggingFaceTB/SmolLM3-3B"),  # TRL's and the SmolLM3
    ("tiiuae/Falcon3-7B-Instruct", "tiiuae/Falcon3-7B-Base"),
    ("ibm-granite/granite-3.3-8b-instruct", "ibm-granite/granite-3.1-8b-base"),
    ("THUDM/GLM-Z1-9B-0414", "THUDM/GLM-4-9B-0414"),
    ("microsoft/Phi-4-reasoning", "microsoft/phi-4"),
    ("Qwen/Qwen2.5-Math-7B-Instruct", "Qwen/Qwen2.5-Math-7B"),
    ("EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-1b"),
    ("deepseek-ai/DeepSeek-R1-0528-Qwen3-8B", "Qwen/Qwen3-8B"),
])
def test_new_variants_read_their_config(name, config, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shown, hf_id, note = resolve(name)
    assert (shown, hf_id, note) == (name, config, "")
    assert load_model(name).params_total == load_model(config).params_total


def test_reuploads_of_new_models_resolve_by_inference():
    shown, hf_id, note = resolve("unsloth/SmolLM3-3B-bnb-4bit")
    assert hf_id == "HuggingFaceTB/SmolLM3-3B" and "re-upload" in note
    assert resolve("unsloth/phi-2")[1] == "microsoft/phi-2"


def test_new_model_types_estimate_without_torch():
    from test_catalogue import assert_estimates_without_torch

    assert_estimates_without_torch(sorted(NEW_TYPES.values()), "--gpu", "rtx-4090", "--method", "qlora")


# ---------------------------------------------------------------------------------------------
# Against transformers (the run extra): exact parameter counts and the trace's accuracy bar


def _meta_count(config: dict):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dict(config)
    model_type = cfg.pop("model_type")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    shapes: dict[str, set] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = (mod.in_features, mod.out_features, mod.bias is not None)
            shapes.setdefault(name.rsplit(".", 1)[-1], set()).add(key)
    return sum(p.numel() for p in model.parameters()), shapes


_INDEXED = set(json.loads((DATA / "aliases.json").read_text())["aliases"])
_META_IDS = sorted({h for h in SHIPPED if load_model(h).model_type in NEW_TYPES} | (set(SHIPPED) - _INDEXED),
                   key=str.lower)


@pytest.mark.slow
@pytest.mark.parametrize("hf_id", _META_IDS)
def test_shipped_count_equals_the_meta_model(hf_id):
    """Every config of a new model type, and every config aliases.json does not index (test_architecture
    covers those), against transformers' own model built on the meta device."""
    spec = load_model(hf_id)
    total, shapes = _meta_count(spec.config)
    assert spec.params_total == total
    for lin in spec.linears:
        if lin.path.startswith("transformer.h") and lin.name.startswith("c_"):
            continue  # GPT-2's Conv1D modules are not nn.Linear
        assert (lin.in_features, lin.out_features, lin.bias) in shapes.get(lin.name, set()), lin


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NEW_TYPES))
@pytest.mark.parametrize("layers", [1, 3])
def test_new_types_truncated_and_variant_shapes_are_exact(model_type, layers):
    spec = load_model(NEW_TYPES[model_type])
    cut = with_layers(spec, layers)
    assert cut.params_total == _meta_count(cut.config)[0]
    # the config keys each builder reads: biases, tying, q/k norms, GQA widths
    cfg = dict(spec.config, num_hidden_layers=2)
    cfg = {"smollm3": dict(cfg, tie_word_embeddings=False, num_key_value_heads=2, no_rope_layers=[1, 0],
                           layer_types=["full_attention"] * 2),
           "granite": dict(cfg, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
           "glm": dict(cfg, attention_bias=False, tie_word_embeddings=True, head_dim=64),
           "glm4": dict(cfg, attention_bias=False, num_key_value_heads=8),
           "phi": dict(cfg, qk_layernorm=True, tie_word_embeddings=True, num_key_value_heads=8),
           "olmo": dict(cfg, tie_word_embeddings=False, num_key_value_heads=4)}[model_type]
    from vramplan.model.architecture import model_spec_from_config

    assert model_spec_from_config(cfg).params_total == _meta_count(cfg)[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NEW_TYPES))
@pytest.mark.parametrize("method, ckpt, b, s", [("full", False, 4, 4096), ("full", True, 4, 4096),
                                                ("lora", False, 4, 4096), ("lora", True, 1, 512)])
def test_new_types_estimate_within_5_percent_of_trace(model_type, method, ckpt, b, s):
    """tests/test_accuracy.py's bar for the shipped families, on a 4-layer copy of each new type's model."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from vramplan.specs import Setup
    from vramplan.validate.accuracy import compare

    row = compare(NEW_TYPES[model_type], Setup(method=method, checkpointing=ckpt, batch=b, seq=s), layers=4)
    assert abs(row.error) <= 0.05, (f"{model_type} {method} ckpt={ckpt} {b}x{s}: estimate {row.estimated_bytes:,} "
                                    f"vs trace {row.traced_bytes:,} ({row.error:+.2%})")


@pytest.mark.slow
def test_olmo_with_clip_qkv_keeps_the_meta_fallback():
    """OLMo-7B-0424's clamp_ on q/k/v has no recipe here: such a config is built on the meta device, as before."""
    pytest.importorskip("torch")
    from vramplan.model.architecture import model_spec_from_config

    cfg = dict(load_model("allenai/OLMo-1B-hf").config, clip_qkv=8.0, num_hidden_layers=2)
    assert model_spec_from_config(cfg).params_total == _meta_count(cfg)[0]
