#!/usr/bin/env python
# vramplan plan for meta-llama/Llama-3.1-8B on 1 GPU
# lora r=16 alpha=32 · bf16 · adamw · batch 4 x seq 2048 · grad accum 8 · checkpointing
# estimate: 34.00 GiB per GPU (device total; peak allocated 31.00 GiB, tensor peak 30.00 GiB) on NVIDIA A100 80GB SXM4 (80.00 GiB usable): fits; ~1,000 tokens/s
# run (from this directory): python train.py
#        or: accelerate launch --config_file accelerate_config.yaml train.py
# random weights from config.json; real weights: add --model meta-llama/Llama-3.1-8B
# the plan and the estimate it was made from: vramplan.json
"""Fine-tune the planned model with the Hugging Face Trainer, exactly as the plan in PLAN says.

The model is built from config.json (next to this file) with random weights: nothing is
downloaded, so the memory of the plan can be checked before any real run. ``--model ID_OR_PATH``
loads real weights instead; a GPTQ/AWQ plan needs it (a pre-quantized checkpoint: random weights
cannot be GPTQ/AWQ-quantized without calibration data and gptqmodel's quantizer). The dataset is
random tokens unless ``--dataset`` names a local .jsonl/.json file (rows with "input_ids" or a
text field), a .txt file (one example per line) or a Hugging Face dataset id (needs the
``datasets`` package). Every sequence is ``--seq`` tokens long, so each step has the shape the
plan was estimated for.

Other code can import this file and reuse its pieces: ``parse_args(argv)``,
``build_trainer(args, callbacks)`` (adds your TrainerCallbacks) and ``main(argv)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig,
                          DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator)

HERE = Path(__file__).resolve().parent

# The plan (edit here to change what is trained; vramplan.json holds the plan and its estimate).
PLAN = {
    'model': 'meta-llama/Llama-3.1-8B',
    'method': 'lora',
    'lora_r': 16,
    'lora_alpha': 32,
    'lora_dropout': 0.0,
    'lora_targets': 'all-linear',
    'quant': 'none',
    'precision': 'bf16',
    'optim': 'adamw_torch',
    'lr': 0.0002,
    'checkpointing': True,
    'attn': 'auto',
    'loss': 'hf',
    'batch': 4,
    'seq': 2048,
    'grad_accum': 8,
    'sharded': False,
}

#: Setup.precision -> dtype the weights are loaded in (the "-mixed" ones keep fp32 weights).
LOAD_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(PLAN["precision"], torch.float32)
COMPUTE_DTYPE = torch.float16 if PLAN["precision"].startswith("fp16") else torch.bfloat16
#: transformers 5 renamed TrainingArguments.gradient_checkpointing to activation_checkpointing.
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                 else "gradient_checkpointing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help=f"real weights: a Hub id or local path (e.g. {PLAN['model']}); default: random weights")
    p.add_argument("--config", default=str(HERE), help="directory of the config.json for random weights")
    p.add_argument("--dataset", default="synthetic",
                   help="synthetic | a .jsonl/.json/.txt file | a Hugging Face dataset id")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.json/Hub rows")
    p.add_argument("--tokenizer", default=None, help="tokenizer for text data (default: --model)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps (default: 10 on synthetic data, else --epochs over the dataset)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=PLAN["batch"], help="micro-batch per GPU")
    p.add_argument("--seq", type=int, default=PLAN["seq"], help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, default=PLAN["grad_accum"])
    p.add_argument("--lr", type=float, default=PLAN["lr"])
    p.add_argument("--output-dir", default="output")
    p.add_argument("--no-save", action="store_true", help="do not save the trained weights/adapter")
    p.add_argument("--save-steps", type=int, default=0, metavar="N",
                   help="also save a Trainer checkpoint (optimizer state included) every N steps; 0: none")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed config (ds_config.json)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (TrainingArguments.use_cpu)")
    p.add_argument("--memory-report", default=None, metavar="PATH",
                   help="write per-step peak memory, step time and tokens/s as JSON")
    p.add_argument("--eval-batch", type=int, default=PLAN.get("eval_batch", 0), metavar="N",
                   help="per_device_eval_batch_size of an eval every --eval-steps steps; 0: no eval")
    p.add_argument("--eval-steps", type=int, default=5, metavar="N", help="optimizer steps between evals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)
    if args.max_steps is None:
        args.max_steps = 10 if args.dataset == "synthetic" else -1
    return args


def _device(args: argparse.Namespace) -> str:
    if args.cpu or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


#: bases that only come pre-quantized (their checkpoint's config.json carries the quantization)
PREQUANTIZED = ("gptq", "awq")


def _quantization_config() -> BitsAndBytesConfig | None:
    if PLAN["quant"] == "none":
        return None
    if PLAN["quant"] == "gptq":  # merged into the checkpoint's own config: gptqmodel's trainable kernel
        from transformers import GPTQConfig

        return GPTQConfig(bits=PLAN["quant_bits"], group_size=PLAN["quant_group_size"], backend="auto_trainable")
    if PLAN["quant"] == "awq":  # the GEMM kernel (AwqGEMMLinear) vramplan estimated
        from transformers import AwqConfig

        return AwqConfig(bits=PLAN["quant_bits"], group_size=PLAN["quant_group_size"], backend="gemm")
    if PLAN["quant"] == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=PLAN["quant"],
                              bnb_4bit_use_double_quant=PLAN["double_quant"],
                              bnb_4bit_compute_dtype=COMPUTE_DTYPE,
                              # uint8, or what ZeRO-3/FSDP shard the packed 4-bit weights as: the
                              # dtype the other parameters have there (16-bit under DeepSpeed)
                              bnb_4bit_quant_storage=getattr(torch, PLAN["quant_storage"]))


def random_checkpoint(args: argparse.Namespace, directory: str) -> str:
    """Random weights from config.json saved as a checkpoint in ``directory`` (no download):
    bitsandbytes quantizes weights while from_pretrained loads them, so a quantized base is
    loaded from here (this needs the unquantized model's size in host RAM and temporary disk
    once per process). Call it before any process group and the TrainingArguments exist: once a
    group does, transformers saves on rank 0 only (the other ranks would load an empty
    directory), and under ZeRO-3 a model created after the TrainingArguments is already
    partitioned and would be saved empty. Seeded: every rank writes the same weights."""
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), dtype=LOAD_DTYPE)
    model.save_pretrained(directory)
    return directory


def build_model(args: argparse.Namespace, checkpoint: str | None = None) -> torch.nn.Module:
    """The model as the plan trains it: (quantized) base, k-bit preparation, LoRA adapters.

    Weights come from ``checkpoint``, else ``--model``, else random from config.json. Under
    ZeRO-3 create the TrainingArguments first (build_trainer does): transformers then partitions
    the weights as they are created.
    """
    _require_prequantized(args)
    kwargs: dict = {"dtype": LOAD_DTYPE}
    if PLAN["attn"] != "auto":
        kwargs["attn_implementation"] = {"flash": "flash_attention_2"}.get(PLAN["attn"], PLAN["attn"])
    quant = _quantization_config()
    if quant is not None:
        kwargs["quantization_config"] = quant
        if not PLAN["sharded"]:  # ZeRO-3 and FSDP place the shards themselves
            kwargs["device_map"] = {"": _device(args)}
    if PLAN.get("device_map"):  # the layers split over this one process's GPUs (accelerate's placement);
        # with fewer than two GPUs (or --cpu) there is nothing to split over: one device
        several = not args.cpu and torch.cuda.device_count() > 1
        kwargs["device_map"] = PLAN["device_map"] if several else {"": _device(args)}
        if several and PLAN.get("max_memory"):  # accelerate's caps: {GPU index: bytes}
            kwargs["max_memory"] = PLAN["max_memory"]
    if PLAN.get("tp"):  # tensor parallelism: transformers' tp_plan over the launched processes (DTensor shards)
        from transformers.distributed.configuration_utils import DistributedConfig

        # beside FSDP2 (fsdp_size): transformers 5.24 fully_shards the TP model itself, on one 2-D mesh
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=PLAN["tp"],
                                                         fsdp_size=PLAN.get("fsdp_size", 1))
    source = checkpoint or args.model
    if source:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    elif quant is None and "device_map" not in kwargs and "distributed_config" not in kwargs:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.config), **kwargs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model = AutoModelForCausalLM.from_pretrained(random_checkpoint(args, tmp), **kwargs)
    # not under FSDP: its fp32 upcast of the norms and embeddings would give a unit two dtypes
    # beside the packed weights, which FSDP refuses to flatten (TRL skips it for sharded QLoRA too)
    if quant is not None and "fsdp" not in PLAN:
        from peft import prepare_model_for_kbit_training

        # checkpointing is the Trainer's (CHECKPOINTING below); peft's would call the deprecated
        # gradient_checkpointing_enable of transformers 5
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if PLAN["method"] in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        targets = PLAN["lora_targets"]
        model = get_peft_model(model, LoraConfig(
            r=PLAN["lora_r"], lora_alpha=PLAN["lora_alpha"], lora_dropout=PLAN["lora_dropout"],
            target_modules=targets if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM",
            modules_to_save=PLAN.get("modules_to_save"), use_dora=PLAN.get("dora", False)))
    if PLAN["loss"] == "trl":
        _fused_lm_head(model)
    return model


def _fused_lm_head(model: torch.nn.Module) -> None:
    """The plan's loss "trl": TRL's fused, chunked LM head (pip install trl; read off TRL 1.16), as
    SFTTrainer installs it (trl/trainer/utils.py add_fused_lm_head, on the base under peft) and calls
    it in every forward (SFTTrainer.compute_loss: fused_lm_head=True): no (tokens x vocab) logits."""
    import functools

    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    base.forward = functools.partial(base.forward, fused_lm_head=True)


class TokenRows(torch.utils.data.Dataset):
    """Fixed-length rows: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""

    def __init__(self, rows: list[list[int]], seq: int, pad_id: int = 0):
        self.rows, self.seq, self.pad_id = rows, seq, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = list(self.rows[i][: self.seq])
        pad = self.seq - len(ids)
        return {"input_ids": ids + [self.pad_id] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": ids + [-100] * pad}


def _read_texts_or_ids(args: argparse.Namespace) -> list:
    path = Path(args.dataset)
    if path.suffix in (".jsonl", ".json", ".txt"):
        if not path.is_file():
            raise SystemExit(f"error: --dataset {args.dataset}: no such file")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".txt":
            return [line for line in text.splitlines() if line.strip()]
        rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else json.loads(text)
    else:
        try:
            import datasets
        except ImportError:
            raise SystemExit(f"error: --dataset {args.dataset}: not a local .jsonl/.json/.txt file, and loading "
                             "a Hugging Face dataset needs the datasets package: pip install datasets") from None
        try:
            rows = list(datasets.load_dataset(args.dataset, split="train"))
        except (ConnectionError, FileNotFoundError, ValueError) as exc:  # offline, no such dataset, no train split
            reason = " ".join(str(exc).split())[:300]
            raise SystemExit(f"error: --dataset {args.dataset}: not a local .jsonl/.json/.txt file, and the Hugging "
                             f"Face dataset could not be loaded ({type(exc).__name__}: {reason})") from None
    return [row["input_ids"] if "input_ids" in row else row[args.text_field] for row in rows]


def build_dataset(args: argparse.Namespace, vocab_size: int, world_size: int) -> TokenRows:
    """Random tokens (enough for ``--max-steps``), or the rows of ``--dataset``, ``--seq`` long."""
    if args.dataset == "synthetic":
        n = max(args.max_steps, 1) * args.batch * args.grad_accum * world_size
        rng = random.Random(args.seed)
        return TokenRows([[rng.randrange(vocab_size) for _ in range(args.seq)] for _ in range(n)], args.seq)
    rows = _read_texts_or_ids(args)
    if rows and isinstance(rows[0], str):
        name = args.tokenizer or args.model
        if not name:
            raise SystemExit("error: text data needs a tokenizer: pass --tokenizer ID_OR_PATH (or --model)")
        tokenizer = AutoTokenizer.from_pretrained(name)
        rows = [tokenizer(text, truncation=True, max_length=args.seq)["input_ids"] for text in rows]
        return TokenRows(rows, args.seq, tokenizer.pad_token_id or 0)
    return TokenRows(rows, args.seq)


def split_eval(args: argparse.Namespace, dataset: TokenRows, vocab_size: int) -> tuple[TokenRows, TokenRows | None]:
    """The eval split (``--eval-batch`` > 0): two eval batches of random tokens, or the last
    two eval batches' rows of ``--dataset`` held out of training."""
    if args.eval_batch <= 0:
        return dataset, None
    n = 2 * args.eval_batch
    if args.dataset == "synthetic":
        rng = random.Random(args.seed + 1)
        return dataset, TokenRows([[rng.randrange(vocab_size) for _ in range(args.seq)] for _ in range(n)], args.seq)
    if len(dataset.rows) <= n:
        raise SystemExit(f"error: --eval-batch {args.eval_batch}: the dataset has too few rows for an eval split")
    return (TokenRows(dataset.rows[:-n], dataset.seq, dataset.pad_id),
            TokenRows(dataset.rows[-n:], dataset.seq, dataset.pad_id))


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _innermost(optimizer):
    """The optimizer that steps, inside accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class OffloadingTrainer(Trainer):
    """activation_offload: TRL 1.16's SFTTrainer offloading on the HF Trainer. Every training_step (the
    forward and the backward) runs under trl.models.activation_offloading.get_act_offloading_ctx_manager
    (OffloadActivations with CUDA streams, pinned host copies, the output head kept on the GPU), as
    SFTTrainer.training_step does. It needs trl and a GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(torch, "accelerator") or torch.accelerator.current_accelerator() is None:
            raise SystemExit("activation offloading (TRL's OffloadActivations) needs a GPU")
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        self.offload_context = get_act_offloading_ctx_manager(model=self.model)

    def training_step(self, *args, **kwargs):
        with self.offload_context:
            return super().training_step(*args, **kwargs)


