"""Setup: one training configuration, the frozen dataclass every stage reads.

Defaults are the canonical step of docs/architecture.md (full fine-tuning of a bf16 model with
torch AdamW, no checkpointing). Validation lives in ``__post_init__``, in one function per group
of knobs, and raises :class:`SpecError` with a message naming the field (the CLI maps field names
to the flags the user typed). Combinations that need the model or the GPU are checked in
:mod:`vramplan.setup.checks`. Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ..util.errors import SpecError, check_choice, check_positive
from .frameworks import DEFAULT_FRAMEWORK, FRAMEWORKS

__all__ = [
    "ATTENTIONS", "DEVICE_MAPS", "FRAMEWORKS", "FSDP_MODES", "GENERATIONS", "LOSSES", "METHODS", "OBJECTIVES",
    "OFFLOADS", "OPTIMIZERS", "PRECISIONS", "PREQUANTIZED", "QUANTS", "QUANT_BITS", "QUANT_GROUP_SIZES", "REF_MODELS",
    "Setup",
]

METHODS = ("full", "lora", "qlora")
QUANTS = ("none", "int8", "nf4", "fp4", "gptq", "awq")
#: Pre-quantized bases (a GPTQ/AWQ checkpoint loaded through gptqmodel): the bits and group sizes
#: their training kernels take (gptqmodel 7.7 TorchLinear / AwqGEMMLinear SUPPORTS_BITS/GROUP_SIZE).
PREQUANTIZED = ("gptq", "awq")
QUANT_BITS = {"gptq": (2, 3, 4, 8), "awq": (4,)}
QUANT_GROUP_SIZES = {"gptq": (-1, 16, 32, 64, 128, 256, 512, 1024), "awq": (-1, 16, 32, 64, 128)}
PRECISIONS = ("bf16", "fp16", "fp32", "bf16-mixed", "fp16-mixed")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd", "lion")
ATTENTIONS = ("auto", "sdpa", "eager", "flash")
OFFLOADS = ("none", "cpu", "nvme")
#: trl: TRL 1.16 SFTTrainer's fused LM head (estimator/objectives.py); unsloth: Unsloth's fused chunked
#: cross-entropy, the loss of --framework unsloth only (estimator/unsloth.py)
LOSSES = ("hf", "chunked", "trl", "unsloth")
#: PyTorch FSDP sharding as accelerate names it (lower case): none, or FULL_SHARD / SHARD_GRAD_OP /
#: NO_SHARD (HYBRID_SHARD needs nodes and a 2-D mesh: not a Setup choice yet)
FSDP_MODES = ("none", "full_shard", "shard_grad_op", "no_shard")
#: accelerate's ``device_map`` placements of one process's layers over its GPUs (none: one GPU per process)
DEVICE_MAPS = ("none", "auto", "balanced", "sequential")
#: the training objective as TRL names its trainers (sft: SFTTrainer / the plain Trainer)
OBJECTIVES = ("sft", "dpo", "orpo", "kto", "grpo")
#: the reference model of DPO/KTO/GRPO: auto (peft's adapter-disabled base with adapters, a frozen
#: copy otherwise), copy, adapter, precomputed (TRL precompute_ref_log_probs), none (GRPO beta=0)
REF_MODELS = ("auto", "copy", "adapter", "precomputed", "none")
#: GRPO's generation engine: HF generate, vLLM colocated on the training GPUs, or vLLM on other GPUs
GENERATIONS = ("hf", "vllm-colocate", "vllm-server")
#: torch 2.13 ``torch.distributed.pipelining`` schedules (schedules.py): ScheduleGPipe, Schedule1F1B,
#: ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV.
#: Modelled: gpipe and 1f1b (estimator/pipeline.py); the others are refused with one line
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
PP_MODELLED_SCHEDULES = ("gpipe", "1f1b")
#: Fields ``Setup.to_dict`` leaves out at their defaults (``from_dict`` restores them): the pipeline's
#: and expert parallelism's, torch.compile's and the tiled MLP's, added after the committed records and baselines
#: were written
OMITTED_AT_DEFAULT = ("pp", "pp_schedule", "ep", "compile", "tiled_mlp", "tiled_mlp_shards", "unsloth_gc")


@dataclass(frozen=True)
class Setup:
    """One training configuration. Defaults are the canonical step of docs/architecture.md:
    full fine-tuning of a bf16 model with torch AdamW (foreach), no checkpointing."""

    method: str = "full"
    lora_rank: int = 16
    lora_alpha: int | None = None  # None: 2 * lora_rank
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"  # peft vocabulary: "all-linear" or comma-separated module names
    quant: str = "none"  # base weights: none | int8 | nf4 | fp4 (qlora defaults to nf4)
    double_quant: bool = True
    #: GPTQ/AWQ only: bits per weight and input channels per scale/zero group (-1: one group over
    #: all input channels, i.e. per output channel)
    quant_bits: int = 4
    quant_group_size: int = 128
    precision: str = "bf16"
    optimizer: str = "adamw"
    checkpointing: bool = False
    #: with ``checkpointing``: checkpoint every k-th decoder layer (layer i when ``i % k == 0``, as
    #: transformers 5.24 ``activation_checkpointing_enable(every_n_layers=k)`` places them); the
    #: others keep their activations. 1: every layer
    checkpoint_every: int = 1
    attn: str = "auto"  # auto: what transformers picks for the family
    batch: int = 1
    seq: int = 2048
    grad_accum: int = 1
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    gpus: int = 1
    loss: str = "hf"
    #: the framework that runs the step (setup/frameworks.py): how it prepares the model (the fp32
    #: upcast of a quantized base, the LoRA weights' dtype); hf: the HF Trainer with peft's QLoRA recipe
    framework: str = DEFAULT_FRAMEWORK
    #: the batch carries a padded ``attention_mask`` (a collator padding to the longest sequence):
    #: SDPA then gets an explicit boolean mask instead of ``is_causal``
    pad_mask: bool = False
    #: PyTorch FSDP (accelerate's FSDP1 plugin) sharding strategy; ``offload_params="cpu"`` with it
    #: is FSDP's CPU offload (parameters, gradients and the optimizer step on the host)
    fsdp: str = "none"
    # ---- memory knobs of today's fine-tuning runs -------------------------------------------------
    #: peft ``modules_to_save``: comma-separated module names (embed_tokens,lm_head) trained in full
    #: beside the adapters; "" for none
    modules_to_save: str = ""
    #: DoRA (peft ``use_dora``): a magnitude vector per adapted Linear and the weight norm in forward
    dora: bool = False
    #: saved activations moved to host memory in forward and back in backward (TRL/torchtune
    #: ``activation_offloading``, axolotl ``activation_offloading: true``)
    activation_offload: bool = False
    #: Liger kernels (``use_liger_kernel``): fused linear cross-entropy, RMSNorm, SwiGLU, RoPE
    liger: bool = False
    #: each parameter stepped during backward as its gradient is ready (torchtune ``optimizer_in_bwd``)
    optimizer_in_backward: bool = False
    #: padding-free batches (TRL ``padding_free``, packing with position_ids): one row of
    #: ``batch * seq`` tokens, flash-attention varlen
    padding_free: bool = False
    #: per-device eval batch (Trainer ``per_device_eval_batch_size``) when the run evaluates; 0: no eval
    eval_batch: int = 0
    #: ``torch.compile`` as the framework applies it: modelled for torchtune's ``compile: True`` (its
    #: compiled cross-entropy, estimator/torchtune.py); refused elsewhere (setup/checks.py)
    compile: bool = False
    #: the MLP run in sequence tiles (Unsloth's ``unsloth_tiled_mlp=True``, axolotl's ``tiled_mlp: true``):
    #: modelled for those two (estimator/tiled_mlp.py); refused elsewhere (setup/checks.py)
    tiled_mlp: bool = False
    #: axolotl's ``tiled_mlp_num_shards`` (0: its default, a shard per 32,768 tokens)
    tiled_mlp_shards: int = 0
    #: LLaMA-Factory's ``use_unsloth_gc``: checkpointed layer inputs kept in host RAM (estimator/unsloth.py)
    unsloth_gc: bool = False
    # ---- model parallelism ----------------------------------------------------------------------
    #: layers split over ``gpus`` GPUs of one process (accelerate ``device_map``)
    device_map: str = "none"
    #: with ``device_map``: accelerate's ``max_memory``, one cap in bytes per GPU index (vramplan/setup/max_memory.py);
    #: () for each GPU's free memory
    max_memory: tuple[int, ...] = ()
    #: tensor-parallel degree (transformers ``tp_plan="auto"``, accelerate ``ParallelismConfig(tp_size)``)
    tp: int = 1
    #: context-parallel degree (accelerate ``ParallelismConfig(cp_size)``)
    cp: int = 1
    #: pipeline-parallel stages (torch 2.13 ``torch.distributed.pipelining``: one stage per GPU, an even
    #: split of the decoder layers); the micro-batches per step are ``grad_accum`` (``n_microbatches``)
    pp: int = 1
    #: the pipeline schedule (``PP_SCHEDULES``; gpipe and 1f1b modelled)
    pp_schedule: str = "1f1b"
    #: expert-parallel degree of an MoE model's routed experts (transformers 5.24
    #: ``DistributedConfig(ep_size)``: each rank holds ``num_experts / ep`` whole experts, tokens
    #: reach them by all-to-all; modelled beside ``tp == ep``, estimator/expert_parallel.py). 1: off
    ep: int = 1
    #: accelerate ``fsdp_version``: 1 (FSDP1's FlatParameter) or 2 (``fully_shard``, DTensor)
    fsdp_version: int = 1
    #: hybrid sharding (HSDP): FSDP shards within groups of ``gpus // dp_replicate`` GPUs and replicates
    #: across ``dp_replicate`` groups (accelerate ``ParallelismConfig(dp_replicate_size, dp_shard_size)``
    #: under FSDP2; FSDP1's HYBRID_SHARD / HYBRID_SHARD_ZERO2, one group per node). 1: off
    dp_replicate: int = 1
    # ---- objective ------------------------------------------------------------------------------
    #: TRL 1.16's trainer (estimator/objectives.py). ``seq`` is a row's length: DPO's ``max_length``
    #: (prompt + completion; chosen and rejected rows both), GRPO's prompt + ``max_completion_length``.
    #: ``batch`` is pairs per micro-batch (DPO: 2 x batch rows) or prompts per micro-batch (GRPO:
    #: ``per_device_train_batch_size`` = batch x num_generations completions)
    objective: str = "sft"
    #: DPO / GRPO prompt and completion lengths in tokens (0: derived from ``seq``). DPO: with both,
    #: rows are at most their sum (DPOConfig has max_length only); the completion sets the positions
    #: the head scores (0: all but the first). GRPO: completion 0 is GRPOConfig's 512 (at most seq/2),
    #: prompt 0 is seq - completion; prompt + completion may not exceed seq
    max_prompt_length: int = 0
    max_completion_length: int = 0
    #: GRPO: completions sampled per prompt
    num_generations: int = 8
    ref_model: str = "auto"
    generation: str = "hf"
    #: GRPO with vLLM colocated: the share of each GPU vLLM reserves (``vllm_gpu_memory_utilization``)
    vllm_memory_fraction: float = 0.3

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_choice("quant", self.quant, QUANTS)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("attn", self.attn, ATTENTIONS)
        check_choice("offload_optimizer", self.offload_optimizer, OFFLOADS)
        check_choice("offload_params", self.offload_params, OFFLOADS)
        check_choice("loss", self.loss, LOSSES)
        check_choice("framework", self.framework, FRAMEWORKS)
        for name in ("lora_rank", "batch", "seq", "grad_accum", "gpus"):
            check_positive(name, getattr(self, name))
        if self.lora_alpha is not None:
            check_positive("lora_alpha", self.lora_alpha)
        if not 0.0 <= self.lora_dropout < 1.0:
            raise SpecError(f"lora_dropout must be in [0, 1); got {self.lora_dropout!r}")
        if type(self.tiled_mlp_shards) is not int or self.tiled_mlp_shards < 0:
            raise SpecError(f"tiled_mlp_shards must be an integer >= 0 (0: the default); got {self.tiled_mlp_shards!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"zero_stage must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        if self.method == "qlora" and self.quant == "none":
            object.__setattr__(self, "quant", "nf4")
        if self.quant in PREQUANTIZED or (self.quant_bits, self.quant_group_size) != (4, 128):
            self._check_prequantized()
        if self.method == "full" and self.quant != "none":
            raise SpecError("a quantized base cannot be fully fine-tuned; use --method lora/qlora or --quant none")
        if self.method == "qlora" and self.quant == "int8":
            raise SpecError("qlora means a 4-bit base; for an 8-bit base use --method lora --quant int8")
        check_choice("fsdp", self.fsdp, FSDP_MODES)
        if self.fsdp != "none":
            if self.zero_stage:
                raise SpecError("use DeepSpeed ZeRO or FSDP, not both (--zero 0 or --fsdp none)")
            if "nvme" in (self.offload_params, self.offload_optimizer):
                raise SpecError("FSDP offloads to CPU only; NVMe offload needs DeepSpeed ZeRO (--zero)")
            if self.offload_optimizer != "none" and self.offload_params == "none":
                raise SpecError("FSDP's CPU offload moves parameters, gradients and the optimizer together: "
                                "use --offload-params cpu")
            if self.quant == "int8":  # torch 2.13 _flat_param.py, _validate_tensors_to_flatten
                raise SpecError("FSDP cannot shard LLM.int8 weights (int8 tensors: \"Cannot flatten integer dtype "
                                "tensors\"); use --quant nf4 or DeepSpeed ZeRO (--zero)")
            if self.quant in ("nf4", "fp4") and self.precision.endswith("-mixed"):
                raise SpecError("QLoRA under FSDP needs --precision bf16 or fp16: a -mixed load packs the 4-bit "
                                "weights in fp32, which FSDP's MixedPrecision casts to 16 bits element by element "
                                "(bitsandbytes then fails on the broken packing)")
            if self.quant in ("nf4", "fp4") and self.fsdp == "shard_grad_op":
                raise SpecError("QLoRA under FSDP SHARD_GRAD_OP fails in torch 2.13 (\"FSDP does not support changing "
                                "the parameters between forward and backward\": bitsandbytes replaces the gathered "
                                "4-bit weight in its forward to restore its quant state); use --fsdp full_shard")
            if self.offload_params == "cpu":  # FSDP steps the optimizer where the shards are: the host
                object.__setattr__(self, "offload_optimizer", "cpu")
        elif self.offload_params != "none" and self.zero_stage != 3:  # deepspeed 0.19.8 zero/config.py offload_param
            raise SpecError(f"--offload-params {self.offload_params} needs ZeRO stage 3: add --zero 3 (DeepSpeed's "
                            "offload_param is valid only with stage 3)" + (
                                "; FSDP's CPU offload is cpu only" if self.offload_params == "nvme"
                                else ", or --fsdp full_shard for FSDP's CPU offload"))
        elif self.offload_optimizer != "none" and self.zero_stage == 0:
            raise SpecError("offloading the optimizer needs ZeRO (--zero 1, 2 or 3)")
        if not self.lora_targets.strip():
            raise SpecError("lora_targets must name modules or be 'all-linear'")
        _check_knobs(self)
        _check_parallelism(self)
        _check_objective(self)

    def _check_prequantized(self) -> None:
        """GPTQ/AWQ: LoRA on a pre-quantized checkpoint, in fp16/bf16, without ZeRO or FSDP."""
        q = self.quant
        if q not in PREQUANTIZED:
            raise SpecError(f"--quant-bits and --quant-group-size apply to a GPTQ or AWQ base (--quant gptq|awq), "
                            f"not {q}")
        name = q.upper()
        a = "an" if q == "awq" else "a"
        if self.method == "full":
            raise SpecError(f"{a} {name} base cannot be fully fine-tuned (its weights are packed integers); "
                            f"use --method lora --quant {q}")
        if self.method == "qlora":
            raise SpecError(f"qlora means a bitsandbytes 4-bit base; for {a} {name} base use --method lora --quant {q}")
        if self.quant_bits not in QUANT_BITS[q]:
            raise SpecError(f"quant_bits must be one of {', '.join(map(str, QUANT_BITS[q]))} for {q}; "
                            f"got {self.quant_bits!r}")
        if self.quant_group_size not in QUANT_GROUP_SIZES[q]:
            raise SpecError(f"quant_group_size must be one of {', '.join(map(str, QUANT_GROUP_SIZES[q]))} for {q}; "
                            f"got {self.quant_group_size!r}")
        if self.precision not in ("bf16", "fp16"):
            raise SpecError(f"{a} {name} base runs in fp16 or bf16 (its kernels' dtypes); use --precision fp16 or bf16")
        if self.zero_stage or getattr(self, "fsdp", "none") != "none":
            raise SpecError(f"{a} {name} base under DeepSpeed ZeRO or FSDP is not modelled (its packed weights are "
                            "buffers they neither shard nor cast); use --zero 0 and no --fsdp")

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def alpha(self) -> int:
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch (b * s)."""
        return self.batch * self.seq

    def replace(self, **changes: Any) -> Setup:
        """``dataclasses.replace`` (the new Setup is checked by ``__post_init__`` as a built one is),
        without rebuilding every field through ``__init__``: the plan search makes thousands."""
        names = _field_names()
        unknown = changes.keys() - names
        if unknown:
            raise TypeError(f"Setup.replace() got an unexpected keyword argument {min(unknown)!r}")
        new = object.__new__(type(self))
        state = new.__dict__
        state.update(self.__dict__)
        if len(state) != len(names):  # anything but the fields (a cached value) is not carried over
            for key in [k for k in state if k not in names]:
                del state[key]
        state.update(changes)
        new.__post_init__()
        return new

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["max_memory"] = list(self.max_memory)  # JSON's and YAML's list (from_dict takes it back)
        defaults = _field_defaults()
        for name in OMITTED_AT_DEFAULT:  # records and files written before these fields read back the same
            if data[name] == defaults[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Setup:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"unknown setup key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        return cls(**data)


def _check_knobs(s: Setup) -> None:
    """The memory knobs: adapters-only ones, and what each cannot be combined with."""
    if isinstance(s.checkpoint_every, bool) or not isinstance(s.checkpoint_every, int) or s.checkpoint_every < 1:
        raise SpecError(f"checkpoint_every must be a positive integer (1: every layer); got {s.checkpoint_every!r}")
    if s.checkpoint_every > 1 and not s.checkpointing:
        raise SpecError("checkpoint_every picks which layers checkpointing recomputes: add --checkpointing")
    if s.modules_to_save.strip() and not s.adapters:
        raise SpecError("modules_to_save trains whole modules beside LoRA adapters: use --method lora or qlora "
                        "(full fine-tuning trains them already)")
    if s.dora and not s.adapters:
        raise SpecError("dora is a LoRA variant: use --method lora or qlora")
    if s.optimizer_in_backward and s.grad_accum > 1:
        raise SpecError("optimizer_in_backward steps each parameter in backward, so gradients cannot accumulate: "
                        "use --grad-accum 1 (torchtune refuses optimizer_in_bwd with gradient accumulation)")
    if s.optimizer_in_backward and s.zero_stage:
        raise SpecError("optimizer_in_backward under DeepSpeed ZeRO is not how ZeRO steps; use --zero 0")
    # modelled on one unsharded GPU (estimator/knobs.py): ZeRO, FSDP and DDP shard or bucket what they add;
    # modules_to_save also under ZeRO 1/2 (its copies join DeepSpeed's flat groups), DDP (its buckets copy
    # their gradients) and FSDP1 full_shard (each copy its own unit), checked by validate --knob
    # modules_to_save against the N-process truths
    sharded = s.zero_stage or s.fsdp != "none" or s.gpus > 1
    if s.modules_to_save.strip() and s.zero_stage == 3:  # DeepSpeed 0.19.8 stage3.py, zero/utils.py defragment
        raise SpecError("modules_to_save under ZeRO-3 fails in DeepSpeed 0.19.8's initialize (peft's fp32 adapters "
                        "and the 16-bit module copies in one group: defragment asserts one dtype); use --zero 2")
    if s.modules_to_save.strip() and s.fsdp != "none" and (
            s.fsdp != "full_shard" or s.gpus < 2 or s.fsdp_version != 1 or s.quant != "none"
            or s.offload_params != "none" or s.optimizer not in ("adamw", "adamw-fused", "sgd")):
        raise SpecError("modules_to_save under FSDP is modelled for FSDP1 full_shard on 2+ GPUs with a 16/32-bit "
                        "base, no CPU offload and torch AdamW/SGD only (verified there); use those, --zero 2 or DDP")
    for name, on in (("dora", s.dora), ("optimizer_in_backward", s.optimizer_in_backward)):
        if on and sharded:
            raise SpecError(f"{name} is modelled on one GPU without ZeRO/FSDP/DDP only; use --gpus 1 "
                            "(no --zero, no --fsdp)")
    if s.padding_free and s.pad_mask:
        raise SpecError("padding-free batches carry no padding and no attention mask: drop --pad-mask")
    if (s.loss == "unsloth") != (s.framework == "unsloth"):
        raise SpecError("loss 'unsloth' is Unsloth's fused cross-entropy, which --framework unsloth always runs "
                        "(the command line sets it): use both or neither")
    if s.liger and s.loss == "chunked":
        raise SpecError("liger's fused linear cross-entropy replaces the loss: use --loss hf with --liger")
    if s.liger and s.loss != "trl" and s.zero_stage == 3:  # huggingface/trl#3368, #5891: "size mismatch" under ZeRO-3
        raise SpecError("liger's fused linear cross-entropy reads lm_head.weight outside the head's forward, which "
                        "ZeRO-3 leaves partitioned (size mismatch): use --zero 1/2 or --fsdp with --liger")
    if isinstance(s.eval_batch, bool) or not isinstance(s.eval_batch, int) or s.eval_batch < 0:
        raise SpecError(f"eval_batch must be a non-negative integer (0: no eval); got {s.eval_batch!r}")


def _check_parallelism(s: Setup) -> None:
    """Layer split, tensor/context parallelism and the FSDP version, against the GPU count."""
    check_choice("device_map", s.device_map, DEVICE_MAPS)
    check_positive("tp", s.tp)
    check_positive("cp", s.cp)
    check_positive("ep", s.ep)
    if s.ep > 1 and s.gpus % s.ep:
        raise SpecError(f"gpus ({s.gpus}) must be a multiple of ep ({s.ep}): each expert-parallel rank is a GPU")
    _check_pipeline(s)
    if s.fsdp_version not in (1, 2):
        raise SpecError(f"fsdp_version must be 1 or 2; got {s.fsdp_version!r}")
    if s.fsdp_version == 2 and s.fsdp == "none":
        raise SpecError("fsdp_version 2 is FSDP2: give a sharding strategy with --fsdp")
    check_positive("dp_replicate", s.dp_replicate)
    if s.dp_replicate > 1:
        if s.fsdp not in ("full_shard", "shard_grad_op"):
            raise SpecError("dp_replicate (hybrid sharding) replicates FSDP shard groups: use --fsdp full_shard or "
                            "shard_grad_op")
        if s.gpus % s.dp_replicate or s.gpus // s.dp_replicate < 2:
            raise SpecError(f"gpus ({s.gpus}) must be dp_replicate ({s.dp_replicate}) groups of 2 or more GPUs each "
                            "(hybrid sharding shards within a group)")
    if isinstance(s.max_memory, (list, str, dict)):  # a file's list of bytes or accelerate's {0: "20GiB"}, text
        from .max_memory import parse_max_memory

        caps = s.max_memory
        if isinstance(caps, dict):
            caps = ",".join(f"{k}={v}" for k, v in caps.items())
        caps = parse_max_memory(caps, "max_memory") if isinstance(caps, str) else caps
        object.__setattr__(s, "max_memory", tuple(caps))
    if s.max_memory != ():
        _check_max_memory(s)
    if s.device_map != "none":
        if s.gpus < 2:
            raise SpecError("device_map splits the layers over the GPUs of one process: use --gpus 2 or more")
        if s.zero_stage or s.fsdp != "none" or s.tp > 1 or s.cp > 1:
            raise SpecError("device_map places whole layers on GPUs in one process; it does not combine with "
                            "ZeRO, FSDP or tensor/context parallelism")
        # the per-GPU split (estimator/layer_split_memory.py) is modelled and traced for the SFT step
        # with gradients kept to the optimizer step and activations on the GPUs
        for name, on in (("objective", s.objective != "sft"), ("optimizer_in_backward", s.optimizer_in_backward),
                         ("activation_offload", s.activation_offload), ("eval_batch", s.eval_batch)):
            if on:
                raise SpecError(f"device_map with --{name.replace('_', '-')} is not modelled yet (the layer split "
                                "is modelled for the SFT step)")
    if s.gpus % (s.tp * s.cp):
        raise SpecError(f"gpus ({s.gpus}) must be a multiple of tp x cp ({s.tp} x {s.cp})")
    if (s.tp > 1 or s.cp > 1) and s.zero_stage:
        raise SpecError("tensor/context parallelism runs with FSDP2 data sharding (--fsdp), not DeepSpeed ZeRO")


def _check_pipeline(s: Setup) -> None:
    """Pipeline parallelism: the stage count, the schedule and what cannot run beside it (what is
    not modelled yet is estimator/pipeline.py ``check_pp``'s)."""
    check_positive("pp", s.pp)
    check_choice("pp_schedule", s.pp_schedule, PP_SCHEDULES)
    if s.pp == 1:
        if s.pp_schedule != "1f1b":
            raise SpecError("pp_schedule applies to pipeline parallelism: add --pp 2 or more")
        return
    if s.zero_stage >= 2:  # deepspeed 0.19.8 runtime/pipe/engine.py:76 (PipelineEngine.__init__)
        raise SpecError(f"pipeline parallelism with ZeRO-{s.zero_stage} does not run: DeepSpeed's pipeline engine "
                        "asserts \"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\" (deepspeed 0.19.8 "
                        "runtime/pipe/engine.py:76); instead run --pp with ZeRO-0/1 (DeepSpeed's pipeline engine; "
                        f"vramplan models --pp {s.pp} --zero 0 with torch.distributed.pipelining), or shard each "
                        "stage with FSDP2 as torchtitan does beside PP (--pp "
                        f"{s.pp} --fsdp full_shard --fsdp-version 2, no --tp), or ZeRO-{s.zero_stage} alone over the "
                        f"{s.gpus} GPUs (--pp 1, no --tp)")
    if s.pp_schedule not in PP_MODELLED_SCHEDULES:
        raise SpecError(f"pp_schedule {s.pp_schedule} (torch 2.13 torch.distributed.pipelining) is not modelled yet; "
                        f"modelled: {', '.join(PP_MODELLED_SCHEDULES)}")
    if s.pp_schedule == "1f1b" and s.grad_accum < s.pp:  # torch 2.13 schedules.py Schedule1F1B.__init__
        raise SpecError(f"grad_accum ({s.grad_accum}) is the pipeline's micro-batch count, and torch 2.13's "
                        f"Schedule1F1B needs at least one per stage (pp {s.pp}): \"Number of microbatches must be "
                        f"greater than or equal to the number of stages\"; use --grad-accum {s.pp} or more, or "
                        "--pp-schedule gpipe")
    if s.gpus % s.pp:
        raise SpecError(f"gpus ({s.gpus}) must be a multiple of pp ({s.pp}): one pipeline stage per GPU")


def _check_max_memory(s: Setup) -> None:
    """accelerate's per-GPU caps: with a layer split, one positive byte count per GPU."""
    from .max_memory import check_caps

    if not isinstance(s.max_memory, tuple):
        raise SpecError("max_memory must be a list of byte counts, one per GPU (0=20GiB,1=24GiB on the command line)")
    check_caps(s.max_memory)
    if s.device_map == "none":
        raise SpecError("max_memory caps the GPUs of a layer split: add --device-map auto, balanced or sequential")
    if len(s.max_memory) != s.gpus:
        raise SpecError(f"max_memory gives {len(s.max_memory)} GPU caps for {s.gpus} GPUs (--gpus): give one per GPU")


@functools.cache
def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(Setup))


