"""torchtune recipe YAML (pytorch/torchtune at the commit in tests/data/configs/torchtune/SOURCES.json).

Semantics, from its source: ``recipes/lora_finetune_single_device.py`` and
``recipes/full_finetune_single_device.py`` read ``batch_size``, ``gradient_accumulation_steps``,
``dtype`` (the model is built in it: no autocast, vramplan's pure ``bf16``/``fp32``),
``enable_activation_checkpointing`` and ``enable_activation_offloading`` (both default False),
``optimizer_in_bwd`` and ``compile`` (False); ``recipes/full_finetune_distributed.py`` shards with
FSDP2 (``fsdp_reshard_after_forward`` True: full shard; ``fsdp_cpu_offload`` False). The recipe
and GPU count are not in the config but in the ``tune run [--nproc_per_node N] RECIPE`` line each
config opens with (read from its comments). ``tokenizer.max_seq_len: null`` does not truncate.

torchtune builds its own modules (``torchtune.models``), not transformers': a single-device recipe
on a Llama 2/3/3.1/3.2, Mistral or Qwen2/2.5 builder in bf16 is read as ``framework: torchtune``, its
own step (estimator/torchtune.py: its saved activations, chunked loss, torchao NF4); the rest is
estimated as the same architecture in transformers/peft (names mapped: ``output_proj`` -> ``o_proj``,
the MLP -> ``gate_proj,up_proj,down_proj``, ``output`` -> ``lm_head``), QLoRA's torchao NF4 as
bitsandbytes NF4 with double quantization.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..setup.inputs import read_text
from .common import TORCH_COMPILE_WHY, Fields, Mapped

__all__ = ["MODELS", "read_torchtune"]

#: torchtune model builder (without its lora_/qlora_ prefix) -> the HF checkpoint it loads
MODELS = {
    "llama3_2_1b": "meta-llama/Llama-3.2-1B", "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B", "llama3_1_70b": "meta-llama/Llama-3.1-70B",
    "llama3_8b": "meta-llama/Meta-Llama-3-8B", "llama2_7b": "meta-llama/Llama-2-7b-hf",
    "llama2_13b": "meta-llama/Llama-2-13b-hf", "llama2_70b": "meta-llama/Llama-2-70b-hf",
    "code_llama2_7b": "codellama/CodeLlama-7b-hf", "code_llama2_13b": "codellama/CodeLlama-13b-hf",
    "mistral_7b": "mistralai/Mistral-7B-v0.1", "gemma_2b": "google/gemma-2b",
    "gemma2_2b": "google/gemma-2-2b", "gemma2_9b": "google/gemma-2-9b",
    "qwen2_0_5b": "Qwen/Qwen2-0.5B", "qwen2_7b": "Qwen/Qwen2-7B",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B", "qwen2_5_1_5b_base": "Qwen/Qwen2.5-1.5B",
    "qwen2_5_3b": "Qwen/Qwen2.5-3B", "qwen2_5_7b_base": "Qwen/Qwen2.5-7B", "qwen2_5_14b_base": "Qwen/Qwen2.5-14B",
    "qwen2_5_32b_base": "Qwen/Qwen2.5-32B", "qwen2_5_72b_base": "Qwen/Qwen2.5-72B",
    "qwen3_0_6b_base": "Qwen/Qwen3-0.6B", "qwen3_1_7b_base": "Qwen/Qwen3-1.7B", "qwen3_4b_base": "Qwen/Qwen3-4B",
    "qwen3_8b_base": "Qwen/Qwen3-8B", "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
}

_LORA_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}

#: torchtune optimizer components -> vramplan's optimizer
_OPTIMIZERS = {
    "torch.optim.AdamW": "adamw", "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit", "bitsandbytes.optim.AdamW8bit": "adamw-8bit",
    "torchao.optim.AdamW8bit": "adamw-8bit", "bitsandbytes.optim.PagedAdamW": None,
}

_UNMODELLED = {
    # torchtune 0.6.1's OffloadActivations (training/_activation_offloading.py) is TRL's ancestor without its
    # storage deduplication and parameter-storage filter, held over the model's forward only: not TRL's
    # (what --activation-offload models, estimator/act_offload.py)
    "enable_activation_offloading": "torchtune's activation offloading is not modelled (it differs from TRL's, "
                                    "which --activation-offload models): activations stay on the GPU",
    "compile": TORCH_COMPILE_WHY,
}

_RUN = re.compile(r"tune run\s+(?:--nnodes\s+\S+\s+)?(?:--nproc_per_node\s+(\d+)\s+)?([\w.-]+)")


def read_torchtune(data: dict, path: Path, m: Mapped) -> None:
    f = Fields(data, str(path))
    s = m.setup
    model = f.sub("model")
    component = model.str("_component_") if model else None
    if not component:
        raise f.bad("model._component_", "a torchtune model builder", component)
    builder = component.rsplit(".", 1)[-1]
    base = re.sub(r"^(q?lora_)", "", builder)
    m.model = MODELS.get(base)
    if m.model is None:
        m.ignore("model._component_", component, "no HF checkpoint known for this builder: pass --model")
    if builder.startswith(("lora_", "qlora_")):
        _lora(model, builder, m)
    else:
        s["method"] = "full"
    tok = f.sub("tokenizer")
    seq = tok.int("max_seq_len") if tok else None
    if seq is None:
        m.assume("tokenizer.max_seq_len", None, "no truncation: sequences of 2048 assumed (pass --seq)")
    else:
        s["seq"] = seq
    s["batch"] = f.int("batch_size", 1)
    s["grad_accum"] = f.int("gradient_accumulation_steps", 1)
    s["checkpointing"] = f.bool("enable_activation_checkpointing", False)
    dtype = f.str("dtype", "bf16")
    if dtype not in ("bf16", "fp32"):
        raise f.bad("dtype", "bf16 or fp32", dtype)
    s["precision"] = dtype
    opt = f.sub("optimizer")
    name = opt.str("_component_", "torch.optim.AdamW") if opt else "torch.optim.AdamW"
    chosen = _OPTIMIZERS.get(name)
    if chosen is None:
        m.ignore("optimizer._component_", name, "this optimizer is not modelled: torch AdamW assumed")
        chosen = "adamw"
    if chosen == "adamw" and opt is not None and opt.bool("fused", False):
        chosen = "adamw-fused"
    s["optimizer"] = chosen
    if f.bool("optimizer_in_bwd", False):  # training/memory.py: one optimizer per parameter, stepped in backward
        s["optimizer_in_backward"] = True
    ds = f.sub("dataset")
    if ds is not None and ds.bool("packed", False):
        m.ignore("dataset.packed", True, "packing is not modelled: sequences of max_seq_len assumed")
    loss = f.sub("loss")
    if loss is not None and "LinearCrossEntropy" in (loss.str("_component_") or ""):
        m.ignore("loss._component_", loss.str("_component_"),
                 "torchtune's chunked linear cross-entropy is not modelled: full logits assumed (an upper bound)")
    for key, why in _UNMODELLED.items():
        if f.bool(key, False):
            m.ignore(key, True, why)
    _recipe(f, path, m)
    _selective(f, path, m)
    _framework(f, base, m)


#: the builders whose single-device recipes estimator/torchtune.py models (its own model; no qlora_qwen2)
_MODELLED = re.compile(r"^(llama2|llama3|llama3_1|llama3_2|code_llama2|mistral|qwen2|qwen2_5)_")


def _framework(f: Fields, base: str, m: Mapped) -> None:
    """``framework: torchtune`` where torchtune's own step is modelled (estimator/torchtune.py: one GPU,
    bf16, the Llama/Mistral/Qwen2 builders, no offloading); else the same architecture's HF step, said."""
    s = m.setup
    why = None
    if m.gpus not in (None, 1) or s.get("fsdp"):
        why = "a distributed recipe (FSDP2)"
    elif s.get("precision") != "bf16":
        why = f"dtype {s.get('precision')}"
    elif not _MODELLED.match(base + "_"):
        why = f"the {base} builder"
    elif s.get("quant") == "nf4" and base.startswith("qwen"):
        why = "QLoRA on Qwen2"
    else:
        from . import framework_for  # the Setup-level refusals (setup/checks.py check_torchtune)

        if framework_for("torchtune", s) != "torchtune":
            why = "this setup (LoRA on the head, selective checkpointing or offloading)"
    if why is None:
        s["framework"] = "torchtune"  # its CEWithChunkedOutputLoss is part of its step (Setup.loss stays hf)
        if f.bool("compile", False):  # its compiled loss is modelled (estimator/torchtune.py loss_bytes)
            s["compile"] = True
            m.warnings[:] = [w for w in m.warnings if w.field != "compile"]
            m.assume("compile", True, "its compiled cross-entropy is modelled; the compiled layers are estimated "
                     "eager (what their recompute keeps: an upper bound)")
        # torchtune's own NF4 (torchao) is what its step models: bitsandbytes' stand-in is not assumed
        m.warnings[:] = [w for w in m.warnings if not (w.field == "model._component_" and "bitsandbytes" in w.why)]
    else:
        m.assume("model._component_", base, f"torchtune's own step is not modelled for {why}: estimated as the "
                 "same architecture in transformers/peft")


