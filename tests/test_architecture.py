"""ModelSpec from config.json: exact parameter counts against transformers on the meta device."""

import json

import pytest

from vramplan.model.architecture import FAMILIES, model_spec_from_config, with_layers
from vramplan.model.profiles import load_model, shipped_models
from vramplan.specs import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REQUIRED_FAMILIES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi3", "olmo2", "cohere", "starcoder2", "stablelm", "gpt_neox", "gpt2", "gptj",
    "deepseek_v2",
}


def meta_model(config: dict, **overrides):
    cfg = dict(config, **overrides)
    mt = cfg.pop("model_type")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoConfig.for_model(mt, **cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)


def test_every_required_family_has_a_recipe_and_a_profile():
    assert REQUIRED_FAMILIES <= set(FAMILIES)
    shipped_types = {load_model(hf).model_type for hf in shipped_models()}
    assert REQUIRED_FAMILIES <= shipped_types


#: families whose modeling code ships with the Hub repository (trust_remote_code): transformers has no class
#: to build, tests/test_catalogue_models.py counts them against the Llama of their shapes
REMOTE_CODE = ("internlm2", "baichuan", "minicpm")


@pytest.mark.parametrize("hf_id", sorted(h for h in shipped_models() if load_model(h).model_type not in REMOTE_CODE))
def test_parameter_count_is_exact(hf_id):
    spec = load_model(hf_id)
    model = meta_model(spec.config)
    assert spec.params_total == sum(p.numel() for p in model.parameters())
    # every Linear the estimator lists exists with that shape
    shapes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            shapes.setdefault(name.rsplit(".", 1)[-1], set()).add((mod.in_features, mod.out_features))
    for lin in spec.linears:
        if lin.path.startswith("transformer.h") and lin.name.startswith("c_"):
            continue  # GPT-2's Conv1D modules are not nn.Linear
        assert (lin.in_features, lin.out_features) in shapes.get(lin.name, set()), lin


@pytest.mark.parametrize("hf_id", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-30B-A3B", "google/gemma-2-2b",
                                   "EleutherAI/gpt-j-6b"])
@pytest.mark.parametrize("layers", [1, 3])
def test_truncated_copies_are_exact(hf_id, layers):
    spec = with_layers(load_model(hf_id), layers)
    assert spec.num_layers == layers
    assert spec.params_total == sum(p.numel() for p in meta_model(spec.config).parameters())


def test_head_dim_override_and_gqa():
    spec = load_model("google/gemma-2-9b")
    assert spec.head_dim == 256 and spec.q_dim == spec.num_heads * 256
    assert load_model("llama-3.1-8b").kv_dim == 8 * 128


def test_moe_spec():
    moe = load_model("mixtral-8x7b").moe
    assert (moe.num_experts, moe.top_k) == (8, 2)
    q = load_model("qwen1.5-moe").moe
    assert q.shared_expert_intermediate_size > 0


def test_unknown_model_type_falls_back_to_meta_structure():
    # a family without a recipe: transformers builds it on the meta device
    cfg = {"model_type": "biogpt", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "vocab_size": 1000}
    spec = model_spec_from_config(cfg, name="tiny-biogpt")
    assert spec.family == "generic"
    assert spec.params_total == sum(p.numel() for p in meta_model(cfg).parameters())


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({}, "no model_type"),
        ({"model_type": "llama", "hidden_size": 64}, "missing"),
        ({"model_type": "llama", "hidden_size": -1, "vocab_size": 10, "num_hidden_layers": 1,
          "num_attention_heads": 1}, "positive"),
        ({"model_type": "llama", "hidden_size": 64, "vocab_size": 10, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 3}, "multiple"),
        ({"model_type": "not-a-model"}, "not-a-model"),
    ],
)
def test_bad_configs_raise_spec_error(cfg, message):
    with pytest.raises(SpecError, match=message):
        model_spec_from_config(cfg)


def test_profile_config_files_are_verbatim_json():
    for hf_id in shipped_models():
        assert isinstance(load_model(hf_id).config, dict)
    assert json.dumps(load_model("gpt2").config)


def test_unknown_model_type_without_transformers_names_the_extra():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None\n"
        "from vramplan.model.architecture import model_spec_from_config\n"
        "from vramplan.specs import SpecError\n"
        "try:\n"
        "    model_spec_from_config({'model_type': 'biogpt', 'hidden_size': 64})\n"
        "except SpecError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "biogpt" in out.stdout and "pip install 'vramplan[run]'" in out.stdout
