"""The truth of a layer split: transformers' real placement of the model built on the meta device.

``real_device_map`` builds the CausalLM of a config as ``from_pretrained`` does before it loads
weights (``cls(config)`` under ``init_empty_weights`` in the load dtype; for a bitsandbytes base,
``hf_quantizer.preprocess_model`` swaps the Linears for ``Linear4bit``/``Linear8bitLt``) and calls
transformers 5.24's ``_get_device_map`` (integrations/accelerate.py: ``get_balanced_memory`` /
``get_max_memory``, the quantizer's ``adjust_max_memory`` and ``infer_auto_device_map``) with the
max_memory the estimate assumed, plus the CPU. The meta device needs no GPU and no weights: a 70B
model's placement takes about a second. Compared with ``vramplan.estimator.layer_split.place``
layer by layer (``vramplan validate --knob device_map``).
"""

from __future__ import annotations

import logging

from ..run.models import hf_config, require_torch
from ..specs import Setup

#: host RAM offered to the placement, so what fits on no GPU shows as "cpu" (not "disk")
CPU_BYTES = 2**50


def _quantizer(setup: Setup):
    if setup.quant not in ("nf4", "fp4", "int8"):
        return None
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    if setup.quant == "int8":
        cfg = BitsAndBytesConfig(load_in_8bit=True)
    else:
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=setup.quant,
                                 bnb_4bit_use_double_quant=setup.double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoHfQuantizer.from_config(cfg, pre_quantized=False)


def meta_model(config: dict, setup: Setup):
    """The model on the meta device as from_pretrained has it at ``_get_device_map``; and its quantizer."""
    require_torch()
    import torch
    import transformers
    from accelerate import init_empty_weights

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    cfg = hf_config(config, None)
    quantizer = _quantizer(setup)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # accelerate's get_max_memory warns of each GPU index this CPU machine lacks; the placement
    # only reads the budget given for it
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        if quantizer is not None:
            quantizer.preprocess_model(model=model, dtype=dtype, device_map="auto", checkpoint_files=None,
                                       use_kernels=False)
    return model, quantizer


def real_device_map(config: dict, setup: Setup, max_memory: tuple[int, ...] | dict,
                    cpu: bool = True) -> dict[str, int | str]:
    """transformers' device_map for ``setup.device_map`` over GPUs with ``max_memory`` bytes free
    (or the ``max_memory`` mapping itself, as from_pretrained gets it); ``cpu``: offer the host's
    RAM too (what fits on no GPU then shows as "cpu"; without it, "disk")."""
    from transformers.integrations import accelerate as hf_accelerate

    model, quantizer = meta_model(config, setup)
    budget = dict(max_memory) if isinstance(max_memory, dict) else {i: int(m) for i, m in enumerate(max_memory)}
    if cpu:
        budget["cpu"] = CPU_BYTES
    if quantizer is not None:  # validate_environment wants CUDA; the placement does not
        quantizer.validate_environment = lambda *a, **k: None
    return dict(hf_accelerate._get_device_map(model, setup.device_map, budget, quantizer))


def layer_devices(device_map: dict[str, int | str], num_layers: int) -> tuple[int | str, ...]:
    """The device of each decoder layer in a (cleaned) device_map."""
    def device(name: str):
        best, depth = None, -1
        for mod, dev in device_map.items():
            if (mod == "" or name == mod or name.startswith(mod + ".")) and len(mod) > depth:
                best, depth = dev, len(mod)
        return best
    return tuple(device(f"model.layers.{i}") for i in range(num_layers))


def placed_bytes(config: dict, setup: Setup, device_map: dict[str, int | str]) -> dict[int | str, int]:
    """The load-time bytes transformers counts on each device of ``device_map``
    (``compute_module_sizes`` with the quantizer's element sizes)."""
    from transformers.integrations import accelerate as hf_accelerate

    model, quantizer = meta_model(config, setup)
    sizes, _ = hf_accelerate.compute_module_sizes(model, quantizer, only_modules=False)
    out: dict[int | str, int] = {}
    for name, dev in device_map.items():
        out[dev] = out.get(dev, 0) + int(sizes[name])
    return out


