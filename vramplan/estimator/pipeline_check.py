"""What pipeline parallelism (``--pp``, estimator/pipeline.py) refuses: one line each, for what its truth
(vramplan/truths/pipeline.py) does not run yet; and what runs beside it (:func:`data_parallel`, shared
with the truth). Apart from estimator/pipeline.py so that setup/checks.py can call it without importing
the estimator's terms (no import cycle). Torch-free."""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError

#: The model types whose stage split is modelled (embedding, decoder layers, final norm, head).
PP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PP_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
#: Setup knobs refused beside --pp away from their defaults (the truth runs none of them).
_PP_UNRUN = ("loss", "liger", "dora", "modules_to_save", "activation_offload", "checkpoint_every", "device_map",
             "optimizer_in_backward", "objective", "eval_batch", "padding_free", "pad_mask", "offload_optimizer",
             "offload_params", "framework", "zero_stage", "tp", "cp", "dp_replicate")


def check_pp(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a pipeline-parallel setup that is not modelled (or does not run)."""
    if setup.pp <= 1:
        return
    default = Setup()
    knob = next((k for k in _PP_UNRUN if getattr(setup, k) != getattr(default, k)), None)
    why = None
    if setup.tp > 1:  # torchtitan parallelize_llama applies TP inside each stage's model part: not verified here
        why = (f"with --tp {setup.tp} is not modelled yet: torchtitan runs TP inside each pipeline stage, which no "
               "vramplan truth runs; use --tp 1 with data parallelism beside the pipeline (--gpus a multiple of --pp: "
               "DDP per stage, or FSDP2 per stage with --fsdp full_shard --fsdp-version 2)")
    elif setup.zero_stage:  # deepspeed 0.19.8 runtime/pipe/engine.py PipelineEngine: ZeRO-1 at most
        why = (f"with --zero {setup.zero_stage} is not modelled: DeepSpeed's PipelineEngine (the only engine running "
               "ZeRO beside a pipeline) takes ZeRO-0/1 and is not modelled; vramplan models torch.distributed."
               "pipelining with DDP (no --zero) or FSDP2 (--fsdp full_shard --fsdp-version 2) beside it")
    elif setup.cp > 1 or setup.dp_replicate > 1:
        why = (f"with --{'cp' if setup.cp > 1 else 'dp-replicate'} is not modelled yet (beside the pipeline vramplan "
               "models DDP or FSDP2 over each stage's ranks)")
    elif knob is not None:
        why = (f"with --{knob.replace('_', '-')} is not modelled yet (pipeline parallelism is modelled for full "
               "fine-tuning of a 16/32-bit base, one torch.distributed.pipelining stage per GPU, the HF loss)")
    elif setup.adapters or setup.quant != "none":
        why = "with LoRA/QLoRA or a quantized base is not modelled yet; use --method full"
    elif setup.precision.endswith("-mixed"):
        why = f"with --precision {setup.precision} is not modelled yet; use bf16, fp16 or fp32"
    elif setup.optimizer not in PP_OPTIMIZERS:
        why = f"with --optimizer {setup.optimizer} is not modelled yet; modelled: {', '.join(PP_OPTIMIZERS)}"
    elif setup.fsdp != "none" and (setup.gpus == setup.pp or setup.fsdp_version != 2 or setup.fsdp == "no_shard"):
        why = (f"with --fsdp {setup.fsdp} (FSDP{setup.fsdp_version}) on --gpus {setup.gpus} is not modelled: beside "
               "the pipeline torch.distributed.pipelining drives FSDP2 (fully_shard) or DDP per stage, and torchtitan "
               "runs FSDP2; use --fsdp full_shard --fsdp-version 2 with --gpus a multiple of --pp above it, or no "
               "--fsdp (DDP per stage)")
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


def data_parallel(setup: Setup) -> str:
    """What runs beside the pipeline on ``gpus = pp x dp``: ``"none"`` (one pipeline), ``"fsdp2"``
    (``fully_shard`` over each stage's ``dp`` ranks, as torchtitan runs it) or ``"ddp"`` (torch's
    ``DistributedDataParallel`` around each stage, which torch.distributed.pipelining's stage.py drives)."""
    if setup.gpus <= setup.pp:
        return "none"
    return "fsdp2" if setup.fsdp != "none" else "ddp"
