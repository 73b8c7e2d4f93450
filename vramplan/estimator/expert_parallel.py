"""Expert parallelism (``--ep N``) as transformers 5.24 runs it on an MoE model: one rank's share.

What runs: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, ep_size=N))``,
the layout transformers documents for an MoE checkpoint on N GPUs (``MuseSparkModel``'s and
``HYV4VLForConditionalGeneration``'s docstrings; ``DistributedConfig``: ``ep_size`` "must be a
multiple of ``tp_size`` and divide ``fsdp_size * tp_size``"). ``distributed/mixin.maybe_distribute_model``
applies the dense tensor-parallel plan with the experts' TP rules dropped (``_resolve_parallel_plans``:
"EP rules take precedence") and then ``distributed/expert_parallel.apply_expert_parallelism`` with
the model's ``base_model_ep_plan`` (configuration_qwen3_moe.py, configuration_mixtral.py):

- ``mlp.experts.gate_up_proj`` / ``down_proj``: ``grouped_gemm`` (``MoEParamShard.shard_param``:
  ``Shard(0)`` over the EP mesh, ``num_experts / N`` whole experts per rank, ``module.num_experts``
  the local count, ``_is_expert_parallel`` set; ``num_experts`` must divide, else ValueError);
- ``mlp.experts``: ``ep_dispatch_experts`` (``EpDispatchExpertsParallel`` with ``AutoEP``, which runs
  ``AllToAllEP`` whenever gradients flow): the ranks of the TP group share one batch of ``T`` tokens;
  each keeps ``T / N`` rows (``Replicate -> Shard(0)``, a local chunk), sorts its ``T k / N``
  (token, expert) pairs by expert, gathers them (``send_tokens``), exchanges the counts and the rows
  with ``all_to_all_single_autograd`` and runs its local experts top-1 with unit weights on the rows
  it receives (``R``; ``T k / N`` when the router is balanced); a second all-to-all brings the
  outputs back (``recv_out``, ``T k / N`` rows), ``token_outputs[order] = recv_out`` restores the
  order, the routing weights scale and sum them (``T / N`` rows), and an all-gather over TP gives every
  rank the ``T`` rows again;
- the router (``mlp.gate``) has no rule: replicated, every rank routes all ``T`` tokens (full ``E``
  logits); attention, embedding and head are tensor-parallel as estimator/tensor_parallel.py models
  them (heads, KV heads, vocabulary / N; the loss sees all ``N x V`` logits).

So a rank's weights, gradients and AdamW states are the TP rank's dense shards, the full routers
and norms, and ``1/N`` of the experts; the HF Trainer's optimizer groups split by mesh
(``Trainer.create_optimizer``: the TP mesh's DTensors, the EP mesh's experts, the plain router and
norms), so AdamW foreach's step transient is the largest group's. An MoE layer saves, per rank,
what the dense TP rank saves around it, the router's outputs for all ``T`` tokens, and
(:func:`moe_saved_per_token`) for the ``R`` received rows what ``grouped_mm_experts_forward``
(integrations/moe.py) keeps (``gate_up``'s masked output, the activation, the unit weights, two
indices and the sentinel mask; when the experts train also the gathered input and the product
``down_proj`` reads: its weights are unit and do not require grad, so the down output is not kept),
and for the ``T k / N`` sent rows the restored ``token_outputs`` the weighting multiplies, their
routing weights (this rank's ``Shard(0)`` copy) and the indices of the two gathers. Its backward peaks
at the activation's backward (:func:`moe_backward_peak`). The vocab-parallel embedding's gradient is
whole on every rank (:func:`embedding_grad_extra_bytes`). Routing is assumed balanced (``R = T k / N``:
every expert as loaded as the mean; transformers drops no token, there is no capacity factor); the
truth reports how many rows its ranks' experts ran (vramplan/truths/ep_truth.py, ``validate --knob ep``:
14 rows on 2 and 4 gloo ranks, worst -3.35 %, where the busiest rank got 9 % more rows than balanced).

The rank model (:func:`rank_model`) is estimated as one GPU by estimator/step.py; what that leaves out
is added here: the MoE layers' saves beyond it (:func:`moe_extra_per_token`), the routers' AdamW
states, the embedding's whole gradient, the MoE backward's moment, AdamW foreach's per-group transient.

Not modelled (one ``error:`` line each, :func:`check_ep`): EP without TP beside it (the expert plan
alone, ``DistributedConfig(tp_size=N, tp_plan={}, ep_size=N)`` as the deprecated
``enable_expert_parallel`` documents it, fails in 5.24's ``_resolve_parallel_plans``: "`tp_size=2` was
requested, but `Qwen3MoeForCausalLM` has no `tp_plan`"); EP beside transformers' FSDP2
(``fsdp_size``, ``efsdp``), ``ep != tp``; shared experts (qwen2_moe: no TP rule reaches
``mlp.shared_expert.*``); LoRA on the experts or the router (peft's ``ParamWrapper`` on a DTensor
expert stack) or on row-parallel Linears (estimator/tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
import math

from ..specs import Breakdown, Component, GpuSpec, ModelSpec, Setup, SpecError
from .tensor_parallel import COLWISE, rank_breakdown
from .tensor_parallel import rank_model as tp_rank_model

#: model types whose ``base_model_ep_plan`` is ``grouped_gemm`` + ``ep_dispatch_experts`` and whose
#: dense plan estimator/tensor_parallel.py models (attention colwise/rowwise, vocab-parallel ends),
#: with no shared expert: configuration_qwen3_moe.py, configuration_mixtral.py (transformers 5.24).
EP_MODEL_TYPES = ("qwen3_moe", "mixtral")
#: LoRA targets that run under TP x EP: the column-parallel attention projections (estimator/tensor_parallel.py).
EP_LORA_TARGETS = tuple(n for n in COLWISE if n in ("q_proj", "k_proj", "v_proj"))
#: int64 indices a sent row keeps: ``order`` (``token_outputs[order] = recv_out``) and ``order // k``
#: (``hidden_states[order // k]``), AllToAllEP._dispatch_tokens / _combine_tokens.
SENT_INDEX_BYTES = 16
#: int64 indices and the bool sentinel mask a received row keeps in grouped_mm_experts_forward
#: (``perm // 1`` of the input's gather, ``inv_perm`` of the output's; ``sentinel_mask``): the unit
#: weights' gather keeps nothing (they do not require grad). Read off the real step's saved tensors.
RECEIVED_INDEX_BYTES = 17


def check_ep(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for an expert-parallel setup that is not modelled (or does not run)."""
    ep = setup.ep
    if model.moe is None:
        raise SpecError(f"--ep {ep} shards an MoE model's routed experts; {model.name} has none (a dense model: "
                        "use --tp or --fsdp)")
    if model.model_type not in EP_MODEL_TYPES or model.moe.shared_expert_intermediate_size:
        raise SpecError(f"--ep on {model.name} (model_type {model.model_type}): expert parallelism is modelled for "
                        f"{', '.join(EP_MODEL_TYPES)} (routed experts only; a shared expert is replicated by "
                        "transformers 5.24's plans and not modelled yet)")
    if model.moe.num_experts % ep:
        raise SpecError(f"--ep {ep} does not divide {model.name}'s {model.moe.num_experts} experts (transformers "
                        "5.24 MoEParamShard.shard_param: \"Cannot evenly shard\")")
    if model.moe.num_moe_layers != model.num_layers:
        raise SpecError(f"--ep on {model.name}: dense MLP layers beside the MoE layers are not modelled under "
                        "expert parallelism yet")
    if setup.tp != ep or setup.gpus != ep:
        raise SpecError(f"--ep {ep} is modelled as transformers 5.24 runs it on {ep} GPUs: "
                        f"DistributedConfig(tp_size={ep}, ep_size={ep}), so use --tp {ep} --gpus {ep}; the expert plan "
                        "alone (tp_plan={}) fails in from_pretrained (\"has no `tp_plan`\"), and EP beside "
                        "transformers' FSDP2 (fsdp_size) or across more GPUs than ep is not modelled yet")
    if model.num_heads % ep or model.num_kv_heads % ep:
        raise SpecError(f"--tp {ep} does not divide {model.name}'s {model.num_heads} attention heads and "
                        f"{model.num_kv_heads} KV heads (transformers shards whole heads)")
    unmodelled = (("--pp", setup.pp > 1), ("--cp", setup.cp > 1), ("--zero", bool(setup.zero_stage)),
                  ("--fsdp", setup.fsdp != "none"), ("--quant", setup.quant != "none"), ("--liger", setup.liger),
                  ("--objective", setup.objective != "sft"), ("--loss", setup.loss != "hf"),
                  ("--eval-batch", setup.eval_batch > 0), ("--optimizer-in-backward", setup.optimizer_in_backward),
                  ("--modules-to-save", bool(setup.modules_to_save)), ("--dora", setup.dora),
                  ("a -mixed --precision", setup.precision.endswith("-mixed")),
                  ("--optimizer", setup.optimizer != "adamw"),
                  ("--offload", setup.offload_params != "none" or setup.offload_optimizer != "none"),
                  ("--activation-offload", setup.activation_offload), ("--padding-free", setup.padding_free),
                  ("--device-map", setup.device_map != "none"), ("--framework", setup.framework != "hf"),
                  ("--checkpoint-every", setup.checkpoint_every > 1), ("--pad-mask", setup.pad_mask))
    for flag, on in unmodelled:
        if on:
            raise SpecError(f"--ep with {flag} is not modelled yet (expert parallelism is modelled for full "
                            "fine-tuning and LoRA on q/k/v of a 16-bit base with torch AdamW and the HF loss)")
    if setup.adapters:
        from ..setup.checks import lora_targets

        other = sorted({l.name for l in lora_targets(model, setup)[0] if l.name not in EP_LORA_TARGETS})
        if setup.lora_targets == "all-linear" or other:
            raise SpecError("--ep with LoRA is modelled on the column-parallel attention projections only: peft 0.21 "
                            "puts all-linear's adapters on the fused experts and the router (ParamWrapper over the "
                            "expert-sharded DTensor stack, not run here) and row-parallel o_proj's fail under TP "
                            f"(estimator/tensor_parallel.py); use --lora-targets {','.join(EP_LORA_TARGETS)}")


