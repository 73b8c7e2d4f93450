"""TRL's own trainers as the truth of the DPO, ORPO, KTO and GRPO estimates (estimator/objectives.py),
and of SFT's ``--loss trl`` (SFTTrainer, :func:`run_sft`): a DPOTrainer, an ORPOTrainer
(``trl.experimental.orpo``), a KTOTrainer, a GRPOTrainer (HF generation) or an SFTTrainer runs two
steps on this CPU on a narrow random model,
with a dataset built in memory (a word-level tokenizer whose words are the token ids, so every row
has exactly the lengths of the Setup) and, for GRPO, a reward function in Python. The live-tensor
counter (:mod:`vramplan.run.live`) labels the phases:

- ``generation``: inside the policy's ``generate`` (GRPO);
- ``kl``: KTO's no-grad forward of the KL rows through the policy, before its forward;
- ``reference``: a forward under ``torch.no_grad`` outside ``generate`` (the reference model, or
  the policy with its adapters disabled);
- ``forward`` / ``backward`` / ``optimizer``: the policy's forward, ``accelerator.backward``,
  ``on_pre_optimizer_step``.

Read with TRL 1.16 (trl/trainer/dpo_trainer.py, kto_trainer.py, grpo_trainer.py,
trl/experimental/orpo/orpo_trainer.py). Weights are loaded in the
Setup's dtype and the trainers' ``bf16``/``fp16`` autocast is off, as in vramplan's canonical step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass

from ..specs import Setup

#: phases in step order (the objective's first)
TRUTH_PHASES = ("generation", "kl", "reference", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class ObjectiveTruth:
    """Peaks of live tensor bytes per phase of two TRL steps."""

    tensor_peak_bytes: int
    phase_peaks_bytes: dict[str, int]
    phase: str
    params_trainable: int
    seconds: float = 0.0
    #: the frozen base's bytes (parameters, buffers and bitsandbytes' quantization state) as the trainer
    #: holds them before the first step (0 where not measured)
    weights_bytes: int = 0
    #: host RAM of activation offloading's copies at their peak (0 without offloading)
    host_peak_bytes: int = 0


def word_tokenizer(vocab: int, eos: int):
    """A fast tokenizer whose words ``t0`` .. ``t{vocab-1}`` are the token ids (no special tokens
    added): a text of n words is n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", pad_token=f"t{eos}", unk_token="t0")
    return out


def _words(gen, n: int, vocab: int, avoid: int) -> str:
    ids = [int(x) for x in gen.integers(2, vocab, size=n)]
    return " ".join(f"t{i if i != avoid else 2}" for i in ids)


def _config_common(setup: Setup, out: str) -> dict:
    from ..emit.trainer import TRAINER_OPTIM

    return dict(output_dir=out, max_steps=2, per_device_train_batch_size=1, learning_rate=1e-5,
                gradient_accumulation_steps=setup.grad_accum, logging_steps=1000, save_strategy="no", report_to=[],
                bf16=False, fp16=False, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
                gradient_checkpointing=setup.checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False}, optim=TRAINER_OPTIM[setup.optimizer])


class _Phases:
    """Phase labels for the counter, from hooks on the policy (and the reference copy)."""

    def __init__(self, counter, kl: bool = False) -> None:
        self.counter = counter
        self.in_generate = False
        self.kl = kl  # KTO: a no-grad forward of the policy before its forward is the KL batch's
        self.policy_forward_done = False

    def pre_forward(self, *_a, **_k) -> None:
        import torch

        if self.in_generate:
            self.counter.phase("generation")
        elif torch.is_grad_enabled():
            self.policy_forward_done = True
            self.counter.phase("forward")
        else:
            self.counter.phase("kl" if self.kl and not self.policy_forward_done else "reference")

    def wrap_generate(self, model) -> None:
        original = model.generate

        def generate(*a, **k):
            self.in_generate = True
            self.counter.phase("generation")
            try:
                return original(*a, **k)
            finally:
                self.in_generate = False

        model.generate = generate


def _callback(phases: _Phases, extra_tracked=()):
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            for group in getattr(optimizer, "param_groups", []):  # torch's default on CUDA (run/callback.py)
                if "foreach" in group and not group.get("fused"):
                    group["foreach"] = True
            # what the run holds (not every tensor of the process: earlier runs' leave theirs behind)
            phases.counter.track(model, optimizer, *extra_tracked)
            phases.counter.__enter__()
            phases.counter.phase("setup")
            return control

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            phases.counter.phase("optimizer")
            return control

        def on_step_end(self, args, state, control, **kwargs):
            phases.counter.phase("step_end")
            return control

    return Count()


