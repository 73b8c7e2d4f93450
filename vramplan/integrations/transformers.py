"""``VramplanCallback``: vramplan's estimate and a measurement of a user's own HF Trainer / TRL run.

    from vramplan.integrations.transformers import VramplanCallback

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                         callbacks=[VramplanCallback(gpu="a100-80gb", record_to="calibration/measurements")])
    trainer.train()

At ``on_train_begin`` (transformers 5.24 ``Trainer._inner_training_loop``: after the model is
wrapped and the optimizer built; ``CallbackHandler.call_event`` passes ``model``, ``optimizer``,
``processing_class``, ``lr_scheduler``, ``train_dataloader``) the Setup is read off the trainer
(:func:`vramplan.integrations.trainer_setup.setup_from_trainer`) and the estimate is logged
(logger ``vramplan.integrations.transformers``: the headline at ``log_level``, default INFO, a
setup that will not fit the GPU at WARNING). The GPU: ``gpu=`` (a shipped name, a GpuSpec, bytes),
else on CUDA the device's (``torch.cuda.get_device_properties``: the shipped card of that name, or
its total memory), else none (no fit verdict).

Sequence length: a TRL config's ``max_length`` (what the collator truncates to), else ``seq=``,
else the first batch's: a forward pre-hook (``with_kwargs=True``) on the model reads
``input_ids``/``inputs_embeds``' shape at the first forward, and the estimate is made and logged
then, before that forward runs. The first batch's shape is recorded either way
(:attr:`VramplanCallback.first_batch_shape`); a padded collator's first batch may be shorter than
later ones, so pass ``seq=`` for the longest.

Measuring: from train begin, :class:`vramplan.run.callback.Measure` (the callback ``vramplan
measure`` runs) counts live tensors over the first two steps (the tensor peak, per phase: forward
from the forward pre-hook, backward from the forward's return, optimizer from
``on_pre_optimizer_step``) and on CUDA reads ``torch.cuda.max_memory_allocated``/``reserved`` per
phase (it resets the peak statistics at each phase change) and NVML's per-process memory. After
``measure_steps`` optimizer steps (default 3; or at train end, if fewer ran) the hooks come off,
the measured peaks are logged against the estimate (:func:`vramplan.calibration.measure.comparison`), and with
``record_to=`` (a records directory, or a ``.jsonl`` file) a measurement record
(docs/schema/measurement.schema.json) is appended, which ``vramplan calibrate`` reads. Unlike
``vramplan measure`` the user's optimizer is left as it is (on the CPU, torch AdamW without
``foreach``: the estimate's foreach transient is the CUDA default). Only the main process
(``args.process_index == 0``) logs, measures and records. Any error inside the callback is logged
and turns it off; the training goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..specs import SpecError
from .trainer_setup import TrainerSetup, setup_from_trainer

__all__ = ["VramplanCallback"]

logger = logging.getLogger(__name__)


def _size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny test model's step)."""
    from ..util.units import GiB, fmt_bytes

    return fmt_bytes(n, "GiB" if abs(n) >= GiB else "MiB")


