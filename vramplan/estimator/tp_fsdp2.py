"""Tensor parallelism combined with FSDP2 sharding (``--tp T --fsdp full_shard|shard_grad_op
--fsdp-version 2 --gpus T*D``): one rank's share, as transformers 5.24 and accelerate 1.15 run it.

transformers 5.24 loads the model onto a 2-D mesh itself: ``from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto", tp_size=T, fsdp_size=D))``
(``distributed/utils.initialize_distributed_mesh``: mesh ``("pp", "dp_replicate", "fsdp", "tp")``,
tp innermost) applies the TP plan over the ``tp`` sub-mesh
(``distributed/tensor_parallel.apply_tensor_parallelism``, estimator/tensor_parallel.py) and then
``fully_shard`` over the ``fsdp`` sub-mesh (``distributed/fsdp.apply_fully_sharded_data_parallelism``
with ``PreTrainedConfig.base_model_fsdp_plan``: every decoder layer and an untied embedding
``free_full_weight``, the final norm with the head (tied: the embedding) one ``keep_full_weight``
group, the root last: accelerate's FSDP2 groups, estimator/fsdp2.py). ``fully_shard`` on a
TP-sharded DTensor shards the TP-local tensor's dim 0 once more (torch 2.13
``FSDPParam._init_sharded_param``), and its all-gather returns the TP-local tensor: so each rank
holds FSDP2's state of :func:`vramplan.estimator.tensor_parallel.rank_model` over ``D`` ranks,
and the loss sees the full vocabulary (the head's ``colwise_gather_output``). No
``MixedPrecisionPolicy`` (``fsdp_mixed_precision`` is off) and no fp32 upcast: the HF Trainer
builds ``ParallelismConfig(tp_size=T, dp_shard_size=D)`` from the model's ``distributed_config``
(``Trainer._build_accelerator_args``), and accelerate's ``prepare`` finds every
parameter a DTensor. Read off the real ``T x D`` gloo run (vramplan/truths/tp_fsdp2.py,
``validate --knob tp``).

What does not run is refused here, each with why:

- LoRA: peft 0.21 wraps the Linears after the load, when ``fully_shard`` has already sharded them.
  ``tuners_utils._get_in_out_features`` takes the full width only for a mesh named ``fsdp`` alone;
  on the ``(fsdp, tp)`` DTensor it reads the local tensor, FSDP's chunk of the TP shard, so
  ``lora_B`` is built with ``out / (T*D)`` rows and ``add_lora_tp_hooks_dtensor`` wraps it as a
  ``Shard(0)`` DTensor over the tp mesh of global ``out`` (``out / T`` rows per rank expected): the
  first forward fails in transformers' ``tp_forward`` (``RuntimeError: shape '[1, 64, 32]' is
  invalid for input of size 1024`` on the tiny Llama; run on 4 gloo ranks and pinned by
  tests/test_tp_lora.py; transformers 5.24's fsdp.py marks PEFT under its FSDP "TODO").
- accelerate's own FSDP2 preparation of a TP model (``distributed_type: FSDP``): accelerate 1.15's
  ``Accelerator._prepare_tp`` imports ``ReplicateParallel`` from
  ``transformers.integrations.tensor_parallel``, which transformers 5.24 no longer has
  (``ImportError``); the plan emits the multi-GPU accelerate config with the parallelism fields.
- ``--fsdp-version 1``, hybrid sharding (``dp_replicate``), one data-parallel rank (``gpus == tp``
  is ``--tp`` alone), and a ``gpus`` that ``tp`` does not divide.

Gradient accumulation runs, but not as FSDP2's: every micro-batch reduce-scatters, and the gradient
shards are what is held between micro-batches (:func:`accumulated_grad_bytes`).
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup, SpecError


def combined(setup: Setup) -> bool:
    """Whether ``setup`` asks for tensor parallelism beside FSDP sharding."""
    return setup.tp > 1 and setup.fsdp != "none"


def dp_shard(setup: Setup) -> int:
    """The FSDP2 shard group's size: ``gpus / tp`` (accelerate's ``dp_shard_size``)."""
    return setup.gpus // setup.tp if combined(setup) else 1


def check_tp_fsdp2(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a TP x FSDP combination no truth runs (the module docstring says why)."""
    if not combined(setup):
        return
    tp = setup.tp
    why = None
    if setup.fsdp_version != 2:
        why = "--tp with FSDP1 is not modelled (transformers 5.24 shards a TP model with FSDP2); use --fsdp-version 2"
    elif setup.fsdp != "full_shard":
        why = (f"--tp with --fsdp {setup.fsdp}: transformers 5.24 shards a TP model with its base_model_fsdp_plan "
               "(every layer reshard_after_forward=True, no DistributedConfig field for another mode); "
               "use --fsdp full_shard")
    elif setup.gpus % tp or setup.gpus // tp < 2:
        why = (f"--tp {tp} with FSDP2 on --gpus {setup.gpus}: the GPUs must be tp x dp_shard with dp_shard >= 2 "
               f"(--gpus {2 * tp}, {4 * tp}, ...)")
    elif getattr(setup, "dp_replicate", 1) > 1:
        why = "--tp with hybrid sharding (dp_replicate, a 3-D mesh) is not modelled yet"
    elif setup.adapters:
        why = ("--tp with FSDP2 and LoRA fails in peft 0.21: transformers 5.24 fully_shards the Linears at load, "
               "peft's _get_in_out_features then reads the (fsdp, tp) shard's width, so lora_B gets out/(tp*dp_shard) "
               "rows where the TP forward wants out/tp (RuntimeError: shape ... is invalid, in the first forward); "
               "use --fsdp none with --gpus equal to --tp, or full fine-tuning")
    if why:
        raise SpecError(why)


