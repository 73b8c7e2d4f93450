"""Peak of live tensor storage bytes in a real run, counted the way the tracer counts fake ones.

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
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable


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

    def _track(self, tensor) -> None:
        if self.device is not None and tensor.device.type != self.device:
            return
        if tensor.is_meta:
            return
        try:
            st = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        key = id(st)
        if key in self._by_obj:
            return
        sid = next(self._ids)
        n = st.nbytes()
        self._by_obj[key] = sid
        self.live[sid] = n
        self.current_bytes += n

        def _free(_ref, sid=sid, key=key):
            self.current_bytes -= self.live.pop(sid, 0)
            self._by_obj.pop(key, None)
            self._refs.pop(sid, None)

        self._refs[sid] = weakref.ref(st, _free)

    def _observe(self) -> None:
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
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
    def __enter__(self) -> "LiveTensorCounter":
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
                return out

        self._mode = _LiveBytesMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)
