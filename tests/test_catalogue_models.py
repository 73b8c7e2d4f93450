"""The catalogue's models (issue 29): every shipped config estimates offline, torch-free; the model
types added to the torch-free builder (smollm3, granite, glm, glm4, phi, olmo; then Falcon, Gemma 3's image-text
model, GPT-BigCode, OPT, gpt-oss, DeepSeek-V3, OLMoE, Granite MoE, Phi-3.5-MoE, Command R7B, GLM-4.5, ERNIE 4.5,
Nemotron, Helium, GPT-Neo, InternLM3) count exactly what transformers builds on the meta device and estimate
within the accuracy bar of the fake-tensor trace; the remote-code families (InternLM2, Baichuan 2, MiniCPM) count
what the Llama model of their shapes counts."""

from __future__ import annotations

import importlib.resources as resources
import json

import pytest
from click.testing import CliRunner

from vramplan import load_model
from vramplan.cli import main
from vramplan.model.architecture import FAMILIES, with_layers
from vramplan.model.modelspec import truncate_config
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
    # the catalogue's second growth (issue 29: >= 250 models)
    "falcon": "tiiuae/falcon-40b",
    "gemma3": "google/gemma-3-4b-pt",
    "gpt_bigcode": "bigcode/starcoder",
    "opt": "facebook/opt-350m",
    "gpt_oss": "openai/gpt-oss-20b",
    "deepseek_v3": "moonshotai/Moonlight-16B-A3B",
    "olmoe": "allenai/OLMoE-1B-7B-0924",
    "granitemoe": "ibm-granite/granite-3.0-1b-a400m-base",
    "phimoe": "microsoft/Phi-3.5-MoE-instruct",
    "cohere2": "CohereForAI/c4ai-command-r7b-12-2024",
    "glm4_moe": "zai-org/GLM-4.5-Air",
    "ernie4_5_moe": "baidu/ERNIE-4.5-21B-A3B-PT",
    "ernie4_5": "baidu/ERNIE-4.5-0.3B-PT",
    "nemotron": "nvidia/Minitron-4B-Base",
    "helium": "kyutai/helium-1-preview-2b",
    "gpt_neo": "EleutherAI/gpt-neo-125m",
    "internlm3": "internlm/internlm3-8b-instruct",
}
#: families whose modeling code the Hub repositories ship (trust_remote_code): no transformers class to count
#: against, so their counts are held against the Llama model of the same shapes
REMOTE_TYPES = {
    "internlm2": "internlm/internlm2-chat-7b",
    "baichuan": "baichuan-inc/Baichuan2-7B-Chat",
    "minicpm": "openbmb/MiniCPM-2B-sft-bf16",
}


def test_the_catalogue_holds_the_models_frameworks_name():
    assert len(SHIPPED) >= 250
    assert set(NEW_TYPES) | set(REMOTE_TYPES) <= set(FAMILIES)
    for model_type, hf_id in {**NEW_TYPES, **REMOTE_TYPES}.items():
        assert load_model(hf_id).model_type == model_type


@pytest.mark.parametrize("model_type", sorted({*NEW_TYPES, *REMOTE_TYPES}))
def test_new_types_count_what_their_publisher_states(model_type):
    """The fast tier's sample of tests/test_catalogue.py's check, for every config of the new model types."""
    from test_catalogue import _check_count

    for hf_id in SHIPPED:
        if load_model(hf_id).model_type == model_type:
            _check_count(hf_id)


