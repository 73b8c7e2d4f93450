"""Preference and RL objectives as TRL 1.16 runs them: DPO (DPOTrainer), KTO (KTOTrainer), GRPO
(GRPOTrainer), and ORPO (ORPOTrainer, whose loss is in estimator/objectives_pref.py).

What the SFT step of estimator/step.py becomes under each objective (read off trl 1.16.0), and the
SFT step's own loss under ``--loss trl`` (SFTTrainer: the fused head below, :func:`check_trl_sft`):

- Both trainers score tokens through TRL's fused LM head (``trl/trainer/utils.py``
  ``add_fused_lm_head`` -> ``trl/kernels/chunked_logprob.py`` ``ChunkedLogProbFunction``): no
  (tokens, vocab) logits. The head projects ``TOKEN_CHUNK_SIZE`` (4096) tokens x
  ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768) vocabulary columns at a time into one compute-dtype
  buffer, folds each tile into fp32 online-logsumexp statistics, saves the head input, and in
  backward recomputes each tile and accumulates fp32 gradients of the hidden states (and, full
  fine-tuning, of the head weight). On CUDA (Triton) only scored positions enter the head
  (``compact``) and the fold is a kernel; elsewhere every position enters and the fold runs as torch
  ops on fp32 copies of the tile (``_forward_tile`` / ``_backward_tile``): ``Stack.trl_triton``.
- DPO (``DPOTrainer._compute_loss``): chosen and rejected rows concatenated in one batch (2 x
  ``per_device_train_batch_size`` rows of at most ``max_length``), the policy forward, then the
  reference forward under ``torch.no_grad`` while the policy's activations are alive: a frozen copy
  (its weights for the whole run), the adapter (handed a PeftModel, TRL adds a frozen "ref" copy of
  its adapter and runs it with ``use_adapter("ref")``: :func:`reference_adapter_bytes`), or
  ``precompute_ref_log_probs`` (nothing at train time but that "ref" adapter with LoRA).
- KTO (``trl/trainer/kto_trainer.py`` ``KTOTrainer._compute_loss``, promoted out of experimental):
  ``per_device_train_batch_size`` unpaired rows of at most ``max_length`` (no ``max_prompt_length``),
  desirable or not by their ``label``, and the KL batch (``loss_type="kto"``: the completions rotated
  by one row within the micro-batch, ``add_kl_completion_ids``): first the KL rows through the
  policy under ``torch.no_grad`` (``_compute_kl_logps``: the ``kl`` phase, nothing of the policy's
  forward alive yet), the policy forward, then the reference's KL and main forwards under no_grad
  while the policy's activations are alive (a frozen copy, peft's adapter-disabled base, or
  ``precompute_ref_log_probs``: both reference forwards precomputed; the policy's KL one stays).
  TRL refuses a micro-batch of one row with the KL term.
- ORPO (``trl/experimental/orpo/orpo_trainer.py``): chosen and rejected rows in one forward, no
  reference, the model's own logits: estimator/objectives_pref.py.
- GRPO (``GRPOTrainer._generate_and_score_completions`` / ``_compute_loss``): HF ``generate`` over the
  process's generation batch (``per_device_train_batch_size x steps_per_generation``, which defaults
  to ``gradient_accumulation_steps``) with a DynamicCache, then (``beta != 0``; the 1.16 default is
  0.0: no reference model; a PeftModel's reference is TRL's frozen "ref" copy of its adapter, as in
  DPO) the reference log-probs in chunks of the micro-batch, then the policy
  forward/backward over micro-batches of (prompt + completion) rows scoring only the completion
  (``logits_to_keep``). With ``num_iterations=1`` and ``steps_per_generation == grad_accum`` the old
  log-probs are the detached current ones (no extra forward).
- vLLM (``--generation vllm-colocate``): vLLM does not run here; its share is its documented
  arithmetic: the engine claims ``gpu_memory_utilization`` x the card's total memory (weights, KV
  cache, activations) for the whole run (TRL's default ``vllm_enable_sleep_mode=False``), so the
  trainer's peak must fit beside it. ``vllm-server``: generation on other GPUs, nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..setup.checks import check_trl_loss
from ..specs import PHASES, Component, GpuSpec, ModelSpec, Setup
from ..util.errors import SpecError
from .activations import global_bytes_per_token
from .lora import adapted_linears
from .model_states import weights_bytes
from .objectives_pref import orpo_loss_transients, orpo_notes, orpo_rows
from .precision import adapter_dtype_bytes, compute_bytes
from .stack import DEFAULT_STACK, Stack

#: the TRL version these terms are read off
TRL_VERSION = "1.16"
#: trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE; trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
HEAD_TOKEN_CHUNK = 4096
HEAD_VOCAB_CHUNK = 32768
#: GRPOConfig.max_completion_length's default (used when neither length is given)
GRPO_DEFAULT_COMPLETION = 512
#: the phases an objective adds to forward/backward/optimizer, in step order
OBJECTIVE_PHASES = {"dpo": ("reference",), "kto": ("kl", "reference"), "orpo": (), "grpo": ("generation", "reference")}
#: the trainer of each objective (notes)
TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "grpo": "GRPOTrainer"}
#: objectives not modelled, refused with their line (all of OBJECTIVES are modelled in TRL 1.16)
NOT_MODELLED_OBJECTIVES: dict[str, str] = {}


@dataclass(frozen=True)
class Lengths:
    """Token counts of one objective's micro-step."""

    rows: int  # rows of the policy forward (DPO: 2 x batch)
    row_len: int  # tokens per row
    prompt: int
    completion: int
    scored: int  # positions the fused head scores per micro-batch
    gen_rows: int = 0  # GRPO: rows HF generate runs at once


