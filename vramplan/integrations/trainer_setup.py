"""The Setup of a running HF Trainer (or TRL trainer), read off the objects it trains with.

:func:`setup_from_trainer` takes what ``TrainerCallback.on_train_begin`` is given (transformers
5.24 ``trainer_callback.py``, ``CallbackHandler.call_event``: ``args``, ``model``, ``optimizer``,
...) and maps, through the readers' own functions (:mod:`vramplan.readers.trainer`):

- ``args.to_dict()`` (TrainingArguments, or a TRL config: SFTConfig's ``max_length``, ``packing``,
  ``padding_free``, ``activation_offloading``) with :func:`~vramplan.readers.trainer.training_arguments`
  (batch, accumulation, checkpointing and its kwargs, ``optim``, ``bf16``/``fp16``, ``deepspeed``,
  ``fsdp``/``fsdp_config``); the GPU count is ``args.world_size``;
- accelerate's shared state (``accelerate.state.AcceleratorState``, 1.15) when the run was
  launched with an accelerate config instead: its DeepSpeed plugin's config, its FSDP plugin,
  its ``mixed_precision``;
- the model: ``config.to_dict()`` -> ModelSpec (:func:`vramplan.model.architecture.model_spec_from_config`),
  ``config._attn_implementation``, the load dtype (the dtype most of the base's parameters have;
  a quantized base's ``config.dtype``), ``config.quantization_config`` (bitsandbytes
  ``load_in_4bit``/``load_in_8bit``, ``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant``), and a
  peft model's active ``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``
  (all the model's Linear names but the head read as ``all-linear``, as peft expands it),
  ``modules_to_save``, ``use_dora``);
- the optimizer the Trainer built (its class and ``fused`` flag): what runs, whatever ``optim`` says;
- the objective from a TRL config's class (DPOConfig, KTOConfig, ORPOConfig, GRPOConfig; GRPO's
  ``num_generations``, ``max_completion_length``, ``use_vllm``/``vllm_mode``).

Torch-free by itself: it reads attributes and dtype names (the callback that calls it imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..readers.common import Fields, Mapped, ReadWarning, attn_from_name
from ..readers.trainer import (
    DTYPES,
    load_precision,
    lora_setup,
    training_arguments,
    trl_loss_precision,
    trl_trainer_fields,
)
from ..specs import ModelSpec, Setup

__all__ = ["TrainerSetup", "load_dtype", "model_name", "optimizer_name", "setup_from_trainer"]


@dataclass(frozen=True)
class TrainerSetup:
    """What the Trainer runs: its model's spec, the Setup (``seq`` None until it is known), the
    fields the mapping determined, and the warnings (fields vramplan does not model)."""

    model: str
    spec: ModelSpec
    fields: dict
    warnings: tuple[ReadWarning, ...]

    def setup(self, seq: int | None = None) -> Setup:
        """The Setup, with ``seq`` when the trainer's arguments do not fix it."""
        from ..setup.inputs import setup_from_mapping

        values = dict(self.fields)
        if seq is not None:
            values["seq"] = seq
        return setup_from_mapping(values, "the Trainer's setup")

    @property
    def seq(self) -> int | None:
        return self.fields.get("seq")


#: torch optimizer classes (transformers 5.24 ``Trainer.get_optimizer_cls_and_kwargs``) -> vramplan
_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Adafactor": "adafactor", "AdamW8bit": "adamw-8bit",
               "Adam8bit": "adamw-8bit", "PagedAdamW8bit": "paged-adamw-8bit", "PagedAdam8bit": "paged-adamw-8bit",
               "Lion": "lion", "Lion32bit": "lion",
               # DeepSpeed 0.19.8 ops/adam: what its ZeRO optimizer wraps (fp32 moments, as torch AdamW)
               "FusedAdam": "adamw-fused", "DeepSpeedCPUAdam": "adamw"}


def optimizer_name(optimizer) -> str | None:
    """vramplan's optimizer for the optimizer object the Trainer steps (accelerate's and
    DeepSpeed's wrappers unwrapped), or None when it is not one vramplan models."""
    inner = optimizer
    for _ in range(4):  # accelerate's AcceleratedOptimizer, DeepSpeed's ZeRO optimizer: .optimizer
        if type(inner).__name__ in _OPTIMIZERS or not hasattr(inner, "optimizer"):
            break
        inner = inner.optimizer
    name = _OPTIMIZERS.get(type(inner).__name__)
    if name == "adamw" and type(inner).__module__.startswith("torch"):
        fused = any(g.get("fused") for g in getattr(inner, "param_groups", ()))
        return "adamw-fused" if fused else "adamw"
    return name


