"""What every torch path builds the same way: the transformers config of a config dict, the
attention implementation, the LoRA/checkpointing adaptation and the torch optimizer of a Setup.

The tracer (fake tensors), the CPU truth and the distributed truths all take these from here, so
that the step each of them runs is the same canonical step.
"""

from __future__ import annotations

import warnings

from ..specs import Setup, SpecError, truncate_config


class NotTraceable(SpecError):
    """The setup uses something fake tensors cannot run (bitsandbytes kernels, DeepSpeed, ...)."""


def require_torch() -> None:
    """Raise a one-line SpecError naming the ``run`` extra when torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SpecError(
            f"tracing needs the optional extra: pip install 'vramplan[run]' ({exc.name} is missing)"
        ) from None


def hf_config(config: dict, num_layers: int | None):
    """The transformers config of an HF config dict (truncated to ``num_layers`` layers when
    given), without the keys that name checkpoints, remote code or a quantization."""
    import transformers

    cfg = dict(truncate_config(config, num_layers) if num_layers else config)
    model_type = cfg.pop("model_type")
    for k in ("architectures", "auto_map", "transformers_version", "quantization_config"):
        cfg.pop(k, None)
    if model_type == "mistral3":
        # Mistral3Config defaults tie_word_embeddings to True and the Hub files name none, but the checkpoints
        # hold a separate lm_head, which from_pretrained keeps (24.0B, what vramplan counts); from_config would tie
        cfg.setdefault("tie_word_embeddings", False)
    return transformers.AutoConfig.for_model(model_type, **cfg)


def causal_lm_from_config(hf_cfg, **kwargs):
    """``AutoModelForCausalLM.from_config``, or for the image-text models it has no class for (Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Mistral 3) ``AutoModelForImageTextToText``'s, the class their checkpoints load as
    (a text-only step runs its language model and head; the vision tower holds weights only)."""
    import transformers

    if type(hf_cfg) not in transformers.AutoModelForCausalLM._model_mapping and \
            type(hf_cfg) in transformers.AutoModelForImageTextToText._model_mapping:
        return transformers.AutoModelForImageTextToText.from_config(hf_cfg, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(hf_cfg, **kwargs)


def attn_implementation(config: dict, setup: Setup) -> str:
    """The ``attn_implementation`` the model of ``setup`` is built with: the family's default for
    ``auto`` (eager for Gemma2, and for gpt-oss, GPT-Neo, BLOOM and MPT, whose classes have no SDPA path; else SDPA).
    FlashAttention-2 needs CUDA; its memory (q, k, v, out, fp32 logsumexp) is what SDPA's flash kernel
    saves, so SDPA runs in its place."""
    if setup.attn == "auto":
        return "eager" if config.get("model_type") in {"gemma2", "gpt_oss", "gpt_neo", "bloom", "mpt"} else "sdpa"
    return "sdpa" if setup.attn == "flash" else setup.attn


def lora_config(setup: Setup):
    """peft's ``LoraConfig`` of ``setup`` (rank, alpha, dropout, targets, the knobs' arguments)."""
    import peft

    from .knob_paths import lora_config_kwargs

    targets = setup.lora_targets
    return peft.LoraConfig(
        r=setup.lora_rank, lora_alpha=setup.alpha, lora_dropout=setup.lora_dropout, task_type="CAUSAL_LM",
        target_modules="all-linear" if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        **lora_config_kwargs(setup))


def adapt_for_training(model, setup: Setup):
    """What every truth does after building the base: peft LoRA adapters (``setup.adapters``),
    HF gradient checkpointing (``use_reentrant=False``; inputs require grad under LoRA so the
    checkpointed segments have a grad path), train mode. Returns the (wrapped) model."""
    if setup.adapters:
        import peft

        with warnings.catch_warnings():
            # peft 0.21's PeftModel reads transformers 5's deprecated is_gradient_checkpointing: not ours to act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            # modules_to_save on a tied model: peft#2777's merging caveat, nothing about the step's memory
            warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`", UserWarning)
            model = peft.get_peft_model(model, lora_config(setup))
    if setup.checkpointing:
        enable_checkpointing(model, setup.checkpoint_every)
        if setup.adapters:
            model.enable_input_require_grads()
    model.train()
    return model


def enable_checkpointing(model, every: int = 1) -> None:
    """HF activation checkpointing of every layer (or, ``every`` > 1, of the layers ``i % every ==
    0``: transformers 5.24's ``every_n_layers``) with ``use_reentrant=False``: transformers 5's
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is its deprecated alias,
    gone in v6, and warns), the old name where an installed transformers 4 has only that."""
    kwargs = {"use_reentrant": False}
    per_layer = {"every_n_layers": every} if every > 1 else {}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **per_layer)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **per_layer)


def torch_optimizer(setup: Setup, params):
    """The torch optimizer of ``setup`` as the canonical step builds it (also the client optimizer
    of the real runs in vramplan.run); bitsandbytes ones raise NotTraceable."""
    import torch

    if setup.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if setup.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=True)
    if setup.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-5, scale_parameter=False, relative_step=False)
    raise NotTraceable(
        f"optimizer {setup.optimizer!r} cannot run on fake tensors (bitsandbytes/custom kernels); "
        "it needs a real run (the measured tier)"
    )