def lengths(setup: Setup, stack: Stack = DEFAULT_STACK) -> Lengths:
    """Rows and lengths. ``batch`` is pairs per micro-batch for DPO, prompts per micro-batch for GRPO
    (per_device_train_batch_size = batch x num_generations completions, whole groups, so the
    generation batch always divides by num_generations as GRPOConfig requires). DPO: ``seq`` is
    DPOConfig.max_length (prompt + completion, truncated); with both ``max_prompt_length`` and
    ``max_completion_length`` the rows are at most their sum. GRPO: a
    row is prompt + completion: the completion is ``max_completion_length`` (GRPOConfig's 512 when
    neither is given, at most half of ``seq``), the prompt ``max_prompt_length`` or the rest of ``seq``."""
    P, C = setup.max_prompt_length, setup.max_completion_length
    if setup.objective == "sft":  # loss trl: SFTTrainer scores every next-token label (labels = input_ids)
        return Lengths(setup.batch, setup.seq, 0, setup.seq - 1, setup.batch * (setup.seq - 1))
    if setup.objective == "orpo":  # the model's logits over every position (estimator/objectives_pref.py)
        rows, row_len = orpo_rows(setup)
        completion = min(max(C if C else (row_len - P if P else row_len - 1), 1), row_len - 1)
        return Lengths(rows, row_len, row_len - completion, completion, rows * (row_len - 1))
    if setup.objective in ("dpo", "kto"):  # KTO: batch unpaired rows (and as many KL rows)
        row_len = min(setup.seq, P + C) if P and C else setup.seq
        rows = 2 * setup.batch if setup.objective == "dpo" else setup.batch
        # compact (Triton): the completion positions are scored; a 0 length reads as the upper bound
        completion = C if C else (row_len - P if P else row_len - 1)
        completion = min(max(completion, 1), row_len - 1)
        scored = rows * (completion if stack.trl_triton else row_len - 1)
        return Lengths(rows, row_len, row_len - completion, completion, scored)
    if not C:
        C = setup.seq - P if P else min(GRPO_DEFAULT_COMPLETION, setup.seq // 2)
    if not P:
        P = setup.seq - C
    rows = setup.batch * setup.num_generations  # per_device_train_batch_size: completions, whole groups
    scored = rows * (C if stack.trl_triton else P + C - 1)
    return Lengths(rows, P + C, P, C, scored, gen_rows=rows * setup.grad_accum)


def check_objective(model: ModelSpec, setup: Setup, gpu: GpuSpec | None) -> None:
    """SpecError for what these terms do not model (one line each)."""
    o = setup.objective
    if o in NOT_MODELLED_OBJECTIVES:
        raise SpecError(NOT_MODELLED_OBJECTIVES[o] + " (--objective)")
    flag = f"--objective {o}"
    if setup.gpus > 1 or setup.zero_stage or setup.fsdp != "none":
        raise SpecError(f"{flag} is modelled on one GPU without ZeRO/FSDP (the reference model's sharding is not "
                        "modelled yet)")
    if model.moe is not None:
        raise SpecError(f"{flag} on an MoE model is not modelled yet (TRL adds the router's aux loss)")
    if setup.liger:
        raise SpecError(f"{flag} with Liger kernels is not modelled yet (TRL patches its own fused head)")
    if setup.loss not in ("hf", "trl"):
        head = "the model's logits" if o == "orpo" else "TRL's fused log-prob head"
        raise SpecError(f"{flag} scores tokens with {head}: --loss chunked applies to SFT")
    if o == "orpo" and setup.ref_model not in ("auto", "none"):
        raise SpecError("ORPO has no reference model (ORPOTrainer): ref_model auto or none")
    if o == "kto" and setup.ref_model == "none":
        raise SpecError("KTO needs a reference model: ref_model auto, copy, adapter or precomputed")
    if o == "kto" and setup.batch < 2:
        raise SpecError("--objective kto needs --batch 2 or more: TRL's KTOTrainer refuses a one-row micro-batch "
                        "with its KL term (per_device_train_batch_size > 1)")
    if setup.quant in ("gptq", "awq"):
        raise SpecError(f"{flag} on a GPTQ/AWQ base is not modelled yet")
    if setup.precision.endswith("-mixed"):
        raise SpecError(f"{flag} is modelled with 16-bit or fp32 weights without autocast; use --precision bf16")
    if o == "grpo" and setup.generation == "vllm-colocate" and gpu is None:
        raise SpecError("--generation vllm-colocate reserves a share of the card: give --gpu")
    lens = lengths(setup)
    if lens.prompt < 1 or lens.completion < 1:
        raise SpecError(f"{flag}: prompt ({lens.prompt}) and completion ({lens.completion}) need a token each; "
                        "raise --seq")


def reference(setup: Setup) -> str:
    """The reference model TRL uses: copy | adapter | precomputed | none. ``auto``: DPO's default
    (peft's adapter-disabled base with adapters, a frozen copy otherwise); GRPO's default beta=0: none."""
    if setup.ref_model != "auto":
        return setup.ref_model
    if setup.objective in ("grpo", "orpo"):
        return "none"
    return "adapter" if setup.adapters else "copy"


def policy_setup(setup: Setup, stack: Stack = DEFAULT_STACK) -> Setup:
    """The Setup of the policy's forward/backward (rows and row length of the micro-step)."""
    lens = lengths(setup, stack)
    return setup.replace(batch=lens.rows, seq=lens.row_len, max_prompt_length=0, max_completion_length=0)


# ----------------------------------------------------------------------------------------------
# the fused head


def head_buffer_bytes(model: ModelSpec, setup: Setup, scored: int) -> int:
    """``mm_buf``: (min(N, 4096), 32768) in the compute dtype, whatever the vocabulary."""
    return min(scored, HEAD_TOKEN_CHUNK) * HEAD_VOCAB_CHUNK * compute_bytes(setup)


def _tile_fp32(model: ModelSpec, setup: Setup, scored: int) -> int:
    """One fp32 tile of the torch fold (no Triton): (min(N, 4096), min(V, 32768))."""
    return min(scored, HEAD_TOKEN_CHUNK) * min(model.vocab_size, HEAD_VOCAB_CHUNK) * 4


#: fp32 tiles alive at once in the torch fold (no Triton): forward ``tile.float()``, ``z``,
#: ``z - m`` and ``exp``; backward ``y``, ``z``, ``log_p``, ``p``, ``grad``, the target mask as float and
#: ``is_target - p`` (read off the ops of ``_backward_tile``)
TORCH_FOLD_TILES = {"forward": 3, "backward": 7}


def head_terms(model: ModelSpec, setup: Setup, scored: int, grad: bool,
               stack: Stack = DEFAULT_STACK) -> tuple[int, int]:
    """(forward, backward) transient bytes of the fused head over ``scored`` positions: the buffer,
    seven fp32 statistics per position and (no Triton) the fold's fp32 tiles; in backward the fp32
    gradient of the head input, its cast, the recomputation buffer, and (head trainable) the fp32
    gradient of the head weight with its cast."""
    c, h, V = compute_bytes(setup), model.hidden_size, model.vocab_size
    buf = head_buffer_bytes(model, setup, scored)
    tiles = 0 if stack.trl_triton else _tile_fp32(model, setup, scored)
    forward = buf + 7 * 4 * scored + TORCH_FOLD_TILES["forward"] * tiles
    if not grad:
        return forward, 0
    head_w = 4 * V * h if setup.method == "full" else 0  # its cast replaces the fp32 one (read off the trace)
    # a soft-capped head (Gemma 2): the fold's backward keeps ``tanh``'s output for its derivative, one fp32
    # tile more (read off ``_backward_tile``); the Triton kernel computes it in registers
    fold_bwd = TORCH_FOLD_TILES["backward"] + (1 if model.traits.final_logit_softcapping else 0)
    backward = buf + (4 + c) * scored * h + head_w + fold_bwd * tiles
    return forward, backward


def saved_per_token(model: ModelSpec, setup: Setup) -> float:
    """Saved outside the decoder layers per token: as SFT's, with the fused head's saved input in
    place of the fp32 log-probs (estimator/activations.py with the chunked loss's head input)."""
    return global_bytes_per_token(model, setup.replace(loss="chunked", liger=False))


def loss_transients(model: ModelSpec, setup: Setup, stack: Stack = DEFAULT_STACK) -> tuple[int, int, int]:
    """(forward, backward, saved) for the policy's micro-step: ``setup`` is the user's Setup."""
    lens = lengths(setup, stack)
    pol = policy_setup(setup, stack)
    if setup.objective == "orpo":
        return orpo_loss_transients(model, pol, lens.rows, lens.row_len, stack)
    fwd, bwd = head_terms(model, pol, lens.scored, grad=True, stack=stack)
    # the head's inputs: TRL's int64 labels of every row, and the copy of the head input the head
    # saves (Triton: ``hidden_states[mask]``, the scored positions; else the reshape of the shifted slice)
    saved = int(saved_per_token(model, pol) * lens.rows * lens.row_len) + 8 * lens.rows * lens.row_len
    saved += compute_bytes(pol) * lens.scored * model.hidden_size
    return fwd, bwd, saved


def check_trl_sft(model: ModelSpec, setup: Setup) -> list[str]:
    """``--loss trl`` on an SFT step: TRL 1.16 ``SFTTrainer.__init__`` always calls
    ``add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))`` and ``compute_loss``
    runs ``model(**inputs, fused_lm_head=True)``: the head of :func:`head_terms` over every
    next-token label. ``use_liger_kernel``: TRL sets ``fused_linear_cross_entropy=False`` (it raises
    when asked for it), so ``--liger`` with ``--loss trl`` is Liger's RMSNorm/SwiGLU/RoPE and TRL's head.
    SpecError for what is not modelled; the notes otherwise."""
    if setup.objective != "sft" or setup.loss != "trl":
        return []
    check_trl_loss(setup)
    notes = [f"loss trl: TRL {TRL_VERSION} SFTTrainer's fused LM head (trl/trainer/utils.py add_fused_lm_head, "
             f"trl/kernels/chunked_logprob.py): {HEAD_TOKEN_CHUNK} x {HEAD_VOCAB_CHUNK} tiles, no N x V logits"]
    if setup.liger:
        notes.append("liger with loss trl: Liger's RMSNorm/SwiGLU/RoPE only; TRL turns its fused linear "
                     "cross-entropy off (liger_kernel_config fused_linear_cross_entropy=False)")
    if setup.zero_stage == 3 or setup.fsdp != "none":
        notes.append("loss trl under ZeRO-3/FSDP: the head weight TRL gathers for its fused head "
                     "(maybe_gather_lm_head_ctx / DTensor.full_tensor) is counted only as the sharding's "
                     "gathered units")
    return notes


# ----------------------------------------------------------------------------------------------
# the reference and generation phases


def nograd_layer_bytes(model: ModelSpec, setup: Setup, tokens: int) -> int:
    """The peak inside one decoder layer's forward under no_grad, over its input: the normed input,
    and the MLP's gate, up and activation outputs (c (3 i + 2 h) per token; the attention side is
    narrower for the families modelled)."""
    c, h, i = compute_bytes(setup), model.hidden_size, model.intermediate_size
    width = 3 * i if model.mlp_kind == "gated" else 2 * i
    return c * tokens * (width + 2 * h)


def reference_layer_bytes(model: ModelSpec, setup: Setup, tokens: int) -> int:
    """As :func:`nograd_layer_bytes` with the adapters on (DPO/KTO/GRPO's "ref" adapter, KTO's KL rows
    through the policy, GRPO's prefill in HF ``generate``: every no-grad forward through a LoRA
    layer): at an adapted MLP input projection (out = intermediate) peft's
    ``result + lora_B(lora_A(x)) * scaling`` holds the base output (c) and lora_B's output and its
    scaled copy (adapter dtype, 2 a) beside the gate's activation (gated MLPs, c), the layer's input,
    the residual and the normed input (3 c h) and the copy of that input peft casts to the adapter
    dtype (``_cast_input_dtype``, a h); under no_grad nothing else of the layer is kept (read off the
    traced DPO/KTO reference and KL forwards, 2-layer Qwen2.5-7B at 16k tokens: within 0.1 %; GRPO's
    prefill against TRL's CPU run: within 0.4 %). Not the training forward's LoRA peak
    (estimator/transients.py ``lora_forward_peak_per_token``, what the layer saved for backward
    before the projection): under no_grad nothing is saved."""
    plain = nograd_layer_bytes(model, setup, tokens)
    c, a, h, i = compute_bytes(setup), adapter_dtype_bytes(setup), model.hidden_size, model.intermediate_size
    if not any(l.role != "attn" and l.out_features == i for l in adapted_linears(model, setup)):
        return plain
    gate = c * i if model.mlp_kind == "gated" else 0
    cast = a * h if a != c else 0  # peft casts the projection's input to the adapter dtype (_cast_input_dtype)
    return int(max(plain, tokens * (gate + c * i + 2 * a * i + 3 * c * h + cast)))


def kv_cache_bytes(model: ModelSpec, setup: Setup, rows: int, tokens: int) -> int:
    """transformers' DynamicCache: keys and values of every layer, (rows, kv heads, tokens, head dim)."""
    return 2 * model.num_layers * rows * model.num_kv_heads * tokens * model.head_dim * compute_bytes(setup)


def reference_forward_bytes(model: ModelSpec, pol: Setup, lens: Lengths, stack: Stack = DEFAULT_STACK,
                            adapted: bool = False) -> int:
    """The reference's no-grad forward over one micro-batch, beyond what was alive before it: one
    layer's transient beside its input (``adapted``: with LoRA adapters active, the policy's own or
    TRL's "ref" copy of them), then the fused head (no gradient) beside the head input."""
    c, h, tokens = compute_bytes(pol), model.hidden_size, lens.rows * lens.row_len
    head, _ = head_terms(model, pol, lens.scored, grad=False, stack=stack)
    layer = reference_layer_bytes(model, pol, tokens) if adapted else nograd_layer_bytes(model, pol, tokens)
    return int(max(layer + c * tokens * h, head + c * lens.scored * h))


@dataclass(frozen=True)
class ObjectiveMemory:
    """What an objective adds to the step: resting weights, its phases' peaks, components, notes."""

    ref_weights: int
    phases: dict[str, int]  # extra phases -> peak bytes
    components: tuple[Component, ...]
    notes: tuple[str, ...]


def objective_memory(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, resting: int, after_forward: int,
                     stack: Stack = DEFAULT_STACK, adapters: int = 0, accum_grads: int = 0) -> ObjectiveMemory:
    """The reference and generation phases. ``resting``: the model states alive between steps
    (weights, adapters, optimizer states); ``after_forward``: the policy's peak-free live bytes at the
    end of its forward (resting states plus saved activations); ``adapters``: the policy's adapter
    bytes (DPO/KTO's "ref" adapter copies them, :func:`reference_adapter_bytes`); ``accum_grads``: the
    gradients kept across micro-batches (grad_accum > 1), alive in DPO/KTO's phases from the second
    micro-batch on (GRPO generates and scores before the first: none)."""
    lens = lengths(setup, stack)
    pol = policy_setup(setup, stack)
    ref = reference(setup)
    c, h = compute_bytes(pol), model.hidden_size
    if setup.objective in ("dpo", "kto"):
        resting, after_forward = resting + accum_grads, after_forward + accum_grads
    ref_w = weights_bytes(model, setup) if ref == "copy" else 0  # the base as loaded (quantized or not)
    ref_w += reference_adapter_bytes(setup, adapters)
    speed = "speed: the policy's rows, the reference forward and GRPO's generation (vramplan/cost/objectives.py)"
    if setup.objective == "orpo":
        return ObjectiveMemory(0, {}, (), (*orpo_notes(setup, lens.rows, lens.row_len), speed))
    notes = [f"objective {setup.objective}: TRL {TRL_VERSION} ({TRAINERS[setup.objective]}), "
             f"{lens.rows} rows x {lens.row_len} tokens per micro-batch, reference: {ref}; {speed}"]
    comps: list[Component] = []
    phases: dict[str, int] = {}
    if ref == "copy":
        comps.append(Component("reference_weights", ref_w, phases_of(setup),
                               note="frozen copy of the base (TRL ref_model)"))
    elif ref_w:
        comps.append(Component("reference_adapter", ref_w, phases_of(setup),
                               note=f"TRL's frozen 'ref' copy of the LoRA adapter "
                                    f"({TRAINERS[setup.objective]}.__init__ add_adapter on a PeftModel)"))
    if setup.objective == "kto":  # the KL rows through the policy before its forward
        kl_fwd = reference_forward_bytes(model, pol, lens, stack, adapted=bool(setup.adapters))
        phases["kl"] = int(resting + ref_w + kl_fwd)
        comps.append(Component("kl_forward", int(kl_fwd), ("kl",),
                               note="no-grad forward of the KL rows through the policy (KTOTrainer._compute_kl_logps)"))
    if setup.objective in ("dpo", "kto"):
        if ref != "precomputed":
            ref_fwd = reference_forward_bytes(model, pol, lens, stack, adapted=ref == "adapter")
            phases["reference"] = int(after_forward + ref_w + ref_fwd + 4 * lens.scored)
            comps.append(Component("reference_forward", int(ref_fwd), ("reference",),
                                   note="no-grad forward: one layer's activations, then the fused head"))
        else:
            notes.append("reference log-probs precomputed before training (precompute_ref_log_probs): no reference "
                         "at train time")
        return ObjectiveMemory(ref_w, phases, tuple(comps), tuple(notes))
    # GRPO: generation, then the reference log-probs, then the policy's micro-steps
    if setup.generation == "hf":
        T = lens.row_len
        kv = kv_cache_bytes(model, pol, lens.gen_rows, T)
        kv_layer = kv // model.num_layers
        prompt_tokens = lens.gen_rows * lens.prompt
        # the prefill: a no-grad forward over the prompts with the policy's adapters on
        prefill = reference_layer_bytes(model, pol, prompt_tokens) + c * prompt_tokens * h
        decode = kv_layer + 4 * lens.gen_rows * model.vocab_size * 3  # cache growth (torch.cat) and fp32 sampling
        phases["generation"] = int(resting + ref_w + max(kv_cache_bytes(model, pol, lens.gen_rows, lens.prompt)
                                                         + prefill, kv + decode))
        comps.append(Component("kv_cache", kv, ("generation",),
                               note=f"HF generate DynamicCache: {lens.gen_rows} rows x {T} tokens"))
    elif setup.generation == "vllm-colocate":
        share = int(setup.vllm_memory_fraction * gpu.usable_memory_bytes)
        comps.append(Component("vllm_reserved", share, phases_of(setup),
                               note=f"vLLM gpu_memory_utilization {setup.vllm_memory_fraction} x the card (vLLM's "
                                    "documented arithmetic, not run here; sleep mode off)"))
        phases["generation"] = int(resting + ref_w)
        notes.append(f"vLLM colocated: {setup.vllm_memory_fraction:.0%} of the card is vLLM's for the whole run "
                     "(vllm_gpu_memory_utilization; TRL's vllm_enable_sleep_mode=False); from vLLM's documented "
                     "arithmetic, vLLM does not run here")
    else:
        phases["generation"] = int(resting + ref_w)
        notes.append("vLLM server: generation runs on other GPUs; nothing of it on the training GPU")
    if ref != "none":  # "adapter": a PeftModel's "ref" adapter active (use_adapter), as in DPO/KTO
        ref_fwd = reference_forward_bytes(model, pol, lens, stack, adapted=ref == "adapter" and bool(setup.adapters))
        phases["reference"] = int(resting + ref_w + ref_fwd + 4 * lens.gen_rows * lens.completion)
        comps.append(Component("reference_forward", int(ref_fwd), ("reference",),
                               note="no-grad forward per micro-batch (beta != 0)"))
    return ObjectiveMemory(ref_w, phases, tuple(comps), tuple(notes))


def reference_adapter_bytes(setup: Setup, adapters: int) -> int:
    """DPO/KTO/GRPO with peft's adapter as the reference: TRL 1.16 ``DPOTrainer.__init__`` /
    ``KTOTrainer.__init__``, handed a PeftModel and no ref_model, ``add_adapter("ref", ...)`` and copy
    the policy's adapter into it (the reference forward runs it with ``use_adapter("ref")``): one
    frozen copy of the adapter bytes, whether or not the reference log-probs are precomputed (the
    ``__init__`` branch does not look at ``precompute_ref_log_probs``). ``GRPOTrainer.__init__`` does
    the same for a PeftModel when ``beta != 0`` (trl/trainer/grpo_trainer.py: ``elif is_peft_model(model)
    and args.beta != 0.0: ... model.add_adapter("ref", default_config)``, each ``.ref.`` parameter
    ``copy_`` of its ``.default.`` one; ``_generate_and_score_completions`` runs the reference under
    ``use_adapter(model, adapter_name="ref")``). (Given ``peft_config`` instead, TRL wraps the model
    itself and adds no copy: the base with adapters disabled; vramplan's train.py and truths hand a
    PeftModel.)"""
    if setup.objective not in ("dpo", "kto", "grpo") or not setup.adapters:
        return 0
    if reference(setup) not in ("adapter", "precomputed"):
        return 0
    return adapters


def phases_of(setup: Setup) -> tuple[str, ...]:
    """The phases of a step of ``setup``'s objective, in step order (SFT: PHASES)."""
    extra = OBJECTIVE_PHASES.get(setup.objective, ())
    ref = reference(setup) if extra else "none"
    extra = tuple(p for p in extra if p != "reference" or ref not in ("none", "precomputed"))
    return (*extra, *PHASES)


def with_objective_phases(setup: Setup, comps: tuple[Component, ...]) -> tuple[Component, ...]:
    """The SFT step's components in the objective's phases too: DPO's reference forward runs while
    everything of the policy's forward is alive; GRPO's generation and reference precede the
    policy's step, so only what lives through the whole step is there."""
    extra = tuple(p for p in phases_of(setup) if p not in PHASES)
    if not extra:
        return comps
    out = []
    for c in comps:
        if set(c.phases) >= set(PHASES) or (setup.objective in ("dpo", "kto") and "forward" in c.phases):
            add = extra if set(c.phases) >= set(PHASES) else ("reference",)
            c = replace(c, phases=(*(p for p in add if p not in c.phases), *c.phases))
        out.append(c)
    return tuple(out)


def vllm_share_bytes(setup: Setup, gpu: GpuSpec | None) -> int:
    """The card vLLM colocated claims (0 otherwise): added to the device total, outside torch's
    tensors of the trainer."""
    if setup.objective != "grpo" or setup.generation != "vllm-colocate" or gpu is None:
        return 0
    return int(setup.vllm_memory_fraction * gpu.usable_memory_bytes)


def vllm_room_note(setup: Setup, gpu: GpuSpec | None, trainer_total: int) -> list[str]:
    """vLLM colocated: the largest ``vllm_gpu_memory_utilization`` the trainer leaves room for
    (``trainer_total``: the device total without vLLM's share), the card's split as a number."""
    if setup.objective != "grpo" or setup.generation != "vllm-colocate" or gpu is None:
        return []
    room = (gpu.usable_memory_bytes - trainer_total) / gpu.usable_memory_bytes
    if room <= 0:
        return ["vLLM colocated: the trainer alone does not fit the card; no share is left for vLLM"]
    return [f"vLLM colocated: the trainer's peak leaves up to {room:.0%} of the card for vLLM "
            f"(--vllm-memory-fraction {int(room * 20) / 20:.2f} or less; {setup.vllm_memory_fraction:.2f} asked)"]

