"""Checks of a Setup against a model and a GPU that a Setup alone cannot make.

``Setup.__post_init__`` validates what it knows by itself (positive sizes, known choices, option
combinations). What needs the model (LoRA targets and rank against its Linears, sequence length
against its positions) or the GPU (bf16 support) lives here: :func:`check` raises
:class:`SpecError` for a setup peft/transformers would refuse or that makes no sense, and returns
warnings (one line each) for one that runs but is probably not what the user meant. Torch-free.
"""

from __future__ import annotations

from ..specs import GpuSpec, LinearSpec, ModelSpec, Setup, SpecError
from .frameworks import UNSLOTH_FAST_PATH


def lora_target_names(setup: Setup) -> list[str] | None:
    """The module names of ``--lora-targets``; None for peft's ``"all-linear"``."""
    text = setup.lora_targets.strip()
    if text == "all-linear":
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _matches(linear: LinearSpec, target: str) -> bool:
    # peft's rule for a list of names: the module's key equals the target or ends with "." + target.
    return linear.name == target or linear.path == target or linear.path.endswith("." + target)


def lora_targets(model: ModelSpec, setup: Setup) -> tuple[list[LinearSpec], list[str]]:
    """The Linears LoRA wraps, and the named targets that match none of them.

    ``all-linear`` is every Linear but the output layer, as peft resolves it.
    """
    names = lora_target_names(setup)
    if names is None:
        return [l for l in model.linears if l.role != "head"], []
    targeted = [l for l in model.linears if any(_matches(l, t) for t in names)]
    unmatched = [t for t in names if not any(_matches(l, t) for l in model.linears)]
    return targeted, unmatched


#: Setup knobs the estimator does not model yet: field -> what a setup that sets it is told. A knob
#: leaves this table in the change that models it (estimator term, truth, validate knob).
NOT_MODELLED: dict[str, str] = {}
# (context parallelism left it: estimator/context_parallel.py check_cp refuses what
# vramplan.truths.cp_truth does not run)

_SETUP_DEFAULTS = Setup()


def refuse_unmodelled(setup: Setup) -> None:
    """Raise SpecError for a setup that sets a knob of :data:`NOT_MODELLED`."""
    for name, why in NOT_MODELLED.items():
        if getattr(setup, name) != getattr(_SETUP_DEFAULTS, name):
            raise SpecError(f"{why} (--{name.replace('_', '-')})")


#: The optimizers FSDP2 is modelled with (torch AdamW foreach or fused, SGD), estimator/fsdp2.py.
FSDP2_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")


def check_fsdp2(model: ModelSpec, setup: Setup) -> None:
    """FSDP2 (``--fsdp-version 2``) is modelled for what estimator/fsdp2.py verifies against
    vramplan.truths.fsdp2 (``validate --knob fsdp2``); the rest is refused, each with why."""
    if setup.fsdp_version != 2:
        return
    why = None
    model_moe = model.moe is not None or any(name in ("experts", "router") for name, _ in model.other_params)
    if setup.fsdp == "no_shard":
        why = ("FSDP2 has no NO_SHARD (accelerate 1.15's fsdp_reshard_after_forward is a bool): use "
               "--fsdp full_shard or shard_grad_op, or plain DDP")
    elif setup.gpus < 2:
        why = "FSDP2 on one GPU is not modelled yet; use 2+ GPUs"
    elif setup.offload_params != "none":
        # tests/test_emitted_multi_gpu_runs.py: it runs on gloo CPU ranks, but its copies do not happen there
        why = ("FSDP2 CPU offload (CPUOffloadPolicy) is not modelled yet: torch 2.13's fully_shard runs it on CPU "
               "ranks, but there its host-to-GPU shard copies and GPU-to-host gradient copies are no-ops (same "
               "storage), so a CPU truth needs stand-in copies for both, and none is verified yet; use "
               "--fsdp-version 1 (its CPU offload is modelled)")
    elif model_moe:
        why = ("FSDP2 on a mixture-of-experts model is not modelled yet (its ranks' peaks differ by 5-11 % "
               "on the tiny Mixtral run); use --fsdp-version 1")
    elif setup.quant not in ("none", "nf4", "fp4"):
        why = f"FSDP2 with a --quant {setup.quant} base is not modelled yet; use --fsdp-version 1"
    elif setup.optimizer not in FSDP2_OPTIMIZERS:
        why = f"FSDP2 with --optimizer {setup.optimizer} is not modelled yet; modelled: {', '.join(FSDP2_OPTIMIZERS)}"
    else:  # knobs whose interplay with fully_shard no FSDP2 truth has run
        knob = next((k for k in _FSDP2_UNRUN if getattr(setup, k) != getattr(_SETUP_DEFAULTS, k)), None)
        if knob is not None:
            why = f"FSDP2 with --{knob.replace('_', '-')} is not modelled yet; use --fsdp-version 1"
    if why:
        raise SpecError(why)


