"""HF ``TrainingArguments`` (JSON or YAML) and TRL's configs (``trl sft|dpo|grpo --config``).

Defaults, read off the sources of the versions modelled:
- transformers 5.24 ``src/transformers/training_args.py``: ``per_device_train_batch_size=8``,
  ``gradient_accumulation_steps=1``, ``gradient_checkpointing=False``, ``optim="adamw_torch_fused"``,
  ``bf16=False``, ``fp16=False``; ``bf16``/``fp16`` turn on autocast (accelerate's native AMP) over
  whatever dtype the script loaded the model in. ``PreTrainedModel.from_pretrained``'s default
  ``dtype="auto"`` loads the checkpoint's dtype (bf16 for the shipped models).
- TRL (huggingface/trl ``trl/trainer/base_config.py``): ``gradient_checkpointing=True``,
  ``bf16=True`` unless ``fp16``; ``trl/trainer/sft_config.py``: ``max_length=1024``,
  ``packing=False``, ``padding_free=False``, ``activation_offloading=False``;
  ``trl/trainer/model_config.py`` (what ``trl sft`` loads the model with): ``dtype="float32"``,
  ``use_peft=False``, ``lora_r=16``, ``lora_alpha=32``, ``lora_dropout=0.05``,
  ``lora_target_modules=None`` (peft's per-model default), ``load_in_4bit/8bit=False``,
  ``bnb_4bit_quant_type="nf4"``, ``use_bnb_nested_quant=False``.
- transformers 5.24 renamed ``gradient_checkpointing(_kwargs)`` to ``activation_checkpointing(_kwargs)``
  (``TrainingArguments.__post_init__``: the old names are aliases used when the new one is unset).
- FSDP with ``bf16``/``fp16`` (accelerate 1.15 ``Accelerator.prepare_model``, FSDP1, and
  ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``): transformers sets accelerate's
  ``mixed_precision`` from the flag (``training_args.py``: ``ACCELERATE_MIXED_PRECISION``), and with
  ``mixed_precision != "no"`` accelerate upcasts every *trainable* low-precision flat parameter to
  fp32 (DeepSpeed's fp32 masters) and runs MixedPrecision(param_dtype=16 bits): whatever the load
  dtype, a full fine-tune is vramplan's ``-mixed``; frozen units (a LoRA base) keep their load
  dtype, so a 16-bit LoRA base stays pure 16-bit (a warning: the adapters then compute in 16 bits).
  Without the flag there is no policy and no upcast: the load dtype is the precision.

Every field of a file that is not a field HfArgumentParser knows (``hf_fields``: the real
TrainingArguments of transformers 5.24 and TRL 1.16's own configs, generated from them) is a
warning: a misspelt ``per_device_batch_size`` would otherwise read as the default batch.
"""

from __future__ import annotations

from pathlib import Path

from ..util.errors import SpecError
from .common import TORCH_COMPILE_WHY, Fields, Mapped, attn_from_name, optimizer_from_name
from .hf_fields import TRAINING_ARGUMENTS, TRANSFORMERS_VERSION, TRL_FIELDS, TRL_VERSION
from .launch import read_deepspeed_file, read_fsdp

__all__ = ["DTYPES", "SCRIPT_FIELDS", "layer_split", "load_precision", "lora_setup", "read_hf", "read_trl",
           "training_arguments", "trl_loss_precision", "trl_trainer_fields", "unknown_fields"]

DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
          "auto": "auto"}

#: what the example scripts' own argument dataclasses add beside TrainingArguments and that
#: read_hf reads (transformers' examples ModelArguments/DataTrainingArguments)
SCRIPT_FIELDS = frozenset({"model_name_or_path", "max_length", "max_seq_length", "dtype", "torch_dtype",
                           "attn_implementation", "model_init_kwargs"})