def rank_setup(setup: Setup) -> Setup:
    """The setup one rank runs: FSDP2 over its dp_shard group, no tensor parallelism beside it
    (the model is :func:`tensor_parallel.rank_model`'s), one micro-batch: accumulation holds the
    gradient shards instead (:func:`accumulated_grad_bytes`)."""
    return setup.replace(tp=1, gpus=dp_shard(setup), grad_accum=1)


def accumulated_grad_bytes(model: ModelSpec, setup: Setup, grad_shard_bytes: int) -> int:
    """What gradient accumulation adds to a micro-batch's forward and backward (0 without it):
    the gradient shards of the micro-batches before, ``grad_shard_bytes``, and a tied embedding's
    second gradient (:func:`tied_head_grad_bytes`). accelerate 1.15's ``Accelerator.no_sync`` is a
    ``nullcontext`` for transformers' FSDP2 model under the multi-GPU state (not ``is_fsdp2``, and
    an ``FSDPModule`` has no DDP ``no_sync``), so every micro-batch reduce-scatters into the
    sharded ``.grad``: no unsharded accumulation (FSDP2's ``set_requires_gradient_sync(False)``
    path, estimator/fsdp2.py ``accum_grads``). Read off the 4-rank run: +69 952 bytes, exactly
    these, on the forward and the backward peaks of the tiny Llama-3.2 at ``--grad-accum 2``."""
    if not combined(setup) or setup.grad_accum <= 1:
        return 0
    return grad_shard_bytes + tied_head_grad_bytes(model, setup)


def tied_head_copy_bytes(model: ModelSpec, setup: Setup) -> int:
    """A tied head's gathered copy of the embedding (0 otherwise), one TP-local ``vocab / tp x
    hidden`` matrix in the load dtype. transformers 5.24 ties ``lm_head.weight`` to
    ``embed_tokens.weight`` after ``fully_shard`` (``modeling_utils._finalize_model_loading``), so
    FSDP2 does not know the head shares it (``FSDPParam._module_info.shared_modules`` is empty, read
    off the run): its pre-forward swaps in the unsharded weight on ``embed_tokens`` only, the head's
    ``F.linear`` meets the sharded 2-D DTensor and DTensor all-gathers it over the ``fsdp`` dim, and
    the matmul saves that copy for its backward: live from the head's forward to its backward."""
    from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE

    if not combined(setup) or not model.tie_word_embeddings:
        return 0
    w = int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])
    return -(-model.vocab_size // setup.tp) * model.hidden_size * w  # rank 0's (the fullest) vocabulary rows


def tied_head_grad_bytes(model: ModelSpec, setup: Setup) -> int:
    """The second gradient of a tied embedding's shard (0 otherwise): the head's DTensor all-gather
    (:func:`tied_head_copy_bytes`) backpropagates into the sharded parameter's ``.grad`` directly
    (``ceil(vocab / tp / dp_shard)`` rows), beside the gradient FSDP2's reduce-scatter writes into
    its flat tail output, which the norm's gradient keeps alive: both are there at the optimizer
    step (read off the run: ``bf16[8192]`` beside the tail's ``bf16[8224]`` on the tiny Llama-3.2)."""
    copy = tied_head_copy_bytes(model, setup)
    rows = -(-model.vocab_size // setup.tp)
    return -(-rows // dp_shard(setup)) * copy // rows if copy else 0


def with_tied_head_copy(model: ModelSpec, setup: Setup, peaks: dict[str, int], held: int = 0) -> dict[str, int]:
    """``peaks`` with :func:`tied_head_copy_bytes` at the loss and at the backward's start (the
    head's backward frees it; a backward peak inside the layers would not hold it, so there it
    overcounts by that copy: the truth's backward peaks are all at the start), the tied shard's
    second gradient (:func:`tied_head_grad_bytes`) at the optimizer step, and ``held`` (the
    accumulated gradients, :func:`accumulated_grad_bytes`) in the forward and the backward."""
    copy, grad = tied_head_copy_bytes(model, setup), tied_head_grad_bytes(model, setup)
    extra = {"forward": copy + held, "backward": copy + held, "optimizer": grad}
    return {p: b + extra.get(p, 0) for p, b in peaks.items()}


def combined_note(setup: Setup) -> str:
    """What the weights' note adds beside FSDP2 ('' otherwise)."""
    if not combined(setup):
        return ""
    return f", FSDP2-sharded over its {dp_shard(setup)} dp_shard ranks (transformers' load-time fully_shard)"
