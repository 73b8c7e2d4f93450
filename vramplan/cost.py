"""Step time and tokens/s of one training step: a first-order roofline, torch-free and pure.

``step_cost(model, setup, gpu, nodes)`` adds one term per cost, each from counts and the GPU
profile's published rates (``profiles/gpus.json``):

- **compute**: matmul FLOPs per token over the GPU's dense half-precision TFLOP/s at a realistic
  utilisation (:data:`MFU`), lower for small micro-batches (:func:`batch_efficiency`).
  Full fine-tuning costs ``6 N`` per token (forward ``2N``, backward ``4N``: Kaplan et al. 2020,
  *Scaling Laws*, section 2.1). A frozen base skips its weight gradients: ``2N`` forward + ``2N``
  for the input gradients = ``4N``, plus ``6 N_lora`` for the adapters (Hu et al. 2021).
  Causal attention adds ``2 L s d_attn`` per token forward (the ``QK^T`` and ``AV`` products,
  halved by the causal mask), three times that for forward + backward (PaLM, Chowdhery et al.
  2022, appendix B, without the factor of 2 a causal kernel saves).
  Gradient checkpointing recomputes one forward per micro-batch (+``2N`` + attention).
- **dequantization**: a bitsandbytes 4-bit/8-bit base is dequantized to the compute dtype before
  every matmul that uses it (forward, backward, recompute): memory-bound traffic at
  :data:`DEQUANT_BW_EFFICIENCY` of the card's bandwidth. A GPTQ base is dequantized by gptqmodel's
  torch path once per forward (the backward reuses the saved copy), an AWQ base by its GEMM kernel
  in every backward and in forwards over 1024 rows (:func:`dequant_passes`).
- **optimizer**: the update is memory-bound; bytes touched per trainable parameter over the
  card's bandwidth (:data:`OPTIMIZER_BYTES_PER_PARAM`), or, offloaded, DeepSpeed's CPU Adam
  (:data:`CPU_ADAM_PARAMS_PER_S`) plus gradients down and parameters up over the host link.
- **parameter offload** (ZeRO-3): every forward, backward and recompute pulls the partition's
  weights over the host link (or NVMe, :data:`NVME_GBPS`).
- **communication**: ring collectives over ``interconnect_gbps`` (``2 (n-1)/n`` of the bytes for
  an all-reduce, ``(n-1)/n`` for a reduce-scatter or all-gather): DDP/ZeRO-1 all-reduce the
  gradients once per optimizer step (``no_sync`` during accumulation), ZeRO-2 reduce-scatters
  every micro-step, ZeRO-3 also all-gathers the weights for every forward/backward/recompute
  (Rajbhandari et al. 2020, *ZeRO*, section 7). Across nodes the slower of the interconnect and
  :data:`INTER_NODE_GBPS` bounds the ring. Only ``1 - COMM_OVERLAP`` of it is exposed.

Constants are stated once below; they make the *ranking* of setups right (what the planner
needs) and the absolute tokens/s a first-order figure, to be replaced by measured throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimator import trainable_params, weights_bytes
from .specs import GpuSpec, ModelSpec, Setup
from .units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE

#: Model FLOPs utilisation of a well-fed training step with HF transformers + SDPA/flash attention
#: (published fine-tuning runs report 35-50 % on A100/H100; 40 % is the middle).
MFU = 0.40
#: Tokens per micro-batch at which the matmuls reach half their large-batch efficiency:
#: ``efficiency = t / (t + BATCH_HALF_TOKENS)`` (GEMMs of a few hundred rows underfill the SMs).
BATCH_HALF_TOKENS = 256
#: Per micro-step, per layer: kernel launches and Python overhead not hidden by the GPU (seconds).
LAYER_OVERHEAD_S = 3e-4
#: Eager attention materialises the s x s scores: its attention FLOPs run at this fraction of the
#: fused kernels' speed.
EAGER_ATTENTION_SLOWDOWN = 2.0
#: fp32 matmuls run as TF32 on tensor cores: half the dense bf16 rate (A100/H100 datasheets).
FP32_RATE = 0.5
#: Fallbacks for a GPU given only by its memory (``--gpu-memory``): an A100-40GB-class card.
DEFAULT_TFLOPS = 150.0
DEFAULT_BANDWIDTH_GBPS = 1500.0
DEFAULT_HOST_LINK_GBPS = 25.0
DEFAULT_INTERCONNECT_GBPS = 25.0
#: Between nodes: one 200 Gb/s NIC per GPU (InfiniBand HDR class), in GB/s.
INTER_NODE_GBPS = 25.0
#: Share of the communication hidden behind compute (bucketed overlap in DDP and DeepSpeed).
COMM_OVERLAP = 0.5
#: bitsandbytes dequantization kernels (one per Linear and pass) reach this share of the bandwidth.
DEQUANT_BW_EFFICIENCY = 0.25
#: Bytes moved per quantized parameter per dequantization: read the packed weight, write the
#: compute-dtype copy, read it again in the matmul.
DEQUANT_BYTES_PER_PARAM = {"nf4": 0.5 + 2 + 2, "fp4": 0.5 + 2 + 2, "int8": 1 + 2 + 2}
#: GPTQ trains through gptqmodel's torch dequantization (int32 shifts, int8 codes, gathered
#: scales and zeros, the 16-bit product: each intermediate written and read once, ~6 B per weight
#: at 4 bits, estimator.GPTQ_DEQUANT_PEAK_BYTES_PER_WEIGHT), then the matmul reads the 16-bit copy;
#: AWQ's GEMM kernel dequantizes straight to fp16 like bitsandbytes.
GPTQ_DEQUANT_BYTES_PER_PARAM = {2: 0.25 + 2 * 6 + 2, 3: 0.375 + 2 * 14 + 2, 4: 0.5 + 2 * 6 + 2, 8: 1 + 2 * 8 + 2}
AWQ_DEQUANT_BYTES_PER_PARAM = 0.5 + 2 + 2
#: Share of the card's bandwidth an optimizer kernel reaches (fused/foreach elementwise kernels).
OPTIMIZER_BW_EFFICIENCY = 0.7
#: Bytes read + written per trainable parameter by one update, per weight byte ``w`` (param r/w,
#: gradient read) and state byte ``s`` (each state read and written); the 8-bit kernels also
#: read/write one fp32 absmax per 256 values and run at lower efficiency (block-wise quantize).
OPTIMIZER_STATES = {"adamw": 2, "adamw-fused": 2, "adamw-8bit": 2, "paged-adamw-8bit": 2, "lion": 1, "sgd": 1,
                    "adafactor": 0}
EIGHT_BIT_OPTIMIZER_SLOWDOWN = 1.5
#: torch AdamW foreach writes and reads one extra state-sized list (``_foreach_sqrt``).
FOREACH_EXTRA_PASSES = 2
#: DeepSpeed CPU Adam updates about this many fp32 parameters per second per node (ZeRO-Offload,
#: Ren et al. 2021, fig. 7: ~1 s per 1-2 B parameters on a 2-socket server).
CPU_ADAM_PARAMS_PER_S = 1.5e9
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


def counts(model: ModelSpec, setup: Setup) -> Counts:
    return Counts(matmul_params=matmul_params(model), adapter_params=adapter_params(model, setup),
                  trainable_params=float(trainable_params(model, setup)), weight_bytes=float(weights_bytes(model, setup)),
                  dequant_bytes_per_pass=dequant_bytes_per_pass(model, setup))


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

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.dequant_s + self.optimizer_s + self.offload_s
                + self.comm_s + self.overhead_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


# ----------------------------------------------------------------------------------------------
# FLOPs


def matmul_params(model: ModelSpec) -> float:
    """Parameters a token multiplies through: every Linear (head included), the routed share of
    the experts (top_k of num_experts) and the router. Embedding lookups and norms cost no matmul."""
    n = float(sum(l.params for l in model.linears))
    other = dict(model.other_params)
    if model.moe is not None:
        n += other.get("experts", 0) * model.moe.top_k / model.moe.num_experts
        n += other.get("router", 0)
    return n


def adapter_params(model: ModelSpec, setup: Setup) -> float:
    """Trainable adapter parameters (all of them touch every token: dense LoRA matrices; the
    experts' adapters only for routed tokens)."""
    if not setup.adapters:
        return 0.0
    from .estimator.lora import expert_lora_params

    routed = expert_lora_params(model, setup)
    share = model.moe.top_k / model.moe.num_experts if model.moe is not None and routed else 0.0
    return float(trainable_params(model, setup) - routed + routed * share)


def attention_flops_per_token(model: ModelSpec, setup: Setup) -> float:
    """Forward FLOPs of the score and value products: ``2 * 2 * s * d_attn`` per layer, halved by
    the causal mask."""
    return 2.0 * model.num_layers * setup.seq * model.q_dim


def forward_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    k = k or counts(model, setup)
    return 2.0 * k.matmul_params + 2.0 * k.adapter_params + attention_flops_per_token(model, setup)


def train_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """Forward + backward FLOPs per token (no recompute): ``6N`` for full fine-tuning; ``4N`` for a
    frozen base (no weight gradients) plus ``6 N_lora``; attention ``3x`` its forward."""
    k = k or counts(model, setup)
    base = 6.0 if setup.method == "full" else 4.0
    return base * k.matmul_params + 6.0 * k.adapter_params + 3.0 * attention_flops_per_token(model, setup)


def recompute_flops_per_token(model: ModelSpec, setup: Setup, k: Counts | None = None) -> float:
    """Gradient checkpointing runs each layer's forward once more in the backward."""
    return forward_flops_per_token(model, setup, k) if setup.checkpointing else 0.0


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


def batch_efficiency(tokens: int) -> float:
    """Share of the large-batch matmul rate reached with ``tokens`` rows per micro-batch."""
    return tokens / (tokens + BATCH_HALF_TOKENS)


def _bandwidth(gpu: GpuSpec | None) -> float:
    return ((gpu.memory_bandwidth_gbps if gpu else None) or DEFAULT_BANDWIDTH_GBPS) * 1e9


def _host_link(gpu: GpuSpec | None) -> float:
    return ((gpu.host_link_gbps if gpu else None) or DEFAULT_HOST_LINK_GBPS) * 1e9


def ring_bandwidth(gpu: GpuSpec | None, nodes: int) -> float:
    """Bytes/s of the slowest link in the ring: the GPUs' interconnect, or the network across nodes."""
    bw = (gpu.interconnect_gbps if gpu else None) or DEFAULT_INTERCONNECT_GBPS
    if nodes > 1:
        bw = min(bw, INTER_NODE_GBPS)
    return bw * 1e9


# ----------------------------------------------------------------------------------------------
# terms


def _weight_bytes_per_param(setup: Setup) -> float:
    return DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]]


