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

from ..model.modelspec import shrink_config  # noqa: F401  (re-exported)
from ..run.cuda_paths import cuda_kernels, int8_as_on_cuda, quant_state_tensors  # noqa: F401  (re-exported)
from ..specs import PHASES, Setup
from ..util.units import PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE

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


# ----------------------------------------------------------------------------------------------
# building the model as the Setup says


_SAVED: dict[str, str] = {}  # config JSON -> directory of its saved bf16 random weights


def _saved_dir(config: dict, dtype) -> str:
    """Random weights of ``config`` saved once per process (from_pretrained needs a checkpoint
    to quantize while loading)."""
    import torch
    import transformers

    from ..run.models import hf_config

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
    from ..run.models import adapt_for_training

    return adapt_for_training(load_base(config, setup), setup)


def load_base(config: dict, setup: Setup):
    """The base of ``setup`` before any adapter: bf16/fp16/fp32 weights, or a bitsandbytes base,
    prepared for k-bit training (peft's ``prepare_model_for_kbit_training``, its fp32 upcast) when
    the framework does that (``--framework hf``: setup/frameworks.py); TRL, axolotl and
    LLaMA-Factory leave it as loaded."""
    import torch
    import transformers

    from ..run.models import attn_implementation, hf_config

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
        from ..setup.frameworks import framework

        if framework(setup.framework).kbit_upcast:
            import peft

            # checkpointing is adapt_for_training's (peft's would call the deprecated gradient_checkpointing_enable)
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def make_optimizer(setup: Setup, params, model=None):
    """The optimizer of ``setup`` (bitsandbytes for its 8-bit, paged and Lion choices). For an
    8-bit one, ``model``'s ``nn.Embedding`` weights get 32-bit states, as the HF Trainer registers
    them (``GlobalOptimManager.register_module_override``, transformers' ``create_optimizer``)."""
    if setup.optimizer not in BNB_OPTIMIZERS:
        from ..run.models import torch_optimizer

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


# ----------------------------------------------------------------------------------------------
# the step


def run_step(config: dict, setup: Setup, steps: int = 2) -> CpuTruth:
    """Run ``steps`` canonical steps of ``setup`` on the model of ``config`` on this CPU and
    return the peaks of live tensor bytes per phase (see the module docstring)."""
    import torch

    from ..run.chunked_loss import patch_chunked_loss
    from ..run.live import LiveTensorCounter

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
        from ..run.real_paths import padding_mask

        batch["attention_mask"] = padding_mask(setup.batch, setup.seq)
    counter.track(list(batch.values()))
    compute = getattr(torch, PRECISION_COMPUTE_DTYPE[setup.precision])
    mixed = setup.precision.endswith("-mixed")
    per_step: list[dict[str, int]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_kernels())
        if setup.loss == "chunked":
            stack.enter_context(patch_chunked_loss(model))
        if setup.liger:  # the tracer's stand-ins for Liger's Triton kernels (vramplan/run/liger.py)
            from ..run.liger import patch_liger

            stack.enter_context(patch_liger(model))
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