def load_precision(load: str, amp: str | None, m: Mapped, key: str) -> str:
    """vramplan's precision from the dtype the model is loaded in (fp32/bf16/fp16, or "auto":
    the checkpoint's) and the autocast dtype (``bf16``/``fp16`` flags; None: no autocast).
    fp32 weights under autocast are vramplan's ``-mixed``; 16-bit weights are its pure 16-bit
    (autocast to the weights' own dtype casts nothing)."""
    if load == "auto":
        m.assume(key, "auto", "the checkpoint's dtype: bf16 assumed (the shipped models' torch_dtype)")
        load = "bf16"
    if amp and m.setup.get("fsdp", "none") != "none" and load != "fp32":
        # accelerate upcasts trainable flat parameters to fp32 under mixed_precision (module docstring)
        if m.setup.get("method", "full") == "full":
            return f"{amp}-mixed"
        m.assume("bf16" if amp == "bf16" else "fp16", True, f"FSDP mixed precision over a {load} LoRA base: the "
                 f"frozen base stays {load} (accelerate upcasts only trainable units), modelled as pure {load}")
        return load
    if load == "fp32":
        return f"{amp}-mixed" if amp else "fp32"
    if amp and amp != load:
        m.ignore("fp16" if amp == "fp16" else "bf16", True, f"autocast to {amp} over {load} weights is not modelled: "
                 f"{load} assumed")
    return load


def training_arguments(f: Fields, path: Path, m: Mapped, *, trl: bool) -> str | None:
    """The TrainingArguments fields into ``m.setup``; returns the autocast dtype (or None)."""
    s = m.setup
    s["batch"] = f.int("per_device_train_batch_size", 8)
    s["grad_accum"] = f.int("gradient_accumulation_steps", 1)
    # transformers 5.24: activation_checkpointing(_kwargs), gradient_checkpointing(_kwargs) its alias
    name = "activation_checkpointing" if f.has("activation_checkpointing") else "gradient_checkpointing"
    s["checkpointing"] = f.bool(name, trl)
    kw_name = "activation_checkpointing_kwargs" if f.has("activation_checkpointing_kwargs") else \
        "gradient_checkpointing_kwargs"
    kwargs = _dict_field(f, kw_name)
    if s["checkpointing"] and kwargs is not None:
        if kwargs.bool("use_reentrant", False):
            m.ignore(f"{kw_name}.use_reentrant", True, "reentrant checkpointing is not modelled: use_reentrant=False "
                     "assumed")
        if kwargs.bool("offload", False):  # transformers 5.24 Trainer: saved activations to the host
            m.ignore(f"{kw_name}.offload", True, "offloaded checkpoints are not modelled: they stay on the GPU")
        every = kwargs.int("every_n_layers", 1)  # transformers 5.24: layers i % n == 0 (estimator/selective.py)
        if every < 1:
            raise kwargs.bad("every_n_layers", "a positive integer", every)
        if every > 1:
            s["checkpoint_every"] = every
    s["optimizer"] = optimizer_from_name(f.str("optim", "adamw_torch_fused"), m, "optim")
    fp16 = f.bool("fp16", False)
    bf16 = f.bool("bf16", trl and not fp16)
    if f.has("deepspeed"):
        read_deepspeed_file(_json_or_path(f.raw("deepspeed")), path, m)
    if f.has("fsdp") and f.raw("fsdp") not in ("", [], False):
        read_fsdp(f.raw("fsdp"), _dict_field(f, "fsdp_config"), m, "fsdp_config")
    if f.bool("use_liger_kernel", False):  # Trainer: integrations/liger.py apply_liger_kernel
        m.setup["liger"] = True
    # the Trainer evaluates every eval_steps (eval_strategy) or when a script calls evaluate (do_eval), at
    # per_device_eval_batch_size (default 8 whatever the train batch): its own phase (estimator/eval_step.py)
    if str(f.str("eval_strategy", "no")).lower() not in ("no", "intervalstrategy.no") or f.bool("do_eval", False):
        m.setup["eval_batch"] = f.int("per_device_eval_batch_size", 8)
    elif f.has("per_device_eval_batch_size"):
        m.ignore("per_device_eval_batch_size", f.raw("per_device_eval_batch_size"),
                 "no evaluation runs (eval_strategy \"no\", no do_eval): its batch is no memory")
    for key, why in (("torch_compile", TORCH_COMPILE_WHY),
                     ("tf32", None), ("auto_find_batch_size", "the batch is per_device_train_batch_size")):
        if why and f.bool(key, False):
            m.ignore(key, True, why)
    return "bf16" if bf16 else "fp16" if fp16 else m.amp


