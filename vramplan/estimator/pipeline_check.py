"""What pipeline parallelism (``--pp``, estimator/pipeline.py) refuses: one line each, for what its truth
(vramplan/truths/pipeline.py) does not run yet. Apart from estimator/pipeline.py so that setup/checks.py
can call it without importing the estimator's terms (no import cycle). Torch-free."""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError

#: The model types whose stage split is modelled (embedding, decoder layers, final norm, head).
PP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PP_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
#: Setup knobs refused beside --pp away from their defaults (the truth runs none of them).
_PP_UNRUN = ("loss", "liger", "dora", "modules_to_save", "activation_offload", "checkpoint_every", "device_map",
             "optimizer_in_backward", "objective", "eval_batch", "padding_free", "pad_mask", "offload_optimizer",
             "offload_params", "framework", "fsdp", "zero_stage", "tp", "cp", "dp_replicate")


def check_pp(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a pipeline-parallel setup that is not modelled (or does not run)."""
    if setup.pp <= 1:
        return
    default = Setup()
    knob = next((k for k in _PP_UNRUN if getattr(setup, k) != getattr(default, k)), None)
    why = None
    if knob is not None:
        why = (f"with --{knob.replace('_', '-')} is not modelled yet (pipeline parallelism is modelled for full "
               "fine-tuning of a 16/32-bit base, one torch.distributed.pipelining stage per GPU, the HF loss)")
    elif setup.adapters or setup.quant != "none":
        why = "with LoRA/QLoRA or a quantized base is not modelled yet; use --method full"
    elif setup.precision.endswith("-mixed"):
        why = f"with --precision {setup.precision} is not modelled yet; use bf16, fp16 or fp32"
    elif setup.optimizer not in PP_OPTIMIZERS:
        why = f"with --optimizer {setup.optimizer} is not modelled yet; modelled: {', '.join(PP_OPTIMIZERS)}"
    elif setup.gpus != setup.pp:
        why = (f"on --gpus {setup.gpus}: data parallelism beside the pipeline (gpus > pp) is not modelled yet; use "
               f"--gpus {setup.pp}")
    elif model.model_type not in PP_MODEL_TYPES or model.moe is not None or model.fp32_params:
        why = (f"on {model.name} (model_type {model.model_type}) is not modelled yet; modelled: the dense "
               f"{', '.join(PP_MODEL_TYPES)} models")
    elif model.tie_word_embeddings:
        why = (f"on {model.name} (tied input and output embeddings) is not modelled: torch.distributed.pipelining "
               "has no shared-weight sync, so the first and last stage would each train their own copy")
    elif model.num_layers < setup.pp:
        why = f"needs at least one decoder layer per stage: {model.name} has {model.num_layers} for {setup.pp} stages"
    if why:
        raise SpecError(f"--pp {setup.pp} {why}")
