"""The dtypes of a step: what activations, autocast's outputs and LoRA adapters are computed and
kept in, for each precision, quantization and distribution setting, and the attention kernel.

Read off transformers 5, peft, accelerate and DeepSpeed (see each function); used by the saved
activations (estimator/activations.py), the step's transients and the ZeRO/FSDP terms.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup
from ..util.units import DTYPE_BYTES, PRECISION_COMPUTE_DTYPE


def mixed(setup: Setup) -> bool:
    """Mixed precision: fp32 weights and residual stream, matmuls and attention under autocast.
    Not under DeepSpeed: accelerate leaves autocast to it (``native_amp`` is off for DeepSpeed)
    and its bf16/fp16 engine casts the parameters to 16 bits (:func:`deepspeed_16bit`). Not under
    FSDP either: its MixedPrecision runs the forward and backward on 16-bit gathered copies of the
    fp32 shards, so the step's activations are those of the 16-bit step (estimator/fsdp.py)."""
    return setup.precision.endswith("-mixed") and not setup.zero_stage and setup.fsdp == "none"


def deepspeed_16bit(setup: Setup) -> bool:
    """DeepSpeed's bf16/fp16 engine (ZeRO with any precision but fp32) casts every floating-point
    parameter of a model not built under ``zero.Init`` to 16 bits at ``initialize``
    (``DeepSpeedEngine._cast_module_mixed_precision``): the fp32 weights of a ``-mixed`` load and
    the embeddings, norms and head that ``prepare_model_for_kbit_training`` upcast on a quantized
    base (which transformers never builds under ``zero.Init``) become 16-bit again."""
    return bool(setup.zero_stage) and setup.precision != "fp32"


def autocast_bytes(setup: Setup) -> int:
    """Bytes of what autocast's lower-precision ops produce (matmuls, SDPA) under mixed
    precision; otherwise the activations' dtype."""
    if mixed(setup):
        return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])
    return compute_bytes(setup)


def kbit_upcast(setup: Setup) -> bool:
    """peft's ``prepare_model_for_kbit_training`` ran on a bitsandbytes or AWQ base: its embeddings,
    norms, head and other 16-bit parameters are fp32. The HF Trainer recipe does (``--framework
    hf``); TRL, axolotl (which casts them back), LLaMA-Factory and Unsloth leave them in the load
    dtype (setup/frameworks.py). Not under DeepSpeed's 16-bit engine or FSDP (the emitted train.py
    skips it there)."""
    from ..setup.frameworks import framework

    return (setup.quant in ("int8", "nf4", "fp4", "awq") and framework(setup.framework).kbit_upcast
            and not deepspeed_16bit(setup) and setup.fsdp == "none")


def adapter_param_bytes(setup: Setup) -> int:
    """Bytes per element of the LoRA weights as parameters (their gradients and AdamW states): peft's
    fp32, or 16-bit where the framework casts them (TRL 1.16 on a quantized base: setup/frameworks.py
    ``kbit_adapter_bytes``)."""
    from ..setup.frameworks import framework

    if setup.quant in ("int8", "nf4", "fp4"):  # TRL casts them whatever the load dtype
        return framework(setup.framework).kbit_adapter_bytes
    return 4


def compute_bytes(setup: Setup) -> int:
    """Bytes per element of the activations. A quantized base is prepared for k-bit training
    (peft ``prepare_model_for_kbit_training``), which upcasts the embeddings, norms and head to
    fp32: the residual stream, every projection's output (bitsandbytes casts its matmul result
    back to the input's dtype) and the logits are fp32; only the matmuls run in the compute dtype.
    peft skips that upcast for a GPTQ base: its activations stay in the load dtype (an AWQ base is
    upcast; its GEMM kernel casts each input to fp16 and the output back). A framework that does not
    upcast (:func:`kbit_upcast`) keeps them in the load dtype."""
    if kbit_upcast(setup):
        return 4  # (under FSDP the base is not prepared: estimator/fsdp.py, _packed_layer)
    return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])


def adapter_dtype_bytes(setup: Setup) -> int:
    """Bytes per element of the LoRA adapters' weights and of what they compute. peft upcasts the
    adapters to fp32 (``autocast_adapter_dtype=True``) and casts each adapter's input to that dtype.
    DeepSpeed with bf16/fp16 casts every parameter to 16 bits at ``initialize``
    (``DeepSpeedEngine._cast_module_mixed_precision``), the adapters included, except on a model
    built under ``zero.Init``, whose parameters it leaves as they are: at stage 3 (transformers
    loads the base under ``zero.Init``, peft adds its fp32 adapters after) they stay fp32, unless
    the parameters are offloaded: stage 3 then copies the trainable partitions into 16-bit host
    buffers (``param_groups_fp16_flat_cpu_memory``), which the adapters become views of. A
    quantized base is never built under ``zero.Init`` (transformers creates it on the meta device
    and loads it whole on every rank): stage 3 partitions it at ``initialize`` and casts it,
    adapters included, like stage 1/2."""
    if setup.framework == "unsloth":  # matmul_lora casts A and B to its input's dtype (unsloth/kernels/utils.py)
        return int(DTYPE_BYTES[PRECISION_COMPUTE_DTYPE[setup.precision]])
    if setup.fsdp != "none":  # FSDP's MixedPrecision (the -mixed precisions) computes the adapters on
        # 16-bit copies; without it (bf16, fp16, fp32) peft's fp32 adapters run in fp32 on fp32 inputs
        return 2 if setup.precision.endswith("-mixed") else 4
    if setup.precision == "fp32" or not setup.zero_stage:
        return adapter_param_bytes(setup)
    if setup.zero_stage in (1, 2) or setup.offload_params != "none" or setup.quant != "none":
        return 2  # a quantized base is not built under zero.Init: the engine casts it, adapters too
    return 4


def attention_impl(model: ModelSpec, setup: Setup) -> str:
    return model.default_attn if setup.attn == "auto" else setup.attn
