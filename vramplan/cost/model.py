"""Step time and tokens/s of one training step: a roofline checked against published runs, torch-free and pure.

``step_cost(model, setup, gpu, nodes)`` adds one term per cost, each a count times one constant.
The constants marked *fitted* are least-squares fits (``vramplan/cost/fit.py``) to the published
throughput of ``calibration/throughput/records.jsonl``; the others cite their source. Printed per row
by ``vramplan validate --throughput`` and ``benchmarks/throughput_accuracy.py``.

- **compute** / **recompute**: the matmul FLOPs the GPU *executes* over its dense 16-bit TFLOP/s
  at :func:`mfu` (fitted per GPU class) and :func:`batch_efficiency`. Full fine-tuning ``6N`` per
  token (Kaplan et al. 2020, section 2.1); a frozen base ``4N`` (no weight gradients) plus
  ``6 N_lora`` for the adapters; checkpointing one more forward (``2N + 2 N_lora``). Causal attention
  ``2 L s d_q`` per token forward (the ``QK^T`` and ``AV`` products, the masked half skipped by
  flash/SDPA-causal kernels), three times that forward + backward. Eager attention, and SDPA given
  an explicit padding mask (``pad_mask``: its memory-efficient kernel cannot skip the masked
  blocks), compute the whole ``s x s``: twice that.
- **lora**: peft's adapter path per targeted Linear re-reads the input (dropout, ``A``), writes and
  re-reads the rank-r product and adds ``B``'s output into the base output: traffic per token
  proportional to ``sum (in + out + 2r)`` of the targeted Linears (fitted element-passes of 2 B).
  This is what LoRA costs beyond the base (adapter FLOPs at r16 are < 0.3 % of the base's), and why
  all-linear LoRA is slower than attention-only LoRA.
- **kbit**: peft's ``prepare_model_for_kbit_training`` upcasts the non-quantized parameters to fp32
  (estimator.precision.compute_bytes), so the residual stream, norms and adapter inputs run in fp32
  with casts around each 16-bit matmul: traffic ``L x hidden x 4 B`` per token (fitted passes).
- **dequant**: bitsandbytes dequantizes each 4-bit Linear before every use (forward, recompute,
  backward): 0.5 B read + 2 B written per weight, at a fitted share of the bandwidth. MoE experts
  count when the library makes them ``nn.Linear`` modules (transformers 4.x: :class:`Stack`);
  transformers 5.x stores them as 3-D parameters bitsandbytes does not quantize. GPTQ/AWQ
  (:func:`dequant_passes`) are not fitted (no published row).
- **attention** (eager only): the materialised scores' traffic, :data:`EAGER_SCORE_BYTES`.
- **optimizer**: memory-bound update on the GPU; offloaded, gradients cross the host link every
  micro-step, the updated 16-bit parameters once per step, and CPU Adam runs at :data:`CPU_ADAM_PARAMS_PER_S` per node.
- **offload** (ZeRO-3 / FSDP parameter offload): the partition crosses the host link for the
  forward's and the backward's gathers (DeepSpeed reuses the recompute's gather in the backward; FSDP
  re-gathers for the recompute). Nothing of it is assumed hidden behind compute.
- **comm**: ring collectives over ``interconnect_gbps``. Sharded parameters (ZeRO-3, FSDP
  FULL_SHARD) gather the (16-bit, or 4-bit for QLoRA) weights for every pass and reduce-scatter the
  gradients, at a fitted exposure; DDP / ZeRO-1/2 / SHARD_GRAD_OP traffic is exposed at
  ``1 - COMM_OVERLAP`` (not fitted: no published row). Across nodes :data:`INTER_NODE_GBPS` bounds it;
  HSDP and TP x FSDP2 run them within their groups (vramplan/cost/parallel.py); CP's ring: vramplan/cost/cp.py.
- **overhead**: per micro-step and layer, kernel launches and Python (:data:`LAYER_OVERHEAD_S`).

Tokens/s counts every position of the micro-batch; with padded data the real-token rate is that times
the fill fraction, which a Setup does not carry (the padded published rows are excluded for it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ..estimator import trainable_params, weights_bytes
from ..estimator.act_offload import exposed_copy_bytes_per_micro_step as act_offload_bytes
from ..estimator.hybrid_shard import replica_bytes, shard_nodes, shard_ranks
from ..estimator.layer_split_memory import copy_bytes_per_micro_step as split_copy_bytes
from ..estimator.precision import compute_bytes
from ..estimator.selective import checkpointed_count
from ..estimator.tensor_parallel import link_bytes_per_micro_step as tp_link_bytes
from ..estimator.unsloth import llamafactory_gc_copy_bytes
from ..specs import GpuSpec, ModelSpec, Setup
from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE
from .constants import (  # noqa: F401  (re-exported: vramplan.cost.model is the public API)
    ADAPTER_16BIT_OVERRIDES,
    CLASS_MIN_ROWS,
    CONSTANT_ROWS,
    CONSTANTS,
    MFU,
    MFU_CLASS,
    SHARED_FIT_SOURCES,
)
from .counts import (  # noqa: F401  (re-exported: vramplan.cost.model is the public API)
    AWQ_DEQUANT_BYTES_PER_PARAM,
    DEQUANT_BYTES_PER_PARAM,
    GPTQ_DEQUANT_BYTES_PER_PARAM,
    NF4_BYTES_PER_WEIGHT,
    STACK,
    Stack,
    adapter_params,
    dequant_bytes_per_pass,
    dequant_passes,
    gathered_weight_bytes,
    in_backward_overhead_s,
    lora_width,
    matmul_params,
    passes_per_micro_step,
    quantized_params,
    stack_of,
    tiled_mlp_extra,
)
from .cp import cp_cost
from .parallel import shard_group, tp_nodes

#: Liger's kernels (``--liger``): the same matmul FLOPs (the fused cross-entropy runs the head's three
#: matmuls chunk by chunk), fused elementwise kernels for RMSNorm, SwiGLU and RoPE. No speed-up is
#: assumed: the one Liger publishes ("increase multi-GPU training throughput by 20%", linkedin/Liger-Kernel
#: README: LLaMA 3-8B, batch 8, gradient checkpointing, FSDP1 on 8 A100s) is one full fine-tuning setup,
#: not a rate that carries to LoRA on one card, and no Liger row is in calibration/throughput. So the plan
#: takes Liger for the memory it saves (a larger micro-batch, checkpointing off), never for a claimed speed,
#: and at equal speed the stack without the extra dependency wins.
LIGER_THROUGHPUT = 1.0

#: Tokens per micro-batch at which the matmuls reach half their large-batch efficiency:
#: ``efficiency = t / (t + BATCH_HALF_TOKENS)`` (GEMMs of a few hundred rows underfill the SMs).
BATCH_HALF_TOKENS = 256
#: Per micro-step, per layer: kernel launches and Python overhead not hidden by the GPU (seconds).
LAYER_OVERHEAD_S = 3e-4
#: Eager attention: bytes per score element (one query, key and head) over forward, recompute and
#: backward: bf16 scores written, mask added, fp32 softmax (read bf16, write fp32, read, write bf16),
#: probabilities read for AV: ~16 B forward and again in the recompute; backward ~8 B. Not fitted.
EAGER_SCORE_BYTES = 40.0
#: Share of the bandwidth the memory-bound eager-score traffic reaches. Not fitted.
MEMORY_BW_EFFICIENCY = 0.8
#: fp32 matmuls run as TF32 on tensor cores: half the dense bf16 rate (A100/H100 datasheets).
FP32_RATE = 0.5
#: Fallbacks for a GPU given only by its memory (``--gpu-memory``): an A100-40GB-class card.
DEFAULT_TFLOPS = 150.0
DEFAULT_BANDWIDTH_GBPS = 1500.0
DEFAULT_HOST_LINK_GBPS = 25.0
DEFAULT_INTERCONNECT_GBPS = 25.0
#: Between nodes: one 200 Gb/s NIC per GPU (InfiniBand HDR class), in GB/s.
INTER_NODE_GBPS = 25.0
#: Share of DDP / ZeRO-1/2 traffic hidden behind compute (bucketed overlap). Not fitted.
COMM_OVERLAP = 0.5
#: Share of the profile's ``host_link_gbps`` (the PCIe lane rate: 16/32/64 GB/s for gen3/4/5 x16) a
#: pinned copy reaches after 128b/130b encoding and TLP headers: ~12/25/50 GB/s. Assumed, not measured here.
HOST_LINK_EFFICIENCY = 0.8
#: GPTQ/AWQ dequantization kernels reach this share of the bandwidth. Not fitted.
DEQUANT_BW_EFFICIENCY = 0.25
#: Share of the bandwidth an optimizer kernel reaches (fused/foreach elementwise kernels).
OPTIMIZER_BW_EFFICIENCY = 0.7
#: Bytes read + written per trainable parameter by one update, per weight byte ``w`` and state byte ``s``.
OPTIMIZER_STATES = {"adamw": 2, "adamw-fused": 2, "adamw-8bit": 2, "paged-adamw-8bit": 2, "lion": 1, "sgd": 1,
                    "adafactor": 0}
EIGHT_BIT_OPTIMIZER_SLOWDOWN = 1.5
#: torch AdamW foreach writes and reads one extra state-sized list (``_foreach_sqrt``).
FOREACH_EXTRA_PASSES = 2
#: DeepSpeed CPU Adam, fp32 parameters updated per second per node. Measured, published: Qwen-72B on
#: 4 nodes of A100-80GB with ZeRO-3 + optimizer/parameter offload took ~10 s per optimizer step vs
#: ~0.2 s on the GPU (deepspeedai/DeepSpeed#6834, maintainer's reading of the timings): 18 B
#: parameters per node in 10 s = 1.8e9/s; rounded down. A weak host is far slower (#1635: 1.35 B
#: parameters in 22.9 s on a Xeon Silver 4210R).
CPU_ADAM_PARAMS_PER_S = 1.5e9
#: FSDP's CPU offload steps torch's own AdamW on the host: "DeepSpeedCPUAdam is 5X--7X faster than
#: the standard PyTorch implementation" (DeepSpeed ZeRO-Offload tutorial, docs/_tutorials/zero-offload.md).
TORCH_CPU_ADAM_SLOWDOWN = 6.0
#: NVMe offload: sequential read/write of one PCIe 4 SSD, in GB/s (ZeRO-Infinity's swap traffic).
NVME_GBPS = 5.0


@dataclass(frozen=True)
class Counts:
    """The model-and-method counts every term needs, computed once per (method, rank, base)."""

    matmul_params: float
    adapter_params: float
    trainable_params: float
    weight_bytes: float
    dequant_bytes_per_pass: float
    #: sum (in + out + 2r) over the Linears LoRA adapts
    lora_width: float = 0.0
    #: weights bitsandbytes dequantizes each pass
    quantized_params: float = 0.0
    #: bytes of the weights ZeRO-3 / FSDP FULL_SHARD gathers (4-bit for a bitsandbytes 4-bit base)
    gathered_weight_bytes: float = 0.0


def counts(model: ModelSpec, setup: Setup, stack: Stack = STACK) -> Counts:
    q = quantized_params(model, setup, stack)
    return Counts(matmul_params=matmul_params(model), adapter_params=adapter_params(model, setup),
                  trainable_params=float(trainable_params(model, setup)),
                  weight_bytes=float(weights_bytes(model, setup)),
                  dequant_bytes_per_pass=dequant_bytes_per_pass(model, setup, stack),
                  lora_width=lora_width(model, setup), quantized_params=q,
                  gathered_weight_bytes=gathered_weight_bytes(model, setup, q))


@dataclass(frozen=True)
class StepCost:
    """Seconds of one optimizer step (all micro-steps), by term, and the tokens/s they give."""

    compute_s: float
    recompute_s: float
    dequant_s: float
    optimizer_s: float
    offload_s: float
    comm_s: float
    overhead_s: float
    tokens_per_step: int
    lora_s: float = 0.0
    kbit_s: float = 0.0
    attention_s: float = 0.0
    #: DPO/GRPO (vramplan/cost/objectives.py): GRPO's generation, the reference model's forward
    generation_s: float = 0.0
    reference_s: float = 0.0

    @functools.cached_property
    def step_s(self) -> float:  # (a search reads it many times: computed once, the fields being frozen)
        return sum(getattr(self, name) for name in _TERMS)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def terms(self) -> dict[str, float]:
        """Seconds per term, by name (``compute``, ``lora``, ...)."""
        return {f.name.removesuffix("_s"): getattr(self, f.name) for f in fields(self) if f.name.endswith("_s")}


#: the fields of :class:`StepCost` that are seconds, in order
_TERMS = tuple(f.name for f in fields(StepCost) if f.name.endswith("_s"))


# ----------------------------------------------------------------------------------------------
# FLOPs


def eager_attention(model: ModelSpec, setup: Setup) -> bool:
    return setup.attn == "eager" or (setup.attn == "auto" and model.default_attn == "eager")


def full_square_attention(model: ModelSpec, setup: Setup) -> bool:
    """The attention kernel computes every score (no causal skip): eager, or SDPA with a padding mask."""
    return eager_attention(model, setup) or (setup.pad_mask and setup.attn != "flash")


def attention_flops_per_token(model: ModelSpec, setup: Setup) -> float:
    """Forward FLOPs of the score and value products: ``2 * 2 * s * d_q`` per layer, halved by the causal mask."""
    return 2.0 * model.num_layers * setup.seq * model.q_dim


def forward_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """One executed forward (what the recompute runs again): base, adapters, attention."""
    k = k or counts(model, setup)
    square = 2.0 if full_square_attention(model, setup) else 1.0
    return 2.0 * k.matmul_params + 2.0 * k.adapter_params + square * attention_flops_per_token(model, setup)


def train_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """The useful work of a step per token: ``6N`` for full fine-tuning, ``4N`` for a frozen base
    (no weight gradients), causal attention ``3x`` its forward. Adapter FLOPs and the recompute are
    *not* useful work (a higher rank or checkpointing buys no speed): see :func:`executed_flops_per_token`."""
    k = k or counts(model, setup)
    base = 6.0 if setup.method == "full" else 4.0
    return base * k.matmul_params + 3.0 * attention_flops_per_token(model, setup)


useful_flops_per_token = train_flops_per_token


def executed_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """Forward + backward FLOPs the GPU runs per token (no recompute): base, ``6 N_lora``, attention
    (the full square where :func:`full_square_attention`)."""
    k = k or counts(model, setup)
    square = 2.0 if full_square_attention(model, setup) else 1.0
    base = 6.0 if setup.method == "full" else 4.0
    return base * k.matmul_params + 6.0 * k.adapter_params + 3.0 * square * attention_flops_per_token(model, setup)


def recompute_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """Gradient checkpointing runs each checkpointed layer's forward once more in the backward
    (every layer; with ``checkpoint_every`` k, ceil(L / k) of L: estimator/selective.py)."""
    tiled = tiled_mlp_extra(model, setup)[0]  # Unsloth's tiled MLP: each MLP's forward once more (cost/counts.py)
    if not setup.checkpointing:
        return tiled
    share = checkpointed_count(setup, model.num_layers) / max(model.num_layers, 1)
    return forward_flops_per_token(model, setup, k) * share + tiled


# ----------------------------------------------------------------------------------------------
# rates


def peak_flops(gpu: GpuSpec | None, setup: Setup) -> float:
    """Dense matmul FLOP/s for the setup's compute dtype (bf16, fp16, or TF32 for fp32)."""
    if gpu is None:
        return DEFAULT_TFLOPS * 1e12
    if setup.precision.startswith("fp16"):
        tflops = gpu.fp16_tflops_dense or gpu.bf16_tflops_dense
    else:
        tflops = gpu.bf16_tflops_dense or gpu.fp16_tflops_dense
    tflops = tflops or DEFAULT_TFLOPS
    return tflops * 1e12 * (FP32_RATE if setup.precision == "fp32" else 1.0)


