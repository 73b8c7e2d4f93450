"""The traced tier: run the real transformers/peft training step on fake tensors and record the
peak of live tensor storage bytes after every op.

The model is built on the ``meta`` device (peft applied there), materialised with ``to_empty``
inside :class:`torch._subclasses.fake_tensor.FakeTensorMode`, and driven through the canonical
step (forward with labels, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) twice.
A :class:`TorchDispatchMode` sees every op's outputs; each distinct storage is counted once while
it is alive (a weakref callback removes it). Nothing is computed and no weights are read, so a
model of any size traces on a laptop; models deeper than a few layers are traced at two depths and
extrapolated per layer (:func:`trace` proves the extrapolation in its tests).

This module (with :mod:`vramplan.run`) is the only one that imports torch.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field

from .specs import PHASES, Breakdown, Component, GpuSpec, ModelSpec, Setup, SpecError, truncate_config

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


class NotTraceable(SpecError):
    """The setup uses something fake tensors cannot run (bitsandbytes kernels, DeepSpeed, ...)."""


@dataclass
class _PhasePeak:
    bytes: int = 0
    categories: dict[str, int] = field(default_factory=dict)


@dataclass
class TraceNumbers:
    """Raw numbers of one traced run (one depth)."""

    num_layers: int
    phase_peaks: dict[str, _PhasePeak]
    params_total: int
    params_trainable: int
    saved_by_module: dict[str, int]
    saved_detail: list = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(p.bytes for p in self.phase_peaks.values())

    def phase(self, phase: str) -> _PhasePeak:
        """The peak of ``phase`` (forward, backward, optimizer): the largest of its moments."""
        moments = [p for m, p in self.phase_peaks.items() if m.split(":")[0] == phase]
        return max(moments, key=lambda p: p.bytes)


def _require_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SpecError(
            f"tracing needs the optional extra: pip install 'vramplan[run]' ({exc.name} is missing)"
        ) from None


class _LiveTracker:
    """Counts the bytes of live storages; the dispatch mode below feeds it every op output."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.live: dict[int, int] = {}  # our id -> nbytes
        self.by_obj: dict[int, int] = {}  # id(storage pyobj) -> our id
        self.refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.saved: set[int] = set()
        self.phase: str | None = None
        self.peaks: dict[str, _PhasePeak] = {m: _PhasePeak() for m in MOMENTS}
        self.classify = None  # callable(live ids) -> categories, set by the driver
        self.on_backward_start = lambda: None

    def track(self, tensor) -> int | None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            return None
        st = tensor.untyped_storage()
        key = id(st)
        if key in self.by_obj:
            return self.by_obj[key]
        sid = next(self._ids)
        n = st.nbytes()
        self.by_obj[key] = sid
        self.live[sid] = n
        self.current += n

        def _free(_ref, sid=sid, key=key):
            self.current -= self.live.pop(sid, 0)
            self.by_obj.pop(key, None)
            self.refs.pop(sid, None)

        self.refs[sid] = weakref.ref(st, _free)
        return sid

    def sid_of(self, tensor) -> int | None:
        return self.by_obj.get(id(tensor.untyped_storage()))

    def observe(self) -> None:
        if self.phase is None:
            return
        peak = self.peaks[self.phase]
        if self.current > peak.bytes:
            peak.bytes = self.current
            peak.categories = self.classify(self.live) if self.classify else {}


def _make_mode(tracker: _LiveTracker):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytesMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    tracker.track(t)
            tracker.observe()
            return out

    return LiveBytesMode()


def _hf_config(config: dict, num_layers: int | None):
    import transformers

    cfg = dict(truncate_config(config, num_layers) if num_layers else config)
    model_type = cfg.pop("model_type")
    for k in ("architectures", "auto_map", "transformers_version", "quantization_config"):
        cfg.pop(k, None)
    return transformers.AutoConfig.for_model(model_type, **cfg)


def _attn_impl(setup: Setup, default: str) -> str:
    if setup.attn == "auto":
        return default
    # FlashAttention-2 needs CUDA; its memory (q, k, v, out, fp32 logsumexp) is what SDPA's flash
    # kernel saves, so the tracer runs SDPA in its place.
    return "sdpa" if setup.attn == "flash" else setup.attn


def make_optimizer(setup: Setup, params):
    """The torch optimizer of ``setup`` as the canonical step builds it (also the client optimizer
    of the real runs in vramplan.run); bitsandbytes ones raise NotTraceable."""
    import torch

    if setup.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if setup.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if setup.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=True)
    if setup.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-5, scale_parameter=False, relative_step=False)
    raise NotTraceable(
        f"optimizer {setup.optimizer!r} cannot run on fake tensors (bitsandbytes/custom kernels); "
        "it needs a real run (the measured tier)"
    )