def _run(trainer, model, phases: _Phases, ref=None) -> dict[str, int]:
    hooks = [model.register_forward_pre_hook(phases.pre_forward)]
    if ref is not None:
        hooks.append(ref.register_forward_pre_hook(lambda *_a: phases.counter.phase("reference")))
    backward = trainer.accelerator.backward

    def wrapped(loss, **kw):
        phases.policy_forward_done = False
        phases.counter.phase("backward")
        return backward(loss, **kw)

    trainer.accelerator.backward = wrapped
    try:
        trainer.train()
    finally:
        phases.counter.__exit__(None, None, None)
        for h in hooks:
            h.remove()
    return {k: v for k, v in phases.counter.phase_peaks.items() if k in TRUTH_PHASES}


def _result(peaks: dict[str, int], model, t0: float) -> ObjectiveTruth:
    phase = max(peaks, key=lambda p: peaks[p])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ObjectiveTruth(peaks[phase], peaks, phase, trainable, time.perf_counter() - t0)


def _quiet() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    logging.getLogger("trl").setLevel(logging.ERROR)
    return stack


def _preference_run(config: dict, setup: Setup, row, trainer_cls, config_cls, **extra) -> ObjectiveTruth:
    """Two steps of TRL's DPOTrainer / ORPOTrainer / KTOTrainer on ``setup``: ``row(gen, i, P, C,
    vocab, eos)`` is dataset row ``i`` (a prompt of ``max_prompt_length`` tokens, 1 if unset, and a
    completion of C tokens with its EOS: ``seq`` in all); the reference as :func:`reference` reads
    it (a frozen copy built here; the adapter, TRL's "ref" copy of it; precomputed)."""
    import numpy as np
    from datasets import Dataset

    from ..estimator.objectives import lengths, reference
    from ..run.live import LiveTensorCounter
    from .cpu_truth import build_model

    t0 = time.perf_counter()
    vocab, eos = int(config["vocab_size"]), _eos(config)
    lens = lengths(setup)
    P = setup.max_prompt_length or 1
    gen = np.random.default_rng(0)
    data = Dataset.from_list([row(gen, i, P, lens.row_len - P, vocab, eos)
                              for i in range(setup.batch * setup.grad_accum * 2)])
    ref = reference(setup)
    model = build_model(config, setup.replace(checkpointing=False))
    ref_model, kw = None, {}
    if ref == "copy":
        ref_model = build_model(config, setup.replace(method="full", checkpointing=False, lora_rank=16))
        ref_model.requires_grad_(False).eval()
    if setup.objective != "orpo":  # ORPO has no reference
        kw["ref_model"] = ref_model
        extra["precompute_ref_log_probs"] = ref == "precomputed"
    with _quiet(), tempfile.TemporaryDirectory() as out:
        args = config_cls(**{**_config_common(setup, out), "per_device_train_batch_size": setup.batch},
                          max_length=lens.row_len, **extra)
        counter = LiveTensorCounter(device="cpu")
        phases = _Phases(counter, kl=setup.objective == "kto")
        trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=word_tokenizer(vocab, eos),
                              callbacks=[_callback(phases, [ref_model] if ref_model is not None else [])], **kw)
        peaks = _run(trainer, trainer.model, phases, getattr(trainer, "ref_model", None))
    return _result(peaks, model, t0)


def run_dpo(config: dict, setup: Setup) -> ObjectiveTruth:
    """Two DPOTrainer steps of ``setup`` (objective dpo): ``batch`` pairs of rows of ``seq`` tokens
    (a prompt of ``max_prompt_length`` tokens, 1 if unset, and the completion with its EOS)."""
    from trl import DPOConfig, DPOTrainer

    def row(gen, _i, P, C, vocab, eos):  # DPOTrainer adds the completion's EOS
        return {"prompt": _words(gen, P, vocab, eos), "chosen": _words(gen, C - 1, vocab, eos),
                "rejected": _words(gen, C - 1, vocab, eos)}

    return _preference_run(config, setup, row, DPOTrainer, DPOConfig)


