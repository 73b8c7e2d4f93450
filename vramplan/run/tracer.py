"""The traced tier: run the real transformers/peft training step on fake tensors and record the
peak of live tensor storage bytes after every op.

The model is built on the ``meta`` device (peft applied there), materialised with ``to_empty``
inside :class:`torch._subclasses.fake_tensor.FakeTensorMode`, and driven through the canonical
step (forward with labels, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) twice.
The live-tensor counter of the real runs (:class:`vramplan.run.live.LiveTensorCounter`) sees every
op's outputs; each distinct storage is counted once while it is alive (a weakref callback removes
it). Nothing is computed and no weights are read, so a model of any size traces on a laptop;
models deeper than a few layers are traced at two depths and extrapolated per layer
(:func:`trace` proves the extrapolation in its tests). The stand-ins that make the fake step take
a real CUDA step's code path are in :mod:`vramplan.run.real_paths`.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

from ..specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup
from .knob_paths import step_optimizer, tie_original_embeddings
from .live import LiveTensorCounter
from .models import (
    NotTraceable,
    adapt_for_training,
    attn_implementation,
    causal_lm_from_config,
    hf_config,
    require_torch,
    torch_optimizer,
)
from .real_paths import padding_mask, real_code_paths

__all__ = ["CATEGORIES", "MOMENTS", "NotTraceable", "PhasePeak", "TraceNumbers", "breakdown_from_trace", "trace",
           "trace_numbers"]

#: Categories a live storage falls in at a peak.
CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "temporaries")

#: Moments of a step whose peaks are each linear in the number of decoder layers: the forward
#: through the layers and through the head and loss; the backward before the top layer's first
#: gradient, in the top (first), inner (middle) and bottom (last) layers, and after them (the
#: embedding); the optimizer step. A phase's peak is the max of its moments. Extrapolating each
#: moment separately stays exact when the moment of a phase's peak moves as depth grows.
MOMENTS = (
    "forward:layers", "forward:head",
    "backward:pre", "backward:first", "backward:middle", "backward:last", "backward:post",
    "optimizer",
)


@dataclass
class PhasePeak:
    """The live bytes at the peak of one moment, and their split by :data:`CATEGORIES`."""

    bytes: int = 0
    categories: dict[str, int] = field(default_factory=dict)


@dataclass
class TraceNumbers:
    """Raw numbers of one traced run (one depth)."""

    num_layers: int
    phase_peaks: dict[str, PhasePeak]
    params_total: int
    params_trainable: int
    saved_by_module: dict[str, int]
    saved_detail: list = field(default_factory=list)
    host_peak: int = 0  # host RAM of activation offloading's copies (peak)

    @property
    def peak(self) -> int:
        return max(p.bytes for p in self.phase_peaks.values())

    def phase(self, phase: str) -> PhasePeak:
        """The peak of ``phase`` (forward, backward, optimizer): the largest of its moments."""
        moments = [p for m, p in self.phase_peaks.items() if m.split(":")[0] == phase]
        return max(moments, key=lambda p: p.bytes)


class _MomentCounter(LiveTensorCounter):
    """The live-tensor counter over fake tensors (every device) keeping each moment's peak and
    its categories there. The moment is set by the driver and changes without an observation:
    only ops observe, so a peak is always the live bytes after some op."""

    def __init__(self) -> None:
        super().__init__(device=None)
        self.moment: str | None = None
        self.saved: set[int] = set()
        self.peaks: dict[str, PhasePeak] = {m: PhasePeak() for m in MOMENTS}
        self.classify = None  # callable(live ids) -> categories, set by the driver
        self.on_backward_start = lambda: None
        self.host: set[int] = set()  # storages in host RAM (activation offloading's copies), not device bytes
        self.host_bytes = 0
        self.host_peak = 0
        self.host_context = False

    def add(self, tensor) -> int | None:
        """Count ``tensor`` (it exists before the counter sees an op make it); its id."""
        return self._track(tensor)

    def observe(self) -> None:
        """Take the live bytes now as a candidate for the moment's peak."""
        self._observe()

    def mark_host(self, tensor) -> None:
        """``tensor``'s storage is host RAM from now on (run/act_offload.py)."""
        sid = self.add(tensor)
        if sid is not None and sid not in self.host:
            self.host.add(sid)
            self.host_bytes += self.live[sid]
            self.host_peak = max(self.host_peak, self.host_bytes)

    def unmark_host(self, tensor) -> None:
        """``tensor``'s storage is device memory again."""
        sid = self.sid_of(tensor)
        if sid in self.host:
            self.host.discard(sid)
            self.host_bytes -= self.live[sid]

    def _counted(self, sid: int, nbytes: int) -> None:
        if self.host_context:  # allocated as host RAM (run/act_offload.py: the host copies)
            self.host.add(sid)
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)

    def _freed(self, sid: int, nbytes: int) -> None:
        if sid in self.host:
            self.host.discard(sid)
            self.host_bytes -= nbytes

    def _observe(self) -> None:
        if self.moment is None:
            return
        peak = self.peaks[self.moment]
        device = self.current_bytes - self.host_bytes
        if device > peak.bytes:
            peak.bytes = device
            live = {s: n for s, n in self.live.items() if s not in self.host} if self.host else self.live
            peak.categories = self.classify(live) if self.classify else {}