#: the recipes of torchtune 0.6.1 that read ``ac_mode`` / ``ac_option``
_AC_RECIPES = ("full_finetune_distributed", "qat_distributed")


def _selective(f: Fields, path: Path, m: Mapped) -> None:
    """torchtune 0.6.1's selective checkpointing (``recipes/full_finetune_distributed.py``,
    ``_setup_model``): ``apply_selective_activation_checkpointing(model, ac_mode, ac_option)`` only
    when ``ac_mode`` is set and ``enable_activation_checkpointing`` is False; the usual
    all-layer checkpointing only when it is True and ``ac_mode`` is unset (both set: neither).
    ``selective`` with ``ac_option`` k wraps layers k-1, 2k-1, ... (training/activations.py
    ``checkpoint_wrapper``); ``int(ac_option)`` fails for ``op``."""
    mode = f.str("ac_mode")
    if mode is None:
        return
    match = _RUN.search(read_text(path, "torchtune config"))
    recipe = match.group(2) if match else ""
    if not any(r in recipe for r in _AC_RECIPES):
        m.ignore("ac_mode", mode, f"read only by torchtune's {' and '.join(_AC_RECIPES)} recipes")
        return
    if m.setup.get("checkpointing"):
        m.setup["checkpointing"] = False
        m.assume("ac_mode", mode, "with enable_activation_checkpointing: True torchtune 0.6.1 applies neither "
                 "kind of checkpointing: none modelled")
        return
    if mode not in ("selective", "full"):
        raise f.bad("ac_mode", "selective or full", mode)
    m.setup["checkpointing"] = True
    if mode == "full":
        return
    every = f.raw("ac_option")
    if isinstance(every, str) and every.strip().isdigit():
        every = int(every)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise f.bad("ac_option", "a layer frequency (a positive integer; torchtune 0.6.1 int()s it, so 'op' fails)",
                    every)
    m.setup["checkpoint_every"] = max(every, 1)  # 0: every layer (``not every_x_layer``)
    if every > 1:
        m.assume("ac_option", every, f"torchtune checkpoints layers {every - 1}, {2 * every - 1}, ...; modelled with "
                 f"transformers' placement (layers 0, {every}, ...): the same count when {every} divides the layers")


