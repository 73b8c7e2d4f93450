"""The library versions an estimate models, and the version boundaries that move its numbers.

The estimator's formulas are read off transformers 5, torch 2.13, peft 0.21, accelerate 1.15,
bitsandbytes 0.50, deepspeed 0.19 and flash-attn 2.7 (``MODELLED_VERSIONS``). A ``Stack`` names another transformers
version where a known boundary changes memory; each boundary is a predicate here, with the source
it was read from, and the terms that depend on it ask the predicate (estimator/transients.py;
4.x's per-expert MoE Linears: estimator/moe_4x.py, which ``estimate()`` builds the model with).
Anything not listed is modelled as the default stack.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..specs import ModelSpec, Setup
from ..util.units import bnb_4bit_tensor_bytes, gib
from ..util.versions import boundary, version_tuple
from .precision import attention_impl

#: what the formulas are read off (the default Stack), stated in every Breakdown's notes
MODELLED_VERSIONS = {"transformers": "5", "torch": "2.13", "peft": "0.21", "accelerate": "1.15",
                     "bitsandbytes": "0.50", "deepspeed": "0.19", "flash-attn": "2.7"}


#: the oldest transformers whose memory-relevant code the boundaries were read from (util/versions.py: the
#: 4.46.0 wheel is the first read for the loss; below it a boundary's side is unknown, not "before")
OLDEST_READ = (4, 46)


def _version(text: str) -> tuple[int, ...]:
    """'4.48.1' -> (4, 48, 1); a leading number only ('5' -> (5,)); a non-version raises ValueError."""
    v = version_tuple(text)
    if not v:
        raise ValueError(f"not a version: {text!r}")
    return v


def _before(key: str, version: str) -> bool:
    """``version`` lies on the older side of the boundary ``key`` (util/versions.py BOUNDARIES)."""
    return boundary(key).side(version) == "before"


@dataclass(frozen=True)
class Stack:
    """The transformers version an estimate models ("5" unless a record or a caller says)."""

    transformers: str = MODELLED_VERSIONS["transformers"]
    #: TRL's fused log-prob head runs its Triton kernels (CUDA); False: its torch fold, as on the CPU
    #: (trl/kernels/chunked_logprob.py ``_use_triton``; estimator/objectives.py)
    trl_triton: bool = True

    def __post_init__(self) -> None:
        _version(self.transformers)  # raises on a non-version

    @property
    def is_default(self) -> bool:
        return _version(self.transformers)[:1] == (5,)

    @property
    def loss_shift_copy(self) -> bool:
        """transformers 4.46-4.48 ``ForCausalLMLoss`` (src/transformers/loss/loss_utils.py):
        ``logits = logits.float()`` then ``shift_logits = logits[..., :-1, :].contiguous()``, a
        second fp32 copy of b (s-1) V logits alive beside the first while cross_entropy runs.
        4.49.0 replaced the shift by padding the labels (``nn.functional.pad(labels, (0, 1))``);
        read off the 4.46.0, 4.48.1 and 4.49.0 wheels."""
        return _before("loss_shift_copy", self.transformers)

    @property
    def moe_experts_linear(self) -> bool:
        """transformers 4.x builds MoE experts as per-expert ``nn.Linear`` modules (4.48.1
        modeling_mixtral.py: ``MixtralBlockSparseTop2MLP`` w1/w2/w3), which bitsandbytes
        quantizes and peft can target one by one; transformers 5 fuses them into 3-D parameters
        that ``replace_with_bnb_linear`` skips. Modelled in estimator/moe_4x.py (weights, routing
        loop, LoRA targets)."""
        return _before("moe_experts_linear", self.transformers)

    @property
    def sdpa_repeats_kv(self) -> bool:
        """transformers before 4.54 repeats K and V to every query head before SDPA
        (integrations/sdpa_attention.py ``repeat_kv``, read off the 4.48.1 and 4.53.0 wheels), so a
        grouped-query layer saves the repeated copies; 4.54.0 passes ``enable_gqa=True`` when there is
        no mask (``use_gqa_in_sdpa``; 5.24 also wants a head_dim of 256 or less), read off the
        4.54.0 wheel. FlashAttention-2 repeats nothing on either side."""
        return _before("sdpa_repeat_kv", self.transformers)

    @property
    def reentrant_checkpointing(self) -> bool:
        """The HF Trainer's ``gradient_checkpointing=True`` with no kwargs: transformers 4.x
        ``PreTrainedModel.gradient_checkpointing_enable`` passes ``{"use_reentrant": True}`` (read
        off the 4.48.1 wheel, modeling_utils.py), transformers 5 ``_activation_checkpointing_enable``
        ``{"use_reentrant": False}`` (5.24). Reentrant checkpointing runs each layer's first forward
        under ``no_grad``, which moves FSDP1's backward prefetch (estimator/fsdp.py
        ``fsdp_phase_peaks``)."""
        return _before("reentrant_checkpointing", self.transformers)

    def describe(self) -> str:
        libs = dict(MODELLED_VERSIONS, transformers=self.transformers)
        return ", ".join(f"{k} {v}" for k, v in libs.items())


DEFAULT_STACK = Stack()


def stack_from_versions(versions: dict) -> Stack:
    """A published record's ``versions`` ({"transformers": {"version": "4.48.1", ...}, ...}) as
    the Stack its estimate models; the default when the record names no transformers version."""
    entry = versions.get("transformers") if versions else None
    version = entry.get("version") if isinstance(entry, dict) else entry
    if not version:
        return DEFAULT_STACK
    try:
        return Stack(transformers=str(version))
    except ValueError:
        return DEFAULT_STACK


def _expert_tensors(model: ModelSpec) -> tuple[int, int]:
    """(routed expert parameters, how many 2-D expert matrices hold them: gate, up, down per expert)."""
    experts = sum(n for name, n in model.other_params if name == "experts")
    if not experts or model.moe is None:
        return 0, 0
    return experts, 3 * model.moe.num_experts * model.moe.num_moe_layers


def moe_experts_4x_saving_bytes(model: ModelSpec, setup: Setup) -> int:
    """Bytes a quantized MoE base's weights take less under transformers 4.x, whose per-expert
    ``nn.Linear`` layers bitsandbytes quantizes (NF4/FP4 blocks of 64 with their absmax, double
    quant as set: units.bnb_4bit_tensor_bytes; LLM.int8: int8 plus a fp32 scale per row), than under
    transformers 5, whose fused 3-D experts stay unquantized and are upcast to fp32 by
    ``prepare_model_for_kbit_training``. Before any sharding; 0 for a dense model or a 16-bit base."""
    experts, tensors = _expert_tensors(model)
    if not experts or setup.quant not in ("nf4", "fp4", "int8") or model.family == "llama4":
        return 0  # (Llama 4's experts were fused 3-D tensors in transformers 4 too: Llama4TextExperts since 4.51)
    per = experts // tensors
    if setup.quant == "int8":
        quantized = experts + 4 * tensors * (model.moe.expert_intermediate_size * 2 + model.hidden_size) // 3
    else:
        quantized = tensors * bnb_4bit_tensor_bytes(per, setup.double_quant)
    return int(4 * experts - quantized)


def stack_notes(model: ModelSpec, setup: Setup, stack: Stack) -> list[str]:
    """What the estimate says about the library versions it models: a non-default stack names
    itself and the boundaries it applies (4.x's per-expert MoE Linears: estimator/moe_4x.py's note);
    under transformers 5 a quantized MoE base states what 4.x's quantized experts would take less."""
    notes = []
    fsdp1_reentrant = (stack.reentrant_checkpointing and setup.checkpointing and setup.fsdp != "none"
                       and setup.fsdp_version == 1)
    repeated = model.traits.sdpa_repeat_kv and attention_impl(model, setup) == "sdpa"
    applied = [what for flag, what in ((stack.loss_shift_copy, "the loss's shifted fp32 logits copy"),
                                       (fsdp1_reentrant, "reentrant checkpointing: FSDP1 prefetches no layer "
                                                         "unit in the backward"),
                                       (repeated, "SDPA's K/V repeated to every head (repeat_kv)"))
               if flag]
    if not stack.is_default:
        notes.append(f"models {stack.describe()}" + (f" (applied: {', '.join(applied)})" if applied else ""))
    if stack.moe_experts_linear and any(l.role == "expert" for l in model.linears):  # the model moe_4x.py built
        from .moe_4x import note

        notes.append(note(model, setup, stack.transformers))
    saving = moe_experts_4x_saving_bytes(model, setup)
    if saving and not stack.moe_experts_linear:  # (under 4.x the experts are Linears: estimator/moe_4x.py)
        notes.append(f"under transformers 4.x (per-expert nn.Linear layers, quantized by bitsandbytes) the base "
                     f"would take {gib(saving, 1)} GiB less (before sharding); this estimate models transformers 5")
    return notes