def rank_model(model: ModelSpec, ep: int) -> ModelSpec:
    """The model one TP x EP rank holds, as the single-GPU estimate reads it: the tensor-parallel rank's
    dense shards (estimator/tensor_parallel.py ``rank_model``), the routers and norms whole, ``1/ep``
    of the experts; its MoE spec has ``num_experts / ep`` experts (the local stacks' shapes) and
    ``top_k / ep`` routed rows per token (a fraction when ``ep`` does not divide ``top_k``): what the
    rank's experts run under balanced routing. What that leaves out of a rank's MoE layer (the router
    over all ``E`` experts and ``k`` slots, the exchange's indices) is :func:`moe_extra_per_token`."""
    tp = tp_rank_model(model, ep, 0)
    k = model.moe.top_k
    moe = dataclasses.replace(model.moe, num_experts=model.moe.num_experts // ep,
                              top_k=k // ep if k % ep == 0 else k / ep)
    other = tuple((name, n // ep if name == "experts" else n) for name, n in tp.other_params)
    return dataclasses.replace(tp, name=f"{model.name} (expert-parallel rank of {ep})", moe=moe, other_params=other)


def rank_setup(setup: Setup) -> Setup:
    """The setup one rank runs, as one GPU."""
    return dataclasses.replace(setup, ep=1, tp=1, gpus=1)


def moe_saved_per_token(model: ModelSpec, setup: Setup) -> float:
    """What one MoE layer's MLP saves on an EP rank, per token of the rank's batch (the module
    docstring): the router's outputs for every token (all ``E`` fp32 probabilities, ``k`` int64
    indices, the renormalised top-k), and ``k / ep`` received and ``k / ep`` sent rows each (balanced
    routing): a received row the masked ``gate_up`` output, the activation, the unit weight, the
    indices (and, when the experts train, the gathered input and the product ``down_proj`` reads); a
    sent row the restored output, its routing weight (this rank's ``Shard(0)`` copy) and two indices."""
    from .precision import compute_bytes

    moe, h, c = model.moe, model.hidden_size, compute_bytes(setup)
    k, E, ei, ep = moe.top_k, moe.num_experts, moe.expert_intermediate_size, setup.ep
    experts_train = setup.method == "full"
    router = 4 * E + 8 * k + ((4 + 4 * k) if moe.norm_topk_prob else 0)
    weight_bytes = 4 if model.family == "mixtral" else c
    received = c * (2 * ei + ei) + c + RECEIVED_INDEX_BYTES + (c * h + c * ei if experts_train else 0)
    sent = c * h + weight_bytes + SENT_INDEX_BYTES
    return router + k / ep * (received + sent)


def moe_extra_per_token(model: ModelSpec, setup: Setup) -> float:
    """:func:`moe_saved_per_token` beyond what the single-GPU estimate of :func:`rank_model` counts
    for one MoE layer (activations.py ``moe_layer_bytes_per_token`` on ``E / ep`` experts and
    ``k / ep`` slots): the router's other experts and slots, the exchange's indices."""
    from .activations import moe_layer_bytes_per_token

    return moe_saved_per_token(model, setup) - moe_layer_bytes_per_token(rank_model(model, setup.ep),
                                                                         rank_setup(setup))


def embedding_grad_extra_bytes(model: ModelSpec, setup: Setup) -> int:
    """The vocab-parallel embedding's gradient is whole on every rank: its weight is ``Shard(0)``
    but the gradient ``embedding_rowwise`` produces is a ``Replicate`` DTensor of all ``V x h``
    (read off the real step, 2 gloo ranks: ``model.embed_tokens.weight.grad`` placements
    ``(Replicate(),)``, local shape ``(512, 64)`` beside a ``(256, 64)`` weight shard; the same under
    plain ``--tp``): ``(1 - 1/ep)`` of it beyond the rank model's gradients. Full fine-tuning only."""
    from .model_states import weight_dtype_bytes

    if setup.adapters:
        return 0
    embed = dict(model.other_params).get("embed_tokens", 0)
    return int(embed - embed // setup.ep) * weight_dtype_bytes(setup)


def router_state_extra_bytes(model: ModelSpec, setup: Setup) -> int:
    """AdamW's states of the replicated routers (all ``E x h`` on every rank) beyond those of the rank
    model's ``E / ep``-expert router shapes (estimator/optimizers.py reads the router's shape off the MoE
    spec). Full fine-tuning only."""
    from .model_states import weight_dtype_bytes

    if setup.adapters:
        return 0
    moe = model.moe
    return 2 * (moe.num_experts - moe.num_experts // setup.ep) * model.hidden_size * moe.num_moe_layers * \
        weight_dtype_bytes(setup)


def moe_backward_peak(model: ModelSpec, setup: Setup, comp: dict, router_states: int, extra_acts: int) -> int:
    """The moment an MoE layer's backward peaks on an EP rank: ``gate_up``'s activation backward, the
    product's gradient and the gate's and up's (``3 x ei`` per received row) beside the masked
    ``gate_up`` output and the activation it still needs, the layer's ``down_proj`` gradient just made
    (full fine-tuning) and the hidden-state gradients (``2 x h`` per token); the product, the restored
    outputs and the down rows are gone by then (read off the real step's live tensors, 2 gloo ranks,
    8 experts 256 wide). At the top layer (all the layers' saves there, without checkpointing) and at
    the bottom one (the other layers' gradients there; checkpointed, its recomputed saves alone);
    ``comp``: the rank estimate's component bytes."""
    from .activations import layer_split_per_token
    from .model_states import head_params, weight_dtype_bytes
    from .precision import compute_bytes

    rank, one = rank_model(model, setup.ep), rank_setup(setup)
    moe, h, c, N, w = model.moe, model.hidden_size, compute_bytes(setup), setup.tokens, weight_dtype_bytes(setup)
    k, E, ei, ep, L = moe.top_k, moe.num_experts, moe.expert_intermediate_size, setup.ep, model.num_layers
    full = setup.method == "full"
    rows = N * k / ep  # received and sent rows (balanced)
    transient = 3 * c * ei * rows + 2 * c * N * h
    down_grad = moe.num_experts // ep * h * ei * w if full else 0
    router = 4 * E + 8 * k + ((4 + 4 * k) if moe.norm_topk_prob else 0)
    weight_bytes = 4 if model.family == "mixtral" else c
    still = (router * N + rows * (c * 2 * ei + c * ei + c + RECEIVED_INDEX_BYTES + (c * h if full else 0))
             + rows * (weight_bytes + SENT_INDEX_BYTES))  # the layer's MoE saves still there
    layer = layer_split_per_token(rank, one, 0)[0] * N + still  # its attention side and those
    states = comp.get("weights", 0) + comp.get("adapters", 0) + comp.get("optimizer_states", 0) + router_states
    grads = comp.get("gradients", 0)
    head = head_params(rank) * w if full else 0
    embed = dict(rank.other_params).get("embed_tokens", 0) * w if full else 0
    layer_grad = (grads - head - embed) / max(L, 1) if full else 0
    accum = setup.grad_accum > 1
    if accum:  # every gradient from the first micro-batch on, the embedding's whole one too
        grads += embedding_grad_extra_bytes(model, setup)
    kept = c * N * h if setup.checkpointing else 0  # the checkpoint's input (without: part of ``layer``)
    bottom = states + (grads if accum else grads - embed - layer_grad) + down_grad + kept + layer + transient
    top = 0.0
    if not setup.checkpointing:  # every layer's saves, this one's freed part aside
        saved = comp.get("activations", 0) + extra_acts
        mine = (layer_split_per_token(rank, one, L - 1)[0] + layer_split_per_token(rank, one, L - 1)[1]) * N \
            + moe_extra_per_token(model, setup) * N
        top = states + (grads if accum else head) + down_grad + saved - mine + layer + transient
    return int(max(bottom, top))


def rank_estimate(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, corrections, stack, estimate) -> Breakdown:
    """One TP x EP rank's Breakdown (every rank holds the same shares: the widths must divide)."""
    from .corrections import device_overheads
    from .optimizers import trainable_tensors
    from .precision import compute_bytes

    check_ep(model, setup)
    if not stack.is_default:
        raise SpecError(f"--ep is modelled for transformers 5.24's expert parallelism, not transformers "
                        f"{stack.transformers}")
    rank, one = rank_model(model, setup.ep), rank_setup(setup)
    b = estimate(rank, one, gpu, corrections, stack, loss_model=model)
    N = setup.tokens
    # the MoE layers' extra saves: all of them to the loss, one recomputed layer with checkpointing
    layers = 1 if setup.checkpointing else model.moe.num_moe_layers
    extra_acts = int(moe_extra_per_token(model, setup) * N * layers)
    embed_grad, router_states = embedding_grad_extra_bytes(model, setup), router_state_extra_bytes(model, setup)
    comp = {c.name: c.bytes for c in b.components}
    step = comp.get("optimizer_step", 0)
    numel = sum(math.prod(shape) * count for shape, count in trainable_tensors(rank, one))
    largest = step * max(optimizer_groups(rank, one)) // max(numel, 1)
    peaks = {p: v + router_states for p, v in b.phase_peaks_bytes.items()}
    peaks["optimizer"] += embed_grad - (step - largest)
    if not setup.checkpointing:  # every MoE layer's saves are there from the loss on
        peaks["forward"] += extra_acts
    # with checkpointing only the recomputed layer's, which is not always the backward's peak: added
    # only when it adds (the single-GPU rank model counts its expert rows' inputs under LoRA too)
    bwd_extra = max(extra_acts, 0) if setup.checkpointing else extra_acts
    # the embedding's whole gradient appears at the end of the backward (from the first micro-batch on
    # with accumulation, in every phase)
    end = (comp.get("weights", 0) + comp.get("adapters", 0) + comp.get("optimizer_states", 0) + router_states
           + comp.get("gradients", 0) + embed_grad + compute_bytes(setup) * N * model.hidden_size)
    peaks["backward"] = max(peaks["backward"] + bwd_extra, end,
                            moe_backward_peak(model, setup, comp, router_states, extra_acts))
    if setup.grad_accum > 1:
        peaks["forward"] += embed_grad
        peaks["backward"] += embed_grad
    phase = max(peaks, key=lambda p: peaks[p])
    allocated, reserved, total, overheads = device_overheads(peaks[phase], setup.gpus, gpu, corrections)
    devices = {name: (n, note) for name, n, note in overheads}
    experts_note = f"{model.moe.num_experts // setup.ep} of {model.moe.num_experts} experts"
    comps = [c for c in b.components if c.name not in devices] + [
        Component("ep_router_states", router_states, ("forward", "backward", "optimizer"),
                  note="AdamW states of the replicated routers' other experts' rows") if router_states else None,
        Component("embedding_grad_replicated", embed_grad, ("backward", "optimizer") if setup.grad_accum == 1
                  else ("forward", "backward", "optimizer"),
                  note="the vocab-parallel embedding's gradient is a whole Replicate DTensor on every rank")
        if embed_grad else None,
        Component("ep_dispatch", extra_acts, ("forward", "backward"),
                  note="per MoE layer (" + ("one recomputed layer" if setup.checkpointing else "every MoE layer")
                  + "): the router over all experts and slots, AllToAllEP's sort and exchange indices")
        if extra_acts else None,
    ] + [Component(name, n, note=note or ("NCCL communicators (the TP/EP groups)" if name == "nccl" else ""))
         for name, (n, note) in devices.items()]
    comps = [dataclasses.replace(c, bytes=largest, note="foreach step transient (largest parameter group)")
             if c.name == "optimizer_step" else
             dataclasses.replace(c, note=f"this rank's 1/{setup.ep} tensor-parallel shard and {experts_note}")
             if c.name == "weights" else
             dataclasses.replace(c, note=f"saved for backward; the MoE layers' experts on "
                                 f"{model.moe.top_k}/{setup.ep} rows per token (balanced routing)")
             if c.name == "activations" else c for c in comps if c is not None]
    notes = (f"--ep {setup.ep}: per GPU, transformers' ep_plan puts {experts_note} on each rank and all-to-alls "
             f"the routed tokens to them (balanced routing assumed: {model.moe.top_k}/{setup.ep} rows per token "
             "per rank); the routers and norms are replicated, attention, embedding and head tensor-parallel "
             "(tp = ep)",) + b.notes
    return rank_breakdown(b, model, setup, comps, notes, peaks, phase, (allocated, reserved, total))


def optimizer_groups(rank: ModelSpec, setup: Setup) -> tuple[int, ...]:
    """Elements of each optimizer parameter group on one rank, as ``Trainer.create_optimizer`` splits
    its decay / no-decay groups by device mesh (vramplan/truths/tp_truth.py ``trainer_mesh_groups``):
    full fine-tuning, the TP mesh's weights (attention, embedding, head), the EP mesh's experts, the
    plain routers (decay) and the norms (no decay); LoRA, the sharded ``lora_B`` and the plain ``lora_A``."""
    from .tensor_parallel import optimizer_groups as tp_groups

    if setup.adapters:
        return tp_groups(rank, setup)
    other = dict(rank.other_params)
    dense = sum(l.count * l.weight_params for l in rank.linears) + other.get("embed_tokens", 0)
    norms = sum(n for name, n in rank.other_params if name not in ("embed_tokens", "experts", "router"))
    return dense, other.get("experts", 0), other.get("router", 0), norms


def comm_bytes_per_micro_step(model: ModelSpec, setup: Setup) -> float:
    """Bytes each EP rank sends and receives per micro-step through the MoE layers (0 without ``--ep``),
    beside the TP all-reduces (estimator/tensor_parallel.py): per MoE layer two all-to-alls of ``T k / ep``
    rows of ``hidden`` in the forward (dispatch, combine) and two in the backward, ``(ep-1)/ep`` of them
    leaving the rank under balanced routing, and the all-gather of the ``T / ep`` output rows over TP
    and its backward's reduce (``(ep-1)/ep`` of ``T x hidden`` each); the checkpointed layers run the
    forward's again."""
    from .precision import compute_bytes

    ep = setup.ep
    if ep <= 1 or model.moe is None:
        return 0.0
    c, T, h, k = compute_bytes(setup), setup.tokens, model.hidden_size, model.moe.top_k
    passes = 2 + (1 if setup.checkpointing else 0)
    per_layer = passes * (2 * T * k / ep * h * c + T * h * c) * (ep - 1) / ep
    return model.moe.num_moe_layers * per_layer