def _label_backward_moments(model, counter: _MomentCounter, num_layers: int) -> None:
    """Move the counter's moment along the backward as gradients land in each decoder layer."""
    import re

    layer_of = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")  # (blocks: MPT's)
    seen_layer = [False]

    def hook_for(idx):
        def hook(_param):
            if not counter.moment or not counter.moment.startswith("backward"):
                return
            if idx is None:
                if seen_layer[0]:
                    counter.moment = "backward:post"
                return
            seen_layer[0] = True
            counter.moment = "backward:" + ("first" if idx == num_layers - 1 else "last" if idx == 0 else "middle")

        return hook

    for name, p in model.named_parameters():
        if p.requires_grad:
            m = layer_of.search("." + name)
            p.register_post_accumulate_grad_hook(hook_for(int(m.group(1)) if m else None))

    def reset(_grad_fn=None):
        seen_layer[0] = False

    counter.on_backward_start = reset


def trace_numbers(config: dict, setup: Setup, num_layers: int | None = None, steps: int = 2) -> TraceNumbers:
    """Trace ``steps`` canonical steps of the model described by ``config`` (an HF config dict)."""
    require_torch()
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    if setup.quant in ("gptq", "awq"):
        raise NotTraceable(f"{setup.quant.upper()} bases need gptqmodel and a pre-quantized checkpoint; they are not "
                           "traced (estimate only: docs/commands/validate.md)")
    if setup.quant != "none":
        raise NotTraceable("bitsandbytes quantized layers cannot run on fake tensors; "
                           "it needs a real run (the measured tier)")
    if setup.zero_stage or setup.gpus > 1:
        raise NotTraceable("DeepSpeed/multi-GPU steps are not traced; it needs a real run (the measured tier)")
    if setup.framework in ("unsloth", "torchtune"):  # their own model, kernels and loss: not transformers' step
        raise NotTraceable(f"--framework {setup.framework} runs its own step (docs/frameworks.md), which the tracer "
                           "does not run (it traces transformers/peft); the analytic estimate models it")
    if setup.loss in ("trl", "unsloth"):  # the tracer runs transformers' loss (or --loss chunked / Liger's)
        raise NotTraceable(f"--loss {setup.loss} is traced by `vramplan validate --knob loss` "
                           "(vramplan/truths/objective_trace.py), not by trace; --loss hf traces transformers' loss")
    if setup.objective != "sft":  # the DPO/GRPO step is traced by truths/objective_trace.py
        raise NotTraceable(f"--objective {setup.objective} is traced by `vramplan validate --knob "
                           f"{setup.objective}` (vramplan/truths/objective_trace.py), not by trace")
    if setup.precision in ("bf16-mixed", "fp16-mixed"):
        dtype = torch.float32
        autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[setup.precision]
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.precision]
        autocast_dtype = None

    hf_cfg = hf_config(config, num_layers)
    hf_cfg.use_cache = False
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = causal_lm_from_config(hf_cfg, dtype=dtype, attn_implementation=attn_implementation(config, setup))
    model = adapt_for_training(model, setup)  # peft and checkpointing on the meta device

    counter = _MomentCounter()
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model

    def _to_head(_mod, _args):
        if counter.moment == "forward:layers":
            counter.moment = "forward:head"

    hf_model.get_output_embeddings().register_forward_pre_hook(_to_head)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved_by_module: dict[str, int] = {}
    saved_detail: list[tuple] = []
    module_stack: list[str] = []

    def _pre(mod, _args, name):
        module_stack.append(name)

    def _post(mod, _args, _out, name):
        if module_stack and module_stack[-1] == name:
            module_stack.pop()

    for name, mod in model.named_modules():
        if name:  # saved tensors are attributed to the innermost module running
            mod.register_forward_pre_hook(lambda m, a, n=name: _pre(m, a, n))
            mod.register_forward_hook(lambda m, a, o, n=name: _post(m, a, o, n))

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    loss_patch = contextlib.nullcontext()
    if setup.loss == "chunked":  # vramplan's chunked cross-entropy (vramplan/run/chunked_loss.py)
        from .chunked_loss import patch_chunked_loss

        loss_patch = patch_chunked_loss(model)
    if setup.liger:  # stand-ins keeping what Liger's Triton kernels keep (vramplan/run/liger.py)
        from .liger import patch_liger

        loss_patch = patch_liger(model)
    with real_code_paths(setup.pad_mask), loss_patch, fake, counter:
        model.to_empty(device="cpu")
        # Module._apply replaces each module's parameters one by one, which unties shared ones
        # (tied input/output embeddings); tie them again as from_pretrained would.
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(hf_model.config, "tie_word_embeddings", False):
            tie_original_embeddings(hf_model)
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        for t in itertools.chain(params, model.buffers()):
            counter.add(t)
        _label_backward_moments(model, counter, hf_cfg.get_text_config().num_hidden_layers)
        opt = step_optimizer(setup, model, trainable, torch_optimizer)  # after the labels (in-backward steps)

        def classify(live: dict[int, int]) -> dict[str, int]:
            param_ids = {counter.sid_of(p) for p in params}
            grad_ids = {counter.sid_of(p.grad) for p in params if p.grad is not None}
            state_ids = set()
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        state_ids.add(counter.sid_of(v))
            out = dict.fromkeys(CATEGORIES, 0)
            for sid, n in live.items():
                if sid in param_ids:
                    out["weights"] += n
                elif sid in grad_ids:
                    out["gradients"] += n
                elif sid in state_ids:
                    out["optimizer_states"] += n
                elif sid in counter.saved:
                    out["activations"] += n
                else:
                    out["temporaries"] += n
            return out

        counter.classify = classify

        param_sids = {counter.sid_of(p) for p in params}

        def pack(t):
            sid = counter.add(t)
            if sid is not None and sid not in param_sids and sid not in counter.saved:
                counter.saved.add(sid)
                key = module_stack[-1] if module_stack else "<model>"
                saved_by_module[key] = saved_by_module.get(key, 0) + t.untyped_storage().nbytes()
                saved_detail.append((key, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                     t.untyped_storage().nbytes()))
            return t

        offload = None
        if setup.activation_offload:  # TRL's manager, built once as SFTTrainer builds it (run/act_offload.py)
            from .act_offload import offload_manager

            offload = offload_manager(model, counter, pack)
        rows = (1, setup.tokens) if setup.padding_free else (setup.batch, setup.seq)  # one flattened row
        input_ids = torch.randint(0, int(config.get("vocab_size", 32000)), rows)
        counter.add(input_ids)
        batch = {"input_ids": input_ids, "labels": input_ids}
        if setup.padding_free:  # DataCollatorWithFlattening: positions restart per sequence (flash varlen)
            batch["position_ids"] = torch.arange(setup.seq).repeat(setup.batch).unsqueeze(0)
            counter.add(batch["position_ids"])
        if setup.pad_mask:
            batch["attention_mask"] = padding_mask(setup.batch, setup.seq)
            counter.add(batch["attention_mask"])
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        for step in range(steps):
            if step == steps - 1:
                saved_by_module.clear()
                saved_detail.clear()
            for _micro in range(setup.grad_accum):
                counter.moment = "forward:layers"
                with _step_hooks(offload, pack) as hooks:
                    with hooks, autocast:
                        loss = model(**batch).loss
                        if setup.grad_accum > 1:
                            loss = loss / setup.grad_accum
                    counter.moment = "backward:pre"
                    counter.on_backward_start()
                    loss.backward()
                    del loss
                counter.observe()
            counter.moment = "optimizer"
            opt.step()
            counter.observe()
            counter.moment = None
            opt.zero_grad(set_to_none=True)
            counter.saved.clear()
        if setup.eval_batch:  # the eval step after the last train step (vramplan/run/eval_trace.py)
            from .eval_trace import eval_step

            counter.peaks["eval"] = PhasePeak()
            eval_step(model, setup, config, counter, autocast)

    return TraceNumbers(
        num_layers=hf_cfg.get_text_config().num_hidden_layers,
        host_peak=counter.host_peak,
        phase_peaks=counter.peaks,
        params_total=sum(p.numel() for p in params),
        params_trainable=sum(p.numel() for p in trainable),
        saved_by_module=dict(sorted(saved_by_module.items(), key=lambda kv: -kv[1])),
        saved_detail=saved_detail,
    )