@pytest.mark.parametrize("hf_id", SHIPPED)
def test_every_shipped_model_estimates_qlora_on_a_4090_offline(hf_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # (all-linear LoRA wraps Phi-3.5-MoE's tuple-returning router and fails in peft: refused, the attention targeted)
    targets = ["--lora-targets", "q_proj,k_proj,v_proj,o_proj"] if "Phi-3.5-MoE" in hf_id else []
    result = CliRunner().invoke(main, ["estimate", hf_id, "--gpu", "rtx-4090", "--method", "qlora", "--json", *targets])
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
    ("google/gemma-3-4b-it", "google/gemma-3-4b-pt"),  # Unsloth's and TRL's Gemma 3 notebooks
    ("google/gemma-3-27b-it", "google/gemma-3-27b-pt"),
    ("tiiuae/falcon-7b-instruct", "tiiuae/falcon-7b"),  # the 2023 QLoRA notebooks
    ("internlm/internlm2_5-7b-chat-1m", "internlm/internlm2_5-7b-chat"),
    ("baichuan-inc/Baichuan2-7B-Base", "baichuan-inc/Baichuan2-7B-Chat"),
    ("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-V3"),
    ("bigcode/starcoderbase", "bigcode/starcoder"),
    ("ibm-granite/granite-3.1-3b-a800m-instruct", "ibm-granite/granite-3.0-3b-a800m-base"),
    ("zai-org/GLM-4.6", "zai-org/GLM-4.5"),
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
    assert resolve("unsloth/gpt-oss-20b")[1] == "openai/gpt-oss-20b"  # the Unsloth notebooks' model
    assert resolve("unsloth/gemma-3-4b-it-bnb-4bit")[1] == "google/gemma-3-4b-pt"
    assert resolve("unsloth/gemma-3-12b-it-unsloth-bnb-4bit")[1] == "google/gemma-3-12b-pt"


@pytest.mark.parametrize("name, words", [
    ("openai/gpt-oss-20b", ("MXFP4", "dequantized to bf16", "eager")),
    ("google/gemma-3-4b-it", ("vision tower", "417M")),
    ("internlm/internlm2-chat-7b", ("remote code", "eager")),
    ("baichuan-inc/Baichuan2-7B-Base", ("NormHead", "not in this estimate")),
    ("tiiuae/falcon-7b", ("math kernel", "upper bound")),
    ("deepseek-ai/DeepSeek-V3", ("FP8",)),
])
def test_what_an_estimate_leaves_out_is_said(name, words, monkeypatch):
    """A shipped model whose estimate assumes or leaves something out says so: one warning line on stderr from
    estimate and plan (catalogue.json ``warning``), and the field in ``models --json``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(main, ["estimate", name, "--gpu", "h100-sxm", "--method", "lora", "--json"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert any(all(w in line for w in words) for line in warnings), result.stderr
    assert json.loads(result.stdout)["params_total"] == load_model(name).params_total
    hf_id = resolve(name)[1]
    row = next(r for r in json.loads(CliRunner().invoke(main, ["models", "--json"]).stdout) if r["hf_id"] == hf_id)
    assert all(w in row["warning"] for w in words)
    plain = CliRunner().invoke(main, ["estimate", "Qwen/Qwen3-8B", "--gpu", "h100-sxm", "--method", "lora", "--json"])
    assert "warning:" not in plain.stderr


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "falcon", "alibi": True, "hidden_size": 1024, "num_attention_heads": 16,
      "num_hidden_layers": 2, "vocab_size": 1000}, "alibi"),
    ({"model_type": "baichuan", "hidden_size": 5120, "num_attention_heads": 40, "num_hidden_layers": 40,
      "intermediate_size": 13696, "vocab_size": 125696}, "ALiBi"),
])
def test_families_whose_attention_is_not_modelled_are_refused(cfg, words):
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.specs import SpecError

    with pytest.raises(SpecError, match=words):
        model_spec_from_config(cfg)


def test_gemma3_counts_its_vision_tower_apart_from_the_text_model():
    """Gemma 3 4B = the report's 417M vision encoder + 675M embedding + 3,209M other; the text model's Linears
    are under model.language_model (peft's names), the vision tower's are role ``vision`` (no activations)."""
    spec = load_model("google/gemma-3-4b-it")
    vision = sum(l.params for l in spec.linears if l.role == "vision") + dict(spec.other_params)["vision_tower"]
    assert 416e6 < vision - 2560 * 1152 - 1152 < 418e6  # less the projector
    assert abs(dict(spec.other_params)["embed_tokens"] - 671e6) < 1e6  # 262,208 x 2560
    assert {l.path.split(".*.")[0] for l in spec.linears if l.role in ("attn", "mlp")} == {
        "model.language_model.layers"}
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (34, 8, 4, 256)  # class defaults
    assert spec.traits.sliding_layers == 29 and spec.traits.sliding_window == 1024
    with_vision = CliRunner().invoke(main, ["estimate", "google/gemma-3-4b-it", "--gpu", "h100", "--method", "lora",
                                            "--json"])
    text_only = CliRunner().invoke(main, ["estimate", "google/gemma-3-1b-it", "--gpu", "h100", "--method", "lora",
                                          "--json"])
    assert json.loads(with_vision.stdout)["params_trainable"] > json.loads(text_only.stdout)["params_trainable"]


def test_the_new_families_traits():
    """What each new family's modeling code does that the activation recipes read."""
    falcon7, falcon40 = load_model("tiiuae/falcon-7b"), load_model("tiiuae/falcon-40b")
    assert (falcon7.traits.shared_norm, falcon7.traits.norms_per_layer, falcon7.num_kv_heads) == (True, 1, 1)
    assert falcon7.default_attn == "eager" and falcon40.default_attn == "sdpa"  # math kernel vs flash
    assert (falcon40.traits.shared_norm, falcon40.traits.norms_per_layer, falcon40.num_kv_heads) == (False, 2, 8)
    assert falcon7.traits.fused_qkv and load_model("internlm/internlm2-chat-7b").traits.fused_qkv
    opt = load_model("facebook/opt-125m")
    assert not opt.traits.rope and opt.traits.dropout_masks_per_layer == 2 and opt.activation == "relu"
    assert not load_model("bigcode/starcoder").traits.rope and load_model("bigcode/starcoder").num_kv_heads == 1
    olmoe, glm = load_model("allenai/OLMoE-1B-7B-0924"), load_model("zai-org/GLM-4.5-Air")
    assert olmoe.family == glm.family == "qwen3_moe"  # peft adapts their fused experts as Qwen3-MoE's
    assert olmoe.traits.qk_norm_rows == 2 and glm.traits.qk_norm_rows == 0 and glm.traits.rope_dim == 64
    assert load_model("zai-org/GLM-4.5").traits.qk_norm_rows == 96 + 8
    assert load_model("deepseek-ai/DeepSeek-V3").traits.mla is not None
    oss = load_model("openai/gpt-oss-20b")
    assert oss.default_attn == "eager" and oss.moe.num_experts == 32 and oss.traits.sliding_layers == 12
    assert load_model("CohereForAI/c4ai-command-r7b-12-2024").traits.sliding_layers == 24
    assert load_model("EleutherAI/gpt-neo-125m").default_attn == "eager"


def test_new_model_types_estimate_without_torch():
    from test_catalogue import assert_estimates_without_torch

    names = {*NEW_TYPES.values(), *REMOTE_TYPES.values()}
    tuple_router = {NEW_TYPES["phimoe"]}  # all-linear LoRA on its router is refused: the attention targeted
    assert_estimates_without_torch(sorted(names - tuple_router), "--gpu", "rtx-4090", "--method", "qlora")
    assert_estimates_without_torch(sorted(tuple_router), "--gpu", "rtx-4090", "--method", "qlora",
                                   "--lora-targets", "q_proj,k_proj,v_proj,o_proj")


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


@pytest.mark.slow
@pytest.mark.parametrize("hf_id", [h for h in SHIPPED if load_model(h).model_type in REMOTE_TYPES])
def test_remote_code_counts_equal_the_llama_of_their_shapes(hf_id):
    """InternLM2's wqkv/wo/w1-3/output, Baichuan 2's W_pack and NormHead, MiniCPM's Llama layout: the same
    tensors as transformers' Llama of those shapes (InternLM2's ``bias`` on wqkv and wo as Llama's attention_bias)."""
    spec = load_model(hf_id)
    cfg = {k: v for k, v in spec.config.items() if k not in ("auto_map", "architectures")}
    if cfg["model_type"] == "internlm2":
        cfg["attention_bias"] = cfg.pop("bias", True)
    cfg["model_type"] = "llama"
    assert spec.params_total == _meta_count(cfg)[0]


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
    cfg = truncate_config(spec.config, 2)
    if model_type not in _VARIANT_KEYS:
        return
    cfg = {"smollm3": dict(cfg, tie_word_embeddings=False, num_key_value_heads=2, no_rope_layers=[1, 0],
                           layer_types=["full_attention"] * 2),
           "granite": dict(cfg, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
           "glm": dict(cfg, attention_bias=False, tie_word_embeddings=True, head_dim=64),
           "glm4": dict(cfg, attention_bias=False, num_key_value_heads=8),
           "phi": dict(cfg, qk_layernorm=True, tie_word_embeddings=True, num_key_value_heads=8),
           "olmo": dict(cfg, tie_word_embeddings=False, num_key_value_heads=4),
           "falcon": dict(cfg, new_decoder_architecture=False, multi_query=True, bias=True, parallel_attn=False),
           "opt": dict(cfg, do_layer_norm_before=True, word_embed_proj_dim=768, enable_bias=False),
           "gpt_bigcode": dict(cfg, multi_query=False, tie_word_embeddings=False),
           "phimoe": dict(cfg, lm_head_bias=False, attention_bias=False),
           "glm4_moe": dict(cfg, use_qk_norm=True, attention_bias=False, first_k_dense_replace=0),
           "ernie4_5": dict(cfg, use_bias=True, tie_word_embeddings=False)}[model_type]
    from vramplan.model.architecture import model_spec_from_config

    assert model_spec_from_config(cfg).params_total == _meta_count(cfg)[0]


_VARIANT_KEYS = ("smollm3", "granite", "glm", "glm4", "phi", "olmo", "falcon", "opt", "gpt_bigcode", "phimoe",
                 "glm4_moe", "ernie4_5")


#: the trace bar's exceptions, each with its reason: (model_type) -> (setup changes, sequence cap, bounds)
_TRACE_CASES = {
    # GPT-Neo's learned positions stop at 2048
    "gpt_neo": ({}, 2048, (-0.05, 0.05)),
    # peft's all-linear wraps PhimoeTopKRouter, an nn.Linear returning a tuple, and fails: attention targets
    "phimoe": ({"lora_targets": "q_proj,k_proj,v_proj,o_proj"}, None, (-0.05, 0.05)),
    # gpt-oss's eager softmax keeps one bf16 copy where the estimator's eager keeps fp32 and bf16 (the catalogue
    # warning): high at long sequences, never low; exact at short ones (test below)
    "gpt_oss": ({}, None, (-0.05, 0.70)),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(NEW_TYPES))
@pytest.mark.parametrize("method, ckpt, b, s", [("full", False, 4, 4096), ("full", True, 4, 4096),
                                                ("lora", False, 4, 4096), ("lora", True, 1, 512)])
def test_new_types_estimate_within_5_percent_of_trace(model_type, method, ckpt, b, s):
    """tests/test_accuracy.py's bar for the shipped families, on a 4-layer copy of each new type's model
    (InternLM3's dynamic RoPE reads position values, which fake tensors do not have: traced without it)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from vramplan.estimator import estimate
    from vramplan.model.architecture import model_spec_from_config
    from vramplan.run.tracer import trace
    from vramplan.specs import Setup

    knobs, cap, (low, high) = _TRACE_CASES.get(model_type, ({}, None, (-0.05, 0.05)))
    spec = load_model(NEW_TYPES[model_type])
    if model_type == "internlm3":
        spec = model_spec_from_config({k: v for k, v in spec.config.items() if k != "rope_scaling"}, name=spec.name)
    spec = with_layers(spec, 4)
    setup = Setup(method=method, checkpointing=ckpt, batch=b, seq=min(s, cap or s), **knobs)
    est, traced = estimate(spec, setup).tensor_peak_bytes, trace(spec, setup).tensor_peak_bytes
    error = est / traced - 1
    assert low <= error <= high, (f"{model_type} {method} ckpt={ckpt} {b}x{s}: estimate {est:,} vs trace {traced:,} "
                                  f"({error:+.2%})")


@pytest.mark.slow
@pytest.mark.parametrize("method, b, s", [("full", 8, 256), ("lora", 8, 256)])
def test_gpt_oss_experts_sinks_and_clamped_swiglu_within_1_percent_at_short_sequences(method, b, s):
    """Where the s x s scores are small, gpt-oss's estimate (biased router and experts, sinks, the clamped
    SwiGLU through the MoE recipe) holds to 1 % of the trace."""
    pytest.importorskip("torch")
    from vramplan.estimator import estimate
    from vramplan.run.tracer import trace
    from vramplan.specs import Setup

    spec, setup = with_layers(load_model("openai/gpt-oss-20b"), 4), Setup(method=method, batch=b, seq=s)
    assert abs(estimate(spec, setup).tensor_peak_bytes / trace(spec, setup).tensor_peak_bytes - 1) <= 0.01


@pytest.mark.slow
def test_olmo_with_clip_qkv_keeps_the_meta_fallback():
    """OLMo-7B-0424's clamp_ on q/k/v has no recipe here: such a config is built on the meta device, as before."""
    pytest.importorskip("torch")
    from vramplan.model.architecture import model_spec_from_config

    cfg = dict(load_model("allenai/OLMo-1B-hf").config, clip_qkv=8.0, num_hidden_layers=2)
    assert model_spec_from_config(cfg).params_total == _meta_count(cfg)[0]


@pytest.mark.slow
@pytest.mark.parametrize("seq", [2048, 4096])
def test_gpt_oss_eager_attention_keeps_one_bf16_softmax(seq):
    """gpt-oss softmaxes its scores and sink column in bf16 (modeling_gpt_oss.py eager_attention_forward):
    the estimate was +15 % (2k) and +37 % (4k) above the trace while it costed other families' fp32 softmax."""
    from vramplan import Setup, estimate
    from vramplan.run.tracer import trace

    model = with_layers(load_model("openai/gpt-oss-20b"), 2)
    setup = Setup(method="lora", seq=seq)
    t, e = trace(model, setup), estimate(model, setup)
    assert e.tensor_peak_bytes == pytest.approx(t.tensor_peak_bytes, rel=0.01)
