"""A real eval step on this CPU (``--eval-batch N``): transformers 5.24's own ``Trainer`` trains one
step of the model (narrowed by :func:`vramplan.model.modelspec.shrink_config`), then runs its
``Trainer.evaluate`` (``evaluation_loop`` -> ``prediction_step``, no ``compute_metrics``) over two
eval batches, under the live-tensor counter (vramplan/run/live.py): the eval phase's peak of live
CPU tensors, with the model states (weights, adapters, AdamW's states; gradients None after the
Trainer's ``zero_grad``) resident as on a GPU.
"""

from __future__ import annotations

from ..specs import Setup

__all__ = ["eval_run"]


def eval_run(config: dict, setup: Setup) -> int:
    """The eval phase's live-tensor peak (bytes) of a real Trainer run of ``setup`` on ``config``."""
    import tempfile

    import torch
    import transformers
    from transformers import Trainer, TrainingArguments, default_data_collator

    from ..run.live import LiveTensorCounter
    from .cpu_truth import build_model

    transformers.logging.set_verbosity_error()
    vocab = int(config.get("vocab_size", 32000))
    gen = torch.Generator().manual_seed(0)

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(0, vocab, (n, setup.seq), generator=gen)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    with tempfile.TemporaryDirectory() as out, LiveTensorCounter("cpu") as counter:
        model = build_model(config, setup)
        counter.track(model)
        args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=setup.batch,
                                 per_device_eval_batch_size=setup.eval_batch, optim="adamw_torch",
                                 gradient_accumulation_steps=setup.grad_accum, use_cpu=True, report_to="none",
                                 save_strategy="no", logging_strategy="no", eval_strategy="no",
                                 remove_unused_columns=False, dataloader_drop_last=True,
                                 bf16=setup.precision == "bf16-mixed")
        trainer = Trainer(model=model, args=args, train_dataset=Rows(setup.batch * setup.grad_accum),
                          eval_dataset=Rows(2 * setup.eval_batch), data_collator=default_data_collator)
        trainer.train()
        counter.reset_peak()
        counter.phase("eval")
        trainer.evaluate()
        counter.phase(None)
        return int(counter.phase_peaks["eval"])
