"""The DPO and GRPO training steps (and SFTTrainer's, ``--loss trl``) on fake tensors, for shapes
too large for a CPU run: the computation of TRL 1.16's ``DPOTrainer._compute_loss`` /
``GRPOTrainer._compute_loss`` (``SFTTrainer.compute_loss``) with TRL's own fused head
(``trl.trainer.utils.add_fused_lm_head``), on the model of :mod:`vramplan.run.tracer`
(meta device, peft, ``to_empty`` inside ``FakeTensorMode``), counted by the live-tensor counter.

- DPO: 2 x batch rows (chosen, rejected) of ``row_len`` tokens, labels -100 on the prompt; the
  policy forward; the reference forward under ``torch.no_grad`` (a frozen copy, or the policy with
  peft's adapters disabled; none when precomputed); the sigmoid loss; backward; the optimizer.
- GRPO: batch x num_generations rows of prompt + completion tokens, the completion scored
  (``logits_to_keep``); the clipped-ratio loss with ``old_per_token_logps = per_token_logps.detach()``
  (num_iterations 1); beta 0: no reference. Generation (HF ``generate``) cannot run on fake tensors
  (sampling and EOS checks read values): it is checked by the TRL CPU run (truths/objectives.py).

The head runs TRL's torch fold (no Triton on the CPU): compare with ``Stack(trl_triton=False)``.
"""

from __future__ import annotations

from ..run.knob_paths import tie_original_embeddings
from ..run.live import LiveTensorCounter
from ..run.models import adapt_for_training, attn_implementation, hf_config, require_torch, torch_optimizer
from ..run.real_paths import real_code_paths
from ..specs import Setup
from .objectives import ObjectiveTruth

PHASE_ORDER = ("kl", "reference", "forward", "backward", "optimizer")


def _fake_model(config: dict, setup: Setup, num_layers: int | None, dtype, trainable: bool = True):
    import torch
    import transformers

    hf_cfg = hf_config(config, num_layers)
    hf_cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, dtype=dtype, attn_implementation=attn_implementation(config, setup))
    if trainable:
        return adapt_for_training(model, setup)
    return model.requires_grad_(False).eval()


def _materialize(model) -> None:
    model.to_empty(device="cpu")
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(hf.config, "tie_word_embeddings", False):
        tie_original_embeddings(hf)