def run_grpo(config: dict, setup: Setup) -> ObjectiveTruth:
    """Two GRPOTrainer steps of ``setup`` (objective grpo, HF generation): ``batch`` prompts x
    ``num_generations`` completions per micro-batch, prompts of exactly the prompt length,
    completions of exactly the completion length (``min_new_tokens``), a reward in Python."""
    import numpy as np
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ..estimator.objectives import lengths, reference
    from ..run.live import LiveTensorCounter
    from .cpu_truth import build_model

    t0 = time.perf_counter()
    vocab, eos = int(config["vocab_size"]), _eos(config)
    lens = lengths(setup)
    gen = np.random.default_rng(0)
    prompts = setup.batch * setup.grad_accum * 2
    data = Dataset.from_list([{"prompt": _words(gen, lens.prompt, vocab, eos)} for _ in range(prompts)])
    ref = reference(setup)
    model = build_model(config, setup.replace(checkpointing=False))
    _generate_with_cache(model, config)
    if ref == "copy":  # GRPOTrainer builds the reference from the policy's checkpoint path
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = tempfile.mkdtemp(prefix="vramplan-grpo-ref-")
        base.save_pretrained(path)
        model.config._name_or_path = base.config._name_or_path = path

    def reward(completions, **_kw):
        return [float(len(c)) for c in completions]

    with _quiet(), tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(**{**_config_common(setup, out),
                             "per_device_train_batch_size": setup.batch * setup.num_generations},
                          num_generations=setup.num_generations, max_completion_length=lens.completion,
                          beta=0.0 if ref == "none" else 0.04, temperature=1.0,
                          generation_kwargs={"min_new_tokens": lens.completion}, log_completions=False)
        counter = LiveTensorCounter(device="cpu")
        phases = _Phases(counter)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=word_tokenizer(vocab, eos), callbacks=[_callback(phases)])
        phases.wrap_generate(trainer.model)
        extra = [trainer.ref_model] if trainer.ref_model is not None else []
        counter.track(*extra)
        peaks = _run(trainer, trainer.model, phases, trainer.ref_model)
    return _result(peaks, model, t0)


