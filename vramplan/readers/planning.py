"""A training config as the input of a plan (``vramplan plan --from FILE``): "here is my config;
will it fit, and if not what should I change?".

:func:`plan_inputs` splits a :class:`~vramplan.readers.ReadConfig` into what the plan keeps and
what it searches. Kept (the user's quality choices, which a planner must not trade for memory):
the model, the GPU count, the sequence length, the global batch (micro-batch x grad accum x GPUs),
the method, the base quantization (and its bits/group/double-quant), the LoRA rank, alpha,
dropout and targets, the precision, the loss, FlashAttention when the file uses it, and an
optimizer the search does not swap in (SGD, Lion, Adafactor: another recipe; paged 8-bit AdamW).
Free (memory savers, searched): the micro-batch / grad-accum split of that global batch,
checkpointing, the AdamW variant (torch, fused or 8-bit), other attention, ZeRO stage, FSDP and
offload. :func:`setup_changes` is the typed diff between the file's setup and the plan's.
Pure and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..specs import Setup
from .common import ReadConfig

__all__ = ["KEPT", "SEARCHED_OPTIMIZERS", "Change", "PlanInputs", "kept_knobs", "merge_fixed", "plan_inputs",
           "setup_changes"]

#: the optimizers the plan's search swaps between (torch AdamW, fused, bitsandbytes 8-bit): free when the
#: file uses one of them; any other (SGD, Lion, Adafactor change the recipe; paged 8-bit AdamW is already
#: the 8-bit saver) is kept as the file has it
SEARCHED_OPTIMIZERS = frozenset({"adamw", "adamw-fused", "adamw-8bit"})

#: the Setup knobs a plan from a file keeps when the file's setup uses them (quality choices, the data
#: pipeline, the objective)
KEPT = ("method", "quant", "double_quant", "quant_bits", "quant_group_size", "lora_rank", "lora_alpha",
        "lora_dropout", "lora_targets", "precision", "loss", "optimizer", "attn", "dora", "modules_to_save",
        "padding_free", "liger", "objective", "max_prompt_length", "max_completion_length", "num_generations",
        "ref_model", "generation", "vllm_memory_fraction", "eval_batch", "framework", "compile",
        "tiled_mlp", "tiled_mlp_shards")

_ADAPTER_KNOBS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "dora", "modules_to_save")
_OBJECTIVE_KNOBS = ("objective", "max_prompt_length", "max_completion_length", "num_generations", "ref_model",
                    "generation", "vllm_memory_fraction")


@dataclass(frozen=True)
class PlanInputs:
    """The plan's inputs from a config: ``setup`` is the file's setup as written (on ``file_gpus``),
    ``fixed`` the Setup knobs the plan keeps, ``gpus`` the GPU count it plans for, ``global_batch``
    the sequences per optimizer step (the file's)."""

    model: str
    setup: Setup
    gpus: int
    seq: int
    global_batch: int
    fixed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """One Setup field the plan changes: its value in the file and in the plan."""

    field: str
    file: Any
    plan: Any

    def to_json(self) -> dict:
        return {"field": self.field, "file": self.file, "plan": self.plan}


def kept_knobs(setup: Setup) -> dict[str, Any]:
    """The quality knobs of ``setup`` a plan keeps: adapter knobs only with adapters, the
    quantization details only with the base they belong to."""
    kept = {"method": setup.method, "quant": setup.quant, "precision": setup.precision, "loss": setup.loss}
    if setup.method != "full":
        kept.update({k: getattr(setup, k) for k in _ADAPTER_KNOBS if k not in ("dora", "modules_to_save")})
        kept.update({k: getattr(setup, k) for k in ("dora", "modules_to_save") if getattr(setup, k)})  # when used
    if setup.quant in ("nf4", "fp4"):
        kept["double_quant"] = setup.double_quant
    if setup.quant in ("gptq", "awq"):
        kept.update(quant_bits=setup.quant_bits, quant_group_size=setup.quant_group_size)
    if setup.optimizer not in SEARCHED_OPTIMIZERS:
        kept["optimizer"] = setup.optimizer
    if setup.attn == "flash":  # the search adds FlashAttention only where the default is eager
        kept["attn"] = "flash"
    if setup.padding_free:  # the collator the file's data runs through (needs flash attention: kept above)
        kept["padding_free"] = True
    if setup.compile:  # torchtune's compile: True (its compiled loss) is kept; a file without it may get it as
        kept["compile"] = True  # a memory saver (search/space.py)
    if setup.tiled_mlp:  # Unsloth's unsloth_tiled_mlp=True, axolotl's tiled_mlp (with its shard count) are kept;
        kept["tiled_mlp"] = True  # a file without it may get it as a memory saver (search/space.py)
        if setup.tiled_mlp_shards:
            kept["tiled_mlp_shards"] = setup.tiled_mlp_shards
    if setup.liger:  # a file that runs Liger keeps it; one without it may get it as a memory saver
        kept["liger"] = True
    # the framework that runs the file (its preparation: setup/frameworks.py), the HF recipe included: a plan
    # for a user's file never turns to another framework (search/explain_framework.py)
    kept["framework"] = setup.framework
    if setup.eval_batch:  # the run's evals (estimator/eval_step.py): judged for fit, never searched
        kept["eval_batch"] = setup.eval_batch
    if setup.objective != "sft":
        kept.update({k: getattr(setup, k) for k in _OBJECTIVE_KNOBS})
    if setup.method == "full" and setup.quant == "none":
        kept.pop("quant")  # nothing to keep: a full fine-tune has no base quantization to choose
    return kept


#: what a 16-bit precision the config leaves to the GPU (``bf16: auto``) becomes on a GPU without bf16:
#: axolotl's ``resolve_dtype`` (src/axolotl/utils/config/__init__.py) falls back to fp16
_WITHOUT_BF16 = {"bf16": "fp16", "bf16-mixed": "fp16-mixed"}


def _bf16_left_to_gpu(read: ReadConfig) -> bool:
    """The config's bf16 is ``auto`` (the reader assumed a GPU with bf16)."""
    return any(w.kind == "assumed" and w.field == "bf16" and w.value == "auto" for w in read.warnings)


def plan_inputs(read: ReadConfig, model: str | None = None, gpus: int | None = None, gpu=None) -> PlanInputs:
    """What a plan of ``read`` keeps and searches. ``model`` replaces the file's model; ``gpus``
    (the user's ``--gpus``) is the count the plan is for; the file's own count, when it fixes one,
    is the one its setup and global batch are on (else ``gpus``, else 1). ``gpu`` (a GpuSpec)
    settles what the file leaves to the GPU: ``bf16: auto`` is fp16 on a card without bf16."""
    from ..specs import SpecError

    name = model or read.model
    if name is None:
        raise SpecError(f"{read.path}: names no model; pass the model as MODEL")
    file_gpus = read.gpus or gpus or 1
    setup = read.setup.replace(gpus=file_gpus)
    if gpu is not None and not gpu.bf16 and setup.precision in _WITHOUT_BF16 and _bf16_left_to_gpu(read):
        setup = setup.replace(precision=_WITHOUT_BF16[setup.precision])
    return PlanInputs(model=name, setup=setup, gpus=gpus or file_gpus, seq=setup.seq,
                      global_batch=setup.batch * setup.grad_accum * file_gpus, fixed=kept_knobs(setup))


def setup_changes(before: Setup, after: Setup) -> tuple[Change, ...]:
    """The fields of ``after`` that differ from ``before``, in Setup's field order. The adapter
    knobs count only when both train adapters (a method change says the rest); ``lora_alpha``
    compares the effective alpha (None means 2 x rank)."""
    changes = []
    for name in Setup.__dataclass_fields__:
        a, b = getattr(before, name), getattr(after, name)
        if name == "lora_alpha":
            a, b = before.alpha, after.alpha
        if a != b and not (name in _ADAPTER_KNOBS and not (before.adapters and after.adapters)):
            changes.append(Change(name, a, b))
    return tuple(changes)


#: the base's knobs go together: one of them typed on the command line replaces the file's whole group
_BASE = ("method", "quant", "double_quant", "quant_bits", "quant_group_size")


def merge_fixed(kept: dict[str, Any], typed: dict[str, Any]) -> dict[str, Any]:
    """The file's kept knobs with the knobs typed on the command line laid over them: a typed knob
    of the base group (method, quant and its details) replaces the file's whole group, and a typed
    ``method="full"`` drops the file's adapter knobs (they would contradict it)."""
    merged = dict(kept)
    if any(k in typed for k in _BASE):
        for k in _BASE:
            merged.pop(k, None)
    if typed.get("method") == "full":
        for k in _ADAPTER_KNOBS:
            merged.pop(k, None)
    return {**merged, **typed}
