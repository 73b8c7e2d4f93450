"""The eval step of a traced run (``--eval-batch N``): what transformers 5.24's Trainer does every
``eval_steps`` after the optimizer step and ``zero_grad`` (gradients None): ``Trainer.evaluate`` ->
``evaluation_loop`` -> ``prediction_step`` on each eval batch: ``model.eval()``, then under
``torch.no_grad()`` and the training autocast (accelerate wraps the model's forward) the model's
forward with the labels, the loss ``.detach().mean()``. ``evaluate`` passes
``prediction_loss_only=True`` when there is no ``compute_metrics``, so ``prediction_step`` returns the
loss alone and the outputs (logits) die with the step; the eval loop gathers the loss (repeated
``batch_size`` times) into its container. Traced by calling the Trainer's own ``prediction_step``
on a bare ``Trainer`` object holding the traced model (its ``compute_loss`` and label handling are
the Trainer's code), under the tracer's live-tensor counter, moment ``eval``.
"""

from __future__ import annotations

__all__ = ["eval_step"]


def eval_step(model, setup, config: dict, counter, autocast) -> None:
    """Run one eval step of ``setup.eval_batch`` rows on ``model`` (fake tensors), counted by
    ``counter`` (the tracer's moment counter) as moment ``eval``."""
    import torch
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    trainer = _bare_trainer(Trainer, TrainingArguments, model)
    try:
        ids = torch.randint(0, int(config.get("vocab_size", 32000)), (setup.eval_batch, setup.seq))
        counter.add(ids)
        inputs = {"input_ids": ids, "labels": ids}
        was_training = model.training
        model.eval()
        counter.moment = "eval"
        with autocast:
            loss, logits, _labels = trainer.prediction_step(model, inputs, prediction_loss_only=True)
        kept = loss.repeat(setup.eval_batch)  # evaluation_loop: gather_function(losses.repeat(batch_size))
        counter.observe()
        counter.moment = None
        del loss, logits, kept, inputs
        model.train(was_training)
    finally:
        # the bare Trainer's Accelerator and TrainingArguments set accelerate's process-wide state
        # (AcceleratorState / PartialState singletons): a trace must leave none behind for the next run
        del trainer
        AcceleratorState._reset_state(reset_partial_state=True)


def _bare_trainer(trainer_cls, args_cls, model):
    """A Trainer object with just what ``prediction_step`` reads (its __init__ would build an
    Accelerator and move the model): the args, the label names, the loss function's defaults."""
    import tempfile

    t = trainer_cls.__new__(trainer_cls)
    t.args = args_cls(output_dir=tempfile.gettempdir(), report_to=[], use_cpu=True)
    t.model = model
    t.label_names = ["labels"]
    t.can_return_loss = True
    t.model_accepts_loss_kwargs = True
    t.compute_loss_func = None
    t.label_smoother = None
    t.is_fsdp_xla_v2_enabled = False
    t.is_deepspeed_enabled = False
    t._attn_mask_causal_checked = True
    t._loss_shifts_labels = True  # transformers' causal-LM losses shift the labels themselves
    from accelerate import Accelerator

    t.accelerator = Accelerator(cpu=True)
    return t