def _grad_bytes(setup: Setup, k: Counts) -> float:
    """Bytes of one full set of gradients (fp32 for adapters, the weight dtype otherwise)."""
    return k.trainable_params * (4.0 if setup.adapters else _weight_bytes_per_param(setup))


def dequant_bytes_per_pass(model: ModelSpec, setup: Setup) -> float:
    """Bytes one dequantization of every quantized Linear moves (the head stays unquantized)."""
    if setup.quant == "none":
        return 0.0
    if setup.quant in ("gptq", "awq"):  # the head and MoE routers stay 16-bit
        quantized = sum(l.count * l.weight_params for l in model.linears if l.role not in ("head", "router"))
        per = GPTQ_DEQUANT_BYTES_PER_PARAM[setup.quant_bits] if setup.quant == "gptq" else AWQ_DEQUANT_BYTES_PER_PARAM
        return quantized * per
    quantized = sum(l.count * l.weight_params for l in model.linears if l.role != "head")
    return quantized * DEQUANT_BYTES_PER_PARAM[setup.quant]


def dequant_passes(setup: Setup) -> int:
    """How often each quantized weight is dequantized per micro-step. bitsandbytes: every use.
    GPTQ: each forward (and recompute); the backward reuses the copy the forward saved. AWQ's GEMM
    kernel: every backward, and a forward (or recompute) only over 1024 rows (below, its fused
    kernel reads the packed weight)."""
    if setup.quant == "gptq":
        return 2 if setup.checkpointing else 1
    if setup.quant == "awq":
        fwd = 1 if setup.tokens > 1024 else 0
        return 1 + fwd * (2 if setup.checkpointing else 1)
    return passes_per_micro_step(setup)