def _dtype_name(dtype) -> str | None:
    text = str(dtype).removeprefix("torch.")
    return DTYPES.get(text)


def load_dtype(model, quantized: bool) -> str:
    """The dtype the base was loaded in (fp32/bf16/fp16): a quantized base's ``config.dtype``
    (its floating parameters were upcast by ``prepare_model_for_kbit_training``), else the
    dtype most of the parameters outside the LoRA adapters have."""
    config = getattr(model, "config", None)
    if quantized:
        found = _dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
        if found is not None:
            return found
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        dt = _dtype_name(param.dtype)
        if dt is not None:
            counts[dt] = counts.get(dt, 0) + param.numel()
    return max(counts, key=counts.get) if counts else "fp32"


def model_name(model) -> str:
    """The name a record gives the model: the Hub id or path it was loaded from, else its type."""
    config = getattr(model, "config", None)
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
               or getattr(config, "model_type", "") or type(model).__name__)


def _unwrap(model):
    """The model under DDP/FSDP1 wrappers (``.module``)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def _accelerate_state(m: Mapped) -> None:
    """DeepSpeed/FSDP and mixed precision from accelerate's shared state, when an Accelerator
    exists (the Trainer creates one in ``create_accelerator_and_postprocess``)."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - transformers needs accelerate
        return
    if not AcceleratorState._shared_state:  # noqa: SLF001 - accelerate's own "initialized" test
        return
    state = AcceleratorState()
    kind = getattr(state.distributed_type, "value", str(state.distributed_type))
    mixed = str(getattr(state, "mixed_precision", "no"))
    if mixed in ("bf16", "fp16"):
        m.amp = mixed
    if kind == "DEEPSPEED" and state.deepspeed_plugin is not None:
        from ..readers.launch import read_deepspeed

        read_deepspeed(dict(state.deepspeed_plugin.deepspeed_config), "accelerate deepspeed_plugin", m,
                       "deepspeed_plugin")
    elif kind == "FSDP" and state.fsdp_plugin is not None:
        from ..readers.launch import read_fsdp

        plugin = state.fsdp_plugin
        strategy = getattr(plugin, "sharding_strategy", None)
        config = {"fsdp_version": getattr(plugin, "fsdp_version", 1),
                  # FSDP1: CPUOffload(offload_params); FSDP2: a CPUOffloadPolicy (no such field)
                  "offload_params": bool(getattr(getattr(plugin, "cpu_offload", None), "offload_params", False))
                  or type(getattr(plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy",
                  "activation_checkpointing": bool(getattr(plugin, "activation_checkpointing", False))}
        if strategy is not None:
            config["sharding_strategy"] = getattr(strategy, "name", str(strategy))
        else:
            config["reshard_after_forward"] = bool(getattr(plugin, "reshard_after_forward", True))
        # hybrid sharding: FSDP1's HYBRID_SHARD is one shard group per node (torchrun's LOCAL_WORLD_SIZE
        # ranks), FSDP2's the ParallelismConfig's replicas (estimator/hybrid_shard.py)
        import os

        nodes = state.num_processes // max(int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes)), 1)
        read_fsdp("full_shard", Fields(config, "accelerate fsdp_plugin"), m, "fsdp_plugin", nodes=max(nodes, 1))
        replicas = getattr(getattr(state, "parallelism_config", None), "dp_replicate_size", 1) or 1
        if replicas > 1:
            m.setup["dp_replicate"] = replicas


def _quantization(model, m: Mapped) -> tuple[str | None, bool, bool]:
    """(4-bit quant type or None, double quant, 8-bit) of a bitsandbytes base; other methods are
    refused by name (GPTQ/AWQ need their checkpoint's bits and groups: a warning)."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return None, False, False
    q = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    method = str(getattr(q.get("quant_method"), "value", q.get("quant_method")) or "")
    if q.get("load_in_4bit"):
        return str(q.get("bnb_4bit_quant_type") or "fp4"), bool(q.get("bnb_4bit_use_double_quant")), False
    if q.get("load_in_8bit"):
        return None, False, True
    if method in ("gptq", "awq"):
        m.setup["quant"] = method
        if q.get("bits") is not None:
            m.setup["quant_bits"] = int(q["bits"])
        if q.get("group_size") is not None:
            m.setup["quant_group_size"] = int(q["group_size"])
        return None, False, False
    m.ignore("quantization_config.quant_method", method, "only bitsandbytes, GPTQ and AWQ bases are modelled: an "
             "unquantized base assumed")
    return None, False, False


def _peft(model, spec: ModelSpec, m: Mapped, quant: tuple[str | None, bool, bool]) -> None:
    configs = getattr(model, "peft_config", None)
    four, double, eight = quant
    if not configs:
        if four or eight:
            m.ignore("quantization_config", "4-bit" if four else "8-bit", "a quantized base without adapters "
                     "is not trainable: a full fine-tune of the unquantized model assumed")
        return
    active = getattr(model, "active_adapter", None)
    name = active[0] if isinstance(active, (list, tuple)) else active
    config = configs.get(name) or next(iter(configs.values()))
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))
    if kind != "LORA":
        m.ignore("peft_config.peft_type", kind, "only LoRA adapters are modelled: a full fine-tune assumed")
        return
    if len(configs) > 1:
        m.ignore("peft_config", sorted(configs), f"several adapters: the active one ({name}) read")
    targets = _adapted(model, spec, m)
    if targets is None:  # no LoRA layer found: what the config names
        targets = config.target_modules
        if isinstance(targets, str):
            targets = (targets,) if targets in ("all-linear", "all_linear") else None
            if targets is None:
                m.ignore("peft_config.target_modules", config.target_modules, "a regular expression of modules is "
                         "not modelled: peft's default q_proj,v_proj assumed")
        elif targets is not None:
            targets = tuple(sorted({str(t).rsplit(".", 1)[-1] for t in targets}))
    for key, why in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                     ("layers_to_transform", "adapters on some layers only")):
        if getattr(config, key, None):
            m.ignore(f"peft_config.{key}", getattr(config, key), f"{why} are not modelled: r on every layer assumed")
    if str(getattr(config, "bias", "none")) != "none":
        m.ignore("peft_config.bias", config.bias, "trained biases are not modelled: adapters only")
    lora_setup(m, r=int(config.r), alpha=int(config.lora_alpha), dropout=float(config.lora_dropout),
               targets=targets, four_bit=four, double_quant=double, eight_bit=eight,
               use_dora=bool(getattr(config, "use_dora", False)), modules_to_save=_saved(model, config),
               target_key="peft_config.target_modules")


def _adapted(model, spec: ModelSpec, m: Mapped) -> tuple[str, ...] | None:
    """The module names peft put a LoRA layer on (``lora_A`` beside a ``base_layer``): peft
    expands ``all-linear`` and suffixes into full paths (``model.layers.0.mlp.down_proj``), so
    the adapted modules are the truth; every Linear but the head reads as ``all-linear``. A name
    adapted on fewer layers than the model has is a warning (vramplan puts r on every layer)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            short = name.rsplit(".", 1)[-1]
            counts[short] = counts.get(short, 0) + 1
    if not counts:
        return None
    per_model = {lin.name: lin.count for lin in spec.linears}
    partial = sorted(n for n, c in counts.items() if c < per_model.get(n, c))
    if partial:
        m.ignore("peft_config.target_modules", partial, "adapters on some layers only are not modelled: every layer "
                 "assumed")
    linear = {lin.name for lin in spec.linears if lin.role != "head"}
    return ("all-linear",) if set(counts) == linear else tuple(sorted(counts))


def _saved(model, config) -> tuple[str, ...]:
    """The modules peft trains in full (``ModulesToSaveWrapper``s in the model; the config's
    ``modules_to_save`` when none is found), by their own names."""
    found = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if type(module).__name__ == "ModulesToSaveWrapper"})
    return tuple(found) if found else tuple(config.modules_to_save or ())