def mfu_key(gpu: GpuSpec | None) -> str | None:
    """The fitted constant that holds this GPU's 1/MFU, or None (the :data:`MFU` default)."""
    cls = MFU_CLASS.get(gpu.name) if gpu is not None else None
    return f"inv_mfu:{cls}" if cls else None


def mfu(gpu: GpuSpec | None, constants: Mapping[str, float] = CONSTANTS) -> float:
    """Large-batch MFU of executed FLOPs: fitted for the GPU's class, else :data:`MFU`."""
    key = mfu_key(gpu)
    return 1.0 / constants[key] if key in constants else MFU


def batch_efficiency(tokens: int) -> float:
    """Share of the large-batch matmul rate reached with ``tokens`` rows per micro-batch."""
    return tokens / (tokens + BATCH_HALF_TOKENS)


def bandwidth(gpu: GpuSpec | None) -> float:
    return ((gpu.memory_bandwidth_gbps if gpu else None) or DEFAULT_BANDWIDTH_GBPS) * 1e9


def host_link(gpu: GpuSpec | None) -> float:
    """Achievable host-link bytes/s (:data:`HOST_LINK_EFFICIENCY` of the lane rate)."""
    return ((gpu.host_link_gbps if gpu else None) or DEFAULT_HOST_LINK_GBPS) * 1e9 * HOST_LINK_EFFICIENCY


