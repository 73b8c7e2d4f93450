"""Tensor parallelism (``--tp N``) as transformers 5.24 runs it: one rank's share of the step.

``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` (transformers 5.24
``distributed/tensor_parallel.apply_tensor_parallelism``; accelerate 1.15's
``ParallelismConfig(tp_size=N)`` and the HF Trainer drive the same plan: ``Trainer.__init__`` builds
``ParallelismConfig(tp_size=model.tp_size)`` for a model sharded at load) shards, on every rank, by
the model's plan (``base_model_tp_plan`` of its config class, e.g. ``LlamaConfig``):

- ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: ``colwise`` (``ColwiseParallel``:
  weight and bias ``Shard(0)``, the input replicated, the output this rank's heads / intermediate
  columns, kept local);
- ``o_proj``, ``down_proj``: ``rowwise`` (``RowwiseParallel``: weight ``Shard(1)``, bias replicated,
  the ``Partial`` output all-reduced to the full hidden size);
- ``embed_tokens``: ``embedding_rowwise`` (``distributed/mixin.init_parallel_plans``: vocab-parallel,
  the partial lookups all-reduced); ``lm_head``: ``colwise_gather_output`` (``LlamaForCausalLM._tp_plan``:
  the vocabulary sharded, the logits all-gathered, so the loss sees the full ``N x V`` logits on every
  rank); a tied head is the embedding's shard;
- norms replicated (Qwen3's per-head ``q_norm``/``k_norm``: ``replicated_with_grad_allreduce``, over
  this rank's heads).

So one rank holds the model of :func:`rank_model`: heads, KV heads, intermediate size and vocabulary
divided by N (the fullest rank's ceiling), the hidden size whole. Its weights, gradients, optimizer
states and saved activations are that model's, as on one GPU (the layer input, norm outputs and
residual stream are full-width on every rank; q/k/v, attention, the MLP's intermediate tensors are
this rank's columns); the loss is the full vocabulary's (:func:`rank_estimate` passes the full model
as ``loss_model``). The all-reduces' outputs replace tensors the single-GPU step has too. Read off
the real DTensor step on N gloo ranks (vramplan/truths/tp_truth.py, ``validate --knob tp``).

LoRA (peft 0.21 ``tuners/lora/model.add_lora_tp_hooks_dtensor``): a colwise Linear's ``lora_B`` is
a DTensor ``Shard(0)`` over the tp mesh (``out / tp`` local rows), its ``lora_A`` a plain replicated
tensor: the adapters of :func:`rank_model`'s Linears; their gradients, AdamW states and one step
match an unsharded LoRA step of the same checkpoint (relative error 1e-6 on the gradients, 2e-5 on
the stepped values, fp32, 2 gloo ranks: vramplan/truths/tp_lora.py, tests/test_tp_lora.py). A
rowwise Linear's adapter does not run: peft's ``tuners_utils._get_in_out_features`` reads the local
weight, so ``lora_A.in_features`` is the shard's width (``in / tp``), and transformers'
``RowwiseParallel.transform_inputs_pre_forward`` builds the input DTensor with that as the global
width (``RuntimeError: shape '[64, 16]' is invalid for input of size 2048`` in ``tp_forward`` on the
tiny Llama, pinned by tests/test_tp_lora.py): refused.
"""

from __future__ import annotations

import dataclasses
import math

from ..specs import Breakdown, Component, GpuSpec, ModelSpec, RankPeak, Setup, SpecError
from .tp_fsdp2 import (
    accumulated_grad_bytes,
    check_tp_fsdp2,
    combined,
    combined_note,
    tied_head_copy_bytes,
    tied_head_grad_bytes,
    with_tied_head_copy,
)
from .tp_fsdp2 import rank_setup as tp_fsdp2_rank_setup