def _lora(model: Fields, builder: str, m: Mapped) -> None:
    s = m.setup
    s["method"] = "qlora" if builder.startswith("qlora_") else "lora"
    if s["method"] == "qlora":
        s["quant"], s["double_quant"] = "nf4", True
        m.assume("model._component_", builder, "torchao NF4 modelled as bitsandbytes NF4 with double quantization")
    s["lora_rank"] = model.int("lora_rank", 8)
    if model.has("lora_alpha"):
        s["lora_alpha"] = model.int("lora_alpha")
    s["lora_dropout"] = model.float("lora_dropout", 0.0)
    attn = model.names("lora_attn_modules", ())
    unknown = [a for a in attn if a not in _LORA_NAMES]
    if unknown:
        raise model.bad("lora_attn_modules", "q_proj, k_proj, v_proj or output_proj", unknown[0])
    names = [_LORA_NAMES[a] for a in attn]
    if model.bool("apply_lora_to_mlp", False):
        names += ["gate_proj", "up_proj", "down_proj"]
    if model.bool("apply_lora_to_output", False):
        names.append("lm_head")
    if not names:
        raise model.bad("lora_attn_modules", "at least one module (or apply_lora_to_mlp)", list(attn))
    s["lora_targets"] = ",".join(names)


def _recipe(f: Fields, path: Path, m: Mapped) -> None:
    """The recipe and GPU count from the config's ``tune run`` comment; distributed recipes shard."""
    match = _RUN.search(read_text(path, "torchtune config"))
    recipe = match.group(2) if match else ""
    if "distributed" not in recipe:
        return
    m.gpus = int(match.group(1)) if match.group(1) else None
    if m.gpus is None:
        m.assume("tune run", recipe, "a distributed recipe without --nproc_per_node: pass --gpus")
    m.setup["fsdp"] = "full_shard" if f.bool("fsdp_reshard_after_forward", True) else "shard_grad_op"
    if f.bool("fsdp_cpu_offload", False):
        m.setup["offload_params"] = "cpu"
    m.ignore("tune run", recipe, "torchtune's FSDP2 (fully_shard) is modelled as accelerate's FSDP1")