class MemoryReport(TrainerCallback):
    """Per optimizer step: peak CUDA memory since the step began (allocated and reserved), step
    time, tokens/s, and the process's peak RSS; written as JSON when training ends. With several
    processes each rank writes PATH with ``.rankN`` before its suffix."""

    def __init__(self, path: str, tokens_per_step: int):
        self.path, self.tokens_per_step, self.steps = Path(path), tokens_per_step, []
        self.cuda = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.cuda = torch.cuda.is_available() and not args.use_cpu
        params = list(model.parameters())
        self.model_info = {
            "optimizer": _qualname(_innermost(optimizer)),
            # ZeRO-3 leaves each parameter empty here and records its size as ds_numel
            "params_trainable": sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad),
            "bnb_modules": sum(type(m).__module__.startswith("bitsandbytes") for m in model.modules()),
            "zero3_partitioned_params": sum(hasattr(p, "ds_id") for p in params),
            "deepspeed_zero_stage": (args.hf_deepspeed_config.config["zero_optimization"]["stage"]
                                     if args.deepspeed else None),
        }

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        row = {"step": state.global_step, "time_s": dt, "tokens_per_s": self.tokens_per_step / dt,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.cuda:
            row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.steps.append(row)

    def on_train_end(self, args, state, control, **kwargs):
        path = self.path
        if args.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{args.process_index}{path.suffix}")
        report = {"device": "cuda" if self.cuda else "cpu", "rank": args.process_index,
                  "world_size": args.world_size, "tokens_per_step": self.tokens_per_step, "plan": PLAN,
                  **self.model_info, "steps": self.steps}
        for key in ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "peak_rss_bytes"):
            if self.steps and key in self.steps[0]:
                report[key] = max(row[key] for row in self.steps)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)  # atomic: a reader never sees half a report


