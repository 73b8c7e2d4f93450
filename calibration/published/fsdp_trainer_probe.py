"""Probe for the FSDP per-token gap of the fms-acceleration rows (README.md, "What the rows show"):
one LoRA step through the HF Trainer exactly as fms-hf-tuning runs it (transformers 4.48.1,
accelerate 1.0.1, peft 0.13.2: the rows' stack), under FSDP1 on 2 ranks or in one process, with
the live-tensor counter (vramplan/truths/fsdp.py's ResizingCounter) per phase of the second step.

Not part of the package or the tests: it needs a venv with the rows' stack, e.g.

    python -m venv --system-site-packages /tmp/venv13
    /tmp/venv13/bin/pip install transformers==4.48.1 peft==0.13.2 accelerate==1.0.1
    V=/tmp/venv13/bin/python
    $V calibration/published/fsdp_trainer_probe.py SEQ BS one
    $V -m torch.distributed.run --nproc_per_node 2 calibration/published/fsdp_trainer_probe.py SEQ BS fsdp

Env: H, I, L, NH, NKV, VOCAB (hidden, intermediate, layers, heads, KV heads, vocabulary;
64/128/2/4/2/32000), AMP=1
(TrainingArguments bf16=True, the QLoRA rows' precision), NONREENTRANT=1 (``use_reentrant: False``;
else transformers 4.48.1's default, reentrant), LAYERS=1 (the live bytes at each layer's
recomputed forward: reentrant checkpointing only). Vocab 32000 (Mistral's) by default, so the
logits dominate.
On the CPU, accelerate's state is MULTI_CPU; it is switched to FSDP with an env-built FullyShardedDataParallelPlugin as
vramplan/truths/fsdp.py does (the Trainer then applies peft's fsdp_auto_wrap_policy itself). On a
CUDA machine with 2 GPUs nothing is switched: `accelerate launch` with fms-acceleration's
scripts/benchmarks/accelerate.yaml is the real thing, and the counter can be replaced by
torch.cuda.max_memory_allocated. Prints one JSON line per rank."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import transformers.utils.import_utils as import_utils

# the global `datasets` needs a newer huggingface_hub than transformers 4.48.1 pins; the Trainer
# imports it only when available
import_utils._datasets_available = False

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    MistralConfig,
    MistralForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from vramplan.truths.fsdp import ResizingCounter  # noqa: E402

warnings.filterwarnings("ignore")
CPU = not torch.cuda.is_available()


def main(seq: int, batch: int, mode: str) -> None:
    torch.set_num_threads(1)
    env = os.environ.get
    cfg = MistralConfig(vocab_size=int(env("VOCAB", 32000)), hidden_size=int(env("H", 64)),
                        intermediate_size=int(env("I", 128)), num_hidden_layers=int(env("L", 2)),
                        num_attention_heads=int(env("NH", 4)), num_key_value_heads=int(env("NKV", 2)),
                        max_position_embeddings=4096, sliding_window=None, torch_dtype="bfloat16")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    model.enable_input_require_grads()  # TRL's SFTTrainer does this for peft + checkpointing
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    ids = torch.randint(0, cfg.vocab_size, (64, seq), generator=torch.Generator().manual_seed(1))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    counter = ResizingCounter()
    counter.track(model)
    peaks: dict = {}
    layer_log: list = []  # LAYERS=1: (layer, live bytes) at each recomputed forward of step 2
    step = {"n": 0}
    if env("LAYERS") == "1":
        for i, layer in enumerate(model.base_model.model.model.layers):
            def log(mod, args, kwargs, i=i):
                if torch.is_grad_enabled() and step["n"] == 1:
                    layer_log.append((i, counter.current_bytes))
            layer.register_forward_pre_hook(log, with_kwargs=True)

    class PhasedTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if mode == "fsdp" and CPU:  # accelerate turns FSDP on for accelerators only
                from accelerate.state import PartialState
                from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

                plugin = FullyShardedDataParallelPlugin()
                for state in (PartialState(), self.accelerator.state):
                    state.distributed_type = DistributedType.FSDP
                    state.device = torch.device("cpu")
                if self.accelerator.mixed_precision != "no":
                    plugin.set_mixed_precision(self.accelerator.mixed_precision)
                self.accelerator.state.fsdp_plugin = plugin
                self.is_fsdp_enabled = True

        def compute_loss(self, *args, **kwargs):
            counter.phase("forward")
            loss = super().compute_loss(*args, **kwargs)
            counter.phase("backward")
            return loss

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                counter.reset_peak()
                counter.phase_peaks.clear()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            counter.phase("optimizer")

        def on_step_end(self, args, state, control, **kw):
            step["n"] = state.global_step
            counter.phase(None)
            if state.global_step == 2:
                peaks.update(counter.phase_peaks)

    fsdp = {}
    if mode == "fsdp":  # fms-acceleration's accelerate.yaml
        fsdp = {"fsdp": "full_shard auto_wrap", "fsdp_config": {
            "backward_prefetch": "backward_pre", "forward_prefetch": False, "use_orig_params": True,
            "sync_module_states": False, "cpu_ram_efficient_loading": False}}
    args = TrainingArguments(
        output_dir="/tmp/fsdp_trainer_probe", use_cpu=CPU, per_device_train_batch_size=batch, max_steps=2,
        gradient_checkpointing=True, learning_rate=1e-4, weight_decay=0.01, adam_epsilon=1e-4, report_to=[],
        save_strategy="no", logging_strategy="no", bf16=env("AMP") == "1",
        gradient_checkpointing_kwargs={"use_reentrant": False} if env("NONREENTRANT") == "1" else None, **fsdp)
    trainer = PhasedTrainer(model=model, args=args, train_dataset=Rows(), callbacks=[Phases()])
    with counter:
        trainer.train()
    acc = trainer.accelerator
    print(json.dumps({"mode": mode, "seq": seq, "batch": batch, "rank": int(env("RANK", 0)),
                      "wrapped": type(trainer.model_wrapped).__name__, "mixed_precision": acc.mixed_precision,
                      "native_amp": acc.native_amp, "peaks": peaks, "layers": layer_log}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
