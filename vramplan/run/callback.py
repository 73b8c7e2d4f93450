"""The measuring callback of :mod:`vramplan.run.worker`: a ``TrainerCallback`` that counts live
tensors over the first steps (:class:`vramplan.run.live.LiveTensorCounter`, capped on CPU to
emulate a card's size), labels the phases, reads the CUDA allocator's peaks and device memory at
every phase change, and times the steps after the counted ones.
"""

from __future__ import annotations

import gc
import json
import resource
import time
from pathlib import Path
from typing import Any

from ..util.fileio import atomic_write_text
from .device_memory import DeviceMemory, cuda_peaks
from .live import LiveTensorCounter

#: Steps whose live tensors are counted (the canonical step's peak is over two steps).
COUNTED_STEPS = 2


class CpuMemoryCapExceeded(MemoryError):
    """Live tensor bytes passed the CPU cap: the CPU emulation of CUDA's out-of-memory error."""


class CappedCounter(LiveTensorCounter):
    """A :class:`LiveTensorCounter` that raises :class:`CpuMemoryCapExceeded` when the live bytes
    pass ``cap_bytes`` (None: no cap), as the CUDA allocator raises when a card is full."""

    def __init__(self, device: str | None, cap_bytes: int | None = None) -> None:
        super().__init__(device)
        self.cap_bytes = cap_bytes

    def _observe(self) -> None:
        super()._observe()
        if self.cap_bytes is not None and self.current_bytes > self.cap_bytes:
            raise CpuMemoryCapExceeded(
                f"live tensors {self.current_bytes} bytes > cap {self.cap_bytes} bytes in {self._phase or 'setup'}")