@contextlib.contextmanager
def _step_hooks(offload, pack):
    """The saved-tensor hooks of one micro-step: the tracer's own around the forward (yielded), or
    with ``--activation-offload`` TRL's offloading manager around forward and backward, as
    ``SFTTrainer.training_step`` holds it (run/act_offload.py; the forward then needs no more)."""
    import torch

    if offload is None:
        yield torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        return
    from .act_offload import offload_step

    with offload_step(offload):
        yield contextlib.nullcontext()


def _combine(base: TraceNumbers, deltas: list[tuple[TraceNumbers, TraceNumbers, float]],
             num_layers: int) -> TraceNumbers:
    """``base`` plus, for each (lo, hi, n), n times the per-layer difference hi - lo."""

    def value(get) -> int:
        return round(get(base) + sum(n * (get(hi) - get(lo)) for lo, hi, n in deltas))

    peaks = {}
    for m in MOMENTS:
        if m == "backward:middle":
            # inner layers exist only from depth 3; a line through the inner layers' peaks never
            # rises above the top or the bottom layer's, which are extrapolated themselves
            peaks[m] = PhasePeak()
            continue
        cats = {c: value(lambda t, m=m, c=c: t.phase_peaks[m].categories.get(c, 0)) for c in CATEGORIES}
        peaks[m] = PhasePeak(bytes=value(lambda t, m=m: t.phase_peaks[m].bytes), categories=cats)
    return TraceNumbers(
        num_layers=num_layers,
        phase_peaks=peaks,
        params_total=value(lambda t: t.params_total),
        params_trainable=value(lambda t: t.params_trainable),
        saved_by_module=base.saved_by_module,
        host_peak=value(lambda t: t.host_peak),
    )


