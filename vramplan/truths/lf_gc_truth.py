"""The truth of ``unsloth_gc`` (LLaMA-Factory's ``use_unsloth_gc``, estimator/unsloth.py ``llamafactory_gc``):
LLaMA-Factory's own ``prepare_model_for_training`` (the file from its wheel, vramplan/run/llamafactory_gc.py)
turns checkpointing on in a narrow model's LoRA step, one forward and backward on this CPU counted by a
``SplitCounter`` (the layer inputs' host copies apart), against the estimate of the same step: the device's peak
and the host's."""

from __future__ import annotations

from ..specs import Setup

__all__ = ["CASES", "estimate_gc", "gc_rows", "run_step"]

#: (model, seq, batch): narrow (8 layers, hidden 256, vocab 512: the layer inputs a visible share) LoRA steps
CASES = (("llama-3.1-8b", 2048, 1), ("llama-3.1-8b", 4096, 2), ("qwen2.5-7b", 4096, 2), ("qwen3-8b", 2048, 1))
SHRINK = {"layers": 8, "hidden": 256, "heads": 8, "vocab": 512}


def setup_of(seq: int, batch: int, gc: bool = True) -> Setup:
    return Setup(method="lora", precision="bf16", optimizer="adamw", checkpointing=True, seq=seq, batch=batch,
                 framework="llamafactory", unsloth_gc=gc)


def narrow(name: str) -> dict:
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model

    return shrink_config(load_model(name).config, **SHRINK)


def run_step(config: dict, setup: Setup, module) -> tuple[int, int]:
    """(device peak, host peak) in bytes of one forward and backward of ``setup`` on ``config``, checkpointing
    turned on by LLaMA-Factory's ``prepare_model_for_training`` (``module``: its checkpointing file), with
    ``use_unsloth_gc`` as ``setup.unsloth_gc`` says; no optimizer step (the same either way)."""
    import types

    import torch

    from ..run.live import SplitCounter
    from ..run.llamafactory_gc import bound_layer_calls, device_copies
    from .cpu_truth import build_model
    from .tiled_truth import counted_step

    torch.manual_seed(0)
    model = build_model(config, setup.replace(checkpointing=False, unsloth_gc=False, framework="hf"))
    args = types.SimpleNamespace(upcast_layernorm=False, use_reentrant_gc=True, disable_gradient_checkpointing=False,
                                 use_unsloth_gc=setup.unsloth_gc, upcast_lmhead_output=False)
    module.prepare_model_for_training(model.get_base_model(), args)  # (LLaMA-Factory patches the base model)
    assert bound_layer_calls(model) >= int(config["num_hidden_layers"])  # transformers 5.24's call form
    counter = counted_step(model, config, setup, SplitCounter(), device_copies)
    return counter.device_peak, counter.host_peak


def estimate_gc(spec, setup: Setup) -> tuple[int, int]:
    """The estimate's (device peak of the forward and backward, host bytes) of ``setup``."""
    from ..estimator import estimate

    bd = estimate(spec, setup)
    return max(bd.phase_peaks_bytes["forward"], bd.phase_peaks_bytes["backward"]), bd.host_bytes


def gc_rows(quick: bool, row_type) -> list:
    """``validate --knob unsloth_gc``'s rows: each case's device peak (its host copies: tests/test_unsloth_gc.py);
    one unverified row without the LLaMA-Factory wheel."""
    from ..model.architecture import model_spec_from_config
    from ..run import llamafactory_gc

    cases = CASES[:1] if quick else CASES
    if llamafactory_gc.find_wheel() is None:
        return [row_type("-", "-", setup_of(*cases[0][1:]), 0, 0, "-", "-", truth="none", knob="unsloth_gc",
                         verified=False, why=f"no LLaMA-Factory wheel: set {llamafactory_gc.ENV} to its "
                                             f"{llamafactory_gc.VERSION} wheel (.ci/run downloads it)")]
    module = llamafactory_gc.load()
    rows = []
    for name, seq, batch in cases:
        cfg, s = narrow(name), setup_of(seq, batch)
        spec = model_spec_from_config(cfg, name=f"{name}[narrow]", source="lf-gc-truth")
        (device, _host), (est_device, _est_host) = run_step(cfg, s, module), estimate_gc(spec, s)
        rows.append(row_type(name, spec.family, s, device, est_device, "backward", "backward",
                             truth="llamafactory-gc-cpu", knob="unsloth_gc"))
    return rows
