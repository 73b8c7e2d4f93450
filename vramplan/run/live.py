"""Peak of live tensor storage bytes: the one counter of every torch path (real runs, and the
tracer's fake tensors through its subclass in :mod:`vramplan.run.tracer`).

    counter = LiveTensorCounter()
    counter.track(model, optimizer)          # what exists before the counter starts
    with counter:
        counter.phase("forward");  loss = model(**batch).loss
        counter.phase("backward"); loss.backward()
        counter.phase("optimizer"); opt.step(); opt.zero_grad(set_to_none=True)
    counter.peak_bytes, counter.phase_peaks

A :class:`TorchDispatchMode` sees the outputs of every op run on this thread while the counter is
entered; each distinct storage is counted once while it is alive (a weakref callback removes it).
Tensors that exist before (weights, buffers, optimizer states) are registered with :meth:`track`.
The number is what ``torch.cuda.max_memory_allocated`` would see without allocator rounding: the
"tensor peak" of the Breakdown. Storages on other device types are ignored (``device=None`` counts
all). Memory a library allocates outside torch (bitsandbytes' paged buffers, DeepSpeed's C++
kernels) is invisible here, as it is to torch's allocator.

:class:`SplitCounter` (the DeepSpeed and FSDP truths) keeps the offloaded host part of the live
bytes apart from what a GPU would hold.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self


class LiveTensorCounter:
    def __init__(self, device: str | None = "cpu") -> None:
        self.device = device
        self._ids = itertools.count()
        self.live: dict[int, int] = {}  # our id -> nbytes
        self._by_obj: dict[int, int] = {}  # id(storage) -> our id
        self._refs: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self._mode = None
        # storages also die on other threads (gloo's workers drop a collective's tensors when it
        # completes): the weakref callback and the main thread's count must not lose an update
        self._lock = threading.RLock()

    # -- registration ---------------------------------------------------------------------
    def track(self, *objs: Any) -> None:
        """Register tensors that already exist: tensors, modules (parameters, their grads and
        buffers), optimizers (their states), or iterables of these."""
        import torch

        for obj in objs:
            if obj is None:
                continue
            if isinstance(obj, torch.Tensor):
                self._track(obj)
                if obj.grad is not None:
                    self._track(obj.grad)
            elif isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    self.track(p)
                for b in obj.buffers():
                    self._track(b)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            self._track(v)
            elif isinstance(obj, dict):
                self.track(*obj.values())
            elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
                self.track(*obj)
        self._observe()

    def _track(self, tensor) -> int | None:
        """Count ``tensor``'s storage while it lives (once, however many tensors view it); its
        id, or None when it is not counted (another device type, meta, no storage). No observing:
        that is :meth:`_observe`'s, after each op."""
        if self.device is not None and tensor.device.type != self.device:
            return None
        if tensor.is_meta:
            return None
        try:
            st = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return None
        key = id(st)
        if key in self._by_obj:
            return self._by_obj[key]
        sid = next(self._ids)
        n = st.nbytes()
        with self._lock:
            self._by_obj[key] = sid
            self.live[sid] = n
            self.current_bytes += n
        self._counted(sid, n)

        def _free(_ref, sid=sid, key=key):
            with self._lock:
                n = self.live.pop(sid, 0)
                self.current_bytes -= n
                self._by_obj.pop(key, None)
                self._refs.pop(sid, None)
            self._freed(sid, n)

        self._refs[sid] = weakref.ref(st, _free)
        return sid

    def _counted(self, sid: int, nbytes: int) -> None:
        """A storage of ``nbytes`` starts being counted as ``sid`` (subclasses attribute it)."""

    def _freed(self, sid: int, nbytes: int) -> None:
        """The storage counted as ``sid`` died (subclasses drop their attribution)."""

    def _after_op(self, func, args: tuple, kwargs: dict) -> None:
        """Called after each op the mode sees, outside the mode (subclasses wait on collectives)."""

    def sid_of(self, tensor) -> int | None:
        """The id under which ``tensor``'s storage is counted, or None if it is not."""
        return self._by_obj.get(id(tensor.untyped_storage()))

    def _observe(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self._phase is not None and self.current_bytes > self.phase_peaks.get(self._phase, 0):
            self.phase_peaks[self._phase] = self.current_bytes

    # -- phases ----------------------------------------------------------------------------
    def phase(self, name: str | None) -> None:
        """Label what runs next (forward, backward, optimizer, ...) for :attr:`phase_peaks`."""
        self._phase = name
        if name is not None:
            self.phase_peaks.setdefault(name, 0)
            self._observe()

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self.phase_peaks = {}

    # -- the dispatch mode -------------------------------------------------------------------
    def __enter__(self) -> Self:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class _LiveBytesMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        counter._track(t)
                counter._observe()
                counter._after_op(func, args, kwargs or {})
                return out

        self._mode = _LiveBytesMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)


