"""torchtune recipe config of a Setup (``tune run RECIPE --config torchtune.yaml``): the inverse of
``vramplan.readers.torchtune``, for torchtune 0.6.1 (the version installed with vramplan's test
dependencies: its ``recipes/lora_finetune_single_device.py``, ``full_finetune_single_device.py``,
``lora_finetune_distributed.py``, ``full_finetune_distributed.py`` and ``recipes/configs/``).

The model is a torchtune builder (``torchtune.models.llama3_2.lora_llama3_2_1b``), the optimizer a
``_component_`` (torch, bitsandbytes), the precision the recipe's ``dtype`` (the model is built in
it: pure bf16 or fp32), FSDP the distributed recipes' FSDP2 (``fsdp_reshard_after_forward``,
``fsdp_cpu_offload``) on ``--nproc_per_node`` GPUs, named in the ``tune run`` line the config
opens with (the line the reader takes the recipe and GPU count from). The rest of the recipe
(tokenizer, checkpointer, dataset, scheduler, logger) follows torchtune's own configs for the
family, with the checkpoint under ``/tmp/<name>`` as ``tune download`` puts it there.
"""

from __future__ import annotations

from ..readers.torchtune import MODELS
from ..specs import ModelSpec, Setup
from .hf_configs import common_refusal

__all__ = ["BUILDERS", "FIELD_KEYS", "OPTIMIZERS", "recipe", "refusal", "torchtune_config"]

#: HF checkpoint -> torchtune 0.6.1 builder (without its lora_/qlora_ prefix); Qwen3 is newer than 0.6.1
BUILDERS = {hub: base for base, hub in MODELS.items() if not base.startswith("qwen3")}

#: builder prefix -> (module, tokenizer component, tokenizer files, checkpointer model_type, QLoRA builder)
_FAMILIES = (
    ("llama3_2", "llama3_2", "torchtune.models.llama3.llama3_tokenizer", {"path": "original/tokenizer.model"},
     "LLAMA3_2", True),
    ("llama3_1", "llama3_1", "torchtune.models.llama3.llama3_tokenizer", {"path": "original/tokenizer.model"},
     "LLAMA3", True),
    ("llama3", "llama3", "torchtune.models.llama3.llama3_tokenizer", {"path": "original/tokenizer.model"},
     "LLAMA3", True),
    ("llama2", "llama2", "torchtune.models.llama2.llama2_tokenizer", {"path": "tokenizer.model"}, "LLAMA2", True),
    ("code_llama2", "code_llama2", "torchtune.models.llama2.llama2_tokenizer", {"path": "tokenizer.model"},
     "LLAMA2", True),
    ("mistral", "mistral", "torchtune.models.mistral.mistral_tokenizer", {"path": "tokenizer.model"}, "MISTRAL",
     True),
    ("gemma2", "gemma2", "torchtune.models.gemma.gemma_tokenizer", {"path": "tokenizer.model"}, "GEMMA2", True),
    ("gemma", "gemma", "torchtune.models.gemma.gemma_tokenizer", {"path": "tokenizer.model"}, "GEMMA", True),
    ("qwen2_5", "qwen2_5", "torchtune.models.qwen2_5.qwen2_5_tokenizer",
     {"path": "vocab.json", "merges_file": "merges.txt"}, "QWEN2", False),
    ("qwen2", "qwen2", "torchtune.models.qwen2.qwen2_tokenizer", {"path": "vocab.json", "merges_file": "merges.txt"},
     "QWEN2", False),
    ("phi3", "phi3", "torchtune.models.phi3.phi3_mini_tokenizer", {"path": "tokenizer.model"}, "PHI3_MINI", True),
)

#: vramplan optimizer -> torchtune's optimizer ``_component_`` (and its ``fused`` flag)
OPTIMIZERS = {
    "adamw": ("torch.optim.AdamW", False), "adamw-fused": ("torch.optim.AdamW", True),
    "adamw-8bit": ("bitsandbytes.optim.AdamW8bit", None),
    "paged-adamw-8bit": ("bitsandbytes.optim.PagedAdamW8bit", None),
    "sgd": ("torch.optim.SGD", None),
}

_ATTN_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj"}
_MLP = ("gate_proj", "up_proj", "down_proj")

#: Setup field -> the recipe keys that carry it (``plan --from FILE --emit``); dotted keys are nested
FIELD_KEYS = {
    "lora_rank": ("model.lora_rank",), "lora_alpha": ("model.lora_alpha",), "lora_dropout": ("model.lora_dropout",),
    "lora_targets": ("model.lora_attn_modules", "model.apply_lora_to_mlp", "model.apply_lora_to_output"),
    "precision": ("dtype",), "optimizer": ("optimizer._component_", "optimizer.fused"),
    "checkpointing": ("enable_activation_checkpointing",), "batch": ("batch_size",), "seq": ("tokenizer.max_seq_len",),
    "grad_accum": ("gradient_accumulation_steps",), "offload_params": ("fsdp_cpu_offload",),
    "optimizer_in_backward": ("optimizer_in_bwd",), "compile": ("compile",),
}


def _family(base: str):
    return next(f for f in _FAMILIES if base.startswith(f[0] + "_"))