def in_backward_optimizer(model: torch.nn.Module, training_args: TrainingArguments, steps: int):
    """optimizer_in_backward: the optimizer stepped inside backward, as transformers 5.24 runs its layer-wise
    optimizers (trainer_optimizer.py _setup_low_rank_optimizer): one optimizer of the plan's kind per
    trainable parameter (Trainer.get_optimizer_cls_and_kwargs), a post-accumulate-grad hook that steps it
    and frees the gradient, and a LayerWiseDummyOptimizer for the Trainer, whose step is a no-op. Each
    parameter's optimizer has its own scheduler over ``steps`` optimizer steps, stepped by a second hook
    (optimization.py get_scheduler's layer-wise branch; its LayerWiseDummyScheduler fails under torch 2.13,
    which zips one lr per parameter with the dummy's one group, so the Trainer schedules the dummy)."""
    from transformers import get_scheduler
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args, model)
    optimizer_dict = {p: optimizer_cls([{"params": [p]}], **optimizer_kwargs)
                      for p in model.parameters() if p.requires_grad}
    scheduler_dict = {p: get_scheduler(training_args.lr_scheduler_type, optimizer=o,
                                       num_warmup_steps=training_args.get_warmup_steps(steps),
                                       num_training_steps=steps,
                                       scheduler_specific_kwargs=training_args.lr_scheduler_kwargs)
                      for p, o in optimizer_dict.items()}

    def optimizer_hook(param):
        if param.grad is not None:
            optimizer_dict[param].step()
            optimizer_dict[param].zero_grad()

    def scheduler_hook(param):
        scheduler_dict[param].step()

    for param in optimizer_dict:
        param.register_post_accumulate_grad_hook(optimizer_hook)
        param.register_post_accumulate_grad_hook(scheduler_hook)
    return LayerWiseDummyOptimizer(optimizer_dict=optimizer_dict, lr=training_args.learning_rate)