def _args_fields(args) -> tuple[dict, bool]:
    data = args.to_dict()
    trl = type(args).__module__.startswith("trl.")
    if str(data.get("eval_strategy", "no")) == "no" and not data.get("do_eval"):
        data.pop("per_device_eval_batch_size", None)  # no evaluation runs: its batch is no memory
    return data, trl


def _unmodelled_eval(m: Mapped) -> None:
    """An eval step (per_device_eval_batch_size with eval on) the estimate cannot model yet
    (estimator/eval_step.py): a warning, the training step's peak only."""
    if not m.setup.get("eval_batch"):
        return
    from ..estimator.eval_step import eval_unmodelled
    from ..setup.inputs import setup_from_mapping

    why = eval_unmodelled(setup_from_mapping(dict(m.setup), "the Trainer's setup"))
    if why:
        m.ignore("per_device_eval_batch_size", m.setup.pop("eval_batch"),
                 f"an eval step with {why} is not modelled yet: the training step's peak only")


#: TRL 1.16 trainer configs -> Setup.objective
_OBJECTIVES = {"DPOConfig": "dpo", "KTOConfig": "kto", "ORPOConfig": "orpo", "GRPOConfig": "grpo"}


def _objective(args, m: Mapped) -> None:
    """The objective of a TRL trainer from its config's class (``SFTConfig`` and TrainingArguments
    are SFT); GRPO's ``num_generations``, ``max_completion_length`` and vLLM generation."""
    objective = _OBJECTIVES.get(type(args).__name__)
    if objective is None:
        return
    m.setup["objective"] = objective
    if objective != "grpo":
        return
    s = m.setup
    s["num_generations"] = int(args.num_generations)
    if getattr(args, "max_completion_length", None):
        s["max_completion_length"] = int(args.max_completion_length)
    if getattr(args, "use_vllm", False):
        colocate = getattr(args, "vllm_mode", "server") == "colocate"
        s["generation"] = "vllm-colocate" if colocate else "vllm-server"
        if colocate:
            s["vllm_memory_fraction"] = float(args.vllm_gpu_memory_utilization)


