"""The framework that runs the step (``Setup.framework``, ``--framework``): what each one does to the
model before the first step that changes memory, read from its source at the version named.

vramplan's estimate is of one step; the frameworks differ in how they prepare the model for it:

- **the fp32 upcast of a quantized base** (``kbit_upcast``): peft 0.21's
  ``prepare_model_for_kbit_training`` (peft/utils/other.py) casts every fp16/bf16 parameter that is
  not a ``Params4bit`` to fp32: embeddings, the head, norms, biases, unquantized routers. With them
  fp32 the residual stream, every projection's output and the logits are fp32 too
  (estimator/precision.py ``compute_bytes``). The HF Trainer recipe peft documents calls it; TRL
  1.16's SFTTrainer does not (trl/trainer/sft_trainer.py: only trl/experimental's trainers prepare,
  with their own copy that does not upcast); Unsloth prepares with its own
  ``unsloth_zoo.training_utils.prepare_model_for_training``, which upcasts only the LoRA weights;
  axolotl calls peft's and then casts norms, ``embed_tokens`` and ``lm_head`` back to the load dtype
  (src/axolotl/loaders/model.py), so at the step they are 16-bit; LLaMA-Factory has its own
  ``prepare_model_for_training`` with ``upcast_layernorm`` off by default
  (src/llamafactory/model/model_utils/checkpointing.py); torchtune builds its own bf16 model.
- **the LoRA weights' dtype on a quantized base** (``kbit_adapter_bytes``): peft upcasts adapters to
  fp32 (``autocast_adapter_dtype=True``); TRL 1.16 then casts every trainable parameter of a
  quantized model to bf16 (sft_trainer.py, "QLoRA paper", peft#2889), so its adapters, their
  gradients and AdamW states are 16-bit; torchtune asserts bf16 adapters
  (``validate_expected_param_dtype``). The others keep fp32 adapters (LLaMA-Factory casts them to
  fp32 explicitly, model/adapter.py; Unsloth's ``prepare_model_for_training`` upcasts them).
- **the loss each framework runs by default** (``default_loss``): TRL 1.16 installs its fused,
  chunked LM head on every SFTTrainer (``add_fused_lm_head``; ``--loss trl``); the HF Trainer,
  axolotl and LLaMA-Factory compute transformers' ``ForCausalLMLoss`` on full logits unless a
  plugin replaces it (Liger, cut-cross-entropy: ``--liger``).

Each framework names the version read (``version``) and the library versions it pins where they
differ from vramplan's (``pins``): Unsloth 2026.8 needs trl <= 0.24 and transformers <= 5.5,
axolotl 0.18 pins transformers 5.14.1 / peft 0.19.1 / trl 1.8.0, LLaMA-Factory 0.9.6 transformers
<= 5.8 / peft <= 0.18.1. The estimate models each framework's own preparation over the transformers
5 step vramplan models; where a framework's own kernels replace the step (Unsloth's fused
cross-entropy and offloaded checkpointing, torchtune's own model) the step is that framework's own
(estimator/unsloth.py, estimator/torchtune.py).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["DEFAULT_FRAMEWORK", "FRAMEWORKS", "UNSLOTH_FAST_PATH", "Framework", "framework",
           "with_framework_defaults"]

#: the model types Unsloth's ``FastLanguageModel.from_pretrained`` dispatches to its own decoder forward and
#: fused LoRA kernels (unsloth 2026.8.19 ``unsloth/models/loader.py``: FastLlamaModel, FastMistralModel,
#: FastGemmaModel, FastGemma2Model, FastQwen2Model, FastQwen3Model, FastQwen3MoeModel); every other model type
#: goes to ``FastModel`` (transformers' modeling code, compiled by unsloth-zoo)
UNSLOTH_FAST_PATH = ("llama", "mistral", "gemma", "gemma2", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Framework:
    """What one framework does to a model before its first step, as far as memory goes."""

    name: str
    title: str
    #: the version whose source this row is read off
    version: str
    #: peft's fp32 upcast of every non-quantized 16-bit parameter of a bitsandbytes base
    kbit_upcast: bool
    #: bytes per element of the LoRA weights (their gradients and AdamW states) on a quantized base
    kbit_adapter_bytes: int
    #: the loss path its SFT trainer runs unless told otherwise (Setup.loss)
    default_loss: str
    #: where each fact was read (repository paths at ``version``)
    source: str
    #: the library versions it pins where they differ from vramplan's constraints.txt ("" when none)
    pins: str = ""
    #: why the estimate refuses it ("" when modelled)
    not_modelled: str = ""
    #: Setup knobs its config has no field for (emit/hf_configs.py ``common_refusal``): a plan for it
    #: searches them only where the user fixes them, so ``plan --emit`` writes what it planned
    unwritten: tuple[str, ...] = ()


_FRAMEWORKS = (
    Framework("hf", "the HF Trainer with peft's QLoRA recipe", "transformers 5.24 / peft 0.21", True, 4, "hf",
              "peft/utils/other.py prepare_model_for_kbit_training (the fp32 upcast); peft/tuners/tuners_utils.py "
              "cast_adapter_dtype (fp32 adapters); transformers/loss/loss_utils.py ForCausalLMLoss (full logits)"),
    Framework("trl", "TRL's SFTTrainer", "trl 1.16.0", False, 2, "trl",
              "trl/trainer/sft_trainer.py (no prepare_model_for_kbit_training; trainable parameters of a "
              "quantized model cast to bf16; add_fused_lm_head in every SFTTrainer); trl/trainer/utils.py "
              "create_model_from_path (dtype float32 unless model_init_kwargs.dtype: --precision says which)",
              unwritten=("checkpoint_every", "optimizer_in_backward")),
    Framework("axolotl", "axolotl", "axolotl 0.18.0", False, 4, "hf",
              "src/axolotl/loaders/model.py (peft's prepare_model_for_kbit_training, then norms, embed_tokens and "
              "lm_head cast back to the load dtype); loaders/adapter.py (peft's fp32 adapters); the HF "
              "Trainer's loss unless the liger / cut_cross_entropy plugins",
              pins="transformers 5.14.1, peft 0.19.1, trl 1.8.0, bitsandbytes 0.49.1",
              unwritten=("checkpoint_every", "optimizer_in_backward")),
    Framework("llamafactory", "LLaMA-Factory", "LLaMA-Factory 0.9.6.dev0", False, 4, "hf",
              "src/llamafactory/model/model_utils/checkpointing.py prepare_model_for_training (upcast_layernorm "
              "off by default, embeddings and head never upcast); model/adapter.py (trainable parameters cast "
              "to fp32); the HF Trainer's loss unless enable_liger_kernel",
              pins="transformers <= 5.8.0, peft <= 0.18.1, trl <= 0.24.0",
              unwritten=("checkpoint_every", "optimizer_in_backward")),
    Framework("unsloth", "Unsloth", "unsloth 2026.8.19 / unsloth-zoo 2026.8.13", False, 4, "unsloth",
              "unsloth_zoo/training_utils.py prepare_model_for_training (only LoRA weights upcast); "
              "unsloth_zoo/fused_losses/cross_entropy_loss.py (chunked fused cross-entropy); "
              "unsloth_zoo/gradient_checkpointing.py (layer inputs offloaded to pinned host memory)",
              pins="trl <= 0.24.0, transformers <= 5.5.0",
              unwritten=("checkpoint_every", "optimizer_in_backward")),
    # its CEWithChunkedOutputLoss is part of its own step (estimator/torchtune.py): Setup.loss stays "hf"
    Framework("torchtune", "torchtune's single-device recipes", "torchtune 0.6.1", False, 2, "hf",
              "recipes/lora_finetune_single_device.py, full_finetune_single_device.py (bf16 model and adapters, "
              "no autocast); torchtune/modules (its own TransformerDecoder, estimator/torchtune.py); "
              "torchtune/modules/loss CEWithChunkedOutputLoss (8 bf16 logit chunks, fp32 log-probs kept); "
              "torchao to_nf4 (QLoRA)",
              unwritten=("checkpoint_every",)),
)

FRAMEWORKS = tuple(f.name for f in _FRAMEWORKS)
#: what ``vramplan emit`` writes (train.py: the HF Trainer, peft's QLoRA recipe)
DEFAULT_FRAMEWORK = "hf"
_BY_NAME = {f.name: f for f in _FRAMEWORKS}


def framework(name: str) -> Framework:
    """The row of framework ``name`` (one of :data:`FRAMEWORKS`)."""
    return _BY_NAME[name]


def with_framework_defaults(knobs: dict, given: Collection[str] = ()) -> dict:
    """``knobs`` (Setup fields) with the framework's own defaults for what the user did not set
    (``given``: the fields set explicitly): the loss its SFT trainer runs (TRL 1.16: its fused head).
    ``Setup(framework=...)`` itself changes no other field: the command line and plan files call this."""
    name = knobs.get("framework")
    if name is None or name not in _BY_NAME or "loss" in given or knobs.get("loss") not in (None, "hf"):
        return knobs
    fw = _BY_NAME[name]
    if fw.not_modelled or fw.default_loss == "hf":
        return knobs
    if fw.name == "trl" and str(knobs.get("precision") or "bf16").endswith("-mixed"):
        return knobs  # TRL's head under autocast is not modelled: transformers' loss (estimator/objectives.py)
    return {**knobs, "loss": fw.default_loss}
