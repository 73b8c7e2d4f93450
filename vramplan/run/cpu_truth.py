"""The truth for knobs fake tensors cannot run: a real training step on this CPU, counted live.

bitsandbytes' 4-bit and 8-bit layers and its optimizers run real kernels on CPU (bitsandbytes
0.50); fake tensors cannot run them. So :func:`run_step` builds a small model with random weights
from a shipped profile (fewer layers, narrower widths: :func:`shrink_config`), sets it up exactly
as the canonical step of docs/architecture.md says for the Setup, runs two steps and counts every
live tensor storage with :class:`vramplan.run.live.LiveTensorCounter`, as the tracer counts fake
ones. The estimate is then computed for the same small model, so a knob's estimate is checked
against what the real libraries allocate, not against another formula.

The setup, knob by knob:
- quantized bases: the bf16 model is saved to a temporary directory and reloaded with
  ``BitsAndBytesConfig`` (``load_in_4bit``, quant type nf4/fp4, double quant, compute dtype of
  the precision; or ``load_in_8bit`` for LLM.int8), then ``peft.prepare_model_for_kbit_training``
  (which upcasts every non-4-bit 16-bit parameter to fp32) and LoRA on all linear layers;
  the 4-bit ``quant_state`` tensors and LLM.int8's ``SCB`` row scales are counted with the weights;
- optimizers: torch AdamW foreach/fused and SGD (momentum 0.9, foreach), transformers' Adafactor,
  bitsandbytes ``AdamW8bit``, ``PagedAdamW8bit`` and ``Lion`` (32-bit states; torch has no Lion);
- paged optimizers: bitsandbytes falls back to ordinary tensors on CPU; on CUDA it allocates the
  states of parameters with at least 1e5 elements with ``cudaMallocManaged``, outside torch's
  allocator (``Optimizer8bit.get_state_buffer``). The run reports those bytes as ``paged_bytes``
  and leaves them out of the tensor peak, as ``torch.cuda.max_memory_allocated`` would;
- attention: eager runs the real code. SDPA and flash run the tracer's stand-in for CUDA's fused
  kernels (on CPU torch would pick its math kernel and keep s^2 scores), here computing the real
  output so that the values downstream are real; flash is that same stand-in (FlashAttention-2
  needs CUDA);
- the chunked loss: :func:`vramplan.run.chunked_loss.patch_chunked_loss` replaces the causal-LM
  loss with a chunked cross-entropy over the hidden states.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from dataclasses import dataclass

from ..specs import PHASES, Setup
from ..units import PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE

#: Parameters of at least this many elements get paged (managed) optimizer state on CUDA.
PAGED_MIN_NUMEL = 100_000

#: Optimizer choices that only bitsandbytes provides here.
BNB_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit", "lion")


@dataclass(frozen=True)
class CpuTruth:
    """Peaks of live tensor bytes in a real CPU run of a Setup (two steps)."""

    tensor_peak_bytes: int
    phase_peaks_bytes: dict[str, int]
    phase: str
    params_total: int
    params_trainable: int
    weights_bytes: int  # parameters, buffers and quantization state before the first step
    paged_bytes: int = 0  # optimizer state bitsandbytes would page on CUDA (outside tensor_peak)
    seconds: float = 0.0


def shrink_config(config: dict, *, layers: int = 2, hidden: int = 256, heads: int = 8, vocab: int = 4096,
                  experts: int = 4) -> dict:
    """A narrow copy of an HF config of the same family: ``layers`` layers, hidden ``hidden``,
    ``heads`` heads (the key/value heads keep their ratio), the MLP keeps its width ratio, MoE
    keeps ``experts`` experts (top-k capped at half of them). Narrow enough for a CPU step in a
    second, wide enough that every tensor a knob adds is a visible share of the peak."""
    from ..specs import truncate_config

    cfg = truncate_config(config, layers)
    gpt2 = "n_embd" in cfg
    h_key, a_key = ("n_embd", "n_head") if gpt2 else ("hidden_size", "num_attention_heads")
    old_h, old_a = int(cfg[h_key]), int(cfg[a_key])
    old_kv = int(cfg.get("num_key_value_heads") or old_a)
    cfg[h_key], cfg[a_key] = hidden, heads
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = max(1, heads * old_kv // old_a)
    if cfg.get("head_dim"):
        cfg["head_dim"] = hidden // heads
    for key in ("intermediate_size", "n_inner"):
        if cfg.get(key):
            cfg[key] = max(64, round(int(cfg[key]) * hidden / old_h / 64) * 64)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.get(key):
            cfg[key] = max(64, round(int(cfg[key]) * hidden / old_h / 64) * 64)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            cfg[key] = experts
    if cfg.get("num_experts_per_tok"):
        cfg["num_experts_per_tok"] = min(int(cfg["num_experts_per_tok"]), experts // 2)
    cfg["vocab_size"] = vocab
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int) and cfg[key] >= vocab:
            cfg[key] = vocab - 1
        elif isinstance(cfg.get(key), list):
            cfg[key] = [min(t, vocab - 1) for t in cfg[key]]
    return cfg


# ----------------------------------------------------------------------------------------------
# building the model as the Setup says


_SAVED: dict[str, str] = {}  # config JSON -> directory of its saved bf16 random weights


def _saved_dir(config: dict, dtype) -> str:
    """Random weights of ``config`` saved once per process (from_pretrained needs a checkpoint
    to quantize while loading)."""
    import torch
    import transformers

    from .models import hf_config

    key = json.dumps(config, sort_keys=True) + str(dtype)
    if key not in _SAVED:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(config, None), dtype=dtype)
        path = tempfile.mkdtemp(prefix="vramplan-cpu-truth-")
        model.save_pretrained(path)
        _SAVED[key] = path
    return _SAVED[key]


def build_model(config: dict, setup: Setup):
    """The model of ``setup``: bf16/fp16/fp32 weights (fp32 for mixed precision), or a
    bitsandbytes base prepared for k-bit training; LoRA adapters; checkpointing."""
    import torch
    import transformers

    from .models import adapt_for_training, attn_implementation, hf_config

    dtype = getattr(torch, PRECISION_WEIGHT_DTYPE[setup.precision])
    attn = attn_implementation(config, setup)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if setup.quant == "none":
        torch.manual_seed(0)
        hf_cfg = hf_config(config, None)
        hf_cfg.use_cache = False
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn)
    else:
        compute = getattr(torch, PRECISION_COMPUTE_DTYPE[setup.precision])
        if setup.quant == "int8":
            qcfg = transformers.BitsAndBytesConfig(load_in_8bit=True)
        else:
            qcfg = transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=setup.quant,
                bnb_4bit_use_double_quant=setup.double_quant, bnb_4bit_compute_dtype=compute)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            _saved_dir(config, dtype), quantization_config=qcfg, dtype=dtype, device_map="cpu",
            attn_implementation=attn, use_cache=False)
        import peft

        # checkpointing is adapt_for_training's (peft's would call the deprecated gradient_checkpointing_enable)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = adapt_for_training(model, setup)
    return model


def make_optimizer(setup: Setup, params, model=None):
    """The optimizer of ``setup`` (bitsandbytes for its 8-bit, paged and Lion choices). For an
    8-bit one, ``model``'s ``nn.Embedding`` weights get 32-bit states, as the HF Trainer registers
    them (``GlobalOptimManager.register_module_override``, transformers' ``create_optimizer``)."""
    if setup.optimizer not in BNB_OPTIMIZERS:
        from .models import torch_optimizer

        return torch_optimizer(setup, params)
    import warnings

    import bitsandbytes as bnb

    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    if setup.optimizer == "lion":
        return bnb.optim.Lion(params, lr=1e-5)
    cls = bnb.optim.AdamW8bit if setup.optimizer == "adamw-8bit" else bnb.optim.PagedAdamW8bit
    opt = cls(params, lr=1e-5)
    if model is not None:
        import torch

        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return opt


def quant_state_tensors(model) -> list:
    """Tensors bitsandbytes keeps beside its quantized weights, which are not parameters or
    buffers: a 4-bit weight's ``quant_state`` (absmax, code, offset and the nested state of
    double quantization) and LLM.int8's per-row scales ``SCB``."""
    import torch

    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            out += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
            qs = getattr(qs, "state2", None)
        scb = getattr(p, "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    return out


# ----------------------------------------------------------------------------------------------
# attention kernels as CUDA runs them


def _flash_real():
    import torch
    import torch.nn.functional as F

    from .real_paths import efficient_attn_bias

    orig = F.scaled_dot_product_attention

    class FlashReal(torch.autograd.Function):
        """CUDA's fused SDPA kernels' memory (the tracer's stand-in: q, k, v, the output, a fp32
        logsumexp and the additive mask made of a bool one, if any, are saved; backward allocates
        dq, dk, dv) with the real output computed, so that what follows sees real values."""

        @staticmethod
        def forward(ctx, q, k, v, mask, is_causal, scale):
            b, a, s, _ = q.shape
            with torch.no_grad():
                res = orig(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
                           enable_gqa=k.shape[1] != a)
            out = q.new_empty(b, s, a, v.shape[-1]).transpose(1, 2)
            out.copy_(res)
            del res
            lse = q.new_empty(b, a, s, dtype=torch.float32)
            # the memory-efficient kernel keeps the additive mask torch converts the bool one into
            bias = [] if mask is None else [efficient_attn_bias(mask, q, k)]
            ctx.save_for_backward(q, k, v, out, lse, *bias)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None

    return FlashReal, orig


@contextlib.contextmanager
def cuda_kernels():
    """SDPA takes the stand-in of CUDA's flash / memory-efficient kernels (see the module
    docstring); everything else runs the real code."""
    import torch
    import torch.nn.functional as F

    from .real_paths import autocast_inputs

    flash, orig = _flash_real()

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.dim() == 4 and (attn_mask is None or attn_mask.dtype == torch.bool):
            query, key, value = autocast_inputs(query, key, value)
            return flash.apply(query, key, value, attn_mask, is_causal, scale)
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    restore = int8_as_on_cuda()
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
        restore()


def int8_as_on_cuda():
    """In training, bitsandbytes runs LLM.int8 on CPU as dequantize-then-matmul
    (``MatMul8bitFp``, which keeps a dequantized fp32 copy of the weight in the forward); on CUDA
    it runs ``MatMul8bitLt`` (int8 matmul with fp16 outlier decomposition). Make ``bnb.matmul``
    take the CUDA path, whose kernels have CPU implementations. Returns the undo function."""
    try:
        import bitsandbytes as bnb
        from bitsandbytes.autograd import _functions as fn
    except ImportError:  # pragma: no cover - the extra is not installed
        return lambda: None
    orig = bnb.matmul

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or fn.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return fn.MatMul8bitLt.apply(A, B, out, bias, state)

    bnb.matmul = matmul
    return lambda: setattr(bnb, "matmul", orig)


# ----------------------------------------------------------------------------------------------
# the step


def run_step(config: dict, setup: Setup, steps: int = 2) -> CpuTruth:
    """Run ``steps`` canonical steps of ``setup`` on the model of ``config`` on this CPU and
    return the peaks of live tensor bytes per phase (see the module docstring)."""
    import torch

    from .chunked_loss import patch_chunked_loss
    from .live import LiveTensorCounter

    t0 = time.perf_counter()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # MatMul8bitLt's fp16-cast notice
    torch.manual_seed(0)
    model = build_model(config, setup)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt = make_optimizer(setup, trainable, model)
    counter = LiveTensorCounter(device="cpu")
    counter.track(model, quant_state_tensors(model))
    counter.track(list(getattr(opt, "name2qmap", {}).values()))
    weights = counter.current_bytes
    vocab = int(config.get("vocab_size"))
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (setup.batch, setup.seq), generator=gen)
    batch = {"input_ids": input_ids, "labels": input_ids}
    if setup.pad_mask:
        from .real_paths import padding_mask

        batch["attention_mask"] = padding_mask(setup.batch, setup.seq)
    counter.track(list(batch.values()))
    compute = getattr(torch, PRECISION_COMPUTE_DTYPE[setup.precision])
    mixed = setup.precision.endswith("-mixed")
    per_step: list[dict[str, int]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_kernels())
        if setup.loss == "chunked":
            stack.enter_context(patch_chunked_loss(model))
        stack.enter_context(counter)
        for _step in range(steps):
            counter.reset_peak()
            for _micro in range(setup.grad_accum):
                counter.phase("forward")
                with torch.autocast("cpu", dtype=compute) if mixed else contextlib.nullcontext():
                    loss = model(**batch).loss
                if setup.grad_accum > 1:
                    loss = loss / setup.grad_accum
                counter.phase("backward")
                loss.backward()
                del loss
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            counter.phase(None)
            per_step.append(dict(counter.phase_peaks))
    # paged states exist from the first optimizer step on; on CUDA bitsandbytes pages state1 and
    # state2 (get_state_buffer) of every large parameter, whatever their dtype: uint8 for 8-bit
    # AdamW, fp32 for the embeddings the Trainer keeps 32-bit. Read off the real states.
    paged = 0
    if setup.optimizer == "paged-adamw-8bit":
        for p in trainable:
            state = opt.state.get(p, {}) if p.numel() >= PAGED_MIN_NUMEL else {}
            paged += sum(state[k].numel() * state[k].element_size() for k in ("state1", "state2") if k in state)
    phase_peaks = {}
    for ph in PHASES:
        vals = []
        for i, peaks in enumerate(per_step):
            if ph in peaks:
                after_first_step = i > 0 or ph == "optimizer"
                vals.append(peaks[ph] - (paged if after_first_step else 0))
        phase_peaks[ph] = max(vals)
    phase = max(PHASES, key=lambda p: phase_peaks[p])
    return CpuTruth(
        tensor_peak_bytes=phase_peaks[phase], phase_peaks_bytes=phase_peaks, phase=phase,
        params_total=sum(p.numel() for p in params), params_trainable=sum(p.numel() for p in trainable),
        weights_bytes=weights, paged_bytes=paged, seconds=time.perf_counter() - t0)