def setup_from_trainer(args, model, optimizer=None, *, seq: int | None = None) -> TrainerSetup:
    """The setup the Trainer runs (see the module docstring); ``seq``: the sequence length when
    the arguments do not fix it (a TRL config's ``max_length`` wins: it is what the collator
    truncates to)."""
    from ..model.architecture import model_spec_from_config

    model = _unwrap(model)
    m = Mapped()
    _accelerate_state(m)
    data, trl = _args_fields(args)
    # the attention the model runs (TRL's padding-free mapping asks for it)
    data["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    f = Fields(data, "TrainingArguments")
    had_distribution = "zero_stage" in m.setup or "fsdp" in m.setup
    amp = training_arguments(f, Path.cwd() / "TrainingArguments", m, trl=trl)
    if had_distribution and (data.get("deepspeed") or data.get("fsdp")):
        m.assume("deepspeed" if data.get("deepspeed") else "fsdp", True, "the Trainer's own setting read over "
                 "accelerate's launch config")
    _objective(args, m)
    if trl:
        trl_trainer_fields(f, m, sft="objective" not in m.setup)
        if data.get("max_length") is None:  # None: TRL does not truncate
            m.setup.pop("seq", None)
    if seq is not None and "seq" not in m.setup:
        m.setup["seq"] = int(seq)
    m.setup["gpus"] = int(getattr(args, "world_size", 1) or 1)
    config = model.config
    spec = model_spec_from_config(config.to_dict(), name=model_name(model), source="trainer")
    m.setup["attn"] = attn_from_name(getattr(config, "_attn_implementation", None), m, "config._attn_implementation")
    quant = _quantization(model, m)
    _peft(model, spec, m, quant)
    actual = optimizer_name(optimizer) if optimizer is not None else None
    if actual is not None:
        m.setup["optimizer"] = actual
    elif optimizer is not None:
        m.ignore("optimizer", type(getattr(optimizer, "optimizer", optimizer)).__name__,
                 f"this optimizer is not modelled: {m.setup['optimizer']} assumed (from optim)")
    # what the layers do (PreTrainedModel.is_activation_checkpointing's test): peft's
    # prepare_model_for_kbit_training turns checkpointing on whatever the arguments say
    if not m.setup.get("checkpointing") and any(getattr(mod, "gradient_checkpointing", False) is True
                                                for mod in model.modules()):
        m.setup["checkpointing"] = True
        m.assume("activation_checkpointing", False, "the model's layers checkpoint (enabled on the model, e.g. by "
                 "peft's prepare_model_for_kbit_training): checkpointing on")
    quantized = bool(quant[0] or quant[2] or m.setup.get("quant") in ("gptq", "awq"))
    m.setup["precision"] = load_precision(load_dtype(model, quantized), amp, m, "model dtype")
    trl_loss_precision(m)  # an SFTTrainer's fused head: --loss trl (readers/trainer.py)
    _unmodelled_eval(m)
    return TrainerSetup(model=model_name(model), spec=spec, fields=dict(m.setup), warnings=tuple(m.warnings))


def describe_fields(fields: dict[str, Any]) -> str:
    """``batch=2 seq=64 ...`` (the fields the Trainer fixed), for a log line."""
    return " ".join(f"{k}={v}" for k, v in sorted(fields.items()))