def _require_prequantized(args: argparse.Namespace) -> None:
    if PLAN["quant"] in PREQUANTIZED and not args.model:
        raise SystemExit(f"error: this plan trains LoRA on a {PLAN['quant'].upper()} base: pass --model with a "
                         f"pre-quantized {PLAN['quant_bits']}-bit {PLAN['quant'].upper()} checkpoint (Hub id or "
                         "directory); random weights cannot be quantized here")


def build_trainer(args: argparse.Namespace, callbacks=()) -> Trainer:
    """TrainingArguments, then the model (ZeRO-3 needs that order), the data and the Trainer."""
    _require_prequantized(args)
    with tempfile.TemporaryDirectory() as tmp:
        # a quantized or tensor-parallel base loads through from_pretrained: save it while no group exists
        random_base = PLAN["quant"] != "none" or PLAN.get("tp")
        checkpoint = random_checkpoint(args, tmp) if random_base and not args.model else None
        if args.deepspeed:
            _init_deepspeed()
        training_args = _training_arguments(args)
        model = build_model(args, checkpoint)
    callbacks = list(callbacks)
    if args.memory_report:
        tokens = args.batch * args.seq * args.grad_accum * training_args.world_size
        callbacks.append(MemoryReport(args.memory_report, tokens))
    if PLAN.get("objective", "sft") != "sft":  # DPO/GRPO: TRL's trainer, from trl_objective.py beside this file
        import importlib.util
        spec = importlib.util.spec_from_file_location("trl_objective", HERE / "trl_objective.py")
        objective = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(objective)
        return objective.objective_trainer(PLAN, args, model, training_args, callbacks, LOAD_DTYPE)
    dataset = build_dataset(args, model.config.vocab_size, training_args.world_size)
    dataset, eval_dataset = split_eval(args, dataset, model.config.vocab_size)
    # padding-free: each micro-batch flattened into one row with per-sequence position_ids (flash varlen)
    collator = DataCollatorWithFlattening() if PLAN.get("padding_free") else default_data_collator
    trainer_class = OffloadingTrainer if PLAN.get("activation_offload") else Trainer
    optimizers = (None, None)
    if PLAN.get("optimizer_in_backward"):  # one GPU, no grad accumulation: the Trainer's optimizer steps
        steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * (len(dataset) // args.batch))
        optimizers = (in_backward_optimizer(model, training_args, steps), None)
    trainer = trainer_class(model=model, args=training_args, train_dataset=dataset, eval_dataset=eval_dataset,
                            data_collator=collator, callbacks=callbacks, optimizers=optimizers)
    _keep_fsdp1_precision(trainer)
    return trainer


def _keep_fsdp1_precision(trainer: Trainer) -> None:
    """QLoRA under FSDP1: keep accelerate_config.yaml's mixed precision. transformers 5.24's
    update_fsdp_plugin_peft (Trainer._prepare_for_training) otherwise gives a 4-bit base stored as
    bf16 a bf16 MixedPrecision whatever the YAML says; FSDP1 casts no unit's inputs, and peft 0.21's
    Linear4bit casts x to lora_A's fp32 weight outside lora_A's own unit, so lora_A's F.linear gets
    fp32 x and bf16 weights and fails. With the YAML's policy the adapters run as the plan
    estimated them (fp32 under pure bf16)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) == 1 and PLAN["quant"] in ("nf4", "fp4"):
        plugin.set_mixed_precision = lambda *args, **kwargs: None


def _training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        optim=PLAN["optim"],
        # "bf16"/"fp16": weights loaded in that dtype and no autocast, the step vramplan estimated;
        # "-mixed": fp32 weights under autocast. DeepSpeed runs its own half-precision engine,
        # whose flag must match ds_config.json.
        bf16=PLAN["precision"] == "bf16-mixed" or (PLAN["precision"] == "bf16" and bool(args.deepspeed)),
        fp16=PLAN["precision"] == "fp16-mixed" or (PLAN["precision"] == "fp16" and bool(args.deepspeed)),
        # checkpoint_every k: only the layers i % k == 0 (transformers 5.24's every_n_layers)
        **{CHECKPOINTING: PLAN["checkpointing"], f"{CHECKPOINTING}_kwargs": {
            "use_reentrant": False, **({"every_n_layers": PLAN["checkpoint_every"]} if "checkpoint_every" in PLAN else {})}},
        # Liger's kernels (pip install liger-kernel); the chunked loss runs as Liger's fused, chunked one
        use_liger_kernel=PLAN.get("liger", False) or PLAN["loss"] == "chunked",
        # loss "trl": Liger's layer kernels only, its fused cross-entropy would replace TRL's head (as SFTTrainer does)
        liger_kernel_config={"fused_linear_cross_entropy": False} if PLAN["loss"] == "trl" else None,
        # optimizer_in_backward: each gradient is stepped and freed in backward, none is left to clip
        **({"max_grad_norm": 0.0} if PLAN.get("optimizer_in_backward") else {}),
        deepspeed=args.deepspeed,
        use_cpu=args.cpu,
        seed=args.seed,
        logging_steps=1,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        report_to="none",
        remove_unused_columns=False,
        dataloader_drop_last=True,
        # the eval step vramplan estimated: loss only (no compute_metrics: the logits are not gathered)
        eval_strategy="steps" if args.eval_batch > 0 else "no",
        eval_steps=args.eval_steps,
        per_device_eval_batch_size=max(args.eval_batch, 1),
        prediction_loss_only=True,
    )


def _init_deepspeed() -> None:
    """Start DeepSpeed's process group before anything reads a DeepSpeed config: under ZeRO-3 the
    model is created inside ``zero.Init``, which takes the world size from it (the Trainer starts
    it itself only on GPUs). Without a launcher (``python train.py --deepspeed ...``): one process
    on a free local port."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = build_trainer(args)
    trainer.train()
    if not args.no_save:
        trainer.save_model(args.output_dir)
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Every rank leaves the process group before the interpreter exits (the Trainer does not):
    torch warns about a group destructed at exit, and gloo's worker threads can abort it there
    ("terminate called without an active exception"). The barrier first: rank 0 may still be
    writing the model (``save_model`` gathers on every rank, then only rank 0 writes), and a rank
    that tears its groups down while a peer still holds the connection can abort the same way."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
