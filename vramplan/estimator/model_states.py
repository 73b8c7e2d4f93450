"""The model states of one GPU before any sharding: weights (quantized or not), LoRA adapters,
gradients, optimizer states and the step's transient, and a quantized Linear's dequantization.

Per parameter, from counts only; ZeRO and FSDP shard these (estimator/distributed.py,
estimator/fsdp.py). The optimizer rules are in estimator/optimizers.py.
"""

from __future__ import annotations

import dataclasses

from ..specs import ModelSpec, Setup
from ..util.units import (
    DTYPE_BYTES,
    PRECISION_COMPUTE_DTYPE,
    PRECISION_WEIGHT_DTYPE,
    awq_linear_bytes,
    bnb_4bit_tensor_bytes,
    gptq_linear_bytes,
)
from . import optimizers as opt_rules
from .lora import lora_params
from .precision import adapter_param_bytes, compute_bytes, kbit_upcast


def trainable_params(model: ModelSpec, setup: Setup) -> int:
    """Parameters that train: all of them (full fine-tuning) or the LoRA adapters'."""
    return model.params_total if setup.method == "full" else lora_params(model, setup)


def text_trained(model: ModelSpec) -> ModelSpec:
    """The part of ``model`` a text-only full fine-tune gives gradients: an image-text model (Gemma 3, Qwen-VL,
    Mistral 3) less its vision tower (role ``vision`` Linears, ``vision_tower`` parameters). The step never runs
    the tower, so autograd leaves their ``.grad`` None, and torch's AdamW/SGD (``if p.grad is None: continue``)
    and bitsandbytes' 8-bit optimizers (the same test) never create their states. One GPU or DDP only: ZeRO and
    FSDP allocate flat gradient and optimizer partitions for every parameter that requires grad."""
    linears = tuple(l for l in model.linears if l.role != "vision")
    if len(linears) == len(model.linears) and not any(n == "vision_tower" for n, _ in model.other_params):
        return model
    return dataclasses.replace(model, linears=linears,
                               other_params=tuple((n, c) for n, c in model.other_params if n != "vision_tower"))


def weight_dtype_bytes(setup: Setup) -> int:
    """Bytes per element of the weights as loaded (fp32 masters under ``-mixed`` precision)."""
    return int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])


def weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """Base weights. A quantized base stores its Linear weights (head excluded) at the bitsandbytes
    bytes/param; ``prepare_model_for_kbit_training`` upcasts everything else to fp32 (the HF Trainer
    recipe; a framework that does not keeps it in the load dtype: precision.py ``kbit_upcast``)."""
    w = weight_dtype_bytes(setup)
    if setup.quant == "none":
        return (model.params_total - model.fp32_params) * w + model.fp32_params * 4
    if setup.quant in ("gptq", "awq"):
        return prequantized_weights_bytes(model, setup)
    quantized = sum(l.count * l.weight_params for l in model.linears if l.role != "head")
    rest = model.params_total - quantized
    if setup.quant == "int8":  # int8 weights and LLM.int8's fp32 scale per output row (SCB)
        quantized_bytes = quantized + 4 * sum(l.count * l.out_features for l in model.linears if l.role != "head")
    else:
        quantized_bytes = sum(l.count * bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant)
                              for l in model.linears if l.role != "head")
    return int(quantized_bytes + rest * (4 if kbit_upcast(setup) else w))


def prequantized_linears(model: ModelSpec) -> list:
    """The Linears a GPTQ/AWQ checkpoint quantizes: every decoder Linear; the head (transformers'
    ``get_modules_to_not_convert`` skips the output embedding) and MoE routers (gptqmodel's model
    definitions leave ``mlp.gate`` out) stay 16-bit, as do embeddings, norms and 3-D expert weights."""
    return [l for l in model.linears if l.role not in ("head", "router")]


def prequantized_weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """A GPTQ/AWQ base: each quantized Linear at its packed size (units.gptq_linear_bytes /
    awq_linear_bytes: int32 qweight/qzeros, fp16 scales, GPTQ's int32 g_idx, fp16 bias, all
    buffers), the other parameters as loaded (fp16/bf16). peft's ``prepare_model_for_kbit_training``
    (peft 0.21 utils/other.py) upcasts fp16/bf16 parameters to fp32 unless the model's
    ``quantization_method`` is gptq (or aqlm/eetq/hqq/torchao): an AWQ base's embeddings, norms
    and head become fp32, a GPTQ base's stay 16-bit. Packed buffers are never upcast."""
    qs = prequantized_linears(model)
    pack = gptq_linear_bytes if setup.quant == "gptq" else awq_linear_bytes
    packed = sum(l.count * pack(l.in_features, l.out_features, setup.quant_bits, setup.quant_group_size, l.bias)
                 for l in qs)
    rest = model.params_total - sum(l.params for l in qs)
    if setup.quant == "awq":
        return int(packed + 4 * rest)
    fp32 = min(model.fp32_params, rest)
    return int(packed + (rest - fp32) * weight_dtype_bytes(setup) + 4 * fp32)