def _flash_like():
    import torch

    class FlashLike(torch.autograd.Function):
        """Memory stand-in for CUDA's fused SDPA kernels (fake tensors carry no values): saves
        q, k, v (K/V at their own head count, as with ``enable_gqa``), the output, a fp32
        logsumexp of shape (b, heads, s) and the mask if there is one; backward allocates dq,
        dk, dv."""

        @staticmethod
        def forward(ctx, q, k, v, mask=None):
            b, a, s, _ = q.shape
            out = q.new_empty(b, s, a, v.shape[-1]).transpose(1, 2)
            lse = q.new_empty(b, a, s, dtype=torch.float32)
            # with a mask CUDA runs the memory-efficient kernel, which also keeps the mask (attn_bias)
            ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors[:3]
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    return FlashLike


class _LazyFlash:
    def __getattr__(self, name):
        cls = _flash_like()
        globals()["_FlashLike"] = cls
        return getattr(cls, name)


_FlashLike = _LazyFlash()


def _label_backward_moments(model, tracker: _LiveTracker, num_layers: int) -> None:
    """Move the tracker's moment along the backward as gradients land in each decoder layer."""
    import re

    layer_of = re.compile(r"\.(?:layers|h)\.(\d+)\.")
    seen_layer = [False]

    def hook_for(idx):
        def hook(_param):
            if not tracker.phase or not tracker.phase.startswith("backward"):
                return
            if idx is None:
                if seen_layer[0]:
                    tracker.phase = "backward:post"
                return
            seen_layer[0] = True
            tracker.phase = "backward:" + ("first" if idx == num_layers - 1 else "last" if idx == 0 else "middle")

        return hook

    for name, p in model.named_parameters():
        if p.requires_grad:
            m = layer_of.search("." + name)
            p.register_post_accumulate_grad_hook(hook_for(int(m.group(1)) if m else None))

    def reset(_grad_fn=None):
        seen_layer[0] = False

    tracker.on_backward_start = reset