def ring_bandwidth(gpu: GpuSpec | None, nodes: int) -> float:
    """Bytes/s of the slowest link in the ring: the GPUs' interconnect, or the network across nodes."""
    bw = (gpu.interconnect_gbps if gpu else None) or DEFAULT_INTERCONNECT_GBPS
    if nodes > 1:
        bw = min(bw, INTER_NODE_GBPS)
    return bw * 1e9


def _weight_bytes_per_param(setup: Setup) -> float:
    return DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]]


def _grad_bytes(setup: Setup, k: Counts) -> float:
    """Bytes of one full set of gradients (fp32 for adapters, the weight dtype otherwise)."""
    return k.trainable_params * (4.0 if setup.adapters else _weight_bytes_per_param(setup))


def _nvme_per_gpu(setup: Setup, nodes: int) -> float:
    """One NVMe drive per node, shared by its GPUs (bytes/s each)."""
    return NVME_GBPS * 1e9 / (setup.gpus // nodes)


#: PyTorch FSDP's traffic and optimizer share, as the ZeRO stage that moves the same bytes.
FSDP_AS_ZERO = {"none": 0, "full_shard": 3, "shard_grad_op": 2, "no_shard": 0}


def sharding_stage(setup: Setup) -> int:
    """The ZeRO stage, or the one FSDP's sharding moves the same bytes as."""
    return setup.zero_stage or FSDP_AS_ZERO[setup.fsdp]


def kbit_prepared(setup: Setup) -> bool:
    """peft's ``prepare_model_for_kbit_training`` left the activations in fp32 (estimator.precision)."""
    return setup.quant not in ("none", "gptq") and setup.precision != "fp32" and compute_bytes(setup) == 4


def cpu_optimizer(setup: Setup) -> bool:
    """The update runs on the host: DeepSpeed's optimizer offload, or FSDP's CPU offload."""
    return setup.offload_optimizer != "none" or (setup.fsdp != "none" and setup.offload_params == "cpu")


def optimizer_update_s(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> float:
    """One optimizer step's update of this GPU's share of the trainable parameters (offloaded: the
    gradients of every micro-step down, the 16-bit parameters up, the update on the host)."""
    n = k.trainable_params / (shard_ranks(setup) if sharding_stage(setup) >= 1 else setup.tp)  # TP: this GPU's
    w = 4.0 if setup.adapters else _weight_bytes_per_param(setup)
    if cpu_optimizer(setup):
        nvme = setup.offload_optimizer == "nvme"
        link = _nvme_per_gpu(setup, nodes) if nvme else host_link(gpu)
        node_share = n * (setup.gpus // nodes)
        rate = CPU_ADAM_PARAMS_PER_S / (TORCH_CPU_ADAM_SLOWDOWN if setup.fsdp != "none" else 1.0)
        seconds = (setup.grad_accum + 1) * n * w / link + node_share / rate
        if nvme:  # fp32 master weights and both moments swapped in and out once per step
            seconds += node_share * 12 * 2 / (NVME_GBPS * 1e9)
        return seconds
    eight_bit = setup.optimizer in ("adamw-8bit", "paged-adamw-8bit")
    s = (1 + 4 / 256) if eight_bit else w
    per_param = 3 * w + 2 * OPTIMIZER_STATES[setup.optimizer] * s
    if setup.optimizer in ("adamw", "sgd", "lion"):
        per_param += FOREACH_EXTRA_PASSES * w
    if setup.optimizer == "adafactor":
        per_param += 2 * w  # the fp32 update and its RMS
    seconds = n * per_param / (bandwidth(gpu) * OPTIMIZER_BW_EFFICIENCY)
    return seconds * (EIGHT_BIT_OPTIMIZER_SLOWDOWN if eight_bit else 1.0)


def param_offload_s_per_micro_step(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> float:
    """Parameter offload: this GPU's 16-bit partition crosses the host link for the forward's and the
    backward's gathers (DeepSpeed ZeRO-3 keeps the recompute's gather for the backward; FSDP reshards
    after the recompute's forward and gathers again)."""
    if setup.offload_params == "none":
        return 0.0
    link = host_link(gpu) if setup.offload_params == "cpu" else _nvme_per_gpu(setup, nodes)
    passes = passes_per_micro_step(setup) if setup.fsdp != "none" else 2
    return passes * k.weight_bytes / setup.gpus / link


def sharded_params(setup: Setup) -> bool:
    return setup.gpus > 1 and sharding_stage(setup) >= 3


def comm_s(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> tuple[float, float]:
    """(seconds per micro-step, seconds per optimizer step) of DDP / ZeRO-1/2 / SHARD_GRAD_OP
    collectives, before overlap. Sharded parameters (ZeRO-3, FULL_SHARD) are :func:`fitted_units`."""
    n = shard_ranks(setup)  # hybrid sharding: the shard group's collectives (estimator/hybrid_shard.py)
    if n == 1 or sharded_params(setup) or setup.device_map != "none" or setup.tp > 1:  # no data-parallel ones
        return 0.0, replica_bytes(k.trainable_params, setup) / ring_bandwidth(gpu, nodes)  # (but hybrid's)
    ring = (n - 1) / n
    G, W = _grad_bytes(setup, k), k.weight_bytes
    per_micro = per_step = 0.0
    stage = sharding_stage(setup)
    if setup.fsdp == "shard_grad_op":
        per_micro += ring * W  # the forward's all-gather, kept for the backward
    if stage <= 1:
        per_step += 2 * ring * G  # all-reduce (ZeRO-1: reduce-scatter + all-gather of the update)
    else:
        per_micro += ring * G  # reduce-scatter every micro-step into the partitioned gradients
        if setup.fsdp == "none":  # all-gather the updated partitions (FSDP: the next forward does)
            per_step += ring * (G if setup.adapters else W)
    bw = ring_bandwidth(gpu, shard_nodes(setup, nodes))  # + hybrid sharding's all-reduce across the replicas:
    return per_micro / bw, per_step / bw + replica_bytes(k.trainable_params, setup) / ring_bandwidth(gpu, nodes)


def fitted_units(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> dict[str, float]:
    """Seconds per optimizer step of each fitted term per unit of its constant (compute and recompute
    per unit of 1/MFU). :func:`step_cost` multiplies them by :data:`CONSTANTS`; cost_fit fits them."""
    ga, tokens, bw = setup.grad_accum, setup.tokens, bandwidth(gpu)
    rate = peak_flops(gpu, setup) * batch_efficiency(tokens)
    g = shard_group(setup, nodes)  # cost/parallel.py: HSDP's shard group, TP x FSDP2's dp_shard (1/tp of each weight)
    shard = ga * g.bytes_per_micro_step(_grad_bytes(setup, k), passes_per_micro_step(setup) * k.gathered_weight_bytes)
    shard = shard / ring_bandwidth(gpu, g.nodes) if sharded_params(setup) else 0.0  # (HSDP's all-reduce: comm_s)
    return {
        "compute": ga * tokens * executed_flops_per_token(model, setup, k) / rate,
        "recompute": ga * tokens * recompute_flops_per_token(model, setup, k) / rate,
        "lora": ga * tokens * k.lora_width * 2.0 / bw,
        "kbit": ga * tokens * model.num_layers * model.hidden_size * 4.0 / bw if kbit_prepared(setup) else 0.0,
        "dequant": ga * (dequant_passes(setup) * k.quantized_params + tiled_mlp_extra(model, setup)[1])
        * DEQUANT_BYTES_PER_PARAM.get(setup.quant, 0.0) / bw,
        "shard_comm": shard,
    }


def fit_features(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, nodes: int = 1,
                 k: Counts | None = None) -> dict[str, float]:
    """Seconds per unit of each constant of :data:`CONSTANTS` this setup exercises (for the fit)."""
    k = k or counts(model, setup)
    u = fitted_units(model, setup, gpu, nodes, k)
    out = {"lora_passes": u["lora"], "kbit_passes": u["kbit"], "shard_comm_exposure": u["shard_comm"],
           "dequant_inefficiency": u["dequant"] if setup.quant in DEQUANT_BYTES_PER_PARAM else 0.0}
    key = mfu_key(gpu)
    if key:
        out[key] = u["compute"] + u["recompute"]
    return out


def step_cost(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
              k: Counts | None = None, stack: Stack = STACK, constants: Mapping[str, float] = CONSTANTS) -> StepCost:
    """Time of one optimizer step of ``setup`` (``grad_accum`` micro-steps on each of ``gpus``).

    ``k`` (from :func:`counts`) may be passed in when many setups share a method, rank and base;
    ``stack`` selects library behaviour (:class:`Stack`); ``constants`` the fitted constants."""
    k = k or counts(model, setup, stack)
    u = fitted_units(model, setup, gpu, nodes, k)
    inv_mfu = 1.0 / mfu(gpu, constants)
    ga = setup.grad_accum
    micro, step = comm_s(setup, gpu, nodes, k)
    bnb = setup.quant in DEQUANT_BYTES_PER_PARAM
    dequant = (u["dequant"] * constants["dequant_inefficiency"] if bnb else
               ga * dequant_passes(setup) * k.dequant_bytes_per_pass / (bandwidth(gpu) * DEQUANT_BW_EFFICIENCY))
    attention = 0.0
    if eager_attention(model, setup):
        attention = (ga * setup.tokens * model.num_layers * model.num_heads * setup.seq * EAGER_SCORE_BYTES
                     / (bandwidth(gpu) * MEMORY_BW_EFFICIENCY))
    if setup.liger:
        inv_mfu /= LIGER_THROUGHPUT
    tp = setup.tp  # tensor parallelism: each GPU runs 1/tp of every matmul (estimator/tensor_parallel.py)
    return cp_cost(model, setup, ring_bandwidth(gpu, nodes), StepCost(  # --cp: one rank's share + the ring
        compute_s=u["compute"] * inv_mfu / tp,
        recompute_s=u["recompute"] * inv_mfu / tp,
        dequant_s=dequant,
        optimizer_s=optimizer_update_s(setup, gpu, nodes, k),
        offload_s=ga * (param_offload_s_per_micro_step(setup, gpu, nodes, k)  # + activation offloading's copies
                        + (act_offload_bytes(model, setup) + llamafactory_gc_copy_bytes(model, setup))
                        / host_link(gpu)),  # (and LLaMA-Factory's use_unsloth_gc's)
        comm_s=u["shard_comm"] * constants["shard_comm_exposure"] + (ga * micro + step) * (1.0 - COMM_OVERLAP)
        + ga * split_copy_bytes(model, setup) / ring_bandwidth(gpu, 1)  # a layer split's copies: not overlapped
        + ga * tp_link_bytes(model, setup, gpu) / ring_bandwidth(gpu, tp_nodes(setup, nodes)),  # TP's: not overlapped
        overhead_s=ga * model.num_layers * LAYER_OVERHEAD_S + in_backward_overhead_s(model, setup),
        # a layer split is one process: its GPUs take turns on one micro-batch (naive pipeline)
        tokens_per_step=setup.tokens * ga * (1 if setup.device_map != "none" else setup.gpus // tp),
        lora_s=u["lora"] * constants["lora_passes"] / tp,
        kbit_s=u["kbit"] * constants["kbit_passes"],
        attention_s=attention,
    ))


def tokens_per_s(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
                 k: Counts | None = None, stack: Stack = STACK) -> float:
    return step_cost(model, setup, gpu, nodes, k, stack).tokens_per_s
