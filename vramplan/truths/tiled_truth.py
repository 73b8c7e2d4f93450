"""The truth of ``--tiled-mlp`` (estimator/tiled_mlp.py): Unsloth's own ``TiledMLP`` (vramplan/run/unsloth_tiled.py,
the file from the unsloth-zoo wheel) patched into transformers' layer of a narrow model, one real step on this CPU
counted live (vramplan/run/live.py), against the estimate of the same step; and axolotl's (its ``tiled_mlp``
files from the axolotl wheel, vramplan/run/axolotl_tiled.py: ``patch_tiled_mlp`` on transformers' MLP class), the
framework whose layer this is, with its shard counts (``tiled_mlp_num_shards``: 2 and 4 shards of 2,048-4,096
tokens exercise the tiles its default would cut only past 32,768 tokens; 0, its default, one shard).

The layer is transformers' (the HF recipe's LoRA step, :func:`vramplan.truths.cpu_truth.build_model`): the one
Unsloth's ``FastModel`` tiles; its fused-kernel layer needs a GPU. ``--tiled-mlp`` with ``--framework hf`` is
refused on the command line (no HF Trainer option runs it), so the estimate here is taken with that one refusal
lifted (:func:`estimate_tiled`): what it checks is the tiled layer's terms (estimator/step.py ``_layer_backward``,
estimator/activations.py), which the FastModel families use under ``--framework unsloth``."""

from __future__ import annotations

import contextlib

from ..specs import Setup

__all__ = ["CASES", "QUICK", "counted_step", "estimate_tiled", "run_step", "tiled_rows"]

#: (model, seq, batch, checkpointing): narrow (2 layers, hidden 256, vocab 512) Llama, Qwen2 and OLMo 2 steps
CASES = (("llama-3.1-8b", 2048, 1, True), ("llama-3.1-8b", 4096, 2, True), ("llama-3.1-8b", 2048, 1, False),
         ("qwen2.5-7b", 2048, 1, True), ("olmo-2-7b", 2048, 1, True), ("olmo-2-7b", 2048, 1, False))
QUICK = CASES[:1]
#: axolotl's (model, seq, batch, checkpointing, shards: tiled_mlp_num_shards, 0 its default: one shard below 32,768
#: tokens, the MLP recomputed whole)
AXOLOTL_CASES = (("llama-3.1-8b", 2048, 1, True, 4), ("llama-3.1-8b", 4096, 2, True, 2),
                 ("llama-3.1-8b", 2048, 1, False, 4), ("llama-3.1-8b", 2048, 1, False, 0),
                 ("llama-3.1-8b", 4096, 2, True, 0), ("qwen2.5-7b", 2048, 1, True, 4))
SHRINK = {"layers": 2, "hidden": 256, "heads": 8, "vocab": 512}


def setup_of(seq: int, batch: int, checkpointing: bool, tiled: bool = True, shards: int | None = None) -> Setup:
    """The LoRA step of a case: Unsloth's tiles (``shards`` None), or axolotl's with ``shards`` of them."""
    axolotl = {} if shards is None else {"framework": "axolotl", "tiled_mlp_shards": shards if tiled else 0}
    return Setup(method="lora", precision="bf16", optimizer="adamw", checkpointing=checkpointing, seq=seq,
                 batch=batch, tiled_mlp=tiled, **axolotl)


def narrow(name: str) -> dict:
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model

    return shrink_config(load_model(name).config, **SHRINK)


def run_step(config: dict, setup: Setup, module=None) -> int:
    """The peak of live tensor bytes of one forward and backward of ``setup`` on ``config`` (``setup.tiled_mlp``:
    Unsloth's ``patch_tiled_mlp(model, "arctic")`` applied after the model is built, or with ``--framework
    axolotl`` axolotl's class patch around the step, ``module`` the one loaded); no optimizer step, whose peak
    (weights, gradients, states) is the same tiled or not and below the backward's here."""
    import torch

    from ..run import unsloth_tiled
    from .cpu_truth import build_model

    torch.manual_seed(0)
    axolotl = setup.framework == "axolotl"  # its tiled forward is a class patch, applied around the step
    model = build_model(config, setup.replace(tiled_mlp=False, tiled_mlp_shards=0, framework="hf"))
    if setup.tiled_mlp and not axolotl:
        unsloth_tiled.patch(model, module)
    with contextlib.ExitStack() as stack:
        if setup.tiled_mlp and axolotl:
            from ..run import axolotl_tiled

            stack.enter_context(axolotl_tiled.patched(config["model_type"], setup.tiled_mlp_shards or None, module))
        return counted_step(model, config, setup).peak_bytes