#: Setup knobs FSDP2 refuses away from their defaults (vramplan.truths.fsdp2 runs none of them).
_FSDP2_UNRUN = ("loss", "liger", "dora", "modules_to_save", "activation_offload", "checkpoint_every",
                "optimizer_in_backward", "objective", "eval_batch", "padding_free")
# (--tp beside FSDP2: estimator/tp_fsdp2.py check_tp_fsdp2 refuses what truths/tp_fsdp2.py does not run)


def check_liger(model: ModelSpec, setup: Setup) -> None:
    """Liger kernels are modelled for the model types of estimator/liger.py, on a 16/32-bit, NF4/FP4 or LLM.int8
    base (docs/knobs.md: the real bitsandbytes step with the kernels' stand-ins)."""
    from ..estimator.liger import LIGER_FAMILIES, LIGER_OTHER_TYPES

    if model.family not in LIGER_FAMILIES:
        why = ("liger-kernel 0.8.5 patches it, but its kernels there are not modelled yet"
               if model.family in LIGER_OTHER_TYPES else "liger-kernel 0.8.5 has no kernels for it")
        raise SpecError(f"--liger on {model.name} (model_type {model.family}): {why}; modelled: "
                        f"{', '.join(LIGER_FAMILIES)}")
    if setup.quant in ("gptq", "awq"):  # (bitsandbytes bases are verified: validate --knob liger)
        raise SpecError(f"--liger on a {setup.quant.upper()} base is not modelled yet (no CPU truth runs its kernels); "
                        "modelled on 16-bit, NF4/FP4 and LLM.int8 bases")
    if setup.tp > 1 or setup.cp > 1:  # LigerRMSNorm gathers a DTensor input in full (full_tensor)
        raise SpecError("--liger with tensor or context parallelism is not modelled yet; use --tp 1 --cp 1")
    if setup.objective != "sft":  # TRL's LigerFusedLinearDPOLoss / GRPO loss: other kernels
        raise SpecError(f"--liger with --objective {setup.objective} (TRL's fused Liger "
                        f"{setup.objective.upper()} loss) is not modelled yet; Liger is modelled for SFT")