def trace_objective(config: dict, setup: Setup, num_layers: int | None = None, steps: int = 2) -> ObjectiveTruth:
    """Peaks per phase of ``steps`` traced DPO/GRPO training steps of ``setup``."""
    require_torch()
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trl.trainer.utils import add_fused_lm_head, use_adapter

    from ..estimator.objectives import lengths, reference
    from ..estimator.stack import Stack

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.precision]
    lens = lengths(setup, Stack(trl_triton=False))
    ref = reference(setup) if setup.objective != "sft" else "none"  # sft: --loss trl, SFTTrainer's head
    model = _fake_model(config, setup, num_layers, dtype)
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    outputs = {"dpo": ("log_probs", "entropy", "mean_logits", "is_top1"), "grpo": ("log_probs", "entropy"),
               "sft": ("log_probs", "entropy", "is_top1"), "kto": ("log_probs", "entropy", "mean_logits"),
               "orpo": None}[setup.objective]
    if outputs is not None:  # ORPOTrainer scores the model's own (tokens, vocab) logits
        add_fused_lm_head(hf, outputs=outputs)
    ref_model = _fake_model(config, setup, num_layers, dtype, trainable=False) if ref == "copy" else None
    if ref_model is not None:
        add_fused_lm_head(ref_model)
    ref_adapter = setup.adapters and ref in ("adapter", "precomputed") and setup.objective in ("dpo", "kto", "grpo")
    if ref_adapter:  # DPO/KTO/GRPOTrainer.__init__ handed a PeftModel (GRPO: beta != 0): a frozen "ref" copy
        model.add_adapter("ref", model.peft_config["default"])
    counter = LiveTensorCounter(device="cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with real_code_paths(False), fake, counter:
        _materialize(model)
        if ref_model is not None:
            _materialize(ref_model)
        if ref_adapter:
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        counter.track(model, ref_model)
        opt = torch_optimizer(setup, trainable)  # the canonical step's (bitsandbytes' cannot run on fake tensors)
        vocab = int(config["vocab_size"])
        ids = torch.randint(0, vocab, (lens.rows, lens.row_len))
        mask = torch.ones_like(ids)
        labels = ids.clone()
        labels[:, :lens.prompt] = -100
        counter.track(ids, mask, labels)
        for _step in range(steps):
            for _micro in range(setup.grad_accum):
                if setup.objective == "sft":
                    loss = _sft_loss(model, ids, mask, labels, counter)
                elif setup.objective == "grpo":
                    loss = _grpo_loss(model, ids, mask, labels, lens.completion, counter)
                elif setup.objective == "orpo":
                    loss = _orpo_loss(model, ids, mask, labels, counter)
                elif setup.objective == "kto":
                    loss = _kto_loss(model, ref_model, ref, ids, mask, labels, counter, use_adapter)
                else:
                    loss = _dpo_loss(model, ref_model, ref, ids, mask, labels, counter, use_adapter, F)
                if setup.grad_accum > 1:
                    loss = loss / setup.grad_accum
                counter.phase("backward")
                loss.backward()
                del loss
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            counter.phase(None)
    peaks = {ph: counter.phase_peaks[ph] for ph in PHASE_ORDER if ph in counter.phase_peaks}
    phase = max(peaks, key=lambda p: peaks[p])
    return ObjectiveTruth(peaks[phase], peaks, phase, sum(p.numel() for p in trainable))


def _dpo_loss(model, ref_model, ref, ids, mask, labels, counter, use_adapter, F):
    import torch

    counter.phase("forward")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
    chosen, rejected = out.log_probs.sum(dim=1).chunk(2, dim=0)
    del out
    if ref == "precomputed":
        ref_chosen, ref_rejected = torch.zeros_like(chosen), torch.zeros_like(rejected)
    else:
        counter.phase("reference")
        r = _reference(model, ref_model, use_adapter, lambda m: m(
            input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False).log_probs)
        ref_chosen, ref_rejected = r.sum(dim=1).chunk(2, dim=0)
        del r
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(0.1 * delta).mean()


def _reference(model, ref_model, use_adapter, forward):
    """``forward(m)`` under no_grad through the reference: the frozen copy, or the policy with TRL's
    "ref" adapter active (``use_adapter(model, "ref")``, as DPOTrainer/KTOTrainer run it)."""
    import torch

    with torch.no_grad():
        if ref_model is not None:
            return forward(ref_model)
        with use_adapter(model, adapter_name="ref"):
            return forward(model)


def _sft_loss(model, ids, mask, labels, counter):
    """TRL 1.16 ``SFTTrainer.compute_loss`` (loss_type nll): the fused head's summed negative
    log-probs over the label count."""
    counter.phase("forward")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
    loss = (-out.log_probs).sum() / out.label_mask.sum().clamp(min=1)
    del out
    return loss


def _grpo_loss(model, ids, mask, labels, completion: int, counter):
    import torch

    counter.phase("forward")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
    logps = out.log_probs[:, -completion:]
    del out
    old = logps.detach()
    advantages = torch.zeros(logps.size(0), 1, dtype=logps.dtype)
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    return per_token.mean()


def _orpo_loss(model, ids, mask, labels, counter):
    """TRL 1.16 ``ORPOTrainer.get_batch_loss_metrics``: its own ``concatenated_forward`` (the
    model's logits, the chosen rows' NLL over prompt + completion, ``get_batch_logps`` averaged over
    the completion) and ``odds_ratio_loss``, run on a stand-in for the trainer's attributes; the
    metrics' ``logits.detach().mean()`` as it takes them."""
    import os
    from types import SimpleNamespace

    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.orpo import ORPOTrainer

    B = ids.size(0) // 2
    batch = {"chosen_input_ids": ids[:B], "chosen_attention_mask": mask[:B], "chosen_labels": labels[:B],
             "rejected_input_ids": ids[B:], "rejected_attention_mask": mask[B:], "rejected_labels": labels[B:]}
    trainer = SimpleNamespace(is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, beta=0.1,
                              accelerator=SimpleNamespace(device=torch.device("cpu")),
                              concatenated_inputs=ORPOTrainer.concatenated_inputs,
                              get_batch_logps=ORPOTrainer.get_batch_logps)
    counter.phase("forward")
    chosen, rejected, chosen_logits, rejected_logits, nll = ORPOTrainer.concatenated_forward(trainer, model, batch)
    losses, *_ = ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected)
    loss = nll - losses.mean()
    metrics = [rejected_logits.detach().mean(), chosen_logits.detach().mean()]
    del chosen_logits, rejected_logits, metrics
    return loss


def _kto_loss(model, ref_model, ref, ids, mask, labels, counter, use_adapter):
    """TRL 1.16 ``KTOTrainer._compute_loss``: the KL batch (completions rotated by one row) through
    the policy under no_grad, the policy's forward, then (not precomputed) the reference's KL and
    main forwards under no_grad while the policy's activations are alive; the KTO loss."""
    import torch

    def logps(m, input_ids):
        return m(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True,
                 use_cache=False).log_probs.sum(-1)

    kl_ids = torch.roll(ids, 1, dims=0)
    counter.phase("kl")
    with torch.no_grad():
        kl_logps = logps(model, kl_ids)
    counter.phase("forward")
    policy = logps(model, ids)
    if ref == "precomputed":
        ref_kl, ref_logps = torch.zeros_like(kl_logps), torch.zeros_like(policy)
    else:
        counter.phase("reference")
        ref_kl, ref_logps = _reference(model, ref_model, use_adapter, lambda m: (logps(m, kl_ids), logps(m, ids)))
    kl = (kl_logps - ref_kl).mean().detach().clamp(min=0)
    return (1 - torch.sigmoid(0.1 * (policy - ref_logps - kl))).mean()


__all__ = ["trace_objective"]