def _generate_with_cache(model, config: dict) -> None:
    """HF ``generate`` with the KV cache, as a user's checkpoint loads: its config.json's ``use_cache``
    (true for every shipped profile) is copied into ``model.generation_config`` by transformers 5.24
    (``GenerationConfig.from_model_config``), and ``generate`` decodes one token per step with a
    DynamicCache only when ``generation_config.use_cache`` is true (generation/utils.py: ``model_kwargs
    ["use_cache"] = generation_config.use_cache``; ``next_sequence_length = 1 if
    model_kwargs["use_cache"] else None``). :func:`build_model` turns ``use_cache`` off for the training
    step; left off, every decode step re-ran the whole prefix without a cache (the last one over
    prompt + completion - 1 tokens), which no GRPO run of a real checkpoint does. The training forwards
    are unchanged: TRL's fused head passes ``use_cache=False`` itself (trl/trainer/utils.py
    ``_fused_forward``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    use = bool(config.get("use_cache", True))
    base.config.use_cache = use
    base.generation_config.use_cache = use


def run_sft(config: dict, setup: Setup) -> ObjectiveTruth:
    """Two SFTTrainer steps of ``setup`` (``--loss trl``): ``batch`` rows of exactly ``seq`` token ids
    (a pre-tokenized dataset: SFTTrainer skips its tokenization, the collator copies ``input_ids`` to
    ``labels``, no padding), TRL's fused LM head as SFTTrainer installs it. With ``--framework trl``
    SFTTrainer prepares the model itself, as users run it: the base as loaded (no
    ``prepare_model_for_kbit_training``), ``peft_config`` handed to the trainer (its ``get_peft_model``,
    ``enable_input_require_grads`` and, on a quantized base, the bf16 cast of the adapters)."""
    import numpy as np
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from ..run.live import LiveTensorCounter, SplitCounter
    from .cpu_truth import build_model

    t0 = time.perf_counter()
    vocab, eos = int(config["vocab_size"]), _eos(config)
    gen = np.random.default_rng(0)
    n = setup.batch * setup.grad_accum * 2
    data = Dataset.from_list([{"input_ids": [int(x) for x in gen.integers(2, vocab, size=setup.seq)]}
                              for _ in range(n)])
    extra = {}
    if setup.framework == "trl":
        from ..run.models import lora_config
        from .cpu_truth import load_base

        model = load_base(config, setup)
        if setup.adapters:
            extra["peft_config"] = lora_config(setup)
    else:
        model = build_model(config, setup.replace(checkpointing=False))
    with _quiet(), tempfile.TemporaryDirectory() as out:
        args = SFTConfig(**{**_config_common(setup, out), "per_device_train_batch_size": setup.batch},
                         max_length=setup.seq, packing=False, dataset_num_proc=None)
        counter = SplitCounter() if setup.activation_offload else LiveTensorCounter(device="cpu")
        phases = _Phases(counter)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer(vocab, eos),
                             callbacks=[_callback(phases)], **extra)
        model = trainer.model
        if setup.activation_offload:
            # SFTConfig(activation_offloading=True) builds get_act_offloading_ctx_manager(model) in __init__,
            # which needs an accelerator; the same manager with cpu playing the device (run/act_offload.py),
            # entered by SFTTrainer.training_step as TRL enters its own; its host copies count as host
            from ..run.act_offload import offload_manager

            trainer.maybe_activation_offload_context = offload_manager(model, counter, lambda t: t)
            counter.measuring = True
        weights = frozen_bytes(model)
        with contextlib.ExitStack() as stack:
            if setup.liger:  # use_liger_kernel: the layer kernels' stand-ins, TRL's fused head kept (run/liger.py)
                from ..run.liger import patch_liger

                stack.enter_context(patch_liger(model, fused_loss=False))
            if setup.activation_offload:  # the manager's record_stream on the no-op streams (run/act_offload.py)
                from ..run.act_offload import host_record_stream

                stack.enter_context(host_record_stream())
            peaks = _run(trainer, trainer.model, phases)
        if setup.activation_offload:  # the device's peaks: the host copies left out
            peaks = {k: v for k, v in counter.device_phase_peaks.items() if k in TRUTH_PHASES}
    host = counter.host_peak if setup.activation_offload else 0
    return dataclasses.replace(_result(peaks, model, t0), weights_bytes=weights, host_peak_bytes=host)


def frozen_bytes(model) -> int:
    """Bytes of ``model``'s frozen parameters and buffers and of bitsandbytes' quantization state
    (each storage once): the base as the trainer holds it."""
    from ..run.cuda_paths import quant_state_tensors

    seen, total = set(), 0
    tensors = [p for p in model.parameters() if not p.requires_grad]
    tensors += list(model.buffers()) + quant_state_tensors(model)
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _eos(config: dict) -> int:
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    vocab = int(config["vocab_size"])
    return int(eos) if isinstance(eos, int) and eos < vocab else vocab - 1


def run_orpo(config: dict, setup: Setup) -> ObjectiveTruth:
    """Two ORPOTrainer steps of ``setup`` (objective orpo; TRL 1.16 ``trl.experimental.orpo``):
    ``batch`` pairs, each row a prompt and a completion with its EOS, ``seq`` tokens in all (ORPO adds
    no BOS: the word tokenizer has none)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    def row(gen, _i, P, C, vocab, eos):  # one text prompt + answer: the answer starts with its space
        return {"prompt": _words(gen, P, vocab, eos), "chosen": " " + _words(gen, C - 1, vocab, eos),
                "rejected": " " + _words(gen, C - 1, vocab, eos)}

    return _preference_run(config, setup, row, ORPOTrainer, ORPOConfig, dataset_num_proc=None)


def run_kto(config: dict, setup: Setup) -> ObjectiveTruth:
    """Two KTOTrainer steps of ``setup`` (objective kto; TRL 1.16 ``trl.KTOTrainer``): ``batch``
    unpaired rows of ``seq`` tokens, desirable and undesirable alternating, and the KL batch TRL
    builds by rotating the completions within the micro-batch (``loss_type="kto"``)."""
    from trl import KTOConfig, KTOTrainer

    def row(gen, i, P, C, vocab, eos):  # one text prompt + completion; KTO appends the EOS text unless there
        return {"prompt": _words(gen, P, vocab, eos), "completion": " " + _words(gen, C - 1, vocab, eos) + f" t{eos}",
                "label": i % 2 == 0}

    return _preference_run(config, setup, row, KTOTrainer, KTOConfig, dataset_num_proc=None)