def transformers_stack(version: str) -> Stack:
    """The Stack of a transformers version as users write it (``--transformers``, a checks file's
    ``transformers:``): ``4.48.1``, ``5``, or ``installed`` (this machine's, from package metadata).
    ValueError, its message saying why, otherwise."""
    text = str(version).strip()
    if text.lower() == "installed":
        from ..util.versions import library_versions

        installed = library_versions(["transformers"])["transformers"]
        if installed is None:
            raise ValueError("installed, but transformers is not installed here; give a version (4.48.1)")
        text = installed
    try:
        stack = Stack(transformers=text)
    except ValueError:
        raise ValueError(f"{version!r} is not a version; write e.g. 4.48.1, 5 or installed") from None
    if version_tuple(text) < OLDEST_READ:
        oldest = ".".join(map(str, OLDEST_READ))
        raise ValueError(f"transformers {text} is older than any version vramplan has read ({oldest}: what "
                         f"changes memory before it, e.g. the causal-LM loss's logits copies, is not modelled); "
                         f"give {oldest} or later")
    return stack


def model_under(model: ModelSpec, stack: Stack) -> ModelSpec:
    """``model`` as ``stack``'s transformers runs its attention: before 4.54 a grouped-query model's SDPA layers
    keep K and V repeated to every head (``FamilyTraits.sdpa_repeat_kv``, read by estimator/activations.py);
    otherwise ``model`` itself (the same object)."""
    if not stack.sdpa_repeats_kv or model.num_kv_heads >= model.num_heads or model.traits.sdpa_repeat_kv:
        return model
    return replace(model, traits=replace(model.traits, sdpa_repeat_kv=True))
