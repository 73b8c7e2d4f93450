"""The Breakdown's components of one step (estimator/step.py): one named, cited Component per term, in
the order a Breakdown lists them, before and after the device terms (estimator/corrections.py)."""

from __future__ import annotations

from typing import Any

from ..specs import PHASES, Component, Setup
from ..util.units import PRECISION_WEIGHT_DTYPE
from . import activations as act
from . import knobs, selective, torchtune, transients, unsloth
from .hybrid_shard import hsdp_held
from .precision import adapter_param_bytes, kbit_upcast

__all__ = ["step_components", "weights_note"]

_ADAPTER_DTYPE = {4: "fp32", 2: "bf16"}  # TRL casts a quantized base's adapters to the model dtype (bf16)


def step_components(setup: Setup, st: Any, a: Any, recompute: int,
                    paged: int) -> tuple[tuple[Component, ...], tuple[Component, ...]]:
    """The step's components before the device terms (estimator/corrections.py) and after them. ``st``
    and ``a``: estimator/step.py's ModelStates and StepActivationTerms of the step."""
    fb = ("forward", "backward")
    A_layers, A_deq = a.layers, a.dequantized
    T_deq, T_deq_fwd = a.dequantization, a.dequantization_forward
    logits = max(a.logits_forward, a.logits_backward)
    # every layer checkpointed: all the layers keep (a layer split's acts are its rank's); selective: some
    ckpt_inputs = a.checkpointed_inputs if selective.selective(setup) else A_layers if setup.checkpointing else 0
    comps = [
        Component("weights", st.weights, PHASES,
                  note=weights_note(setup) if st.fsdp is None else "this rank's FSDP shards"),
        Component("adapters", st.adapters - st.trained_modules, PHASES,
                  note=f"LoRA A/B in {_ADAPTER_DTYPE[adapter_param_bytes(setup)]}")
        if st.adapters else None,
        Component("trained_modules", st.trained_modules, PHASES, note=knobs.trained_modules_note(setup))
        if st.trained_modules else None,
        Component("autocast_weight_cache", st.cast_cache, fb, note="half copies of weights under autocast")
        if st.cast_cache else None,
        Component("gradients", st.gradients, ("backward", "optimizer") if setup.grad_accum == 1 else PHASES),
        Component("optimizer_states", st.optimizer_states, PHASES, note=setup.optimizer),
        Component("paged_optimizer_states", paged, PHASES,
                  note="cudaMallocManaged: in device_total, not in tensor peak/allocated/reserved") if paged else None,
        Component("optimizer_step", st.optimizer_step, ("optimizer",), note="foreach step transient")
        if st.optimizer_step else None,
        Component("activations", A_layers - A_deq - ckpt_inputs, fb, note="saved for backward"),
        Component("dequantized_weights", A_deq, fb,
                  note="GPTQ: each Linear's 16-bit weight, saved by torch.matmul for backward") if A_deq else None,
        Component("dequantization", max(T_deq, T_deq_fwd), fb,
                  note="one Linear's weight dequantized (estimate only: validate)")
        if setup.quant in ("gptq", "awq") and max(T_deq, T_deq_fwd) else None,
        Component("dora_weight_norm", a.dora_norm, fb, note="one Linear's W + s*BA in fp32 and the eye(in) "
                  "its LoRA weight is built from") if a.dora_norm else None,
        Component("checkpointed_inputs", ckpt_inputs, fb, note="layer inputs kept by checkpointing"
                  + act.checkpoint_note(setup)
                  + unsloth.checkpoint_note(setup)
                  + (f" (one layer in {setup.checkpoint_every})" if selective.selective(setup) else ""))
        if setup.checkpointing else None,
        Component("recompute", recompute, ("backward",), note="one layer recomputed, with its gradient temporaries")
        if recompute else None,
        Component("model_io_activations", a.model_io, fb, note="embeddings, final norm, fp32 log-probs"),
        Component("logits_loss", logits, fb,
                  note="TRL's fused log-prob head (4096 x 32768 tiles, fp32 gradients)"
                  if setup.objective != "sft" or setup.loss == "trl"
                  else unsloth.LOSS_NOTE if setup.loss == "unsloth"
                  else torchtune.loss_note(setup) if torchtune.torchtune(setup)
                  else "logits, fp32 upcast and its gradient" if setup.loss == "hf"
                  else f"one {transients.LOSS_CHUNK_TOKENS}-token chunk at a time (chunked loss)"),
        Component("deepspeed_buffers", st.buffers, PHASES) if st.buffers and not st.ddp_buckets else None,
        Component("ddp_buckets", st.ddp_buckets, PHASES, note="DDP gradient buckets (a copy of the gradients)")
        if st.ddp_buckets else None,
        Component("fsdp_gathered", st.fsdp_gathered, PHASES, note="unsharded root unit + one layer unit (16-bit)"
                  if st.fsdp.version == 1 else "FSDP2: unsharded tail group (norm, head) + one layer; at the loss "
                  "also the last all-gather buffer (estimator/fsdp2.py)")
        if st.fsdp_gathered else None,
        Component("hsdp_reduce_held", held, ("backward",), note="hybrid sharding: each group's 16-bit reduce output "
                  "held for its all-reduce to the end of the backward (torch 2.13 FSDPParamGroup._all_reduce_state; "
                  "estimator/hybrid_shard.py)") if (held := hsdp_held(st.fsdp)) else None,
    ]
    after = [
        Component("host_offload", st.host, PHASES, where="host") if st.host else None,
        Component("nvme_offload", st.zero.nvme, PHASES, where="nvme", note="ZeRO-Infinity's swap files")
        if st.zero is not None and st.zero.nvme else None,
    ]
    return tuple(c_ for c_ in comps if c_ is not None), tuple(c_ for c_ in after if c_ is not None)


def weights_note(setup: Setup) -> str:
    """The weights' component note: the base's format and the dtype of the other parameters."""
    if setup.quant in ("gptq", "awq"):
        g = "per channel" if setup.quant_group_size == -1 else f"g{setup.quant_group_size}"
        rest = "fp32 (k-bit prep)" if setup.quant == "awq" else PRECISION_WEIGHT_DTYPE[setup.precision]
        return f"{setup.quant} {setup.quant_bits}-bit {g} base (packed int32 + fp16 scales); other params {rest}"
    if setup.quant != "none":
        rest = "fp32" if kbit_upcast(setup) else PRECISION_WEIGHT_DTYPE[setup.precision]
        return f"{setup.quant}{' + double quant' if setup.double_quant else ''} base; other params {rest}"
    return PRECISION_WEIGHT_DTYPE[setup.precision]
