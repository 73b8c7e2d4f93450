"""The truth of ``--framework torchtune``: torchtune 0.6.1's own single-device step on this CPU, counted live.

torchtune runs its own model (``torchtune.modules.TransformerDecoder``), not transformers'. This runs
the step of ``recipes/lora_finetune_single_device.py`` (LoRA, QLoRA) and
``recipes/full_finetune_single_device.py`` as their configs run it, assembled from the recipe's own
code: the model built by torchtune's component builders (``lora_llama3_1``, ``llama3_2``, ``qwen2``,
``mistral``, ...) under ``training.set_default_dtype(bf16)`` (no autocast), ``set_trainable_params`` on
``get_adapter_params``, ``training.set_activation_checkpointing(model,
auto_wrap_policy={TransformerSelfAttentionLayer})`` (non-reentrant ``checkpoint_wrapper``),
``CEWithChunkedOutputLoss`` with ``model.set_num_output_chunks``, the labels shifted with the ignore
index (``_loss_step``), ``loss * num_tokens`` back-propagated, ``training.scale_grads``, the optimizer's
step and ``zero_grad(set_to_none=True)``; ``optimizer_in_bwd`` with
``training.register_optim_in_bwd_hooks``. QLoRA's base is torchao's ``NF4Tensor`` (``to_nf4``: blocks of
64, scalers per 256 blocks), counted through its inner tensors.

The model is the HF config narrowed by ``shrink_config`` mapped onto torchtune's builder of that family;
the estimate is computed for the same narrow config. SDPA takes the stand-in of CUDA's fused kernels
(vramplan/run/cuda_paths.py: on the CPU torch's math kernel would keep s^2 scores).

Importable anywhere (torch and torchtune are imported inside the functions); runs only where torchtune
0.6.1 and a torchao with ``torchao.dtypes.nf4tensor`` import (it cannot be installed beside peft 0.21:
a venv sharing the system torch, ``VRAMPLAN_TORCHTUNE_PYTHON``). :func:`torchtune_rows` runs the cases
there in a subprocess, or returns one unverified row saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from ..specs import PHASES, Setup

__all__ = ["CASES", "TorchtuneTruth", "builder_kwargs", "run_step", "torchtune_python", "torchtune_rows"]

#: torchtune's names of the LoRA targets (vramplan's HF names -> torchtune's)
_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj"}
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TorchtuneTruth:
    """Peaks of live tensor bytes in torchtune's step (two steps; the worst of each phase)."""

    tensor_peak_bytes: int
    phase_peaks_bytes: dict[str, int]
    phase: str
    params_total: int
    params_trainable: int
    weights_bytes: int  # the model's parameters and buffers (NF4's inner tensors included)
    seconds: float


def builder_kwargs(config: dict, setup: Setup) -> tuple[str, dict]:
    """(torchtune builder function name, its keyword arguments) for an HF ``config`` and ``setup``."""
    mt = config.get("model_type")
    h, a = int(config["hidden_size"]), int(config["num_attention_heads"])
    kw = dict(vocab_size=int(config["vocab_size"]), num_layers=int(config["num_hidden_layers"]), num_heads=a,
              num_kv_heads=int(config.get("num_key_value_heads") or a), embed_dim=h,
              intermediate_dim=int(config["intermediate_size"]),
              max_seq_len=max(setup.seq, int(config.get("max_position_embeddings") or 0)),
              norm_eps=float(config.get("rms_norm_eps", 1e-5)))
    tied = bool(config.get("tie_word_embeddings", False))
    scaling = config.get("rope_scaling") or {}
    if mt == "llama" and scaling.get("rope_type", scaling.get("type")) == "llama3":
        name = "llama3_2" if tied else "llama3_1"
        kw["scale_factor"] = int(scaling.get("factor", 8))
        kw["rope_base"] = int(config.get("rope_theta", 500_000))
        if tied:
            kw["tie_word_embeddings"] = True
    elif mt == "llama" and not tied:
        name = "llama3"
        kw["rope_base"] = int(config.get("rope_theta", 500_000))
    elif mt == "qwen2":
        name = "qwen2"
        kw["rope_base"] = float(config.get("rope_theta", 1_000_000.0))
        kw["tie_word_embeddings"] = tied
    elif mt == "mistral":
        name = "mistral"
        kw["rope_base"] = int(config.get("rope_theta", 10_000))
    else:
        raise ValueError(f"no torchtune builder modelled for model_type {mt!r}")
    if setup.method == "full":
        return name, kw
    every = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # all-linear: every Linear but the head
    named = every if setup.lora_targets in ("", "all-linear") else setup.lora_targets
    targets = [t.strip() for t in named.split(",")]
    kw.update(lora_attn_modules=[_ATTN[t] for t in targets if t in _ATTN],
              apply_lora_to_mlp=any(t in _MLP for t in targets),
              apply_lora_to_output="lm_head" in targets, lora_rank=setup.lora_rank,
              lora_alpha=float(setup.lora_alpha or 2 * setup.lora_rank), lora_dropout=setup.lora_dropout)
    if setup.method == "qlora":
        kw["quantize_base"] = True
    return "lora_" + name, kw


