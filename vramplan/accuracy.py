"""Estimate-vs-trace comparison shared by tests/test_accuracy.py and benchmarks/accuracy.py."""

from __future__ import annotations

from dataclasses import dataclass

from .specs import Setup

#: Families whose analytic recipe matches the tracer within 5 % for full and LoRA, with and
#: without checkpointing (see benchmarks/accuracy.py for the table).
VERIFIED_FAMILIES = {
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
}

#: Known gaps, with the reason; the accuracy test marks them xfail(strict) so a fix shows up.
KNOWN_GAPS = {
    ("gpt2", False): "GPT-2/StarCoder2/GPT-J attention without checkpointing keeps s^2 terms the recipe lacks",
    ("starcoder2", False): "GPT-2/StarCoder2/GPT-J attention without checkpointing keeps s^2 terms the recipe lacks",
    ("gptj", False): "GPT-J attention keeps fp32 scores the recipe lacks",
    ("moe-lora", None): "peft on transformers 5 MoE experts adapts the 3-D expert weights; not modelled yet",
}
GAP_FAMILIES = {
    "gpt2": "openai-community/gpt2",
    "starcoder2": "bigcode/starcoder2-3b",
    "gptj": "EleutherAI/gpt-j-6b",
    "mixtral": "mistralai/Mixtral-8x7B-v0.1",
    "qwen2_moe": "Qwen/Qwen1.5-MoE-A2.7B",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B",
    "deepseek_v2": "deepseek-ai/DeepSeek-V2-Lite",
}


@dataclass(frozen=True)
class Row:
    model: str
    family: str
    setup: Setup
    traced_bytes: int
    estimated_bytes: int
    traced_phase: str
    estimated_phase: str

    @property
    def error(self) -> float:
        return self.estimated_bytes / self.traced_bytes - 1


def compare(model_name: str, setup: Setup, layers: int | None = 4) -> Row:
    """Trace ``setup`` on the model (truncated to ``layers`` layers, traced at full depth) and
    estimate it; None layers traces the whole model with per-layer extrapolation."""
    from .estimator import estimate
    from .profiles import load_model
    from .tracer import trace

    model = load_model(model_name)
    if layers is not None:
        model = model.with_layers(layers)
    t = trace(model, setup)
    e = estimate(model, setup)
    return Row(model_name, model.family, setup, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase)


#: Individual cases still outside 5 % on 4-layer truncations (family, method, checkpointing,
#: batch x seq): the next slice of work; listed so the test names each one instead of hiding it.
OPEN_CASES = {
    ("mistral", "lora", True, (4, 4096)): "LoRA + checkpointing backward transient over-estimated at 4 layers",
    ("gemma2", "full", False, (1, 512)): "Gemma2 tied 256k embedding: backward end spike at 4 layers",
    ("gemma2", "full", True, (1, 512)): "Gemma2 tied 256k embedding: backward end spike at 4 layers",
    ("gemma3_text", "full", True, (1, 512)): "Gemma3 tied 262k embedding: backward end spike at 4 layers",
    ("gpt_neox", "full", False, (4, 4096)): "GPT-NeoX parallel residual: layer backward transient",
    ("cohere", "full", False, (4, 4096)): "Cohere parallel block: layer backward transient",
    ("gpt2", "full", True, (4, 4096)): "GPT-2 recompute of an eager-like attention layer",
    ("gpt2", "lora", True, (4, 4096)): "GPT-2 recompute of an eager-like attention layer",
    ("starcoder2", "full", True, (4, 4096)): "StarCoder2 recompute of an eager-like attention layer",
    ("starcoder2", "lora", True, (4, 4096)): "StarCoder2 recompute of an eager-like attention layer",
    ("mixtral", "full", False, (4, 4096)): "MoE grouped_mm backward transients",
    ("deepseek_v2", "full", False, (4, 4096)): "MLA + MoE backward transients",
}


def known_gap(family: str, setup: Setup) -> str | None:
    case = (family, setup.method, setup.checkpointing, (setup.batch, setup.seq))
    if case in OPEN_CASES:
        return OPEN_CASES[case]
    if family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2") and setup.adapters:
        return KNOWN_GAPS[("moe-lora", None)]
    return KNOWN_GAPS.get((family, setup.checkpointing))
