"""Estimate-vs-trace comparison shared by tests/test_accuracy.py and benchmarks/accuracy.py."""

from __future__ import annotations

from ..specs import Setup
from ..truths.row import Row  # noqa: F401  (re-exported: the rows validate and the tests compare)

#: One shipped model per family: the estimate-vs-trace matrix runs each of them.
FAMILY_MODELS = {
    "llama": "meta-llama/Llama-3.2-1B",
    "mistral": "mistralai/Mistral-7B-v0.3",
    "qwen2": "Qwen/Qwen2.5-7B",
    "qwen3": "Qwen/Qwen3-0.6B",
    "gemma": "google/gemma-2b",
    "gemma2": "google/gemma-2-2b",
    "gemma3_text": "google/gemma-3-1b-it",
    "phi3": "microsoft/Phi-4-mini-instruct",
    "olmo2": "allenai/OLMo-2-1124-7B",
    "stablelm": "stabilityai/stablelm-2-1_6b",
    "gpt_neox": "togethercomputer/RedPajama-INCITE-Base-3B-v1",
    "cohere": "CohereForAI/c4ai-command-r-v01",
    "gpt2": "openai-community/gpt2",
    "starcoder2": "bigcode/starcoder2-3b",
    "gptj": "EleutherAI/gpt-j-6b",
    "mixtral": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2_moe": "Qwen/Qwen1.5-MoE-A2.7B",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B",
    "deepseek_v2": "deepseek-ai/DeepSeek-V2-Lite",
}


def compare(model_name: str, setup: Setup, layers: int | None = 4) -> Row:
    """Trace ``setup`` on the model (truncated to ``layers`` layers, traced at full depth) and
    estimate it; None layers traces the whole model with per-layer extrapolation."""
    from ..estimator import estimate
    from ..model.architecture import with_layers
    from ..model.profiles import load_model
    from ..run.tracer import trace

    model = load_model(model_name)
    if layers is not None:
        model = with_layers(model, layers)
    t = trace(model, setup)
    e = estimate(model, setup)
    return Row(model_name, model.family, setup, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase)