def _extrapolate(a: TraceNumbers, b: TraceNumbers, num_layers: int) -> TraceNumbers:
    """Per-layer linear extrapolation from traces at depths ``a.num_layers`` < ``b.num_layers``."""
    per_layer = (num_layers - a.num_layers) / (b.num_layers - a.num_layers)
    return _combine(a, [(a, b, per_layer)], num_layers)


def _num_layers(config: dict) -> int:
    if isinstance(config.get("text_config"), dict):  # an image-text model (Gemma 3): its text tower's layers
        config = config["text_config"]
    return int(config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
               or config.get("n_layers"))  # (MPT's name)


def _layer_types(config: dict) -> list[str] | None:
    """Per-layer attention types as transformers resolves them (sliding/full), if the family has them."""
    hf = hf_config(config, None)
    types = getattr(hf, "layer_types", None)
    return list(types) if types else None


def trace(
    model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, *, full_depth_max: int = 4,
    depths: tuple[int, int] = (2, 3),
) -> Breakdown:
    """Traced Breakdown of ``setup`` on ``model``.

    Models with more than ``full_depth_max`` layers are traced at two depths and extrapolated
    linearly per layer: every layer of a decoder stack adds the same bytes to each phase's peak
    (weights, gradients, states and saved activations), which ``tests/test_trace.py`` checks
    against a full-depth trace. Families mixing layer types (Gemma2/3 sliding and full attention)
    are extrapolated per type: one extra trace adds a layer of each type to the base.
    """
    from ..setup.checks import check

    check(model, setup)  # a setup peft or transformers would refuse fails here, in one line
    require_torch()
    L = _num_layers(model.config)
    if setup.activation_offload:  # the forward stash holds the last layers' inputs: linear from 5 layers on
        full_depth_max, depths = max(full_depth_max, 6), (5, 6)
    # selective checkpointing: the layers differ, so a per-layer extrapolation would not hold
    if L <= full_depth_max or setup.checkpoint_every > 1:
        return breakdown_from_trace(model, setup, trace_numbers(model.config, setup), "traced at full depth", gpu)
    types = _layer_types(model.config)
    if types and len(set(types)) > 1:
        base_types = [types[0]] * depths[0]
        base = trace_numbers(dict(model.config, layer_types=base_types), setup, depths[0])
        deltas = []
        for t in dict.fromkeys(types):
            plus = trace_numbers(dict(model.config, layer_types=base_types + [t]), setup, depths[0] + 1)
            deltas.append((base, plus, types.count(t) - base_types.count(t)))
        nums = _combine(base, deltas, L)
        note = f"traced at {depths[0]} layers plus one of each layer type, extrapolated to {L}"
    else:
        a = trace_numbers(model.config, setup, depths[0])
        b = trace_numbers(model.config, setup, depths[1])
        nums = _extrapolate(a, b, L)
        note = f"traced at {depths[0]} and {depths[1]} layers, extrapolated to {L}"
    return breakdown_from_trace(model, setup, nums, note, gpu)


