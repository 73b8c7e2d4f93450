"""The truth of a capped layer split (``--max-memory``): transformers' own placement under the caps.

``capped_device_map`` hands transformers 5.24's ``_get_device_map`` (``get_balanced_memory`` /
``get_max_memory``, the bitsandbytes quantizer's ``adjust_max_memory``, ``infer_auto_device_map``;
integrations/accelerate.py over accelerate 1.15's ``get_max_memory`` and
``convert_file_size_to_int``) the ``max_memory`` mapping the emitted train.py passes to
``from_pretrained``: ``{GPU index: bytes}``, no ``"cpu"`` budget, so a module that fits on no
GPU shows as ``"disk"`` (what a real load would do without ``offload_folder``: refuse). The
model is the meta-device one of vramplan/truths/layer_split_truth.py; the per-GPU traced step
(vramplan/truths/layer_split_trace.py) runs under the capped map. Rows for
``vramplan validate --knob device_map``.
"""

from __future__ import annotations

from ..specs import Setup
from .layer_split_truth import gpu_rows, layer_devices, placed_bytes, real_device_map

#: (model, setup, caps): uneven caps that move the split off the even one, for auto (balanced:
#: every GPU but the last capped at the share), sequential (GPU by GPU) and balanced; the 70B
#: QLoRA of the issue on a 20 GB and a 24 GB budget (the quantizer keeps 90 % of each), an 8-bit
#: base over 3 GPUs, a tied head (with the embedding on GPU 0), full fine-tuning over 4
CASES = (
    ("meta-llama/Llama-3.1-70B", dict(method="qlora", checkpointing=True, device_map="auto"), "0=20GiB,1=24GiB"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", device_map="auto"), "0=8GiB,1=20GiB"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", device_map="sequential"), "0=6GiB,1=12GiB"),
    ("Qwen/Qwen2.5-7B", dict(method="lora", quant="int8", device_map="balanced"), "0=3GiB,1=4GiB,2=6GiB"),
    ("meta-llama/Llama-3.2-1B", dict(method="lora", device_map="auto"), "0=1GiB,1=4GiB"),
    ("meta-llama/Llama-3.1-8B", dict(method="full", device_map="sequential"), "0=4GiB,1=6GiB,2=3GiB,3=8GiB"),
)

#: (model, setup, caps) of the per-GPU traced step under a capped map
TRACE_CASES = (
    ("meta-llama/Llama-3.2-1B", dict(method="lora", seq=512, device_map="auto"), "0=1GiB,1=4GiB"),
    ("meta-llama/Llama-3.1-8B", dict(method="lora", seq=256, device_map="sequential"), "0=6GiB,1=12GiB"),
)


def capped_setup(kw: dict, caps: str) -> Setup:
    """The Setup of a case: one GPU per cap."""
    return Setup(gpus=caps.count(",") + 1, max_memory=caps, **kw)


def capped_device_map(config: dict, setup: Setup) -> dict[str, int | str]:
    """transformers' device_map under ``setup.max_memory``, as from_pretrained gets the caps
    from the emitted train.py (vramplan.emit.trainer: ``{index: bytes}``, no cpu budget)."""
    from ..setup.max_memory import max_memory_map

    return real_device_map(config, setup, max_memory_map(setup.max_memory), cpu=False)


def placement_rows(quick: bool = False) -> list:
    """Per case and GPU: the bytes placed there, truth = transformers' capped placement of the
    meta-device model; the truth column says whether every decoder layer went to the same GPU."""
    from ..estimator.layer_split import place
    from ..model.profiles import load_model
    from .row import Row

    rows = []
    for name, kw, caps in CASES[1:3] if quick else CASES:
        model, setup = load_model(name), capped_setup(kw, caps)
        est = place(model, setup, None, 0)
        real = capped_device_map(model.config, setup)
        same = layer_devices(real, model.num_layers) == est.layer_devices()
        truth = placed_bytes(model.config, setup, real)
        for r in range(setup.gpus):
            rows.append(Row(name, model.family, setup, truth.get(r, 0) or 1, est.placed_bytes[r],
                            "layers match" if same else "layers differ", f"GPU {r} (max_memory {caps})",
                            truth="placement", knob="device_map", quantity=f"gpu{r}_placed_bytes"))
    return rows


def traced_rows(quick: bool = False) -> list:
    """Each GPU's tensor peak against the per-GPU traced step under transformers' capped map."""
    from ..estimator import estimate
    from ..model.profiles import load_model
    from ..setup.inputs import resolve_gpu
    from .layer_split_trace import traced_rank_peaks

    rows = []
    for name, kw, caps in TRACE_CASES[:1] if quick else TRACE_CASES:
        model, setup = load_model(name), capped_setup(kw, caps)
        truth = traced_rank_peaks(model.config, setup, capped_device_map(model.config, setup))
        rows += gpu_rows(name, model, setup, truth, estimate(model, setup, resolve_gpu("a100-80gb")),
                         f", max_memory {caps}")
    return rows


def max_memory_rows(quick: bool = False) -> list:
    """validate rows of ``device_map`` under ``--max-memory``: placement, then the traced step."""
    return placement_rows(quick) + traced_rows(quick)