def counted_step(model, config: dict, setup: Setup, counter=None, within=None):
    """One forward and backward of ``setup`` on random ids, counted live by ``counter`` (a LiveTensorCounter
    unless given; a SplitCounter starts measuring at the forward), ``within(counter)`` entered around it when
    given (a stand-in that needs the counter); the counter."""
    import torch

    from ..run.cuda_paths import cuda_kernels
    from ..run.live import LiveTensorCounter

    counter = counter or LiveTensorCounter(device="cpu")
    counter.track(model)
    ids = torch.randint(0, int(config["vocab_size"]), (setup.batch, setup.seq),
                        generator=torch.Generator().manual_seed(1))
    counter.track([ids])
    with cuda_kernels(), counter, (within(counter) if within else contextlib.nullcontext()):
        if hasattr(counter, "start_measuring"):
            counter.start_measuring()
        counter.phase("forward")
        loss = model(input_ids=ids, labels=ids).loss
        counter.phase("backward")
        loss.backward()
        del loss
        counter.phase(None)
    return counter


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
    backward's), Unsloth's then axolotl's; one unverified row for each without its wheel."""
    from ..model.architecture import model_spec_from_config
    from ..run import unsloth_tiled

    cases = QUICK if quick else CASES
    source = unsloth_tiled.find_source()
    if source is None:
        return [row_type("-", "-", setup_of(*cases[0][1:]), 0, 0, "-", "-", truth="none", knob="tiled_mlp",
                         verified=False, why=f"no unsloth_zoo/tiled_mlp.py: set {unsloth_tiled.ENV} to an "
                                             f"unsloth-zoo {unsloth_tiled.VERSION} wheel (.ci/run downloads it)"),
                *axolotl_rows(quick, row_type)]
    module = unsloth_tiled.load(source)
    rows = []
    for name, seq, batch, ck in cases:
        cfg, s = narrow(name), setup_of(seq, batch, ck)
        spec = model_spec_from_config(cfg, name=f"{name}[narrow]", source="tiled-truth")
        rows.append(row_type(name, spec.family, s, run_step(cfg, s, module), estimate_tiled(spec, s), "backward",
                             "backward", truth="unsloth-tiled-cpu", knob="tiled_mlp"))
    return rows + axolotl_rows(quick, row_type)


def axolotl_rows(quick: bool, row_type) -> list:
    """axolotl's tiled MLP (its own files from the axolotl wheel, vramplan/run/axolotl_tiled.py) on the same
    narrow steps; one unverified row without the wheel."""
    from ..model.architecture import model_spec_from_config
    from ..run import axolotl_tiled

    cases = AXOLOTL_CASES[:1] if quick else AXOLOTL_CASES
    if axolotl_tiled.find_wheel() is None:
        return [row_type("-", "-", setup_of(*cases[0][1:4], shards=cases[0][4]), 0, 0, "-", "-", truth="none",
                         knob="tiled_mlp", verified=False,
                         why=f"no axolotl wheel: set {axolotl_tiled.ENV} to axolotl {axolotl_tiled.VERSION}'s "
                             "(.ci/run downloads it)")]
    module = axolotl_tiled.load()
    rows = []
    for name, seq, batch, ck, shards in cases:
        cfg, s = narrow(name), setup_of(seq, batch, ck, shards=shards)
        spec = model_spec_from_config(cfg, name=f"{name}[narrow]", source="tiled-truth")
        rows.append(row_type(name, spec.family, s, run_step(cfg, s, module), estimate_tiled(spec, s), "backward",
                             "backward", truth="axolotl-tiled-cpu", knob="tiled_mlp"))
    return rows
