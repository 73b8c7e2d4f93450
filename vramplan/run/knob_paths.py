"""The memory knobs of a Setup applied for real in the torch truths (tracer, CPU step):
peft's ``modules_to_save`` and DoRA, torchtune's optimizer in backward.

- ``modules_to_save`` / ``use_dora`` go into the same ``peft.LoraConfig`` every truth builds
  (:func:`lora_config_kwargs`, read by :func:`vramplan.run.models.adapt_for_training`);
- a tied model wrapped by peft's ``ModulesToSaveWrapper`` ties the wrapped *original* modules
  again after ``to_empty`` (:func:`tie_original_embeddings`): peft 0.21 deep-copies the trained
  module and leaves the frozen original, the one the head shares (``ensure_weight_tying=False``);
- the optimizer in backward is torchtune 0.6.1's code (``training/memory.py``
  ``register_optim_in_bwd_hooks``, copied in :func:`register_hooks`: torchtune 0.6.1 needs
  torchao < 0.14, which peft 0.21 refuses, so it is not installed beside peft): one optimizer per
  trainable parameter, stepped and zeroed by a post-accumulate-grad hook (:func:`step_optimizer`).
"""

from __future__ import annotations

import itertools

from ..specs import Setup


def saved_module_names(setup: Setup) -> list[str]:
    """The module names of ``setup.modules_to_save`` (peft matches each by its last name part)."""
    return [m.strip() for m in setup.modules_to_save.split(",") if m.strip()]


def lora_config_kwargs(setup: Setup) -> dict:
    """The ``peft.LoraConfig`` arguments of the knobs (none when they are off)."""
    out: dict = {}
    if saved_module_names(setup):
        out["modules_to_save"] = saved_module_names(setup)
    if setup.dora:
        out["use_dora"] = True
    return out


def tie_original_embeddings(hf_model) -> None:
    """Tie the output embedding to the input embedding again, as ``from_pretrained`` would
    (``Module._apply`` in ``to_empty`` unties shared parameters). Under ``modules_to_save`` the
    shared weight is the wrapped original's, not the trainable copy's."""
    out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    if out_emb is None or in_emb is None:
        return
    out_emb = getattr(out_emb, "original_module", out_emb)
    in_emb = getattr(in_emb, "original_module", in_emb)
    out_emb.weight = in_emb.weight


class _InBackward:
    """The optimizer the driver steps: torchtune's per-parameter optimizers, already stepped in
    backward by their hooks, so ``step`` and ``zero_grad`` do nothing (torchtune's recipes skip
    both when ``optimizer_in_bwd``). ``state`` joins the per-parameter states."""

    def __init__(self, optim_dict: dict) -> None:
        self.optim_dict = optim_dict

    @property
    def state(self) -> dict:
        return dict(itertools.chain.from_iterable(o.state.items() for o in self.optim_dict.values()))

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def step_optimizer(setup: Setup, model, trainable: list, make):
    """The optimizer ``make(setup, params)`` builds over ``trainable`` (models.torch_optimizer);
    with ``optimizer_in_backward``, torchtune's: ``{p: make(setup, [p])}`` and a hook per parameter
    that steps and zeroes it as soon as its gradient is accumulated (register hooks that must run
    before the step first)."""
    if not setup.optimizer_in_backward:
        return make(setup, trainable)
    optim_dict = {p: make(setup, [p]) for p in trainable}
    register_hooks(model, optim_dict)
    return _InBackward(optim_dict)


def register_hooks(model, optim_dict: dict) -> None:
    """torchtune 0.6.1 ``training/memory.py`` ``register_optim_in_bwd_hooks``, line for line: a
    post-accumulate-grad hook on every trainable parameter that steps its optimizer and zeroes
    the gradient (``zero_grad()``: set to None)."""

    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(optim_step)