#: transformers 5.24's ``base_model_tp_plan`` of the model types modelled here (configuration_<type>.py),
#: by Linear name; ``lm_head`` is ``colwise_gather_output`` and ``embed_tokens`` ``embedding_rowwise`` for all.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def shard_size(n: int, tp: int, rank: int) -> int:
    """Rank ``rank``'s share of a dimension of ``n`` sharded over ``tp`` ranks: torch 2.13's
    ``Shard.local_shard_size_and_offset`` (what transformers' shard-on-read uses), chunks of
    ``ceil(n / tp)``, the last ranks shorter (or empty) when ``n`` does not divide."""
    chunk = -(-n // tp)
    return max(0, min(n, (rank + 1) * chunk) - rank * chunk)


def check_tp(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a tensor-parallel setup that is not modelled (or does not run)."""
    tp = setup.tp
    if model.model_type not in TP_MODEL_TYPES or model.moe is not None:
        raise SpecError(f"--tp on {model.name} (model_type {model.model_type}): tensor parallelism is modelled for "
                        f"the dense plans of {', '.join(TP_MODEL_TYPES)}"
                        + (f"; an MoE model's experts: add --ep {tp} (estimator/expert_parallel.py)"
                           if model.moe is not None else ""))
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise SpecError(f"--tp {tp} does not divide {model.name}'s {model.num_heads} attention heads and "
                        f"{model.num_kv_heads} KV heads (transformers shards whole heads)")
    check_tp_fsdp2(model, setup)  # beside FSDP2 sharding: what its truth runs (estimator/tp_fsdp2.py)
    if setup.gpus != tp and not combined(setup):
        raise SpecError(f"--tp {tp} on --gpus {setup.gpus}: tensor parallelism combined with data parallelism "
                        "(FSDP2 dp_shard, DDP) is not modelled yet; use --gpus equal to --tp")
    unmodelled = (("--quant", setup.quant != "none"), ("--fsdp", setup.fsdp != "none" and not combined(setup)),
                  ("--zero", bool(setup.zero_stage)), ("--cp", setup.cp > 1), ("--liger", setup.liger),
                  ("--objective", setup.objective != "sft"), ("--loss", setup.loss != "hf"),
                  ("--eval-batch", setup.eval_batch > 0), ("--optimizer-in-backward", setup.optimizer_in_backward),
                  ("--modules-to-save", bool(setup.modules_to_save)),
                  ("--dora", setup.dora), ("a -mixed --precision", setup.precision.endswith("-mixed")),
                  ("--optimizer", setup.optimizer != "adamw"),
                  ("--offload", setup.offload_params != "none" or setup.offload_optimizer != "none"),
                  ("--activation-offload", setup.activation_offload), ("--padding-free", setup.padding_free))
    for flag, on in unmodelled:
        if on:
            raise SpecError(f"--tp with {flag} is not modelled yet (tensor parallelism is modelled for full "
                            "fine-tuning and LoRA of a 16-bit base with torch AdamW and the HF loss)")
    if setup.adapters:
        from ..setup.checks import lora_targets

        rowwise = sorted({l.name for l in lora_targets(model, setup)[0] if l.name in ROWWISE or l.role == "head"})
        if rowwise:
            raise SpecError(f"--tp with LoRA on {', '.join(rowwise)} (row-parallel, or the gathered head) fails in "
                            "peft 0.21: tuners_utils._get_in_out_features builds lora_A with the shard's in_features "
                            "(in/tp), which transformers 5.24's RowwiseParallel.transform_inputs_pre_forward takes as "
                            "the input's global width (RuntimeError: shape ... is invalid, in the first forward); "
                            f"target the column-parallel ones: --lora-targets {','.join(COLWISE)}")


def _rank_linear(linear, tp: int, rank: int):
    if linear.name in COLWISE or linear.role == "head":
        return dataclasses.replace(linear, out_features=shard_size(linear.out_features, tp, rank))
    if linear.name in ROWWISE:
        return dataclasses.replace(linear, in_features=shard_size(linear.in_features, tp, rank))
    return linear


def rank_model(model: ModelSpec, tp: int, rank: int = 0) -> ModelSpec:
    """The model rank ``rank`` holds (rank 0 is the fullest when a width does not divide by ``tp``):
    heads, KV heads, intermediate size and vocabulary sharded, the hidden size and the norms whole."""
    h = model.hidden_size
    other = tuple((name, shard_size(n // h, tp, rank) * h if name == "embed_tokens" else n)
                  for name, n in model.other_params)
    traits = model.traits
    if traits.qk_norm_rows:  # per-head q/k norms run over this rank's heads
        traits = dataclasses.replace(traits, qk_norm_rows=traits.qk_norm_rows // tp)
    return dataclasses.replace(
        model, name=f"{model.name} (tensor-parallel rank {rank} of {tp})", num_heads=model.num_heads // tp,
        num_kv_heads=model.num_kv_heads // tp, intermediate_size=shard_size(model.intermediate_size, tp, rank),
        vocab_size=shard_size(model.vocab_size, tp, rank),
        linears=tuple(_rank_linear(l, tp, rank) for l in model.linears), other_params=other, traits=traits)


def rank_setup(setup: Setup) -> Setup:
    """The setup one rank runs, as one GPU: no data parallelism beside it (``gpus == tp``); beside
    FSDP2 sharding, FSDP2 over its dp_shard group (estimator/tp_fsdp2.py)."""
    return tp_fsdp2_rank_setup(setup) if combined(setup) else dataclasses.replace(setup, tp=1, gpus=1)


def optimizer_groups(rank: ModelSpec, setup: Setup) -> tuple[int, ...]:
    """Elements of each optimizer parameter group on one rank. The HF Trainer splits its decay /
    no-decay groups by device mesh when DTensor and plain parameters mix (``Trainer.create_optimizer``,
    ``trainer_optimizer.has_mixed_dtensor``: one foreach call cannot span them): full fine-tuning,
    the sharded weights (decay), the biases (DTensor, no decay) and the norms (plain, no decay); LoRA,
    the colwise Linears' sharded ``lora_B`` and their replicated ``lora_A``."""
    from .lora import adapted_linears

    if setup.adapters:
        r, linears = setup.lora_rank, adapted_linears(rank, setup)
        return (sum(l.count * l.out_features * r for l in linears), sum(l.count * l.in_features * r for l in linears))
    weights = sum(l.count * l.weight_params for l in rank.linears) + dict(rank.other_params).get("embed_tokens", 0)
    biases = sum(l.count * l.out_features for l in rank.linears if l.bias)
    return weights, biases, sum(n for name, n in rank.other_params if name != "embed_tokens")


def rank_estimate(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections, stack, estimate) -> Breakdown:
    """The fullest tensor-parallel rank's Breakdown (rank 0), with ``per_rank`` when the ranks'
    shares differ (an intermediate size or vocabulary that does not divide by ``tp``)."""
    check_tp(model, setup)
    if not stack.is_default:  # transformers 4's tp_plan loaded shards another way (no DTensor plan at load)
        raise SpecError(f"--tp is modelled for transformers 5.24's DTensor tensor parallelism, not transformers "
                        f"{stack.transformers}")
    shapes = {r: (shard_size(model.intermediate_size, setup.tp, r), shard_size(model.vocab_size, setup.tp, r))
              for r in range(setup.tp)}
    first = {}
    for r, shape in shapes.items():
        first.setdefault(shape, r)
    ranks = {shape: _rank_breakdown(model, setup, r, gpu, corrections, stack, estimate) for shape, r in first.items()}
    b = ranks[shapes[0]]
    if len(ranks) == 1:
        return b
    layers = tuple(range(model.num_layers))
    per_rank = tuple(RankPeak(r, layers, x.tensor_peak_bytes, x.peak_allocated_bytes, x.peak_reserved_bytes,
                              x.device_total_bytes, x.phase) for r, x in ((r, ranks[shapes[r]]) for r in shapes))
    return dataclasses.replace(b, per_rank=per_rank)


def _rank_breakdown(model: ModelSpec, setup: Setup, rank_index: int, gpu: GpuSpec | None, corrections, stack,
                    estimate) -> Breakdown:
    """One rank's Breakdown: ``estimate`` of :func:`rank_model` as one GPU, the loss over the full
    vocabulary (the gathered logits), AdamW foreach's step transient per parameter group
    (:func:`optimizer_groups`: the largest group's ``_foreach_sqrt``, not all parameters'), and
    NCCL's communicators beside the context."""
    from .corrections import device_overheads
    from .optimizers import trainable_tensors

    rank, one = rank_model(model, setup.tp, rank_index), rank_setup(setup)
    b = estimate(rank, one, gpu, corrections, stack, loss_model=model)
    step = next((c.bytes for c in b.components if c.name == "optimizer_step"), 0)
    numel = sum(math.prod(shape) * count for shape, count in trainable_tensors(rank, one))
    largest = step * max(optimizer_groups(rank, one)) // max(numel, 1)
    peaks = {**b.phase_peaks_bytes, "optimizer": b.phase_peaks_bytes["optimizer"] - (step - largest)}
    grads = next((c.bytes for c in b.components if c.name == "gradients"), 0)
    held = accumulated_grad_bytes(model, setup, grads)  # beside FSDP2 with accumulation: the gradient shards
    peaks = with_tied_head_copy(model, setup, peaks, held)  # beside FSDP2: a tied head's gathered copy (tp_fsdp2.py)
    phase = max(peaks, key=lambda p: peaks[p])
    allocated, reserved, total, overheads = device_overheads(peaks[phase], setup.gpus, gpu, corrections)
    devices = {name: (n, note) for name, n, note in overheads}
    copy = tied_head_copy_bytes(model, setup)
    comps = [c for c in b.components if c.name not in devices] + [
        Component("tied_head_gather", copy, ("forward", "backward"), note="the tied head's DTensor all-gather of "
                  "the sharded embedding (transformers ties it after fully_shard)"),
        Component("tied_head_grad", tied_head_grad_bytes(model, setup), ("backward", "optimizer"),
                  note="its gradient into the embedding's shard, beside FSDP2's")] * bool(copy) + [
        Component(name, n, note=note or ("NCCL communicators (the TP group)" if name == "nccl" else ""))
        for name, (n, note) in devices.items()]
    shard_note = f"this rank's 1/{setup.tp} tensor-parallel shard" + combined_note(setup)
    comps = [dataclasses.replace(c, bytes=largest, note="foreach step transient (largest parameter group)")
             if c.name == "optimizer_step" else dataclasses.replace(c, note=shard_note) if c.name == "weights" else c
             for c in comps]
    if held:  # the gradient shards live through the next micro-batches (tp_fsdp2.accumulated_grad_bytes)
        comps = [dataclasses.replace(c, phases=("forward", "backward", "optimizer"), note="sharded, held across "
                                     "micro-batches (every micro-batch reduce-scatters)")
                 if c.name in ("gradients", "tied_head_grad") else c for c in comps]
    notes = (f"--tp {setup.tp}: per GPU, transformers' tp_plan shards q/k/v/gate/up by columns, o/down by rows, "
             "the embedding and head by vocabulary; norms are replicated and the loss sees all N x V logits",) + b.notes
    return rank_breakdown(b, model, setup, comps, notes, peaks, phase, (allocated, reserved, total))


def rank_breakdown(b: Breakdown, model: ModelSpec, setup: Setup, comps, notes: tuple, peaks: dict, phase: str,
                   headline: tuple) -> Breakdown:
    """The rank model's Breakdown ``b`` as the whole model's on one rank: its components, notes, phase
    peaks and (allocated, reserved, device total) ``headline``, the whole model's parameter counts."""
    from .model_states import trainable_params

    allocated, reserved, total = headline
    return dataclasses.replace(
        b, model=model.name, setup=setup, components=tuple(comps), notes=notes, phase_peaks_bytes=peaks, phase=phase,
        tensor_peak_bytes=int(peaks[phase]), peak_allocated_bytes=int(allocated), peak_reserved_bytes=int(reserved),
        device_total_bytes=int(total), params_total=model.params_total,
        params_trainable=trainable_params(model, setup))


#: How many times a TP collective's bytes cross the PCIe link between GeForce cards: NVIDIA's driver
#: disables peer-to-peer on them, so NCCL stages through host memory (device to host, host to
#: device). Data-centre and workstation cards without NVLink run P2P over the PCIe switch (once).
#: From NCCL's transport selection (P2P, else SHM); the factor is assumed, not measured here.
GEFORCE_PCIE_CROSSINGS = 2


def link_bytes_per_micro_step(model: ModelSpec, setup: Setup, gpu: GpuSpec | None) -> float:
    """:func:`comm_bytes_per_micro_step` as the GPUs' link carries them (GeForce cards without
    NVLink: twice, through host memory, :data:`GEFORCE_PCIE_CROSSINGS`)."""
    staged = gpu is not None and gpu.interconnect == "pcie" and "GeForce" in gpu.display_name
    return comm_bytes_per_micro_step(model, setup) * (GEFORCE_PCIE_CROSSINGS if staged else 1)


def comm_bytes_per_micro_step(model: ModelSpec, setup: Setup) -> float:
    """Bytes each tensor-parallel rank sends and receives per micro-step (0 without ``--tp``), for
    cost/model.py. Per decoder layer four all-reduces of ``batch x seq x hidden`` in the compute dtype: two
    in the forward (o_proj's and down_proj's ``Partial`` outputs, ``RowwiseParallel``) and two in the
    backward (the replicated inputs' gradients of q/k/v and gate/up, ``ColwiseParallel``); the
    vocab-parallel embedding's all-reduce and its backward's; the logits' all-gather (``N x V``,
    ``colwise_gather_output``). A ring all-reduce moves ``2 (n-1)/n`` of its bytes per rank, an
    all-gather ``(n-1)/n``. The checkpointed layers' recompute runs the forward's two again."""
    from .precision import compute_bytes

    n = setup.tp
    if n <= 1:
        return 0.0
    c, tokens, h = compute_bytes(setup), setup.tokens, model.hidden_size
    per_layer = (4 + (2 if setup.checkpointing else 0)) * tokens * h * c
    all_reduce = (model.num_layers * per_layer + 2 * tokens * h * c) * 2 * (n - 1) / n
    return all_reduce + tokens * model.vocab_size * c * (n - 1) / n