def _json_or_path(value):
    """A dict field given on a command line: TrainingArguments parses a string starting with ``{``
    as JSON (``__post_init__``, ``_VALID_DICT_FIELDS``); anything else stays (a path)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        from ..setup.inputs import loads_json

        return loads_json(value, "a JSON argument")
    return value


def _dict_field(f: Fields, key: str) -> Fields | None:
    value = _json_or_path(f.raw(key))
    return None if value is None else Fields({key: value}, f.where, f.prefix).sub(key)


def unknown_fields(f: Fields, m: Mapped, *, trl: bool) -> None:
    """A warning for every field that is not a field of TrainingArguments (transformers
    ``TRANSFORMERS_VERSION``), of the example scripts' arguments read_hf reads, or with ``trl``
    of TRL's configs (TRL ``TRL_VERSION``)."""
    # trl: also accelerate's num_processes, which a TRL config may carry for `trl ... --config`, and
    # ``env`` (TrlParser.parse_args_and_config sets those environment variables)
    known = TRAINING_ARGUMENTS.keys() | SCRIPT_FIELDS | (TRL_FIELDS.keys() | {"num_processes", "env"} if trl else set())
    what = (f"TrainingArguments (transformers {TRANSFORMERS_VERSION}) or TRL {TRL_VERSION}" if trl
            else f"TrainingArguments (transformers {TRANSFORMERS_VERSION})")
    for key in f.data:
        if key not in known:
            m.ignore(str(key), f.data[key], f"not a field of {what}: nothing read from it")


def _load_dtype(f: Fields, default: str, m: Mapped) -> str:
    kwargs = _dict_field(f, "model_init_kwargs")
    value = f.raw("dtype", f.raw("torch_dtype"))
    key = "dtype"
    if value is None and kwargs is not None:
        value, key = kwargs.raw("dtype", kwargs.raw("torch_dtype")), "model_init_kwargs.dtype"
    if value is None:
        return default
    if value not in DTYPES:
        raise f.bad(key, "one of " + ", ".join(DTYPES), value)
    return DTYPES[value]


def read_hf(data: dict, path: Path, m: Mapped) -> None:
    """Plain TrainingArguments: the setup of a full fine-tune of the model the script loads (no
    model in the file unless ``model_name_or_path`` is there); sequence length from
    ``max_length``/``max_seq_length`` when present."""
    f = Fields(data, str(path))
    m.model = f.str("model_name_or_path")
    amp = training_arguments(f, path, m, trl=False)
    seq = f.int("max_length", None) or f.int("max_seq_length", None)
    if seq is None:
        m.assume("max_length", None, "TrainingArguments has no sequence length: 2048 assumed (pass --seq)")
    else:
        m.setup["seq"] = seq
    load = _load_dtype(f, "auto", m)
    m.setup["precision"] = load_precision(load, amp, m, "dtype")
    m.setup["attn"] = attn_from_name(f.str("attn_implementation"), m, "attn_implementation")
    unknown_fields(f, m, trl=False)