@functools.cache
def _field_defaults() -> dict[str, Any]:
    """Setup's field defaults by name (read once: every Setup built checks against them)."""
    return {f.name: f.default for f in dataclasses.fields(Setup)}


def _check_objective(s: Setup) -> None:
    """The objective and its knobs: each given only with an objective that reads it."""
    check_choice("objective", s.objective, OBJECTIVES)
    check_choice("ref_model", s.ref_model, REF_MODELS)
    check_choice("generation", s.generation, GENERATIONS)
    for name in ("max_prompt_length", "max_completion_length"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{name} must be a non-negative integer (0: from seq); got {value!r}")
    check_positive("num_generations", s.num_generations)
    if not 0.0 < s.vllm_memory_fraction < 1.0:
        raise SpecError(f"vllm_memory_fraction must be in (0, 1); got {s.vllm_memory_fraction!r}")
    default = _field_defaults()
    if s.objective != "grpo":
        for name in ("num_generations", "generation", "vllm_memory_fraction"):
            if getattr(s, name) != default[name]:
                raise SpecError(f"{name} applies to --objective grpo (got --objective {s.objective})")
    elif s.num_generations < 2:
        raise SpecError("num_generations must be at least 2 for GRPO (its advantages compare a prompt's completions)")
    if s.objective == "sft":
        for name in ("max_prompt_length", "max_completion_length"):
            if getattr(s, name):
                raise SpecError(f"{name} applies to --objective dpo/orpo/kto/grpo; SFT reads --seq")
        if s.ref_model != "auto":
            raise SpecError("ref_model applies to --objective dpo/kto/grpo")
    if s.generation != "vllm-colocate" and s.vllm_memory_fraction != default["vllm_memory_fraction"]:
        raise SpecError("vllm_memory_fraction applies to --generation vllm-colocate")
    if s.objective == "dpo" and s.ref_model == "none":
        raise SpecError("DPO needs a reference model: ref_model auto, copy, adapter or precomputed")
    if s.objective == "grpo" and s.ref_model == "precomputed":
        raise SpecError("GRPO scores fresh completions: its reference cannot be precomputed (ref_model)")
    if s.ref_model == "adapter" and not s.adapters:
        raise SpecError("ref_model adapter is peft's adapter-disabled base: use --method lora or qlora")
    if s.objective == "grpo" and s.max_prompt_length and s.max_completion_length \
            and s.max_prompt_length + s.max_completion_length > s.seq:
        raise SpecError(f"max_prompt_length + max_completion_length ({s.max_prompt_length + s.max_completion_length}) "
                        f"exceeds seq ({s.seq}): seq is a GRPO row's prompt + completion length")