def passes_per_micro_step(setup: Setup) -> int:
    """How often each weight is used per micro-step: forward, backward, and the recompute."""
    return 3 if setup.checkpointing else 2


def _nvme_per_gpu(setup: Setup, nodes: int) -> float:
    """One NVMe drive per node, shared by its GPUs (bytes/s each)."""
    return NVME_GBPS * 1e9 / (setup.gpus // nodes)


#: PyTorch FSDP's traffic and optimizer share, as the ZeRO stage that moves the same bytes:
#: FULL_SHARD gathers the parameters for every pass and reduce-scatters the gradients (ZeRO-3),
#: SHARD_GRAD_OP gathers them once per micro-step and keeps them to the backward (ZeRO-2's
#: gradient reduce-scatter plus that gather), NO_SHARD all-reduces (DDP).
FSDP_AS_ZERO = {"none": 0, "full_shard": 3, "shard_grad_op": 2, "no_shard": 0}


def sharding_stage(setup: Setup) -> int:
    """The ZeRO stage, or the one FSDP's sharding moves the same bytes as."""
    return setup.zero_stage or FSDP_AS_ZERO[setup.fsdp]


def optimizer_update_s(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> float:
    """One optimizer update of this GPU's share of the trainable parameters."""
    n = k.trainable_params / (setup.gpus if sharding_stage(setup) >= 1 else 1)
    w = 4.0 if setup.adapters else _weight_bytes_per_param(setup)
    if setup.offload_optimizer != "none":
        # gradients down, updated half-precision parameters up, CPU Adam on the node's share
        link = _host_link(gpu) if setup.offload_optimizer == "cpu" else _nvme_per_gpu(setup, nodes)
        node_share = n * (setup.gpus // nodes)
        seconds = 2.0 * n * w / link + node_share / CPU_ADAM_PARAMS_PER_S
        if setup.offload_optimizer == "nvme":
            # fp32 master weights and both moments swapped in and out once per step
            seconds += node_share * 12 * 2 / (NVME_GBPS * 1e9)
        return seconds
    eight_bit = setup.optimizer in ("adamw-8bit", "paged-adamw-8bit")
    s = (1 + 4 / 256) if eight_bit else w
    per_param = 3 * w + 2 * OPTIMIZER_STATES[setup.optimizer] * s
    if setup.optimizer in ("adamw", "sgd", "lion"):
        per_param += FOREACH_EXTRA_PASSES * w
    if setup.optimizer == "adafactor":
        per_param += 2 * w  # the fp32 update and its RMS
    seconds = n * per_param / (_bandwidth(gpu) * OPTIMIZER_BW_EFFICIENCY)
    return seconds * (EIGHT_BIT_OPTIMIZER_SLOWDOWN if eight_bit else 1.0)


def param_offload_s_per_micro_step(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> float:
    """ZeRO-3 parameter offload: this GPU's partition crosses the host link for every pass."""
    if setup.offload_params == "none":
        return 0.0
    link = _host_link(gpu) if setup.offload_params == "cpu" else _nvme_per_gpu(setup, nodes)
    return passes_per_micro_step(setup) * k.weight_bytes / setup.gpus / link


def comm_s(setup: Setup, gpu: GpuSpec | None, nodes: int, k: Counts) -> tuple[float, float]:
    """(seconds per micro-step, seconds per optimizer step) of collective traffic, before overlap."""
    n = setup.gpus
    if n == 1:
        return 0.0, 0.0
    ring = (n - 1) / n
    bw = ring_bandwidth(gpu, nodes)
    G, W = _grad_bytes(setup, k), k.weight_bytes
    per_micro = per_step = 0.0
    stage = sharding_stage(setup)
    if setup.fsdp == "shard_grad_op":
        per_micro += ring * W  # the forward's all-gather, kept for the backward
    if stage <= 1:
        per_step += 2 * ring * G  # all-reduce (ZeRO-1: reduce-scatter + all-gather of the update)
    elif stage == 2:
        per_micro += ring * G  # reduce-scatter every micro-step into the partitioned gradients
        if setup.fsdp == "none":  # all-gather the updated partitions (FSDP: the next forward does)
            per_step += ring * (G if setup.adapters else W)
    else:
        per_micro += ring * G + passes_per_micro_step(setup) * ring * W
    return per_micro / bw, per_step / bw


def step_cost(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
              k: Counts | None = None) -> StepCost:
    """Time of one optimizer step of ``setup`` (``grad_accum`` micro-steps on each of ``gpus``).

    ``k`` (from :func:`counts`) may be passed in when many setups share a method, rank and base."""
    k = k or counts(model, setup)
    tokens, ga = setup.tokens, setup.grad_accum
    rate = peak_flops(gpu, setup) * MFU * batch_efficiency(tokens)
    eager = setup.attn == "eager" or (setup.attn == "auto" and model.default_attn == "eager")
    attn = attention_flops_per_token(model, setup) * (EAGER_ATTENTION_SLOWDOWN - 1.0 if eager else 0.0)
    compute = ga * tokens * (train_flops_per_token(model, setup, k) + 3 * attn) / rate
    recompute = ga * tokens * (recompute_flops_per_token(model, setup, k) + attn) / rate if setup.checkpointing else 0.0
    dequant = ga * dequant_passes(setup) * k.dequant_bytes_per_pass / (_bandwidth(gpu) * DEQUANT_BW_EFFICIENCY)
    micro, step = comm_s(setup, gpu, nodes, k)
    return StepCost(
        compute_s=compute,
        recompute_s=recompute,
        dequant_s=dequant,
        optimizer_s=optimizer_update_s(setup, gpu, nodes, k),
        offload_s=ga * param_offload_s_per_micro_step(setup, gpu, nodes, k),
        comm_s=(ga * micro + step) * (1.0 - COMM_OVERLAP),
        overhead_s=ga * model.num_layers * LAYER_OVERHEAD_S,
        tokens_per_step=tokens * ga * setup.gpus,
    )


def tokens_per_s(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
                 k: Counts | None = None) -> float:
    return step_cost(model, setup, gpu, nodes, k).tokens_per_s