class SplitCounter(LiveTensorCounter):
    """LiveTensorCounter that keeps a host part apart: storages marked host (by owner, or
    allocated while ``host_context`` is set) count to ``host_peak`` and not to the device."""

    def __init__(self, detail: bool = False) -> None:
        super().__init__(device="cpu")
        self.detail = detail
        self.sites: dict[int, str] = {}
        self.at_peak: dict[int, int] = {}
        self.host_context = False
        self.host_sids: set[int] = set()
        self.measuring = False
        self.device_peak = 0
        self.device_phase = ""
        self.device_phase_peaks: dict[str, int] = {}
        self.host_peak = 0

    def _track(self, tensor) -> int | None:
        before = self._by_obj.get(id(tensor.untyped_storage())) if not tensor.is_meta else None
        counted = super()._track(tensor)
        if self.detail and before is None and not tensor.is_meta:
            sid = self._by_obj.get(id(tensor.untyped_storage()))
            if sid is not None and sid not in self.sites:
                self.sites[sid] = f"{str(tensor.dtype)[6:]}{list(tensor.shape)} {creation_site()} [{self._phase}]"
        if self.host_context and before is None and not tensor.is_meta:
            sid = self._by_obj.get(id(tensor.untyped_storage()))
            if sid is not None:
                self.host_sids.add(sid)
        return counted

    def host_steps(self, optimizer) -> None:
        """Count what ``optimizer.step()`` allocates as host memory (it steps on the host)."""

        def _pre(*_a):
            self.host_context = True

        def _post(*_a):
            self.host_context = False

        optimizer.register_step_pre_hook(_pre)
        optimizer.register_step_post_hook(_post)

    def mark_host(self, tensors) -> None:
        """Count ``tensors`` (one tensor or several) as host memory from now on."""
        for t in [tensors] if hasattr(tensors, "untyped_storage") else tensors:
            self._track(t)
            sid = self._by_obj.get(id(t.untyped_storage()))
            if sid is not None:
                self.host_sids.add(sid)
        self._observe()

    def unmark_host(self, tensor) -> None:
        """Count ``tensor``'s storage as device memory again (an offloaded activation brought back)."""
        sid = self._by_obj.get(id(tensor.untyped_storage()))
        if sid is not None:
            self.host_sids.discard(sid)
        self._observe()

    def host_live(self) -> int:
        dead = [s for s in self.host_sids if s not in self.live]
        for s in dead:
            self.host_sids.discard(s)
        return sum(self.live[s] for s in self.host_sids)

    def _observe(self) -> None:
        super()._observe()
        if not self.measuring:
            return
        host = self.host_live()
        dev = self.current_bytes - host
        self.host_peak = max(self.host_peak, host)
        if dev > self.device_peak:
            self.device_peak, self.device_phase = dev, self._phase or ""
            if self.detail and not os.environ.get("VRAMPLAN_DETAIL_PHASE"):
                self.at_peak = {s: n for s, n in self.live.items() if s not in self.host_sids}
        if self._phase is not None and dev > self.device_phase_peaks.get(self._phase, 0):
            self.device_phase_peaks[self._phase] = dev
            if self.detail and os.environ.get("VRAMPLAN_DETAIL_PHASE") == self._phase:
                self.at_peak = {s: n for s, n in self.live.items() if s not in self.host_sids}

    def start_measuring(self) -> None:
        self.measuring = True
        self.device_peak, self.device_phase, self.device_phase_peaks, self.host_peak = 0, "", {}, 0
        self._observe()


def creation_site() -> str:
    """The innermost DeepSpeed/transformers frames that allocated a tensor (diagnostics)."""
    import traceback

    frames = [f for f in traceback.extract_stack(limit=24)
              if "site-packages" in f.filename and "/torch/" not in f.filename]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3]) or "?"