def autocast_inputs(*tensors):
    """SDPA is on autocast's lower-precision list: under autocast the real kernel receives
    q, k, v cast to the autocast dtype (and saves those copies). A stand-in called in its place
    bypasses autocast's dispatch, so it casts them itself."""
    import torch

    if not tensors or not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def padding_mask(batch: int, seq: int):
    """The attention_mask of a padded batch: the last sequence right-padded by an eighth."""
    import torch

    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - max(1, seq // 8):] = 0
    return mask


@contextlib.contextmanager
def _real_code_paths(padded: bool = False):
    """Make the traced step take the code path a real CUDA step takes.

    - transformers treats fake tensors as a sign of torch.export/compile tracing (``is_tracing``)
      and then builds an explicit 4-D causal mask and repeats K/V for SDPA, and it reads position
      ids to detect packed sequences: memory and data a real eager step never touches.
    - torch's CPU kernels save different tensors than its CUDA kernels. SDPA on CPU picks the
      math kernel when dropout is on or K/V are grouped (s^2 scores and probabilities saved) and
      lays its output out so that transformers' ``transpose(1, 2).contiguous()`` copies it for
      some head sizes; CUDA runs flash attention, which saves q, k, v, its output (laid out
      (b, s, heads, d)) and a fp32 logsumexp, whatever the dropout and GQA. The tracer runs a
      stand-in with exactly flash's saved tensors, outputs and gradient allocations.
      Dropout keeps a 16-bit noise tensor on CPU where CUDA's fused ``native_dropout`` keeps a
      bool mask: the tracer calls ``native_dropout`` (its CPU version keeps the bool mask too).
    """
    import torch
    import torch.nn.functional as F
    from transformers import masking_utils

    orig_sdpa, orig_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.dim() == 4 and (attn_mask is None or attn_mask.dtype == torch.bool):
            return _FlashLike.apply(*autocast_inputs(query, key, value), attn_mask)
        return orig_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return orig_dropout(input, p, training, inplace)

    patches = [
        # real tensors are not being exported: take the eager path (is_causal SDPA, GQA kernel)
        (masking_utils, "is_tracing", lambda tensor=None: False),
        # the canonical step passes no position_ids, so sequences are never packed
        (masking_utils, "find_packed_sequence_indices", lambda position_ids: None),
        # fake tensors carry no values: a padded batch (--pad-mask) is known to have padding
        (masking_utils, "fast_all", lambda tensor: not padded),
        (F, "scaled_dot_product_attention", sdpa),
        (F, "dropout", dropout),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def trace_numbers(config: dict, setup: Setup, num_layers: int | None = None, steps: int = 2) -> TraceNumbers:
    """Trace ``steps`` canonical steps of the model described by ``config`` (an HF config dict)."""
    _require_torch()
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    if setup.quant in ("gptq", "awq"):
        raise NotTraceable(f"{setup.quant.upper()} bases need gptqmodel and a pre-quantized checkpoint; they are not "
                           "traced (estimate only: docs/commands/validate.md)")
    if setup.quant != "none":
        raise NotTraceable("bitsandbytes quantized layers cannot run on fake tensors; it needs a real run (the measured tier)")
    if setup.zero_stage or setup.gpus > 1:
        raise NotTraceable("DeepSpeed/multi-GPU steps are not traced; it needs a real run (the measured tier)")
    if setup.precision in ("bf16-mixed", "fp16-mixed"):
        dtype, autocast_dtype = torch.float32, {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[setup.precision]
    else:
        dtype, autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.precision], None

    hf_cfg = _hf_config(config, num_layers)
    hf_cfg.use_cache = False
    transformers.logging.set_verbosity_error()
    probe_default = "eager" if config.get("model_type") in {"gemma2"} else "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, dtype=dtype, attn_implementation=_attn_impl(setup, probe_default)
        )
    if setup.adapters:
        import peft

        targets = setup.lora_targets
        lcfg = peft.LoraConfig(
            r=setup.lora_rank,
            lora_alpha=setup.alpha,
            lora_dropout=setup.lora_dropout,
            target_modules="all-linear" if targets == "all-linear" else [t.strip() for t in targets.split(",")],
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lcfg)
    if setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if setup.adapters:
            model.enable_input_require_grads()
    model.train()

    tracker = _LiveTracker()
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model

    def _to_head(_mod, _args):
        if tracker.phase == "forward:layers":
            tracker.phase = "forward:head"

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
    mode = _make_mode(tracker)
    loss_patch = contextlib.nullcontext()
    if setup.loss == "chunked":  # vramplan's chunked cross-entropy (vramplan/run/chunked_loss.py)
        from .run.chunked_loss import patch_chunked_loss

        loss_patch = patch_chunked_loss(model)
    with _real_code_paths(setup.pad_mask), loss_patch, fake, mode:
        model.to_empty(device="cpu")
        # Module._apply replaces each module's parameters one by one, which unties shared ones
        # (tied input/output embeddings); tie them again as from_pretrained would.
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if getattr(hf_model.config, "tie_word_embeddings", False):
            out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
            if out_emb is not None and in_emb is not None:
                out_emb.weight = in_emb.weight
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        for t in itertools.chain(params, model.buffers()):
            tracker.track(t)
        opt = make_optimizer(setup, trainable)
        _label_backward_moments(model, tracker, hf_cfg.num_hidden_layers)

        def classify(live: dict[int, int]) -> dict[str, int]:
            param_ids = {tracker.sid_of(p) for p in params}
            grad_ids = {tracker.sid_of(p.grad) for p in params if p.grad is not None}
            state_ids = set()
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        state_ids.add(tracker.sid_of(v))
            out = dict.fromkeys(CATEGORIES, 0)
            for sid, n in live.items():
                if sid in param_ids:
                    out["weights"] += n
                elif sid in grad_ids:
                    out["gradients"] += n
                elif sid in state_ids:
                    out["optimizer_states"] += n
                elif sid in tracker.saved:
                    out["activations"] += n
                else:
                    out["temporaries"] += n
            return out

        tracker.classify = classify

        param_sids = {tracker.sid_of(p) for p in params}

        def pack(t):
            sid = tracker.track(t)
            if sid is not None and sid not in param_sids and sid not in tracker.saved:
                tracker.saved.add(sid)
                key = module_stack[-1] if module_stack else "<model>"
                saved_by_module[key] = saved_by_module.get(key, 0) + t.untyped_storage().nbytes()
                saved_detail.append((key, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.untyped_storage().nbytes()))
            return t

        input_ids = torch.randint(0, int(config.get("vocab_size", 32000)), (setup.batch, setup.seq))
        tracker.track(input_ids)
        batch = {"input_ids": input_ids, "labels": input_ids}
        if setup.pad_mask:
            batch["attention_mask"] = padding_mask(setup.batch, setup.seq)
            tracker.track(batch["attention_mask"])
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        for step in range(steps):
            if step == steps - 1:
                saved_by_module.clear()
                saved_detail.clear()
            for micro in range(setup.grad_accum):
                tracker.phase = "forward:layers"
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                    loss = model(**batch).loss
                    if setup.grad_accum > 1:
                        loss = loss / setup.grad_accum
                tracker.phase = "backward:pre"
                tracker.on_backward_start()
                loss.backward()
                del loss
                tracker.observe()
            tracker.phase = "optimizer"
            opt.step()
            tracker.observe()
            tracker.phase = None
            opt.zero_grad(set_to_none=True)
            tracker.saved.clear()

    return TraceNumbers(
        num_layers=hf_cfg.num_hidden_layers,
        phase_peaks=tracker.peaks,
        params_total=sum(p.numel() for p in params),
        params_trainable=sum(p.numel() for p in trainable),
        saved_by_module=dict(sorted(saved_by_module.items(), key=lambda kv: -kv[1])),
        saved_detail=saved_detail,
    )


def _combine(base: TraceNumbers, deltas: list[tuple[TraceNumbers, TraceNumbers, float]], num_layers: int) -> TraceNumbers:
    """``base`` plus, for each (lo, hi, n), n times the per-layer difference hi - lo."""

    def value(get) -> int:
        return round(get(base) + sum(n * (get(hi) - get(lo)) for lo, hi, n in deltas))

    peaks = {}
    for m in MOMENTS:
        if m == "backward:middle":
            # inner layers exist only from depth 3; a line through the inner layers' peaks never
            # rises above the top or the bottom layer's, which are extrapolated themselves
            peaks[m] = _PhasePeak()
            continue
        cats = {c: value(lambda t, m=m, c=c: t.phase_peaks[m].categories.get(c, 0)) for c in CATEGORIES}
        peaks[m] = _PhasePeak(bytes=value(lambda t, m=m: t.phase_peaks[m].bytes), categories=cats)
    return TraceNumbers(
        num_layers=num_layers,
        phase_peaks=peaks,
        params_total=value(lambda t: t.params_total),
        params_trainable=value(lambda t: t.params_trainable),
        saved_by_module=base.saved_by_module,
    )


def _extrapolate(a: TraceNumbers, b: TraceNumbers, num_layers: int) -> TraceNumbers:
    """Per-layer linear extrapolation from traces at depths ``a.num_layers`` < ``b.num_layers``."""
    per_layer = (num_layers - a.num_layers) / (b.num_layers - a.num_layers)
    return _combine(a, [(a, b, per_layer)], num_layers)


def _num_layers(config: dict) -> int:
    return int(config.get("num_hidden_layers") or config.get("n_layer"))


def _layer_types(config: dict) -> list[str] | None:
    """Per-layer attention types as transformers resolves them (sliding/full), if the family has them."""
    hf = _hf_config(config, None)
    types = getattr(hf, "layer_types", None)
    return list(types) if types else None


def trace(
    model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, *, full_depth_max: int = 4, depths: tuple[int, int] = (2, 3)
) -> Breakdown:
    """Traced Breakdown of ``setup`` on ``model``.

    Models with more than ``full_depth_max`` layers are traced at two depths and extrapolated
    linearly per layer: every layer of a decoder stack adds the same bytes to each phase's peak
    (weights, gradients, states and saved activations), which ``tests/test_trace.py`` checks
    against a full-depth trace. Families mixing layer types (Gemma2/3 sliding and full attention)
    are extrapolated per type: one extra trace adds a layer of each type to the base.
    """
    from .checks import check

    check(model, setup)  # a setup peft or transformers would refuse fails here, in one line
    _require_torch()
    L = _num_layers(model.config)
    if L <= full_depth_max:
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
    from .estimator.corrections import device_overheads

    phase_peaks = {ph: nums.phase(ph).bytes for ph in PHASES}
    phase = max(PHASES, key=lambda ph: phase_peaks[ph])
    cats = nums.phase(phase).categories
    peak = phase_peaks[phase]
    allocated, reserved, device_total, overheads = device_overheads(peak, setup.gpus, gpu)
    components = tuple(Component(name=c, bytes=int(cats.get(c, 0)), phases=(phase,)) for c in CATEGORIES) + tuple(
        Component(name, n, PHASES, note=(n_note + "; " if n_note else "") + "published figure, not traced")
        for name, n, n_note in overheads
    )
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
        gpu=gpu,
        notes=(note,),
    )