def trl_trainer_fields(f: Fields, m: Mapped, *, sft: bool = True) -> None:
    """What TRL's trainer configs add to TrainingArguments (SFTConfig 1.16): ``max_length``
    (default 1024; ``max_seq_length`` its old name), packing, padding-free, activation offloading."""
    m.setup["seq"] = f.int("max_length", None) or f.int("max_seq_length", 1024)
    # SFTConfig: padding_free, and always with packing_strategy "bfd" (the default), flattens each
    # micro-batch into one row with per-sequence position_ids, for flash attention only (TRL warns else)
    bfd = f.bool("packing", False) and f.str("packing_strategy", "bfd") == "bfd"
    if f.bool("padding_free", False) or bfd:
        key = "padding_free" if f.bool("padding_free", False) else "packing"
        if "flash" in (f.str("attn_implementation", "") or ""):
            m.setup["padding_free"] = True
        else:
            m.ignore(key, True, "padding-free batches without flash attention (SDPA/eager get a block-diagonal N x N "
                     "mask; TRL warns) are not modelled: batch x max_length assumed")
    if f.bool("packing", False) and not bfd:
        m.ignore("packing", True, "packing is not modelled: sequences of max_length assumed")
    # trl 1.16 sft_trainer.py SFTTrainer.__init__: add_fused_lm_head (trl/kernels/chunked_logprob.py)
    # always replaces the head's logits and transformers' loss: --loss trl (estimator/objectives.py);
    # label smoothing (and a compute_loss_func) computes the full logits instead, the head under no_grad
    if sft:
        if f.float("label_smoothing_factor", 0.0) > 0:
            m.assume("label_smoothing_factor", f.raw("label_smoothing_factor"), "TRL 1.16's SFTTrainer computes the "
                     "full logits for label smoothing: transformers' full-logits loss assumed (its extra no-grad pass "
                     "through the fused head is not modelled)")
        else:
            m.setup["loss"] = "trl"
            if f.str("loss_type", "nll") != "nll":
                m.assume("loss_type", f.raw("loss_type"), "DFT weights the fused head's log-probs (N-sized): "
                         "modelled as loss trl")
    if f.bool("activation_offloading", False):  # SFTTrainer.training_step under OffloadActivations
        m.setup["activation_offload"] = True  # (with TRL's fused head: under --framework trl only, readers._framework)


def objective_fields(f: Fields, m: Mapped) -> None:
    """DPOConfig / KTOConfig / GRPOConfig (TRL 1.16) fields that set the objective's memory
    (estimator/objectives.py). GRPO: ``per_device_train_batch_size`` counts completions (default 8),
    ``num_generations`` 8, ``max_completion_length`` 512, ``beta`` 0.0 (no reference model),
    ``use_vllm`` False, ``vllm_mode`` "colocate", ``vllm_gpu_memory_utilization`` 0.3; GRPOConfig has no
    prompt truncation (no ``max_prompt_length`` in 1.16)."""
    s = m.setup
    objective = s.get("objective")
    if objective in ("dpo", "kto") and f.bool("precompute_ref_log_probs", False):
        s["ref_model"] = "precomputed"
    if objective != "grpo":
        return
    gens, completion = f.int("num_generations", 8), f.int("max_completion_length", 512)
    per_device = f.int("per_device_train_batch_size", 8)
    if gens < 1 or completion < 1:
        raise SpecError("num_generations and max_completion_length must be positive")
    if per_device % gens:
        raise SpecError(f"per_device_train_batch_size {per_device} is not a multiple of num_generations {gens}: "
                        f"vramplan models whole groups of completions per micro-batch (--batch is prompts: "
                        f"per_device_train_batch_size / num_generations)")
    s["num_generations"], s["max_completion_length"], s["batch"] = gens, completion, per_device // gens
    prompt = f.int("max_prompt_length", None)
    if prompt is None:  # 512: GRPOConfig's max_prompt_length default before TRL 1.0 removed it
        prompt = 512
        m.assume("max_prompt_length", None, "GRPOConfig (TRL 1.16) does not truncate prompts: prompts of 512 "
                 "tokens assumed (the old max_prompt_length default; --max-prompt-length to change it)")
    s["max_prompt_length"], s["seq"] = prompt, prompt + completion
    if f.float("beta", 0.0) == 0.0:  # GRPOTrainer loads no reference model at beta 0
        s["ref_model"] = "none"
    if f.bool("use_vllm", False):
        mode = f.str("vllm_mode", "colocate")
        if mode not in ("colocate", "server"):
            raise SpecError(f"vllm_mode must be colocate or server; got {mode!r}")
        s["generation"] = f"vllm-{mode}"
        if mode == "colocate":
            s["vllm_memory_fraction"] = f.float("vllm_gpu_memory_utilization", 0.3)