#: Peak bytes per weight element of gptqmodel's torch dequantization in training mode
#: (``PackableQuantLinear.dequantize_weight``: int32 shifts of the packed words, int8 codes,
#: gathered scales/zeros, the 16-bit product), result included; measured with gptqmodel 7.7's
#: TorchLinear on CPU (fp16 and bf16 alike): the 3-bit unpack concatenates three planes.
GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT = {2: 6, 3: 14, 4: 6, 8: 8}


def gptq_saved_weights_bytes_per_layer(model: ModelSpec, setup: Setup) -> float:
    """GPTQ trains through gptqmodel's torch path (TorchLinear; TritonV2Linear falls back to it in
    training mode, the fused/Marlin/ExLlama kernels do not train): each forward dequantizes the
    whole weight and ``torch.matmul(x, weights)`` saves it for the input gradient. So every GPTQ
    Linear keeps a 16-bit copy of its weight until its backward: a 16-bit model's worth of
    weights in the activations without checkpointing, one layer's with it. AWQ's GEMM kernel
    (``AwqGemmFn``) saves only the packed tensors."""
    if setup.quant != "gptq":
        return 0.0
    w = weight_dtype_bytes(setup)
    return sum(l.count * l.weight_params for l in prequantized_linears(model)) * w / max(model.num_layers, 1)


def adapter_bytes(model: ModelSpec, setup: Setup) -> int:
    """peft upcasts adapters to fp32 (autocast_adapter_dtype=True); TRL casts a quantized model's to
    bf16 (precision.py ``adapter_param_bytes``)."""
    return adapter_param_bytes(setup) * lora_params(model, setup)


def gradient_bytes(model: ModelSpec, setup: Setup) -> int:
    """One gradient per trainable parameter in its dtype (fp32 for adapters and mixed precision)."""
    if setup.adapters:
        return adapter_param_bytes(setup) * lora_params(model, setup)
    return model.params_total * weight_dtype_bytes(setup)


def optimizer_state_bytes(model: ModelSpec, setup: Setup) -> int:
    """States on the device, per trainable tensor (estimator/optimizers.py): AdamW 2 and SGD
    1 in the parameter dtype, bitsandbytes Lion 1 in fp32, 8-bit AdamW two uint8 states + fp32
    block absmax (fp32 states under 4096 elements; paged ones excluded), Adafactor factored."""
    return opt_rules.state_bytes(model, setup, weight_dtype_bytes(setup))


def optimizer_step_transient_bytes(model: ModelSpec, setup: Setup) -> int:
    """torch AdamW foreach: ``_foreach_sqrt(exp_avg_sqs)`` allocates one state-sized list before
    the in-place update (torch/optim/adamw.py, _multi_tensor_adamw); fused, SGD and the
    bitsandbytes kernels update in place; Adafactor's fp32 copies of the largest tensor."""
    return opt_rules.step_transient_bytes(model, setup, weight_dtype_bytes(setup))


def dequantization_transient_bytes(model: ModelSpec, setup: Setup) -> int:
    """A quantized Linear's backward dequantizes its weight for the input gradient
    (bitsandbytes/autograd/_functions.py): 4-bit ``dequantize_4bit(B).to(grad.dtype)`` (the
    load dtype, then the compute dtype the matmul's gradient is in), LLM.int8
    ``CB.to(A.dtype, copy=True)`` in the dtype of the Linear's input (fp32 once the model is
    prepared for k-bit training). Alive for one Linear: the largest quantized one counts."""
    if setup.quant == "none":
        return 0
    if setup.quant in ("gptq", "awq"):
        largest = max((l.weight_params for l in prequantized_linears(model)), default=0)
        if setup.quant == "gptq":  # the recomputed forward's dequantization, beyond the saved copy
            return (GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT[setup.quant_bits] - weight_dtype_bytes(setup)) * largest
        # AWQ GEMM backward: ``awq_dequantize_weights(...).to(grad_output.dtype)``, fp16 (no copy)
        return 2 * largest
    largest = max((l.weight_params for l in model.linears if l.role != "head"), default=0)
    act_bytes = compute_bytes(setup)
    if setup.quant == "int8":
        return act_bytes * largest
    # 4-bit: dequantized to the dtype the model was loaded in (fp32 under mixed precision),
    # then cast to the gradient's, the compute dtype the matmul ran in
    load, compute = weight_dtype_bytes(setup), int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])
    return (load + (compute if compute != load else 0)) * largest


def head_params(model: ModelSpec) -> int:
    """Parameters of an untied output head (0 when it is tied to the embeddings)."""
    return sum(l.params for l in model.linears if l.role == "head")