def _build(config: dict, setup: Setup):
    import importlib

    import torch
    from torchtune import training

    name, kw = builder_kwargs(config, setup)
    family = name.removeprefix("lora_")
    mod = importlib.import_module(f"torchtune.models.{family}._component_builders")
    with training.set_default_dtype(getattr(torch, "bfloat16" if setup.precision == "bf16" else "float32")):
        model = getattr(mod, name)(**kw)
    return model


def _nf4_inner(model) -> list:
    """The inner tensors of every torchao NF4Tensor parameter (its quantized data, scalers, ...)."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    inner = []
    for p in model.parameters():
        if isinstance(p, NF4Tensor):
            names, _ = p.__tensor_flatten__()
            inner += [getattr(p, n) for n in names]
    return inner


def _counter():
    """The live counter, blind to NF4Tensor wrappers (their ``untyped_storage`` is a bf16-sized stand-in):
    their inner tensors are what is counted."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    from ..run.live import LiveTensorCounter

    class _Counter(LiveTensorCounter):
        def _track(self, tensor):
            return None if isinstance(tensor, NF4Tensor) else super()._track(tensor)

    return _Counter(device="cpu")


def _optimizer(setup: Setup, params):
    import torch

    if setup.optimizer == "adamw-fused":
        return lambda ps: torch.optim.AdamW(ps, lr=3e-4, fused=True)
    if setup.optimizer == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=3e-4)
    if setup.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=3e-4)
    if setup.optimizer in ("paged-adamw-8bit", "adamw-8bit"):
        import warnings

        import bitsandbytes as bnb

        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        cls = bnb.optim.PagedAdamW8bit if setup.optimizer == "paged-adamw-8bit" else bnb.optim.AdamW8bit
        return lambda ps: cls(ps, lr=3e-4)
    raise ValueError(f"optimizer {setup.optimizer!r} is not one torchtune's configs name")