def trl_loss_precision(m: Mapped) -> None:
    """``--loss trl`` is modelled without autocast (estimator/objectives.py ``check_trl_sft``): a
    mixed-precision TRL run is read with transformers' full-logits loss, and says so."""
    if m.setup.get("loss") == "trl" and str(m.setup.get("precision", "")).endswith("-mixed"):
        m.setup.pop("loss")
        m.assume("loss", "trl", "TRL's fused LM head under autocast (fp32 weights, bf16/fp16 on) is not modelled: "
                 "transformers' full-logits loss assumed (load the model in bf16 to model TRL's head)")


def lora_setup(m: Mapped, *, r: int, alpha: int, dropout: float, targets, four_bit: str | None = None,
               double_quant: bool = False, eight_bit: bool = False, use_dora: bool = False,
               modules_to_save=None, target_key: str = "lora_target_modules") -> None:
    """A LoRA adapter into ``m.setup``: TRL ModelConfig's fields or a peft ``LoraConfig``'s
    (``targets``: None for peft's per-model default, names, or ``all-linear``; ``four_bit``: the
    bitsandbytes 4-bit quant type of a QLoRA base; ``modules_to_save``: the modules trained in
    full beside the adapters; ``use_dora``: DoRA); ``target_key``: the field a warning names."""
    s = m.setup
    s["method"] = "qlora" if four_bit else "lora"
    s["lora_rank"], s["lora_alpha"], s["lora_dropout"] = r, alpha, dropout
    if targets is None:
        m.assume(target_key, None, "peft's default for the model: q_proj,v_proj assumed")
        targets = ("q_proj", "v_proj")
    targets = tuple(targets)
    s["lora_targets"] = "all-linear" if targets in (("all-linear",), ("all_linear",)) else ",".join(targets)
    if four_bit:
        s["quant"], s["double_quant"] = four_bit, double_quant
    elif eight_bit:
        s["quant"] = "int8"
    if use_dora:  # peft LoraConfig(use_dora=True): a magnitude vector per adapted Linear
        s["dora"] = True
    if modules_to_save:  # peft ModulesToSaveWrapper: a trained full copy of each module
        s["modules_to_save"] = ",".join(modules_to_save)


def read_trl(data: dict, path: Path, m: Mapped) -> None:
    """A ``trl sft|dpo|grpo --config`` YAML: ModelConfig + ScriptArguments + the trainer's config."""
    f = Fields(data, str(path))
    m.model = f.str("model_name_or_path")
    amp = training_arguments(f, path, m, trl=True)
    s = m.setup
    trl_trainer_fields(f, m, sft="objective" not in s)  # trl dpo|kto|grpo: the objective's own head
    objective_fields(f, m)
    s["attn"] = attn_from_name(f.str("attn_implementation"), m, "attn_implementation")
    load = _load_dtype(f, "fp32", m)  # ModelConfig.dtype defaults to float32
    four, eight = f.bool("load_in_4bit", False), f.bool("load_in_8bit", False)
    if f.bool("use_peft", False):
        quant = None
        if four:
            quant = f.str("bnb_4bit_quant_type", "nf4")
            if quant not in ("nf4", "fp4"):
                raise f.bad("bnb_4bit_quant_type", "nf4 or fp4", quant)
        lora_setup(m, r=f.int("lora_r", 16), alpha=f.int("lora_alpha", 32), dropout=f.float("lora_dropout", 0.05),
                   targets=f.names("lora_target_modules"), four_bit=quant,
                   double_quant=f.bool("use_bnb_nested_quant", False), eight_bit=eight,
                   use_dora=f.bool("use_dora", False), modules_to_save=f.names("lora_modules_to_save"))
    else:
        if four or eight:
            m.ignore("load_in_4bit" if four else "load_in_8bit", True, "a quantized base needs use_peft: full "
                     "fine-tune of the unquantized model assumed")
        for key in ("use_dora", "lora_modules_to_save"):
            if f.has(key) and f.raw(key) is not False:
                m.ignore(key, f.raw(key), "use_peft is off: no adapter")
    s["precision"] = load_precision(load, amp, m, "dtype")
    trl_loss_precision(m)
    if f.has("num_processes"):
        m.gpus = f.int("num_processes")
    layer_split(f, m)
    unknown_fields(f, m, trl=True)