#: (model, setup, GPU) of the validate matrix: the 70B QLoRA split of the issue, dense LoRA and
#: full fine-tuning splits over 2-4 cards, a tied-embedding model, each strategy
CASES = (
    ("meta-llama/Llama-3.1-70B", dict(method="qlora", checkpointing=True), 2, "rtx-3090"),
    ("meta-llama/Llama-3.1-70B", dict(method="qlora"), 4, "rtx-4090"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora"), 2, "rtx-3090"),
    ("meta-llama/Llama-3.1-8B", dict(method="full"), 4, "a100-80gb"),
    ("Qwen/Qwen2.5-7B", dict(method="lora", quant="int8"), 3, "rtx-4090"),
    ("meta-llama/Llama-3.2-1B", dict(method="lora"), 2, "rtx-3090"),
)


#: (model, setup, GPUs, GPU) of the per-GPU traced step: tied and untied heads, LoRA with and
#: without checkpointing, full fine-tuning, 2 and 3 GPUs
TRACE_CASES = (
    ("meta-llama/Llama-3.2-1B", dict(method="lora", seq=512), 2, "rtx-3090"),
    ("meta-llama/Llama-3.2-1B", dict(method="lora", seq=2048, batch=2), 2, "rtx-3090"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", seq=256), 2, "a100-80gb"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", seq=256, checkpointing=True), 2, "a100-80gb"),
    ("meta-llama/Llama-3.1-8B", dict(method="full", seq=256), 2, "a100-80gb"),
    ("Qwen/Qwen2.5-7B", dict(method="lora", seq=1024), 3, "rtx-4090"),
    ("google/gemma-2b", dict(method="full", seq=1024), 2, "rtx-4090"),
)


def traced_rows(quick: bool = False) -> list:
    """validate rows of ``device_map``'s memory: each GPU's tensor peak against the per-GPU
    traced step (vramplan/truths/layer_split_trace.py) under transformers' real device_map."""
    from ..estimator import estimate
    from ..estimator.corrections import DEFAULT_CORRECTIONS
    from ..estimator.layer_split import free_memory_bytes
    from ..model.profiles import load_model
    from ..setup.inputs import resolve_gpu
    from .layer_split_trace import traced_rank_peaks

    rows = []
    for name, kw, gpus, gpu_name in TRACE_CASES[:1] if quick else TRACE_CASES:
        model, gpu = load_model(name), resolve_gpu(gpu_name)
        setup = Setup(gpus=gpus, device_map="auto", **kw)
        real = real_device_map(model.config, setup,
                               (free_memory_bytes(gpu, DEFAULT_CORRECTIONS.cuda_context_bytes),) * gpus)
        rows += gpu_rows(name, model, setup, traced_rank_peaks(model.config, setup, real), estimate(model, setup, gpu))
    return rows


def gpu_rows(name: str, model, setup: Setup, truth: list[dict[str, int]], est, label: str = "") -> list:
    """One validate row per GPU: the traced step's peak phase against the estimate's GPU."""
    from .row import Row

    rows = []
    for r, (t, e) in enumerate(zip(truth, est.per_rank, strict=True)):
        phase = max(t, key=lambda p: t[p])
        rows.append(Row(name, model.family, setup, t[phase], e.tensor_peak_bytes, f"{phase} (GPU {r})",
                        f"{e.phase} (GPU {r}{label})", truth="trace", knob="device_map"))
    return rows


def layer_split_rows(quick: bool = False) -> list:
    """validate rows of ``device_map``: per case and strategy, each GPU's placed bytes, truth =
    transformers' real placement of the meta-device model; a row's phase column says whether the
    decoder layers went to the same GPUs ("layers match" / "layers differ")."""
    from ..estimator.corrections import DEFAULT_CORRECTIONS
    from ..estimator.layer_split import free_memory_bytes, place
    from ..model.profiles import load_model
    from ..setup.inputs import resolve_gpu
    from .row import Row

    rows = []
    cases = CASES[:1] + CASES[2:3] if quick else CASES
    for name, kw, gpus, gpu_name in cases:
        model, gpu = load_model(name), resolve_gpu(gpu_name)
        for strategy in ("auto",) if quick else ("auto", "sequential"):
            setup = Setup(gpus=gpus, device_map=strategy, **kw)
            est = place(model, setup, gpu, DEFAULT_CORRECTIONS.cuda_context_bytes)
            free = (free_memory_bytes(gpu, DEFAULT_CORRECTIONS.cuda_context_bytes),) * gpus
            real = real_device_map(model.config, setup, free)
            same = layer_devices(real, model.num_layers) == est.layer_devices()
            truth = placed_bytes(model.config, setup, real)
            for r in range(gpus):
                if not truth.get(r) and not est.placed_bytes[r]:
                    continue  # a GPU both leave empty (sequential fills the first ones)
                rows.append(Row(name, model.family, setup, truth.get(r, 0) or 1, est.placed_bytes[r],
                                "layers match" if same else "layers differ", f"GPU {r}", truth="placement",
                                knob="device_map", quantity=f"gpu{r}_placed_bytes"))
    return rows + traced_rows(quick)