class Measure:
    """The events of a TrainerCallback (mixed into one by :func:`make_callback`) that count live
    tensors over the first steps, labels phases, reads CUDA peaks per phase and times steps.

    Phases: ``forward`` (a forward pre-hook on the model), ``backward`` (around the Trainer's
    ``accelerator.backward``), ``optimizer`` (``on_pre_optimizer_step``, after clipping; with
    DeepSpeed, around ``engine.step``, which accelerate calls inside ``backward``).

    ``accelerator``: set by whoever holds the Trainer (:mod:`vramplan.run.worker`); a callback
    added to a user's Trainer has none (a ``TrainerCallback`` is not given the Trainer), and then
    ``backward`` starts when the model's forward returns (a forward hook: the loss the model
    computes is in ``forward``, what the Trainer computes after it in ``backward``).
    Request keys: ``device``, ``steps``, ``tokens_per_step``, ``cpu_memory_cap_bytes``, and
    ``cpu_foreach`` (default True: on the CPU, AdamW's groups are switched to ``foreach`` as torch
    defaults to on CUDA; False leaves a user's optimizer as it is).
    """

    accelerator = None

    def __init__(self, request: dict, status_path: Path | None) -> None:
        self.device = request["device"]
        self.steps_total = int(request["steps"])
        self.counted_steps = min(COUNTED_STEPS, self.steps_total)
        self.tokens_per_step = int(request["tokens_per_step"])
        self.status_path = status_path
        self.counter = CappedCounter("cuda" if self.device == "cuda" else "cpu", request.get("cpu_memory_cap_bytes"))
        self.counting = False
        self.phase: str | None = "setup"
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.device_samples: list[int] = []
        self.process_samples: list[int] = []
        self.device_memory: DeviceMemory | None = None
        self.step_times: list[tuple[float, bool]] = []  # (seconds, counted)
        self.step = 0
        self._t0 = 0.0
        self.cpu_foreach = bool(request.get("cpu_foreach", True))
        self.hooks: list = []

    # phases -----------------------------------------------------------------------------------
    def set_phase(self, name: str) -> None:
        if name == self.phase:
            return
        if self.device == "cuda":
            self.close_cuda_phase()
        self.phase = name
        if self.counting:
            self.counter.phase(name)
        if self.counting or not self.step_times:  # the timed steps write nothing (it is fsynced)
            self._status()

    def close_cuda_phase(self) -> None:
        """End the phase on CUDA: fold the allocator's peaks into it, sample the device memory,
        reset the peaks."""
        import torch

        torch.cuda.synchronize()
        peaks = cuda_peaks()
        into = self.phase_peaks.setdefault(self.phase or "setup", {})
        for k, v in peaks.items():
            into[k] = max(into.get(k, 0), v)
        if self.device_memory is not None:
            try:  # a reading NVML cannot give costs a sample, not the run
                used = self.device_memory.used_bytes()
            except Exception:  # noqa: BLE001
                used = None
            if used is not None:
                self.device_samples.append(max(0, used - self.device_memory.baseline_bytes))
            mine = self.device_memory.process_bytes()
            if mine is not None:
                self.process_samples.append(mine)
        torch.cuda.reset_peak_memory_stats()

    def _status(self) -> None:
        if self.status_path is not None:
            atomic_write_text(self.status_path, json.dumps({"step": self.step, "phase": self.phase}))

    # Trainer events -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import torch

        from .cuda_paths import quant_state_tensors

        if self.device == "cpu" and optimizer is not None and self.cpu_foreach:
            for group in optimizer.param_groups:  # torch's default on CUDA
                if "foreach" in group and not group.get("fused"):
                    group["foreach"] = True
        self.hooks = [model.register_forward_pre_hook(lambda *_: self.set_phase("forward"))]
        if self.accelerator is None:  # no Trainer at hand: the backward phase starts after the forward
            self.hooks.append(model.register_forward_hook(lambda *_: self.set_phase("backward")))
        else:
            self._wrap_accelerator()
        self.counter.track(model, optimizer, quant_state_tensors(model), all_tensors(torch))
        self.counter.__enter__()
        self.counting = True
        self.counter.phase(self.phase)
        return control

    def _wrap_accelerator(self) -> None:
        """The backward phase around ``accelerator.backward``; DeepSpeed's step inside it."""
        trainer_backward = self.accelerator.backward

        def backward(loss, **kw):
            self.set_phase("backward")
            return trainer_backward(loss, **kw)

        self.accelerator.backward = backward
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:  # accelerate runs DeepSpeed's optimizer step inside backward()
            engine_step = wrapped.engine.step

            def step(*a, **kw):
                self.set_phase("optimizer")
                return engine_step(*a, **kw)

            wrapped.engine.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self._status()
        self._t0 = time.perf_counter()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.set_phase("optimizer")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self.step_times.append((time.perf_counter() - self._t0, self.counting))
        self.step += 1
        self.set_phase("step_end")
        if self.counting and self.step >= self.counted_steps:
            self.stop_counting()
        return control

    def stop_counting(self) -> None:
        if self.counting:
            self.counting = False
            self.counter.__exit__(None, None, None)

    def remove_hooks(self) -> None:
        """Take the phase hooks off the model (a user's run goes on without them)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    # the result --------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tensor_peak_bytes": self.counter.peak_bytes,
            "tensor_phase_peaks_bytes": {k: v for k, v in self.counter.phase_peaks.items() if k != "step_end"},
            "steps_done": self.step,
            "counted_steps": self.counted_steps,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        timed = [t for t, counted in self.step_times if not counted] or [t for t, _ in self.step_times]
        if timed:
            step_time = sorted(timed)[len(timed) // 2]
            out.update(step_time_s=step_time, tokens_per_s=self.tokens_per_step / step_time,
                       timed_with_counter=all(c for _, c in self.step_times))
        if self.device == "cuda":
            overall: dict[str, int] = {}
            for peaks in self.phase_peaks.values():
                for k, v in peaks.items():
                    overall[k] = max(overall.get(k, 0), v)
            out.update(overall)
            out["phase_peaks"] = self.phase_peaks
            if self.device_samples:
                out["device_used_bytes"] = max(self.device_samples)
            if self.process_samples:
                out["device_process_bytes"] = max(self.process_samples)
        return out


def make_callback(request: dict, status_path: Path | None) -> Measure:
    """A :class:`Measure` that is also a ``transformers.TrainerCallback`` (its other events are
    the base class's no-ops)."""
    from transformers import TrainerCallback

    cls = type("MeasureCallback", (Measure, TrainerCallback), {})
    return cls(request, status_path)


def all_tensors(torch) -> list:
    """Every tensor the garbage collector can reach: what exists before the counter starts
    (DeepSpeed's flat buffers and fp32 partitions, the Trainer's loss accumulator)."""
    import warnings

    found = []
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
            except ReferenceError:  # a dead weakref proxy
                continue
    return found
