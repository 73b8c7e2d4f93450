"""The truth of ``--tiled-mlp`` (estimator/tiled_mlp.py): Unsloth's own ``TiledMLP`` (vramplan/run/unsloth_tiled.py,
the file from the unsloth-zoo wheel) patched into transformers' layer of a narrow model, one real step on this CPU
counted live (vramplan/run/live.py), against the estimate of the same step.

The layer is transformers' (the HF recipe's LoRA step, :func:`vramplan.truths.cpu_truth.build_model`): the one
Unsloth's ``FastModel`` tiles; its fused-kernel layer needs a GPU. ``--tiled-mlp`` with ``--framework hf`` is
refused on the command line (no HF Trainer option runs it), so the estimate here is taken with that one refusal
lifted (:func:`estimate_tiled`): what it checks is the tiled layer's terms (estimator/step.py ``_layer_backward``,
estimator/activations.py), which the FastModel families use under ``--framework unsloth``."""

from __future__ import annotations

from ..specs import Setup

__all__ = ["CASES", "QUICK", "estimate_tiled", "run_step", "tiled_rows"]

#: (model, seq, batch, checkpointing): narrow (2 layers, hidden 256, vocab 512) Llama, Qwen2 and OLMo 2 steps
CASES = (("llama-3.1-8b", 2048, 1, True), ("llama-3.1-8b", 4096, 2, True), ("llama-3.1-8b", 2048, 1, False),
         ("qwen2.5-7b", 2048, 1, True), ("olmo-2-7b", 2048, 1, True), ("olmo-2-7b", 2048, 1, False))
QUICK = CASES[:1]
SHRINK = {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512}


def setup_of(seq: int, batch: int, checkpointing: bool, tiled: bool = True) -> Setup:
    return Setup(method="lora", precision="bf16", optimizer="adamw", checkpointing=checkpointing, seq=seq,
                 batch=batch, tiled_mlp=tiled)


def narrow(name: str) -> dict:
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model

    return shrink_config(load_model(name).config, **SHRINK)


def run_step(config: dict, setup: Setup, module=None) -> int:
    """The peak of live tensor bytes of one forward and backward of ``setup`` on ``config`` (``setup.tiled_mlp``:
    Unsloth's ``patch_tiled_mlp(model, "arctic")`` applied after the model is built); no optimizer step, whose
    peak (weights, gradients, states) is the same tiled or not and below the backward's here."""
    import torch

    from ..run import unsloth_tiled
    from ..run.cuda_paths import cuda_kernels
    from ..run.live import LiveTensorCounter
    from .cpu_truth import build_model

    torch.manual_seed(0)
    model = build_model(config, setup.replace(tiled_mlp=False))
    if setup.tiled_mlp:
        unsloth_tiled.patch(model, module)
    counter = LiveTensorCounter(device="cpu")
    counter.track(model)
    ids = torch.randint(0, int(config["vocab_size"]), (setup.batch, setup.seq),
                        generator=torch.Generator().manual_seed(1))
    counter.track([ids])
    with cuda_kernels(), counter:
        counter.phase("forward")
        loss = model(input_ids=ids, labels=ids).loss
        counter.phase("backward")
        loss.backward()
        del loss
        counter.phase(None)
    return counter.peak_bytes


def estimate_tiled(spec, setup: Setup) -> int:
    """The estimate's peak of the forward and backward of ``setup`` (its framework's refusal of ``tiled_mlp``
    lifted: module docstring)."""
    from ..estimator import step

    check = step.check
    step.check = lambda *a, **k: []
    try:
        peaks = step.estimate(spec, setup).phase_peaks_bytes
        return max(peaks["forward"], peaks["backward"])
    finally:
        step.check = check


def tiled_rows(quick: bool, row_type) -> list:
    """``validate --knob tiled_mlp``'s rows (``row_type``: validate.accuracy.Row): the peak of each case tiled (its
    backward's); one unverified row without the unsloth-zoo wheel."""
    from ..model.architecture import model_spec_from_config
    from ..run import unsloth_tiled

    cases = QUICK if quick else CASES
    source = unsloth_tiled.find_source()
    if source is None:
        return [row_type("-", "-", setup_of(*cases[0][1:]), 0, 0, "-", "-", truth="none", knob="tiled_mlp",
                         verified=False, why=f"no unsloth_zoo/tiled_mlp.py: set {unsloth_tiled.ENV} to an "
                                             f"unsloth-zoo {unsloth_tiled.VERSION} wheel (.ci/run downloads it)")]
    module = unsloth_tiled.load(source)
    rows = []
    for name, seq, batch, ck in cases:
        cfg, s = narrow(name), setup_of(seq, batch, ck)
        spec = model_spec_from_config(cfg, name=f"{name}[narrow]", source="tiled-truth")
        rows.append(row_type(name, spec.family, s, run_step(cfg, s, module), estimate_tiled(spec, s), "backward",
                             "backward", truth="unsloth-tiled-cpu", knob="tiled_mlp"))
    return rows
