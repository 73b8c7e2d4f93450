"""DeepSpeed ZeRO settings shared by the estimator (memory of its buffers) and the emitter (the
values written into ds_config.json), so that what is estimated is what is launched.

``zero_config`` returns the ``zero_optimization`` numbers vramplan chooses for a plan; callers
must not hard-code them elsewhere. The sizes follow what the HF Trainer / accelerate fill in for
``"auto"`` (transformers/integrations/deepspeed.py, ``trainer_config_finalize``), because that is
what most launched configs hold and because DeepSpeed's own defaults (5e8-element buckets, 1 GB
each in bf16, allocated whatever the model's size) would dominate a small model's memory:
- ``reduce_bucket_size`` = h² elements (DeepSpeed default 5e8): stage 1/2 allocate two gradient
  buckets of this size with ``overlap_comm`` (``ipg_buckets``), stage 3 one;
- ``allgather_bucket_size`` = h² (stage 1/2; the updated bf16 partitions are gathered in place);
- ``stage3_prefetch_bucket_size`` = 0 (HF "auto" fills 0.9 h², DeepSpeed's default is 5e7): with a
  prefetch bucket, DeepSpeed 0.19 keeps gathered every parameter the prefetcher walked past
  ("don't release params whose reuse was skipped by prefetch",
  ``PartitionedParameterCoordinator.__params_to_release``). In the real 2-rank run of
  ``vramplan.truths.distributed`` that left 92% of the parameters gathered at the end of the forward,
  so stage 3 saved almost no parameter memory and nothing bounds it by the bucket. Without
  prefetch the gathered set is the running module's parameters, which the estimate can hold to;
  the price is that the all-gather no longer overlaps the compute (slower steps);
- ``stage3_param_persistence_threshold`` = 10 h: parameters up to this size (norms, biases) stay
  gathered on every rank;
- ``stage3_max_live_parameters`` = 1e9 (DeepSpeed's default; it only bounds the prefetch);
- offload blocks (``offload_optimizer`` / ``offload_param``) are written by the emitter
  (vramplan/emit/deepspeed.py: ``pin_memory`` on, DeepSpeed's CPU Adam for AdamW).
- ``stage3_max_reuse_distance`` = 0 (DeepSpeed's default is 1e9): a gathered parameter is
  released after its module ran. With 1e9, every parameter whose next use is less than 1e9
  elements of fetches away stays gathered, so between the forward and the backward up to ~1e9
  parameters (2 GB in bf16; the whole model below 1B parameters) stay on every rank, and how
  many depends on the module order. 0 costs one extra gather of the top layers at the start of
  the backward and makes the gathered set the running module's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ModelSpec, Setup
from ..util.units import bnb_4bit_tensor_bytes
from .lora import adapted_linears, converted_moe, expert_lora_factors
from .precision import adapter_dtype_bytes


def zero_config(model: ModelSpec, setup: Setup) -> dict:
    """The ``zero_optimization`` block's numeric knobs for ``setup`` (stage, buckets, prefetch)."""
    h2 = model.hidden_size * model.hidden_size
    cfg: dict = {
        "stage": setup.zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": h2,
        "allgather_bucket_size": h2,
    }
    if setup.zero_stage == 3:
        cfg.update({
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 10 * model.hidden_size,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    return cfg


# ----------------------------------------------------------------------------------------------
# what ZeRO keeps per rank (DeepSpeed 0.19: runtime/zero/stage_1_and_2.py, stage3.py)

#: Bytes of optimizer state per fp32 master element. DeepSpeed hands the client optimizer one flat
#: fp32 partition, so a factored optimizer (Adafactor) sees a vector and keeps a full second moment.
_STATE_BYTES_PER_ELEMENT = {"adamw": 8, "adamw-fused": 8, "sgd": 4, "lion": 4, "adafactor": 4,
                            "adamw-8bit": 2 * (1 + 4 / 256), "paged-adamw-8bit": 2 * (1 + 4 / 256)}
#: DeepSpeed's stage-3 default: the fp32 partition is stepped in sub-groups of this many elements.
SUB_GROUP_SIZE = int(1e9)
#: NVMe parameter offload as vramplan/emit/deepspeed.py writes it (``offload_param``): buffer_count
#: page-locked swap buffers of buffer_size elements (at least the largest parameter), and max_in_cpu
#: elements of the trainable 16-bit partition kept in host RAM (stage3.py
#: _create_param_groups_fp16_flat_cpu_memory, DeepSpeed 0.19.8).
PARAM_SWAP_BUFFERS, PARAM_SWAP_BUFFER_NUMEL, PARAM_MAX_IN_CPU = 5, int(1e8), int(1e9)
#: What ZeRO-Infinity's optimizer swapper keeps on NVMe, not in host RAM (the fp32 master, its
#: gradient and the optimizer states of every sub-group: swap_tensor/partitioned_optimizer_swapper.py).
ON_NVME = ("fp32 master partition", "fp32 gradient partition", "optimizer states")
#: DeepSpeed swaps a tensor only from this many bytes (swap_tensor/utils.py MIN_AIO_BYTES, and the
#: emitted aio block_size); smaller sub-groups and parameters stay in host RAM (optimizer_utils.py
#: is_swappable_tensor, partitioned_param_swapper.py swappable_tensor). Applied to the whole
#: sub-group / partition: a tiny model swaps nothing, a real one all but its norms and biases.
MIN_AIO_BYTES = 1024**2


@dataclass(frozen=True)
class ZeroMemory:
    """Per-rank bytes of one ZeRO setup's model states, split by where and when they live.

    Device terms are what one GPU holds; ``host_*`` what the offload keeps in host RAM. The
    activations are not here: DeepSpeed runs the model's own forward/backward unchanged."""

    weights: int  # 16-bit parameters held between steps (stage 3: the partition + persistent ones)
    master: int  # fp32 master partition on the device
    states: int  # optimizer states on the device
    grad_partition: int  # the rank's 16-bit gradient partition (stage 1/2 from backward to step)
    grad_partition_static: bool  # True: allocated at initialize and kept (stage 3)
    buckets: int  # gradient reduce buckets (stage 3: allocated at initialize and kept)
    staging: int  # buffers kept from initialize on (stage 1/2 offload: the device gradient staging buffer)
    gathered: int  # stage 3: the running module's gathered parameters (inside a layer's backward)
    step: int  # the optimizer step's extra device bytes (flat/fp32 gradients, foreach transient)
    host: int  # host RAM held by the offload (peak, with the host step's transient)
    host_terms: tuple[tuple[str, int], ...] = ()
    nvme: int = 0  # bytes ZeRO-Infinity keeps on NVMe (not host RAM)
    nvme_terms: tuple[tuple[str, int], ...] = ()

    @property
    def static(self) -> int:
        """Bytes on the device through the whole step."""
        kept = self.grad_partition + self.buckets if self.grad_partition_static else 0
        return self.weights + self.master + self.states + self.staging + kept


def _elem_bytes(setup: Setup) -> int:
    """16-bit under DeepSpeed's bf16/fp16 (it casts the model itself, so *-mixed is the same)."""
    return 4 if setup.precision == "fp32" else 2


def _quantized(model: ModelSpec, setup: Setup) -> list:
    """The Linears a bitsandbytes base stores quantized (every one but the head); none otherwise."""
    if setup.quant not in ("int8", "nf4", "fp4"):
        return []
    return [l for l in model.linears if l.role != "head"]


def _stored_numel(l, setup: Setup, pb: int) -> int:
    """Elements of one Linear weight as ZeRO sees the parameter: a 4-bit weight is packed two
    values a byte into a tensor of ``bnb_4bit_quant_storage``, which under stage 3 must be the
    16-bit dtype the engine trains in (docs/deepspeed.md), so pb-byte elements of 2·pb values;
    int8 one element per value."""
    if setup.quant in ("nf4", "fp4"):
        return -(-l.weight_params // (2 * pb))
    return l.weight_params


def _quantized_base(model: ModelSpec, setup: Setup, pb: int) -> tuple[int, int, int]:
    """(parameters stored quantized, the quantized parameters' numel as ZeRO sees them, the
    quantization state beside them: 4-bit absmax/codes, LLM.int8's fp32 row scales ``SCB``)."""
    qs = _quantized(model, setup)
    params = sum(l.count * l.weight_params for l in qs)
    stored = sum(l.count * _stored_numel(l, setup, pb) for l in qs)
    if setup.quant == "int8":
        state = 4 * sum(l.count * l.out_features for l in qs)
    else:
        state = sum(l.count * (bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant) - -(-l.weight_params // 2))
                    for l in qs)
    return params, stored, state


def _persistent_params(model: ModelSpec, threshold: int, setup: Setup | None = None) -> int:
    """Parameters of at most ``threshold`` elements that stage 3 keeps gathered (norms, small
    biases, small routers, small packed 4-bit weights); DeepSpeed tests each parameter's numel
    (``ds_numel``)."""
    n = sum(p for name, p in model.other_params if name == "norms")
    quantized = {id(l) for l in _quantized(model, setup)} if setup is not None else set()
    for l in model.linears:
        if l.bias and l.out_features <= threshold:
            n += l.out_features * l.count
        numel = _stored_numel(l, setup, _elem_bytes(setup)) if id(l) in quantized else l.weight_params
        if numel <= threshold:
            n += numel * l.count
    return n


def _largest_trainable(model: ModelSpec, setup: Setup) -> int:
    """The largest trainable parameter: a LoRA factor (r x in or out x r) under adapters."""
    if not setup.adapters:
        return _largest_param(model)
    from .knobs import saved_modules  # peft's modules_to_save copies train too

    copies = [shape[0] * shape[1] for _, shape, _ in saved_modules(model, setup)]
    return max([setup.lora_rank * max(l.in_features, l.out_features) for l in adapted_linears(model, setup)] + copies,
               default=0)


def _largest_param(model: ModelSpec, setup: Setup | None = None) -> int:
    quantized = {id(l) for l in _quantized(model, setup)} if setup is not None else set()
    sizes = [_stored_numel(l, setup, _elem_bytes(setup)) if id(l) in quantized else l.weight_params
             for l in model.linears]
    sizes += [n for name, n in model.other_params if name == "embed_tokens"]
    return max(sizes)


def zero_memory(model: ModelSpec, setup: Setup, trainable: int) -> ZeroMemory:
    """Model-state bytes per rank under ZeRO ``setup.zero_stage`` on ``setup.gpus`` ranks.

    bf16/fp16 training under DeepSpeed is mixed precision whatever ``setup.precision`` says: the
    engine casts the model to 16 bits and the ZeRO optimizer keeps an fp32 master partition that
    the client optimizer steps (ZeRO paper, §5: 2 + 2 + 12 bytes/param before partitioning)."""
    stage, n = setup.zero_stage, setup.gpus
    cfg = zero_config(model, setup)
    pb = _elem_bytes(setup)
    total = model.params_total
    part = -(-trainable // n)  # the rank's partition (DeepSpeed pads the flat group to n parts)
    state_b = _STATE_BYTES_PER_ELEMENT[setup.optimizer]
    foreach = setup.optimizer in ("adamw", "sgd", "lion", "adafactor")
    off_opt = setup.offload_optimizer != "none"
    off_par = setup.offload_params != "none"
    bucket = cfg["reduce_bucket_size"] * pb
    host_terms: list[tuple[str, int]] = []
    nvme_terms: list[tuple[str, int]] = []
    staging = 0

    master, states = 4 * part, int(state_b * part)
    # the client torch optimizer's foreach transient (one fp32 state-sized list); DeepSpeed's own
    # CPU Adam (used for offloaded AdamW, as the emitter writes) steps in place
    t_step = 4 * part if foreach and not (off_opt and setup.optimizer in ("adamw", "adamw-fused")) else 0
    # a bitsandbytes base: its Linears stay quantized (not castable), everything else is cast to
    # pb bytes by the engine (precision.deepspeed_16bit); the quantization state is no
    # parameter, so every rank keeps all of it
    q_params, q_stored, q_state = _quantized_base(model, setup, pb)
    if stage in (1, 2):
        # bit16_groups_flat: the whole model, every rank
        weights = (total - q_params) * pb + (q_stored * (1 if setup.quant == "int8" else pb)) + q_state
        if setup.adapters:  # the frozen base as loaded, and the adapters (cast to pb) flattened
            weights += pb * trainable
        grad_part = 0 if off_opt else pb * part  # grads_in_partition
        buckets = 2 * bucket  # ipg buckets, double-buffered with overlap_comm
        # step: the gradient partition flattened (a 16-bit copy) and converted to fp32, then the
        # inner step on the fp32 gradient. The 16-bit partition (one buffer for all groups) is
        # freed with the last group's gradients: the HF Trainer gives full fine-tuning two groups
        # (weight decay, then biases and norms), so the first, nearly all, steps beside it
        kept = grad_part if setup.method == "full" else 0
        step = max(grad_part + pb * part + 4 * part, kept + 4 * part + t_step)
        # before it, the gradient norm (compute_grad_norm, on by default): get_grad_norm_direct takes
        # ``vector_norm(g.data.to(get_norm_dtype()))`` of each gradient in the rank's partition, one at
        # a time, beside the 16-bit partition; get_norm_dtype is fp64 wherever the accelerator has it
        # (CUDA and the CPU): an 8-byte copy of the largest piece, which outgrows the step when one
        # parameter fills most of a small partition (a modules_to_save copy beside LoRA adapters)
        step = max(step, grad_part + 8 * min(_largest_trainable(model, setup), part))
        if off_opt:
            largest = _largest_trainable(model, setup) * pb
            staging = largest  # temp_grad_buffer_for_gpu_offload
            host_terms = [("fp32 master partition", master), ("fp32 gradient partition", 4 * part),
                          ("16-bit staging partition", pb * part), ("gradient staging buffer", largest),
                          ("optimizer states", states), ("optimizer step", t_step)]
            master, states, step = 0, 0, 0
        gathered = 0
        static_grad = False
    else:
        persistent = _persistent_params(model, cfg["stage3_param_persistence_threshold"], setup)
        stored = total - q_params + q_stored  # packed 4-bit weights as pb-byte elements
        weights = pb * (-(-stored // n)) + pb * persistent + q_state
        # peft's adapters, added after zero.Init, keep their dtype (adapter_dtype_bytes): the
        # rank's partition of them (lp_param_buffer)
        adapters = adapter_dtype_bytes(setup) * part if setup.adapters else 0
        weights += adapters
        grad_part = pb * part  # grad_partitions_flat_buffer, allocated at initialize
        buckets = bucket
        sub = min(part, SUB_GROUP_SIZE)
        t_sub = t_step * sub // part if part else 0
        step = max(pb * sub + 4 * sub, 4 * sub + t_sub)
        # no prefetch and stage3_max_reuse_distance 0 (zero_config): a module's parameters are
        # gathered while it runs and released after
        gathered = pb * _largest_param(model, setup)
        if setup.checkpointing and n > 1:
            # a recomputed layer keeps all its parameters gathered through its backward
            L = max(model.num_layers, 1)
            layer = sum(l.params for l in model.linears if l.role != "head")
            layer = (layer + sum(k for name, k in model.other_params if name in ("experts", "router", "qk_norms"))) // L
            gathered = max(gathered,
                           pb * layer + adapter_dtype_bytes(setup) * (trainable // L if setup.adapters else 0))
        static_grad = True
        if off_opt:
            host_terms = [("fp32 master partition", master), ("16-bit gradient partition", grad_part),
                          ("fp32 gradient partition", 4 * part), ("optimizer states", states),
                          ("optimizer step", t_step)]
            master, states, grad_part, step = 0, 0, 0, 0
        if setup.offload_optimizer == "nvme" and 4 * sub >= MIN_AIO_BYTES:
            # the fp32 partitions and states are swapped to NVMe; the 16-bit gradient partition
            # stays in host RAM (grad_partitions_flat_buffer on the offload device, pinned), and so
            # do the optimizer swapper's page-locked buffers: buffer_count (4, as the emitter
            # writes it) fp32 buffers of the largest sub-group (swap_tensor/optimizer_utils.py)
            nvme_terms += [t for t in host_terms if t[0] in ON_NVME]
            host_terms = [t for t in host_terms if t[0] not in ON_NVME]
        if setup.offload_optimizer == "nvme":
            host_terms.append(("NVMe swap buffers", 4 * 4 * sub))
        if off_par:
            params = pb * (-(-stored // n)) + adapters
            if setup.offload_params == "nvme" and pb * (-(-stored // n)) >= MIN_AIO_BYTES:
                # the trainable partition up to max_in_cpu stays in host RAM, beyond it one sub-group's
                # reuse buffer; the parameter swapper's buffers hold the largest parameter
                trainable_b = adapters if setup.adapters else pb * part
                in_cpu = min(trainable_b, pb * PARAM_MAX_IN_CPU)
                reuse = pb * sub if part > PARAM_MAX_IN_CPU else 0
                swap = PARAM_SWAP_BUFFERS * pb * max(PARAM_SWAP_BUFFER_NUMEL, _largest_param(model, setup))
                host_terms += [("16-bit trainable partition (max_in_cpu)", in_cpu),
                               ("NVMe parameter swap buffers", swap + reuse)]
                nvme_terms.append(("16-bit parameter partition", params - in_cpu))
            else:
                host_terms.append(("16-bit parameter partition", params))
            weights = pb * persistent + q_state
    host = sum(b for _, b in host_terms)
    return ZeroMemory(weights=weights, master=master, states=states, grad_partition=grad_part,
                      grad_partition_static=static_grad, buckets=buckets, staging=staging,
                      gathered=gathered, step=step,
                      host=host, host_terms=tuple((k, v) for k, v in host_terms if v),
                      nvme=sum(b for _, b in nvme_terms), nvme_terms=tuple((k, v) for k, v in nvme_terms if v))


@dataclass(frozen=True)
class StepActivations:
    """The activation side of each moment of the step, as the single-GPU estimate computes it
    (DeepSpeed runs the model's forward and backward unchanged)."""

    at_loss: int  # saved activations + logits and their fp32 copy
    backward_start: int  # saved activations + the log-softmax gradients
    top_layer: int  # saved activations + the top layer's backward
    bottom_layer: int  # the bottom layer's saved activations + its backward
    end: int  # what outlives the layers (the embedding's input gradient)
    saved: int = 0  # every layer's saved activations (at the start of the top layer's backward)


def saved_gathered_weights(model: ModelSpec, setup: Setup) -> tuple[int, int]:
    """(bytes kept at the loss, by one layer) of gathered weights that autograd holds past
    DeepSpeed's release under ZeRO-3 on 2+ ranks. Releasing a parameter (``param.data = empty``)
    drops DeepSpeed's reference only; a view of the gathered storage saved for the backward keeps
    it until that backward (``F.linear`` has ``LinearFunctionForZeroStage3``, which saves the
    parameter and gathers it again; these paths have nothing alike). On one rank the gathered
    tensor is the partition itself: nothing extra.
    - MoE: transformers 5 runs fused 3-D experts through ``_grouped_mm(x, weight.transpose(-2,
      -1))`` (integrations/moe.py), which saves that transpose: each MoE layer's whole expert stack
      until its backward (with checkpointing, the recomputed layer's only). Under LoRA with peft's
      merged expert copies grouped_mm saves the merged copy instead (counted in the activations).
    - bitsandbytes 4-bit: ``MatMul4Bit`` keeps ``B.view(-1, 1)`` of the packed weight in
      ``ctx.tensors`` (an attribute, so checkpointing's saved-tensor hooks do not drop it either):
      every non-persistent packed weight until its Linear's backward."""
    if setup.zero_stage != 3 or setup.gpus < 2:
        return 0, 0
    pb = _elem_bytes(setup)
    kept = layer = 0
    if model.moe is not None and not (setup.adapters and converted_moe(model)):
        experts = pb * sum(n for name, n in model.other_params if name == "experts")
        kept += 0 if setup.checkpointing else experts
        layer += experts // max(model.moe.num_moe_layers, 1)
    if setup.quant in ("nf4", "fp4"):
        threshold = zero_config(model, setup)["stage3_param_persistence_threshold"]
        packed = sum(l.count * pb * _stored_numel(l, setup, pb) for l in _quantized(model, setup)
                     if _stored_numel(l, setup, pb) > threshold)
        kept += packed
        layer += packed // max(model.num_layers, 1)
    return kept, layer


#: MoE blocks DeepSpeed 0.19 makes ZeRO-3 leaf modules by default (``zero_optimization.leaf_module``,
#: runtime/zero/leaf_module_config.py ``DEFAULT_LEAF_MODULE_CLASSES``: Mixtral, Qwen2-MoE and
#: Qwen3-MoE's ``*SparseMoeBlock``), by model_type.
ZERO3_LEAF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_leaf_fetch(model: ModelSpec, setup: Setup) -> int:
    """Bytes of one MoE block's parameters that ZeRO-3 gathers in one fetch on 2+ ranks (0 if none).

    DeepSpeed installs no hooks inside a leaf module: its pre-forward and pre-backward hooks fetch
    every parameter under it (``iter_params(recurse=True)``) that is not persistent, in one
    ``all_gather_coalesced`` per dtype: the router (when above the persistence threshold), the
    fused experts, shared-expert Linears, and under LoRA every adapter factor inside the block
    (peft's ``ParamWrapper`` on the router and the experts, kept in fp32). The coalesced path
    gathers into one flat buffer and then copies each parameter out of it
    (``AllGatherCoalescedHandle.wait``: ``param.data = torch.cat(partitions)``); the buffer is
    freed only when the handle leaves the in-flight registry, after the last of the block's
    parameters was waited for, so the fetch holds the block twice. On one rank nothing is
    gathered (``_no_gather_coalesced``)."""
    if setup.zero_stage != 3 or setup.gpus < 2 or model.moe is None or model.model_type not in ZERO3_LEAF_MOE:
        return 0
    pb = _elem_bytes(setup)
    threshold = zero_config(model, setup)["stage3_param_persistence_threshold"]
    n_moe = max(model.moe.num_moe_layers, 1)
    numel = sum(n for name, n in model.other_params if name == "experts") // n_moe
    router = sum(n for name, n in model.other_params if name == "router") // n_moe
    numel += router if router > threshold else 0
    quantized = {id(l) for l in _quantized(model, setup)}
    block = [l for l in model.linears if l.role in ("shared_expert", "router")]  # per layer (count: layers)
    stored_bytes = 0  # int8 weights: one byte per element
    for l in block:
        if id(l) in quantized:
            stored = _stored_numel(l, setup, pb)
            stored_bytes += (stored * (1 if setup.quant == "int8" else pb)) if stored > threshold else 0
        else:
            numel += l.weight_params if l.weight_params > threshold else 0
        numel += l.out_features if l.bias and l.out_features > threshold else 0
    factors = [f for f in expert_lora_factors(model, setup) if f > threshold]
    r = setup.lora_rank
    adapted = {id(l) for l in adapted_linears(model, setup)}
    factors += [f for l in block if id(l) in adapted for f in (r * l.in_features, l.out_features * r) if f > threshold]
    return pb * numel + stored_bytes + adapter_dtype_bytes(setup) * sum(factors)


def zero_phase_peaks(model: ModelSpec, setup: Setup, zm: ZeroMemory, act: StepActivations) -> dict[str, int]:
    """Per-rank device peak of each phase under ZeRO.

    Gradients never pile up as in the single-GPU step: DeepSpeed's hook copies each parameter's
    gradient into a reduce bucket as soon as autograd produces it and frees ``param.grad``, so the
    backward holds the rank's gradient partition, the buckets and one parameter's gradient at a
    time. A tied head/embedding weight is the exception: autograd keeps the head's contribution
    until the embedding's arrives at the end of the backward, then sums the two out of place."""
    pb = _elem_bytes(setup)
    full = setup.method == "full"
    kept_experts, layer_experts = saved_gathered_weights(model, setup)
    act = StepActivations(at_loss=act.at_loss + kept_experts, backward_start=act.backward_start + kept_experts,
                          top_layer=act.top_layer + kept_experts, bottom_layer=act.bottom_layer + layer_experts,
                          end=act.end, saved=act.saved)
    head = model.vocab_size * model.hidden_size * pb if full else 0
    # inside the layers the largest gradient is a layer's largest matrix; the embedding's comes last
    layer = max((l.weight_params for l in model.linears if l.role != "head"), default=0) * pb if full else 0
    largest = _largest_param(model) * pb if full else 0
    if setup.modules_to_save.strip() and not full:  # peft's trained copies (estimator/knobs.py)
        from .knobs import saved_modules

        copies = {emb: shape[0] * shape[1] * pb for _, shape, emb in saved_modules(model, setup)}
        head, largest = copies.get(False, 0), max(copies.values())
    grads = 0 if zm.grad_partition_static else zm.grad_partition + zm.buckets
    held = head if model.tie_word_embeddings else 0
    mod = zm.gathered
    # a leaf MoE block's fetch (moe_leaf_fetch) holds it twice; the top layer's, at the start of
    # its backward, beside every layer's saved activations and the incoming gradient
    fetch = 2 * moe_leaf_fetch(model, setup)
    forward = zm.static + act.at_loss
    backward = zm.static + max(
        act.backward_start,
        act.top_layer + grads + max(head, layer) + mod,
        act.bottom_layer + grads + held + layer + mod,
        act.end + grads + (3 * held if held else largest),
        act.saved + kept_experts + act.end + grads + held + fetch if fetch else 0,
    )
    optimizer = zm.static + zm.step
    return {"forward": int(forward), "backward": int(backward), "optimizer": int(optimizer)}
