"""transformers 5 deprecates ``gradient_checkpointing_enable`` (gone in v6): every torch path enables
checkpointing through ``activation_checkpointing_enable``, with ``use_reentrant=False`` and input grads
under adapters, and says nothing on the way (transformers 5.24, peft 0.21)."""

import warnings

import pytest

from vramplan.model.architecture import with_layers
from vramplan.model.profiles import load_model
from vramplan.specs import Setup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)
            and "checkpointing" in str(w.message)]


def _tiny_llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_adapt_for_training_checkpoints_without_deprecation(method):
    from vramplan.run.models import adapt_for_training

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = adapt_for_training(_tiny_llama(), Setup(method=method, checkpointing=True))
    assert _deprecations(caught) == []
    base = model.get_base_model() if method == "lora" else model
    assert base.is_activation_checkpointing and model.training
    layers = [m for m in base.model.layers if m.gradient_checkpointing]
    assert len(layers) == 2
    assert layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)  # under LoRA: through the input-grad hook


def test_trace_with_checkpointing_warns_nothing():
    from vramplan.run.tracer import trace

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(with_layers(load_model("gpt2"), 2), Setup(method="lora", checkpointing=True, seq=32))
    assert _deprecations(caught) == []