def check_activation_offload(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for an activation-offloading setup that estimator/act_offload.py does not model
    (TRL 1.16's OffloadActivations; its docstring says why each is refused)."""
    if not setup.activation_offload:
        return
    why = None
    if setup.framework == "torchtune":
        why = "under --framework torchtune: its OffloadActivations runs on CUDA streams only; not modelled"
    elif not setup.checkpointing:
        why = ("without --checkpointing TRL offloads every saved tensor but its storage deduplication keeps each "
               "tensor saved twice on the device (it can take more device memory than checkpointing alone); "
               "not modelled: add --checkpointing")
    elif (setup.method == "qlora" or setup.quant != "none") and setup.framework != "trl":
        why = ("on a quantized base: verified with TRL's SFTTrainer preparing the model (--framework trl), "
               "not with this framework's preparation")
    elif model.traits.norm not in ("rms", "rms_fp32_mul") or (model.traits.final_logit_softcapping
                                                               and setup.loss != "trl"):
        # (TRL's fused head applies the soft-capping inside its tiles, under the manager's NoOpManager)
        why = f"on {model.name} (its final norm or logit soft-capping saves other tensors): not traced yet"
    elif setup.precision not in ("bf16", "fp16"):
        why = f"with --precision {setup.precision}: modelled for a 16-bit step (bf16, fp16)"
    elif setup.gpus > 1 or setup.zero_stage or setup.fsdp != "none" or setup.device_map != "none":
        why = "on several GPUs (ZeRO, FSDP, DDP, a layer split): modelled on one GPU"
    elif setup.liger and setup.loss != "trl":
        why = ("with Liger's fused linear cross-entropy: it multiplies by lm_head's weight outside the module, so "
               "the manager's NoOpManager on lm_head does not cover its saved grad_input (offloaded); not traced. "
               "Modelled: Liger's layer kernels under TRL's fused head (--framework trl --loss trl)")
    elif (setup.loss not in ("hf", "trl") or (setup.loss == "trl" and setup.framework != "trl")
          or setup.objective != "sft"):
        why = ("with a chunked loss or DPO/GRPO: modelled with transformers' default loss and, under "
               "--framework trl, TRL's fused head (SFT)")
    elif setup.padding_free or setup.pad_mask or setup.eval_batch:
        why = "with padding-free or padded batches or an eval step: not traced yet"
    elif setup.modules_to_save or setup.dora or setup.optimizer_in_backward or setup.checkpoint_every > 1:
        why = "with modules_to_save, DoRA, optimizer in backward or selective checkpointing: not traced yet"
    elif model.moe is not None:
        why = f"on a mixture-of-experts model ({model.name}): not traced yet"
    if why:
        raise SpecError(f"--activation-offload {why}")


def check_padding_free(model: ModelSpec, setup: Setup) -> None:
    """Padding-free batches (TRL ``padding_free``, ``DataCollatorWithFlattening``): one row of
    ``batch * seq`` tokens whose ``position_ids`` restart per sequence. transformers 5.24 runs it as
    flash-attention varlen (``_flash_attention_forward``: cu_seqlens from the position ids, no
    mask): the same saved tensors as the padded batch without a mask. With SDPA or eager,
    ``masking_utils`` (``find_packed_sequence_indices``) builds a block-diagonal (1, 1, N, N) mask
    instead, and TRL 1.16 warns (SFTTrainer: padding-free needs a flash attention variant): not
    modelled, refused."""
    from ..estimator.precision import attention_impl

    if attention_impl(model, setup) != "flash":
        raise SpecError("padding-free batches need flash attention (--attn flash): with SDPA or eager, transformers "
                        "builds a block-diagonal N x N mask over the packed row (TRL warns), which is not modelled")


def check_framework(setup: Setup) -> None:
    """A framework other than the HF Trainer recipe is modelled on one GPU or DDP ranks, for SFT, as
    its model preparation (setup/frameworks.py); what it replaces of the step is refused until modelled."""
    from .frameworks import framework

    if setup.compile and setup.framework != "torchtune":
        raise SpecError("--compile is modelled for torchtune's compile: True (its compiled cross-entropy, "
                        "--framework torchtune); torch.compile elsewhere (the Trainer's torch_compile, axolotl's, "
                        "LLaMA-Factory's) is not: estimate without it, an upper bound")
    check_tiled_mlp(setup)
    if setup.unsloth_gc and (setup.framework != "llamafactory" or not setup.checkpointing
                             or setup.checkpoint_every > 1 or setup.activation_offload):
        raise SpecError("--unsloth-gc is LLaMA-Factory's use_unsloth_gc (its checkpointed layer inputs in host "
                        "RAM): it goes with --framework llamafactory and --checkpointing on every layer, without "
                        "--activation-offload (Unsloth's own offloaded checkpointing is --framework unsloth)")
    if setup.framework == "hf":
        return
    fw = framework(setup.framework)
    if fw.not_modelled:
        raise SpecError(f"--framework {fw.name} ({fw.title}, {fw.version}): {fw.not_modelled}; modelled: hf, trl, "
                        "axolotl, llamafactory, unsloth, torchtune")
    sharded = setup.zero_stage or setup.fsdp != "none" or setup.tp > 1 or setup.cp > 1 or setup.device_map != "none"
    if sharded:
        raise SpecError(f"--framework {fw.name} with ZeRO, FSDP, tensor/context parallelism or a layer split is not "
                        "modelled yet (its preparation is modelled on one GPU or DDP ranks); use --framework hf")
    if setup.objective != "sft":
        raise SpecError(f"--framework {fw.name} with --objective {setup.objective}: modelled for SFT; the DPO/GRPO "
                        "objectives are TRL's trainers as they run (--framework hf)")
    if setup.quant in ("gptq", "awq"):
        raise SpecError(f"--framework {fw.name} on a GPTQ/AWQ base is not modelled yet; use --framework hf")
    if setup.modules_to_save.strip() or setup.dora:
        raise SpecError(f"--framework {fw.name} with modules_to_save or DoRA is not modelled yet (each framework "
                        "casts trainable copies its own way); use --framework hf")
    if fw.name == "unsloth":
        check_unsloth(setup)
    if fw.name == "torchtune":
        check_torchtune(setup)


def check_torchtune(setup: Setup) -> None:
    """torchtune 0.6.1's single-device recipes are modelled (estimator/torchtune.py, which also refuses the
    model families it has no builder for); the rest is refused in one line."""
    why = None
    if setup.gpus > 1:
        why = "on several GPUs: its distributed recipes (FSDP2) are not modelled; one GPU"
    elif setup.precision != "bf16":
        why = f"--precision {setup.precision}: modelled for its configs' dtype: bf16 (no autocast)"
    elif setup.quant not in ("none", "nf4"):
        why = f"--quant {setup.quant}: torchtune's QLoRA is torchao NF4 (--method qlora)"
    elif setup.activation_offload:
        why = ("--activation-offload: torchtune's OffloadActivations runs on CUDA streams only and is not verified "
               "here; not modelled")
    elif setup.liger or setup.dora or setup.modules_to_save.strip() or setup.checkpoint_every > 1:
        why = "with Liger, DoRA, modules_to_save or selective checkpointing: not modelled"
    elif setup.eval_batch:
        why = "with an eval step: not modelled"
    elif setup.loss != "hf":
        why = f"--loss {setup.loss}: its step runs its own CEWithChunkedOutputLoss (modelled; leave --loss unset)"
    elif setup.attn not in ("auto", "sdpa"):
        why = f"--attn {setup.attn}: its attention is its own SDPA module"
    elif setup.adapters and "lm_head" in setup.lora_targets:
        why = "LoRA on the head (apply_lora_to_output): not modelled"
    elif setup.adapters and setup.lora_targets != "all-linear" and len(
            {"gate_proj", "up_proj", "down_proj"} & {t.strip() for t in setup.lora_targets.split(",")}) in (1, 2):
        why = "LoRA on part of the MLP: its apply_lora_to_mlp adapts w1, w2 and w3 or none"
    elif setup.optimizer not in ("adamw", "adamw-fused", "sgd", "adamw-8bit", "paged-adamw-8bit"):
        why = f"--optimizer {setup.optimizer}: not one its configs name"
    elif setup.adapters and setup.optimizer_in_backward:
        why = "LoRA with the optimizer in backward: only the full recipe reads optimizer_in_bwd"
    elif setup.optimizer_in_backward and setup.grad_accum > 1:
        why = "optimizer_in_bwd with gradient accumulation: the recipe refuses it"
    if why:
        raise SpecError(f"--framework torchtune {why}")


def check_unsloth(setup: Setup) -> None:
    """Unsloth's FastLanguageModel LoRA path is modelled (estimator/unsloth.py): one GPU, a 16-bit or
    nf4 base, bf16/fp16, its own loss and checkpointing; the rest is refused."""
    why = None
    if setup.method == "full":
        why = "full fine-tuning (FastModel's full_finetuning path) is not modelled; use --method lora or qlora"
    elif setup.quant not in ("none", "nf4"):
        why = f"--quant {setup.quant}: modelled for a 16-bit or nf4 base (Unsloth's load_in_4bit)"
    elif setup.gpus > 1:
        why = "on several GPUs: modelled on one GPU"
    elif setup.precision not in ("bf16", "fp16"):
        why = f"--precision {setup.precision}: Unsloth loads and trains in bf16 (fp16 on cards without it)"
    elif setup.liger or setup.activation_offload or setup.optimizer_in_backward or setup.checkpoint_every > 1:
        why = ("with --liger, --activation-offload, optimizer in backward or selective checkpointing: Unsloth runs "
               "its own kernels, loss and offloaded checkpointing")
    elif setup.eval_batch:
        why = "with an eval step: not modelled yet"
    if why:
        raise SpecError(f"--framework unsloth {why}")


def check_trl_loss(setup: Setup) -> None:
    """``--loss trl`` (TRL's fused LM head) is modelled on a model loaded in 16 or 32 bits that trains
    without autocast: TRL loads the model in its checkpoint's dtype (estimator/objectives.py
    ``check_trl_sft``). A full fine-tune under fp16 autocast (a card without bf16) is refused."""
    if setup.objective == "sft" and setup.loss == "trl" and setup.precision.endswith("-mixed"):
        raise SpecError("--loss trl is modelled with 16-bit or fp32 weights without autocast (TRL loads the model "
                        "in its checkpoint's dtype); use --precision bf16")


def check_tiled_mlp(setup: Setup) -> None:
    """``--tiled-mlp`` is modelled for Unsloth's ``unsloth_tiled_mlp=True`` and for axolotl's ``tiled_mlp: true``
    with adapters on one GPU (estimator/tiled_mlp.py); its shard count is axolotl's."""
    if setup.tiled_mlp_shards and (not setup.tiled_mlp or setup.framework != "axolotl"):
        raise SpecError("tiled_mlp_shards is axolotl's tiled_mlp_num_shards: it goes with --tiled-mlp and "
                        "--framework axolotl (Unsloth's tiles are hidden_size tokens)")
    if not setup.tiled_mlp or setup.framework == "unsloth":
        return
    if setup.framework != "axolotl":
        raise SpecError("--tiled-mlp is modelled for Unsloth's unsloth_tiled_mlp=True (--framework unsloth) and "
                        "axolotl's tiled_mlp (--framework axolotl); no other framework tiles the MLP")
    if not setup.adapters:  # axolotl/monkeypatch/tiled_mlp/base.py TiledMLP.backward
        raise SpecError("--tiled-mlp with --framework axolotl and full fine-tuning: its tiled backward keeps a "
                        "gradient accumulator per MLP weight (zeros_like) beside each shard's gradient, not "
                        "modelled; LoRA and QLoRA only")
    if setup.gpus > 1:
        raise SpecError("--tiled-mlp with --framework axolotl on several GPUs (DeepSpeed's TiledMLP, FSDP2's "
                        "deferred reshard) is not modelled; one GPU only")


def tiled_mlp_applies(model: ModelSpec) -> bool:
    """The tiled MLP (``--tiled-mlp``) is modelled on ``model``: a dense decoder-only transformer (no MoE block,
    no LFM2 convolution layers); :func:`check` refuses it elsewhere, the search does not try it there."""
    return model.moe is None and not model.traits.conv_layers


def check(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None) -> list[str]:
    """Raise SpecError if ``setup`` cannot run on ``model``; return warnings (one line each)."""
    refuse_unmodelled(setup)
    check_framework(setup)
    if setup.tiled_mlp and model.moe is not None:  # estimator/tiled_mlp.py: dense MLPs only (tiled_mlp_applies)
        raise SpecError(f"--tiled-mlp on {model.name} (MoE): Unsloth also tiles an MoE block (a module named "
                        "*.mlp or *.block_sparse_moe), which is not modelled yet; dense models only")
    if setup.tiled_mlp and model.traits.conv_layers:  # (a hybrid's layers: estimator/short_conv.py)
        raise SpecError(f"--tiled-mlp on {model.name} (convolution and attention layers): not modelled yet; "
                        "decoder-only transformers only")
    check_trl_loss(setup)
    check_fsdp2(model, setup)
    if setup.pp > 1:  # pipeline parallelism: what its truth does not run is refused
        from ..estimator.pipeline_check import check_pp

        check_pp(model, setup)
    if setup.cp > 1:  # context parallelism: what its truth does not run is refused
        from ..estimator.context_parallel import check_cp

        check_cp(model, setup)
    if setup.dp_replicate > 1:  # hybrid sharding: what its truths do not run is refused
        from ..estimator.hybrid_shard import check_hybrid

        check_hybrid(model, setup)
    if setup.activation_offload:  # modelled for what estimator/act_offload.py names; the rest refused
        check_activation_offload(model, setup)
    if setup.liger:
        check_liger(model, setup)
    if setup.padding_free:
        check_padding_free(model, setup)
    if setup.checkpoint_every > 1:
        from ..estimator.selective import check_selective

        check_selective(model, setup)
    warnings: list[str] = []
    if model.max_position_embeddings and setup.seq > model.max_position_embeddings:
        warnings.append(
            f"seq {setup.seq} exceeds max_position_embeddings {model.max_position_embeddings} of {model.name}"
        )
    if setup.adapters:
        warnings += _check_lora(model, setup)
    experts = sum(n for name, n in model.other_params if name == "experts")
    if experts and setup.quant in ("int8", "nf4", "fp4"):
        # transformers 5 stores the routed experts as fused 3-D parameters, not Linears: bitsandbytes
        # leaves them unquantized and prepare_model_for_kbit_training upcasts them to fp32.
        warnings.append(
            f"{model.name}'s {experts / 1e9:.1f}B expert parameters are fused 3-D tensors that bitsandbytes "
            f"does not quantize; --quant {setup.quant} keeps them in fp32 (4 bytes each), more than a 16-bit "
            "LoRA base needs"
        )
    if setup.framework == "unsloth" and setup.checkpointing and model.model_type not in UNSLOTH_FAST_PATH:
        warnings.append(
            f"--framework unsloth on {model.model_type}: FastLanguageModel hands it to FastModel (transformers' "
            "modeling code compiled by unsloth-zoo), not Unsloth's fused decoder kernels; its recomputed layer is "
            "estimated as transformers' (an upper bound)"
        )
    if fsdp_lora_crashes(model, setup):
        warnings.append(
            f"FSDP {'NO_SHARD' if setup.fsdp == 'no_shard' else setup.fsdp.upper() + ' on one GPU (run as NO_SHARD)'} "
            f"with LoRA on {model.name} (tied embeddings) crashes in torch 2.13's FSDP1 with use_orig_params "
            "(AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>, in "
            "FlatParamHandle._use_unsharded_views); use --fsdp full_shard on 2+ GPUs, DDP or ZeRO"
        )
    if gpu is not None and not gpu.bf16 and setup.precision in ("bf16", "bf16-mixed"):
        warnings.append(f"{gpu.display_name} has no bf16; train it with --precision fp16-mixed (or fp32)")
    cc = gpu.compute_capability if gpu is not None else None
    if cc and setup.attn == "flash" and float(cc) < 8.0:  # flash-attn 2's README: Ampere, Ada or Hopper
        warnings.append(f"{gpu.display_name} (compute capability {cc}) cannot run FlashAttention-2 (it needs Ampere or "
                        "newer, compute capability 8.0+); use --attn sdpa")
    return warnings


def fsdp_lora_crashes(model: ModelSpec, setup: Setup) -> bool:
    """torch 2.13's FSDP1 fails the first step of a peft LoRA model with tied embeddings when a
    unit is not sharded (NO_SHARD, or any strategy on one rank) and ``use_orig_params`` is on (as
    accelerate sets it): after the forward, ``_use_unsharded_views(as_params=True)`` asserts that
    the tied weight's primary is a Parameter and finds a plain Tensor. Reproduced with plain torch
    FSDP (no accelerate); untied models and full fine-tuning run."""
    return (setup.adapters and setup.fsdp != "none" and (setup.fsdp == "no_shard" or setup.gpus == 1)
            and model.tie_word_embeddings)


#: Families whose router is an ``nn.Linear`` subclass returning a tuple (all-linear LoRA wraps it and fails).
TUPLE_ROUTERS = {"phimoe": "PhimoeTopKRouter (modeling_phimoe.py)", "llama4": "Llama4Router (modeling_llama4.py)"}
#: what each of those routers returns (phimoe's when not named)
_ROUTER_RETURNS = {"llama4": "(routing scores, logits)"}


def attention_targets(model: ModelSpec) -> str:
    """The model's attention projections as ``--lora-targets`` (comma-separated module names)."""
    return ",".join(dict.fromkeys(l.name for l in model.linears if l.role == "attn"))


def _check_lora(model: ModelSpec, setup: Setup) -> list[str]:
    targeted, unmatched = lora_targets(model, setup)
    known = ", ".join(dict.fromkeys(l.name for l in model.linears))
    if not targeted:
        raise SpecError(f"--lora-targets {setup.lora_targets!r} matches no Linear of {model.name}; "
                        f"its Linears: {known}")
    warnings = [f"--lora-targets {t!r} matches no Linear of {model.name} (ignored); its Linears: {known}"
                for t in unmatched]
    if model.family in TUPLE_ROUTERS and any(l.role == "router" for l in targeted):
        attn = attention_targets(model)
        raise SpecError(f"LoRA on {model.name}'s router does not run: transformers 5.24's "
                        f"{TUPLE_ROUTERS[model.family]} is an nn.Linear whose forward returns "
                        f"{_ROUTER_RETURNS.get(model.family, '(logits, routing weights, expert indices)')}, and peft's "
                        f"LoRA layer adds its output to that tuple; target the attention: --lora-targets {attn}")
    # Routers (e.g. Qwen2-MoE's 1-wide shared_expert_gate) are wrapped by "all-linear" whatever the
    # rank; peft accepts a rank above their width, so they do not bound it.
    bounded = [l for l in targeted if l.role != "router"]
    if bounded:
        small = min(bounded, key=lambda l: min(l.in_features, l.out_features))
        width = min(small.in_features, small.out_features)
        if setup.lora_rank > width:
            raise SpecError(
                f"--lora-rank {setup.lora_rank} is larger than the smallest targeted layer, {small.name} "
                f"({small.in_features} in, {small.out_features} out); use a rank of at most {width} "
                "or narrow --lora-targets"
            )
    return warnings