def breakdown_from_trace(model: ModelSpec, setup: Setup, nums: TraceNumbers, note: str = "", gpu=None) -> Breakdown:
    """The traced numbers as a Breakdown. The tracer measures live tensors; the allocated,
    reserved and device totals add the same named overheads the analytic tier adds."""
    from ..estimator.corrections import device_overheads

    phases = (*PHASES, "eval") if "eval" in nums.phase_peaks else PHASES
    phase_peaks = {ph: nums.phase(ph).bytes for ph in phases}
    phase = max(phases, key=lambda ph: phase_peaks[ph])
    cats = nums.phase(phase).categories
    peak = phase_peaks[phase]
    allocated, reserved, device_total, overheads = device_overheads(peak, setup.gpus, gpu)
    components = tuple(Component(name=c, bytes=int(cats.get(c, 0)), phases=(phase,)) for c in CATEGORIES) + tuple(
        Component(name, n, PHASES, note=(n_note + "; " if n_note else "") + "published figure, not traced")
        for name, n, n_note in overheads
    )
    if nums.host_peak:
        components += (Component("activation_offload_host", nums.host_peak, ("forward", "backward"), where="host",
                                 note="TRL OffloadActivations' host copies (traced)"),)
    return Breakdown(
        model=model.name,
        setup=setup,
        tier="traced",
        components=components,
        phase_peaks_bytes=phase_peaks,
        phase=phase,
        tensor_peak_bytes=peak,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        device_total_bytes=device_total,
        params_total=nums.params_total,
        params_trainable=nums.params_trainable,
        host_bytes=nums.host_peak,
        gpu=gpu,
        notes=(note,),
    )