class VramplanCallback(TrainerCallback):
    """Estimate at train start, measure the first steps, optionally append a measurement record.

    After training: :attr:`trainer_setup` (what was read), :attr:`setup`, :attr:`breakdown` (the
    estimate), :attr:`measurement` (a :class:`vramplan.calibration.measure.Measurement`), :attr:`record_path`,
    :attr:`first_batch_shape`, :attr:`notes` (every line logged).
    """

    def __init__(self, *, seq: int | None = None, gpu: Any = None, measure_steps: int = 3,
                 record_to: str | Path | None = None, calibration: bool = True,
                 log_level: int = logging.INFO) -> None:
        if measure_steps < 1:
            raise SpecError(f"measure_steps must be at least 1; got {measure_steps}")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
            raise SpecError(f"seq must be a positive integer; got {seq!r}")
        self.seq, self.gpu_arg, self.measure_steps = seq, gpu, measure_steps
        self.record_to, self.calibration, self.log_level = record_to, calibration, log_level
        self.trainer_setup: TrainerSetup | None = None
        self.setup = None
        self.breakdown = None
        self.gpu = None
        self.measurement = None
        self.record_path: Path | None = None
        self.first_batch_shape: tuple[int, ...] | None = None
        self.notes: list[str] = []
        self.device = "cpu"
        self._measure = None
        self._hook = None
        self._info: dict[str, Any] = {}
        self._args = None
        self._active = False

    # logging ----------------------------------------------------------------------------------
    def _log(self, level: int, message: str) -> None:
        self.notes.append(message)
        logger.log(level, "vramplan: %s", message)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._log(logging.WARNING, f"{what} failed ({type(exc).__name__}: {exc}); the callback is off for this run")
        self._stop()

    # Trainer events ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(args, "process_index", 0) != 0 or model is None:
            return control
        self._args = args
        try:
            self.trainer_setup = setup_from_trainer(args, model, optimizer, seq=self.seq)
            for w in self.trainer_setup.warnings:
                self._log(logging.WARNING if w.kind == "ignored" else logging.INFO, str(w))
            self.device = "cuda" if getattr(getattr(args, "device", None), "type", "cpu") == "cuda" else "cpu"
            self.gpu = self._resolve_gpu(args)
            self._hook = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)
            if self.trainer_setup.seq is not None:
                self._estimate(self.trainer_setup.seq)
            self._start_measuring(args, state, control, model, optimizer)
        except Exception as exc:  # noqa: BLE001 - the user's run must go on
            self._failed("reading the trainer's setup", exc)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if self._active:
            self._measure.on_step_begin(args, state, control)
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._active:
            self._measure.on_pre_optimizer_step(args, state, control)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self._active:
            try:
                self._measure.on_step_end(args, state, control)
                if self._measure.step >= self.measure_steps:
                    self._finish()
            except Exception as exc:  # noqa: BLE001
                self._failed("measuring", exc)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._active:
            try:
                self._finish()
            except Exception as exc:  # noqa: BLE001
                self._failed("measuring", exc)
        self._remove_hook()
        return control

    # the estimate -----------------------------------------------------------------------------
    def _resolve_gpu(self, args):
        from ..setup.inputs import resolve_gpu

        if self.gpu_arg is not None:
            return resolve_gpu(self.gpu_arg)
        if self.device != "cuda":
            return None
        import torch

        from ..model.profiles import load_gpu

        index = args.device.index or 0
        props = torch.cuda.get_device_properties(index)
        self._info = {"gpu_name": props.name, "gpu_total_bytes": int(props.total_memory),
                      "compute_capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
        try:
            return load_gpu(props.name)
        except SpecError:
            return resolve_gpu(int(props.total_memory))

    def _first_forward(self, module, args, kwargs):
        """The forward pre-hook: the first batch's shape; the estimate when it waited for it."""
        try:
            if self.first_batch_shape is None:
                batch = kwargs.get("input_ids")
                if batch is None:
                    batch = kwargs.get("inputs_embeds")
                if batch is None and args:
                    batch = args[0]
                if hasattr(batch, "shape"):
                    self.first_batch_shape = tuple(int(d) for d in batch.shape)
                self._remove_hook()
                if self.setup is None and self.trainer_setup is not None:
                    if self.first_batch_shape is None or len(self.first_batch_shape) < 2:
                        self._log(logging.WARNING, "the first batch has no input_ids: pass VramplanCallback(seq=N)")
                        return None
                    self._log(self.log_level, f"sequence length {self.first_batch_shape[1]} from the first batch "
                              f"(pass seq= for the longest a batch can be)")
                    self._estimate(self.first_batch_shape[1])
                elif self.setup is not None and self.first_batch_shape and len(self.first_batch_shape) >= 2 \
                        and self.first_batch_shape[1] != self.setup.seq:
                    self._log(self.log_level, f"the first batch is {self.first_batch_shape[1]} tokens long; the "
                              f"estimate is for seq {self.setup.seq}")
        except Exception as exc:  # noqa: BLE001
            self._failed("the estimate", exc)
        return None

    def _estimate(self, seq: int) -> None:
        from ..estimator import estimate
        from ..estimator.corrections import calibration_for
        from ..estimator.stack import Stack
        from ..setup.wording import describe

        self.setup = self.trainer_setup.setup(seq)
        corrections, warnings = calibration_for(self.gpu, None, enabled=self.calibration)
        for w in warnings:
            self._log(logging.WARNING, w)
        # TRL's fused head (loss trl, DPO, GRPO) runs its Triton fold on CUDA only (trl/kernels/chunked_logprob.py
        # _use_triton): its torch fold's fp32 tiles elsewhere
        bd = estimate(self.trainer_setup.spec, self.setup, self.gpu, corrections,
                      stack=Stack(trl_triton=self.device == "cuda"))
        self.breakdown = bd
        gpus = f" on {self.setup.gpus} GPUs" if self.setup.gpus > 1 else ""
        head = (f"{self.trainer_setup.model}: {describe(self.setup)}{gpus}: estimated device total "
                f"{_size(bd.device_total_bytes)} (tensor peak {_size(bd.tensor_peak_bytes)}, peak in {bd.phase})")
        if bd.gpu is None:
            self._log(self.log_level, f"{head}; no GPU to judge the fit (pass gpu=)")
        elif bd.fits:
            self._log(self.log_level, f"{head}; fits on {bd.gpu.display_name} ({_size(bd.headroom_bytes)} headroom)")
        else:
            self._log(logging.WARNING, f"{head}; will NOT fit on {bd.gpu.display_name} "
                      f"({_size(bd.gpu.usable_memory_bytes)} usable, {_size(-bd.headroom_bytes)} short)")

    # measuring --------------------------------------------------------------------------------
    def _start_measuring(self, args, state, control, model, optimizer) -> None:
        from ..run.callback import Measure

        request = {"device": self.device, "steps": self.measure_steps, "tokens_per_step": 0, "cpu_foreach": False}
        self._measure = Measure(request, None)
        if self.device == "cuda":
            import torch

            from ..run.device_memory import DeviceMemory

            self._measure.device_memory = DeviceMemory(args.device.index or 0)
            self._info.update(self._measure.device_memory.info())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # from train begin: loading the model is not the step
        self._measure.on_train_begin(args, state, control, model=model, optimizer=optimizer)
        self._active = True

    def _stop(self) -> None:
        self._active = False
        if self._measure is not None:
            self._measure.stop_counting()
            self._measure.remove_hooks()
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _finish(self) -> None:
        measure = self._measure
        measure.stop_counting()
        if self.device == "cuda":
            measure.close_cuda_phase()
        measure.remove_hooks()
        self._active = False
        if self.setup is None:
            self._log(logging.WARNING, "no estimate was made (the sequence length is unknown): nothing to compare")
            return
        s = self.setup
        measure.tokens_per_step = s.batch * s.seq * s.grad_accum
        self.measurement = self._measurement(measure.result())
        self._compare()
        if self.record_to is not None:
            self._record()

    def _measurement(self, result: dict):
        from ..calibration import measure as m
        from ..estimator import estimate
        from ..estimator.corrections import DEFAULT_CORRECTIONS
        from ..estimator.stack import Stack

        args = self._args
        measured = {"device": self.device, "oom": False, "world_size": int(getattr(args, "world_size", 1) or 1),
                    "rank": int(getattr(args, "process_index", 0)), **result}
        measured.setdefault("tensor_peak_bytes", None)
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            measured.setdefault(key, None)
        measured["device_total_bytes"] = measured.get("device_process_bytes") or measured.get("device_used_bytes")
        if self.device == "cuda":
            measured.update({k: v for k, v in self._info.items() if k in ("gpu_name", "gpu_total_bytes",
                             "compute_capability", "cuda", "driver", "memory_source")})
        hardware = self._info.get("gpu_name", "") if self.device == "cuda" else "cpu"
        est = estimate(self.trainer_setup.spec, self.setup, self.gpu, DEFAULT_CORRECTIONS,
                       stack=Stack(trl_triton=self.device == "cuda")).to_json()
        model = self.trainer_setup.model
        return m.Measurement(model=model, setup=self.setup, device=self.device, steps=self.measure_steps,
                             estimate=est, measured=measured, provenance=m.provenance(measured),
                             key=m.measurement_key(model, self.setup, self.device, None, None, hardware))

    def _compare(self) -> None:
        from ..calibration.measure import comparison

        rows = comparison(self.measurement)
        if not rows:
            self._log(self.log_level, "measured: nothing comparable with the estimate")
            return
        parts = [f"{key.removesuffix('_bytes').replace('_', ' ')} {_size(r['measured'])} measured vs "
                 f"{_size(r['estimate'])} estimated ({r['error']:+.1%})" for key, r in rows.items()]
        self._log(self.log_level, f"after {self._measure.step} steps: " + "; ".join(parts))

    def _record(self) -> None:
        from ..calibration import measure as m

        target = Path(self.record_to)
        if target.suffix == ".jsonl":
            self.record_path = m.append_record(target, self.measurement.to_json())
        else:
            self.record_path = m.save(self.measurement, target)
        self._log(self.log_level, f"measurement appended to {self.record_path}")