def _targets(s: Setup, model: ModelSpec) -> tuple[list[str], bool, bool] | None:
    """(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output), or None if not expressible."""
    if s.lora_targets == "all-linear":  # every Linear but the head
        names = {lin.name for lin in model.linears}
    else:
        names = {t.strip() for t in s.lora_targets.split(",") if t.strip()}
    mlp = names & set(_MLP)
    if mlp and mlp != set(_MLP) or names - set(_ATTN_NAMES) - set(_MLP) - {"lm_head"}:
        return None
    attn = [_ATTN_NAMES[n] for n in _ATTN_NAMES if n in names]
    return attn, bool(mlp), "lm_head" in names


def refusal(s: Setup, model: ModelSpec) -> str | None:
    """Why torchtune cannot express Setup ``s`` on ``model``, or None."""
    why = common_refusal(s)
    if why:
        return why
    if s.liger:
        return "liger (torchtune builds its own modules, not transformers' that Liger patches)"
    if s.activation_offload:  # readers/torchtune.py: its OffloadActivations is not TRL's
        return "activation_offload (torchtune's enable_activation_offloading is not TRL's OffloadActivations)"
    if s.padding_free:
        return "padding_free (torchtune's dataset.packed is not a field vramplan reads back)"
    if s.dora:
        return "dora (its builders' use_dora is not a field vramplan reads back)"
    if s.modules_to_save:
        return "modules_to_save (torchtune's LoRA builders train no full module copies)"
    base = BUILDERS.get(model.name)
    if base is None:
        return f"the model {model.name} (no torchtune 0.6.1 builder for it)"
    if s.method == "qlora" and not _family(base)[5]:
        return f"method qlora on {model.name} (torchtune 0.6.1 has no qlora_{base} builder)"
    if s.quant != "none" and (s.method != "qlora" or s.quant != "nf4" or not s.double_quant):
        return (f"a {s.quant} base{'' if s.double_quant else ' without double quant'} with method {s.method} "
                "(torchtune quantizes only QLoRA, to torchao NF4)")
    if s.precision not in ("bf16", "fp32"):
        return f"precision {s.precision} (the recipes build the model in dtype bf16 or fp32, without autocast)"
    if s.optimizer not in OPTIMIZERS:
        return f"optimizer {s.optimizer} (no optimizer component vramplan reads back for it)"
    if s.attn != "auto":
        return f"attn {s.attn} (torchtune's attention is its own SDPA module)"
    if s.zero_stage:
        return f"zero_stage {s.zero_stage} (torchtune shards with FSDP, not DeepSpeed)"
    if s.gpus > 1 and s.fsdp == "none":
        return "several GPUs without FSDP (torchtune's distributed recipes shard with FSDP2)"
    if s.fsdp == "no_shard":
        return "fsdp no_shard (the distributed recipes shard: fsdp_reshard_after_forward true or false)"
    if s.adapters and _targets(s, model) is None:
        return (f"lora_targets {s.lora_targets} (torchtune adapts q/k/v/output_proj, the whole MLP or none, "
                "and the output)")
    return None


def recipe(s: Setup) -> str:
    """The ``tune run`` recipe of the Setup."""
    kind = "lora" if s.adapters else "full"
    return f"{kind}_finetune_{'distributed' if s.fsdp != 'none' else 'single_device'}"


def torchtune_config(s: Setup, model: ModelSpec, *, model_id: str, nodes: int = 1) -> dict:
    """The recipe config (the ``tune run`` line is the header's, :func:`vramplan.emit.frameworks.framework_run`)."""
    base = BUILDERS[model.name]
    prefix, module, tokenizer, files, model_type, _ = _family(base)
    ckpt = "/tmp/" + model.name.rsplit("/", 1)[-1]
    builder = {"lora": "lora_", "qlora": "qlora_"}.get(s.method, "") + base
    model_cfg: dict = {"_component_": f"torchtune.models.{module}.{builder}"}
    if s.adapters:
        attn, mlp, output = _targets(s, model)
        model_cfg.update(lora_attn_modules=attn, apply_lora_to_mlp=mlp, apply_lora_to_output=output,
                         lora_rank=s.lora_rank, lora_alpha=s.alpha, lora_dropout=s.lora_dropout)
    component, fused = OPTIMIZERS[s.optimizer]
    optimizer: dict = {"_component_": component, "lr": 2e-4 if s.adapters else 2e-5}
    if fused is not None:
        optimizer["fused"] = fused
    cfg: dict = {
        "output_dir": f"/tmp/torchtune/{base}/{recipe(s)}",
        "model": model_cfg,
        "tokenizer": {"_component_": tokenizer, **{k: f"{ckpt}/{v}" for k, v in files.items()}, "max_seq_len": s.seq},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": ckpt,
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": "${output_dir}", "model_type": model_type},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": False},
        "seed": None,
        "shuffle": True,
        "batch_size": s.batch,
        "optimizer": optimizer,
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 100},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "epochs": 1,
        "max_steps_per_epoch": None,
        "gradient_accumulation_steps": s.grad_accum,
        "optimizer_in_bwd": s.optimizer_in_backward,  # one optimizer per parameter, stepped in backward
        "compile": s.compile,  # the compiled loss is modelled (estimator/torchtune.py); the layers kept eager
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": "${output_dir}/logs"},
        "log_every_n_steps": 1,
        "log_peak_memory_stats": True,
        "device": "cuda",
        "dtype": s.precision,
        "enable_activation_checkpointing": s.checkpointing,
        "enable_activation_offloading": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }
    if s.adapters:
        cfg["save_adapter_weights_only"] = False
    if s.fsdp != "none":
        cfg["fsdp_reshard_after_forward"] = s.fsdp == "full_shard"
        cfg["fsdp_cpu_offload"] = s.offload_params == "cpu"
    return cfg