def run_step(config: dict, setup: Setup, steps: int = 2) -> TorchtuneTruth:
    """``steps`` steps of torchtune's single-device recipe (see the module docstring) on ``config``."""
    import torch
    from torchtune import modules, training
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from ..run.cuda_paths import cuda_kernels

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = _build(config, setup)
    if setup.adapters:
        adapter = get_adapter_params(model)
        set_trainable_params(model, adapter)
        training.validate_expected_param_dtype(adapter.items(), dtype=next(iter(adapter.values())).dtype)
    if setup.checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    make = _optimizer(setup, trainable)
    in_bwd = setup.optimizer_in_backward
    if in_bwd:  # recipes/full_finetune_single_device.py _setup_optimizer
        optim_dict = {p: make([p]) for p in trainable}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        opts = list(optim_dict.values())
    else:
        opts = [make(trainable)]
    counter = _counter()
    counter.track(model, _nf4_inner(model))
    weights = counter.current_bytes
    gen = torch.Generator().manual_seed(1)
    vocab = int(config["vocab_size"])
    tokens = torch.randint(0, vocab, (setup.batch, setup.seq), generator=gen)
    ignore = torch.full((setup.batch, 1), loss_fn.ignore_index)
    counter.track(tokens, ignore)
    per_step: list[dict[str, int]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_kernels())
        stack.enter_context(counter)
        for _step in range(steps):
            counter.reset_peak()
            num_tokens = 0
            for _micro in range(setup.grad_accum):
                counter.phase("forward")
                labels = tokens.clone()
                current_num_tokens = (labels != loss_fn.ignore_index).sum()
                num_tokens += current_num_tokens
                # _loss_step
                logits = model(tokens)
                labels = torch.hstack((labels[..., 1:], ignore))
                loss = loss_fn(logits, labels)
                del logits
                current_loss = loss * current_num_tokens
                del loss
                counter.phase("backward")
                current_loss.backward()
                del current_loss
            counter.phase("optimizer")
            if not in_bwd:
                training.scale_grads(model, 1 / num_tokens)
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            counter.phase(None)
            per_step.append(dict(counter.phase_peaks))
    # bitsandbytes' paged states are managed memory on CUDA (outside torch's allocator, vramplan's
    # paged_optimizer_states): on the CPU ordinary tensors, taken out of the peaks they are in (cpu_truth.py)
    paged = 0
    if setup.optimizer == "paged-adamw-8bit":
        from .cpu_truth import PAGED_MIN_NUMEL

        for opt in opts:
            for p, state in opt.state.items():
                if p.numel() >= PAGED_MIN_NUMEL:
                    paged += sum(state[k].numel() * state[k].element_size() for k in ("state1", "state2")
                                 if k in state)
        per_step = per_step[1:]  # the states exist from the first step on
    phase_peaks = {ph: max(p.get(ph, 0) for p in per_step) - paged for ph in PHASES}
    phase = max(PHASES, key=lambda p: phase_peaks[p])
    params = list(model.parameters())
    return TorchtuneTruth(
        tensor_peak_bytes=phase_peaks[phase], phase_peaks_bytes=phase_peaks, phase=phase,
        params_total=sum(p.numel() for p in params), params_trainable=sum(p.numel() for p in trainable),
        weights_bytes=weights, seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# the validate rows

#: The narrow CPU model (validate's DEEP_SHRINK widths, 4 layers) and the cases: the recipes' defaults
#: (LoRA on q/v/output_proj and the MLP, rank 8 / 64), QLoRA, full fine-tuning, with and without
#: checkpointing, seq 256-1024, batch 1-2; full with the 8-bit paged AdamW in backward (its config's default).
SHRINK = {"layers": 4, "hidden": 256, "heads": 16, "vocab": 2048}
_TT_LORA = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
_T = Setup(framework="torchtune", precision="bf16", optimizer="adamw-fused", seq=512, batch=2)
CASES: tuple[tuple[str, Setup], ...] = tuple(
    (m, _T.replace(**kw)) for m, kw in (
        ("meta-llama/Llama-3.2-1B", {"method": "lora", "lora_targets": _TT_LORA, "lora_rank": 64}),
        ("meta-llama/Llama-3.2-1B", {"method": "lora", "lora_targets": _TT_LORA, "checkpointing": True}),
        ("meta-llama/Llama-3.2-1B", {"method": "qlora", "lora_targets": _TT_LORA, "seq": 1024, "batch": 1}),
        ("meta-llama/Llama-3.2-1B", {"method": "qlora", "lora_targets": _TT_LORA, "checkpointing": True}),
        ("meta-llama/Llama-3.2-1B", {"seq": 256}),
        ("meta-llama/Llama-3.2-1B", {"seq": 256, "checkpointing": True}),
        ("meta-llama/Llama-3.1-8B", {"method": "qlora", "lora_targets": _TT_LORA, "checkpointing": True}),
        ("meta-llama/Llama-3.1-8B", {"method": "lora", "lora_targets": _TT_LORA, "seq": 1024, "batch": 1}),
        ("meta-llama/Llama-3.1-8B", {"seq": 256, "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True,
                                     "checkpointing": True, "batch": 1, "grad_accum": 1}),
        ("Qwen/Qwen2.5-7B", {"method": "lora", "lora_targets": _TT_LORA}),
        ("Qwen/Qwen2.5-7B", {"seq": 256, "checkpointing": True}),
        ("mistralai/Mistral-7B-v0.1", {"method": "qlora", "lora_targets": _TT_LORA}),
        # the LoRA configs accumulate 8 micro-batches (the gradients live from the first on)
        ("meta-llama/Llama-3.2-1B", {"method": "lora", "lora_targets": _TT_LORA, "checkpointing": True,
                                     "grad_accum": 2, "seq": 1024, "batch": 1}),
        ("Qwen/Qwen2.5-7B", {"seq": 256, "grad_accum": 2}),
        ("meta-llama/Llama-3.2-1B", {"seq": 256, "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True}),
        ("mistralai/Mistral-7B-v0.1", {"method": "lora", "optimizer": "adamw", "seq": 256}),
        ("Qwen/Qwen2.5-7B", {"method": "lora", "lora_targets": _TT_LORA, "checkpointing": True, "seq": 1024,
                             "batch": 1}),
        # Llama 2 (one kv head per query head) and Llama 3 (a RoPE module per layer in their LoRA builders)
        ("meta-llama/Llama-2-7b-hf", {"method": "lora", "lora_targets": _TT_LORA, "checkpointing": True}),
        ("meta-llama/Meta-Llama-3-8B", {"method": "qlora", "lora_targets": _TT_LORA, "batch": 1}),
        # bitsandbytes' 8-bit AdamW (not paged) on the adapters
        ("meta-llama/Llama-3.2-1B", {"method": "lora", "lora_targets": _TT_LORA, "lora_rank": 64,
                                     "checkpointing": True, "optimizer": "adamw-8bit"}),
    ))
#: ``validate --quick`` (CI, well under a minute): one LoRA step with checkpointing (about 15 s with torchtune's import)
QUICK = (CASES[1],)


def narrow_config(model_name: str) -> dict:
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model

    return shrink_config(load_model(model_name).config, **SHRINK)


def torchtune_python() -> str | None:
    """A Python that imports torchtune (this one, or ``VRAMPLAN_TORCHTUNE_PYTHON``: a venv sharing this torch, e.g.
    ``python -m venv /tmp/vtt --system-site-packages && /tmp/vtt/bin/pip install torchtune==0.6.1 torchao==0.14.1``),
    or None."""
    with contextlib.suppress(ImportError, Exception):
        import torchtune  # noqa: F401

        return sys.executable
    for cand in (os.environ.get("VRAMPLAN_TORCHTUNE_PYTHON"),):
        probe = [cand, "-c", "import torchtune, torchao.dtypes.nf4tensor"] if cand and shutil.which(cand) else None
        if probe and subprocess.run(probe, capture_output=True, timeout=300).returncode == 0:
            return cand
    return None


def _truth_json(cases) -> list[dict]:
    return [asdict(run_step(narrow_config(m), s)) for m, s in cases]


def run_cases(cases, python: str | None = None) -> list[TorchtuneTruth]:
    """Each case's truth, run in ``python`` (a subprocess when it is not this one)."""
    python = python or torchtune_python()
    if python is None:
        raise RuntimeError("torchtune 0.6.1 is not importable (set VRAMPLAN_TORCHTUNE_PYTHON)")
    if python == sys.executable:
        return [run_step(narrow_config(m), s) for m, s in cases]
    payload = json.dumps([[m, s.to_dict()] for m, s in cases])
    code = ("import json,sys; from vramplan.specs import Setup; "
            "from vramplan.truths.torchtune_truth import _truth_json; "
            "cases=[(m, Setup.from_dict(d)) for m, d in json.loads(sys.stdin.read())];"
            "print(json.dumps(_truth_json(cases)))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([python, "-c", code], input=payload, capture_output=True, text=True, env=env, check=True)
    return [TorchtuneTruth(**d) for d in json.loads(out.stdout.strip().splitlines()[-1])]


def torchtune_rows(quick: bool, row_type) -> list:
    """``validate --knob framework``'s torchtune rows (``row_type``: validate.accuracy.Row): tensor peak and
    the weights of each case; one unverified row when no Python here imports torchtune."""
    from ..estimator import estimate
    from ..model.architecture import model_spec_from_config

    cases = QUICK if quick else CASES
    python = torchtune_python()
    if python is None:
        return [row_type("-", "-", cases[0][1], 0, 0, "-", "-", truth="none", knob="framework", verified=False,
                         why="torchtune 0.6.1 is not importable here (it cannot be installed beside peft 0.21: "
                             "a venv sharing this torch, VRAMPLAN_TORCHTUNE_PYTHON)")]
    truths = run_cases(cases, python)
    rows = []
    for (m, s), t in zip(cases, truths, strict=True):
        spec = model_spec_from_config(narrow_config(m), name=f"{m}[narrow]")
        e = estimate(spec, s)
        rows.append(row_type(m, spec.family, s, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase,
                             truth="torchtune-cpu", knob="framework"))
        rows.append(row_type(m, spec.family, s, t.weights_bytes, e.component("weights") + e.component("adapters"),
                             "-", "-", truth="torchtune-cpu", knob="framework", quantity="weights_bytes"))
    return rows


def main() -> None:  # pragma: no cover - the reproduce command (docs/frameworks.md)
    """``python -m vramplan.truths.torchtune_truth`` in a Python that imports torchtune: every case's
    truth and estimate (tensor peak, each phase, the loaded weights)."""
    from ..estimator import estimate
    from ..model.architecture import model_spec_from_config

    for m, s in CASES:
        t = run_step(narrow_config(m), s)
        e = estimate(model_spec_from_config(narrow_config(m), name=f"{m}[narrow]"), s)
        phases = " ".join(f"{p} {e.phase_peaks_bytes[p] / t.phase_peaks_bytes[p] - 1:+.2%}" for p in PHASES)
        w = (e.component("weights") + e.component("adapters")) / t.weights_bytes - 1
        print(f"{m:28s} {s.method:5s} ck={int(s.checkpointing)} seq={s.seq} b={s.batch} ga={s.grad_accum} "
              f"{s.optimizer}{' in-bwd' if s.optimizer_in_backward else ''}: truth {t.tensor_peak_bytes:,} "
              f"estimate {e.tensor_peak_bytes:,} ({e.tensor_peak_bytes / t.tensor_peak_bytes - 1:+.2%}; {phases}; "
              f"weights {w:+.3%})", flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
