"""A traced step per GPU of a layer split: the fake-tensor step with each tensor on the GPU of its layer.

The tracer (vramplan/run/tracer.py) runs the real transformers/peft step on fake tensors on one
device; a ``device_map`` step runs the same ops with each module on its GPU and accelerate's
hooks copying what crosses (accelerate 1.15 hooks.py ``AlignDevicesHook``: ``send_to_device`` of
a module's inputs to its execution device; the top module's output back to the first GPU). Here
every storage is charged to a GPU when it is created:

- parameters and buffers to the GPU of their module in the real device_map (transformers' own,
  from vramplan/truths/layer_split_truth.py);
- in the forward, what a placed module (embeddings, each decoder layer, final norm, rotary
  embedding, head) creates goes to its GPU; an input from another GPU is copied first (a
  ``clone``, differentiable as ``.to(device)`` is), as the hook does;
- in the backward, a hook on each placed module's output switches to that module's GPU as its
  gradient arrives, so a layer's backward (and its recompute under checkpointing) is charged
  there; the loss's backward runs on the head's GPU;
- the optimizer steps each GPU's parameters in turn (torch's foreach AdamW groups tensors by
  device): one optimizer per GPU, stepped in order.

Two canonical steps; per GPU, the live bytes' peak in each phase. A bitsandbytes base cannot run
on fake tensors (as for the tracer): its splits are checked by placement only.
"""

from __future__ import annotations

from ..run.live import LiveTensorCounter
from ..run.models import (
    NotTraceable,
    adapt_for_training,
    attn_implementation,
    hf_config,
    require_torch,
    torch_optimizer,
)
from ..specs import PHASES, Setup


class RankCounter(LiveTensorCounter):
    """Live storage bytes per GPU: each storage is charged to :attr:`rank` when it is first seen
    (or to the rank given to :meth:`add`); per GPU, the peak of each phase."""

    def __init__(self, ranks: int) -> None:
        super().__init__(device=None)
        self.rank = 0
        self.rank_of: dict[int, int] = {}
        self.by_rank = [0] * ranks
        self.peaks = [dict.fromkeys(PHASES, 0) for _ in range(ranks)]

    def add(self, tensor, rank: int | None = None) -> int | None:
        """Count ``tensor`` (charged to ``rank``, moved there if it is counted already)."""
        saved, self.rank = self.rank, self.rank if rank is None else rank
        try:
            sid = self._track(tensor)
        finally:
            self.rank = saved
        if sid is not None and rank is not None and self.rank_of[sid] != rank:
            self.by_rank[self.rank_of[sid]] -= self.live[sid]
            self.by_rank[rank] += self.live[sid]
            self.rank_of[sid] = rank
        return sid

    def _counted(self, sid: int, nbytes: int) -> None:
        self.rank_of[sid] = self.rank
        self.by_rank[self.rank] += nbytes

    def _freed(self, sid: int, nbytes: int) -> None:
        self.by_rank[self.rank_of.pop(sid)] -= nbytes

    def _observe(self) -> None:
        if self._phase is None:
            return
        for r, n in enumerate(self.by_rank):
            if n > self.peaks[r][self._phase]:
                self.peaks[r][self._phase] = n


def _device_of(device_map: dict, name: str) -> int:
    best, depth = None, -1
    for mod, dev in device_map.items():
        if (mod == "" or name == mod or name.startswith(mod + ".")) and len(mod) > depth:
            best, depth = dev, len(mod)
    if not isinstance(best, int):
        raise NotTraceable(f"{name} is placed on {best!r}, not a GPU")
    return best


def traced_rank_peaks(config: dict, setup: Setup, device_map: dict, steps: int = 2) -> list[dict[str, int]]:
    """Per GPU, the tensor peak of each phase of ``steps`` canonical steps under ``device_map``."""
    require_torch()
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from ..run.knob_paths import tie_original_embeddings
    from ..run.real_paths import real_code_paths

    if (setup.quant != "none" or setup.precision.endswith("-mixed") or setup.loss != "hf"
            or setup.optimizer_in_backward):
        raise NotTraceable("the per-GPU trace runs 16/32-bit bases with the HF loss (bitsandbytes layers cannot "
                           "run on fake tensors)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.precision]
    hf_cfg = hf_config(config, None)
    hf_cfg.use_cache = False
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, dtype=dtype, attn_implementation=attn_implementation(config, setup))
    model = adapt_for_training(model, setup)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ranks = 1 + max(d for d in device_map.values() if isinstance(d, int))
    counter = RankCounter(ranks)
    L = hf_cfg.num_hidden_layers
    placed = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(L)), "model.norm", "model.rotary_emb",
              "lm_head"]
    head_rank = _device_of(device_map, "lm_head")

    def pre(mod, args, kwargs, rank):
        counter.rank = rank

        def move(t):
            if isinstance(t, torch.Tensor) and counter.rank_of.get(counter.sid_of(t)) not in (rank, None):
                return t.clone()  # AlignDevicesHook.pre_forward: send_to_device(args, execution_device)
            return t

        return tree_map(move, args), tree_map(move, kwargs)

    def post(mod, args, out, rank):
        def mark(t):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, r=rank: setattr(counter, "rank", r))
            return t

        tree_map(mark, out if isinstance(out, (tuple, list, torch.Tensor)) else tuple(out.values()))

    for name in placed:
        mod = base.get_submodule(name)
        rank = _device_of(device_map, name)
        mod.register_forward_pre_hook(lambda m, a, k, r=rank: pre(m, a, k, r), with_kwargs=True)
        mod.register_forward_hook(lambda m, a, o, r=rank: post(m, a, o, r))

    def to_first(_mod, _args, out):  # the top module's io_same_device: its output goes to GPU 0
        if head_rank == 0:
            return out
        counter.rank = 0
        out["loss"] = out["loss"].clone()
        out["logits"] = out["logits"].clone()
        return out

    base.register_forward_hook(to_first)

    with real_code_paths(setup.pad_mask), FakeTensorMode(allow_non_fake_inputs=True), counter:
        model.to_empty(device="cpu")
        if getattr(base.config, "tie_word_embeddings", False):
            tie_original_embeddings(base)
        for pname, p in base.named_parameters(remove_duplicate=False):
            counter.add(p, _device_of(device_map, pname))
        for bname, b in base.named_buffers():
            counter.add(b, _device_of(device_map, bname))
        by_rank: dict[int, list] = {}
        for pname, p in base.named_parameters():
            if p.requires_grad:
                by_rank.setdefault(_device_of(device_map, pname), []).append(p)
        opts = [(r, torch_optimizer(setup, ps)) for r, ps in sorted(by_rank.items())]
        input_ids = torch.randint(0, int(config.get("vocab_size", 32000)), (setup.batch, setup.seq))
        counter.add(input_ids, 0)
        for _step in range(steps):
            for _micro in range(setup.grad_accum):
                counter.phase("forward")
                counter.rank = 0
                loss = model(input_ids=input_ids, labels=input_ids).loss
                if setup.grad_accum > 1:
                    loss = loss / setup.grad_accum
                counter.phase("backward")
                counter.rank = head_rank
                loss.backward()
                del loss
            counter.phase("optimizer")
            for r, opt in opts:
                counter.rank = r
                opt.step()
            counter.phase(None)
            for _r, opt in opts:
                opt.zero_grad(set_to_none=True)
    return counter.peaks