def layer_split(f: Fields, m: Mapped) -> None:
    """``model_init_kwargs`` with ``device_map`` auto/balanced/sequential and ``max_memory``: the
    layer split over the capped GPUs of one process (TRL 1.16 ``SFTTrainer.__init__`` hands the
    kwargs to ``create_model_from_path`` -> ``from_pretrained``, trl/trainer/utils.py, unless the
    run is distributed: MULTI_GPU/DEEPSPEED set ``device_map=None``, and from_pretrained then
    ignores ``max_memory``). The caps give the GPU count; ``cpu``/``disk`` budgets are refused
    (vramplan/setup/max_memory.py). A ``device_map`` without caps: :func:`_device_map_alone`."""
    kwargs = _dict_field(f, "model_init_kwargs")
    if kwargs is None:
        return
    if not kwargs.has("max_memory"):
        _device_map_alone(kwargs, m)
        return
    caps, where = kwargs.raw("max_memory"), "model_init_kwargs.max_memory"
    strategy = kwargs.raw("device_map")
    if m.gpus not in (None, 1):
        m.ignore(where, caps, f"{m.gpus} processes: TRL loads with device_map=None when distributed, and "
                 "from_pretrained reads max_memory only with a device_map")
        return
    if strategy not in ("auto", "balanced", "sequential"):
        m.ignore(where, caps, f"read with device_map auto, balanced or sequential only (a layer split); got "
                 f"{strategy!r}")
        return
    if not isinstance(caps, dict):
        raise kwargs.bad("max_memory", "a mapping of GPU index to size ({0: 20GiB, 1: 24GiB})", caps)
    from ..setup.max_memory import parse_max_memory

    try:
        parsed = parse_max_memory(",".join(f"{k}={v}" for k, v in caps.items()), where)
    except SpecError as exc:
        raise SpecError(f"{f.where}: {exc}") from None
    if len(parsed) < 2:
        m.ignore(where, caps, "one GPU: nothing to split")
        return
    m.setup.update(device_map=strategy, max_memory=parsed)
    m.gpus = len(parsed)


def _device_map_alone(kwargs: Fields, m: Mapped) -> None:
    """``model_init_kwargs.device_map`` auto/balanced/sequential without ``max_memory``: the even
    layer split over the GPUs the one process sees (``--device-map``; TRL 1.16 passes it on to
    ``from_pretrained``, sft_trainer.py, unless MULTI_GPU/DEEPSPEED set ``device_map=None``). The
    config does not name that GPU count: 2 is assumed, and said (``--gpus N`` overrides it). Any
    other placement (one device, a dict) is said not read."""
    if not kwargs.has("device_map"):
        return
    strategy, where = kwargs.raw("device_map"), "model_init_kwargs.device_map"
    if m.gpus not in (None, 1):
        m.ignore(where, strategy, f"{m.gpus} processes: TRL loads with device_map=None when distributed")
        return
    if strategy not in ("auto", "balanced", "sequential"):
        m.ignore(where, strategy, "not a layer split (auto, balanced or sequential): one GPU assumed")
        return
    m.setup.update(device_map=strategy)
    m.gpus = 2
    m.assume(where, strategy, "the layers split over the GPUs the process sees, which the config does not "
             "name: 2 GPUs assumed (pass --gpus N)")
