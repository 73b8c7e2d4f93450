"""``plan()``: the inputs checked, the search run (again without the margin when nothing fits
with it, and under relaxed targets when nothing fits at all), and the :class:`~vramplan.specs.Plan`
assembled from what it found."""

from __future__ import annotations

from typing import Any

from ..inputs import resolve_gpu
from ..specs import GpuSpec, ModelSpec, Plan, SpecError
from . import explain
from .core import Search
from .geometry import Target, batch_shape, global_batch_of
from .relax import what_would
from .space import check_fixed


def plan(model: ModelSpec | str, gpu: GpuSpec | str | int, *, gpus: int = 1, nodes: int = 1,
         host_ram: int | str | None = None, nvme: bool = False, seq: int = 2048, global_batch: int | None = None,
         tokens_per_step: int | None = None, dataset_tokens: int | None = None, error_band: float | None = None,
         relax: bool = True, **fixed: Any) -> Plan:
    """The fastest Setup of ``model`` that fits ``gpu`` (see :mod:`vramplan.search` for how).

    ``fixed`` pins Setup knobs (``method="lora"``, ``lora_rank=64``, ``quant="none"``,
    ``checkpointing=False``, ``zero_stage=3``, ``batch=4``...); every other knob is searched.
    ``host_ram`` (bytes or "64GiB") bounds CPU offload per node; ``nvme`` allows NVMe offload.
    When nothing fits, the Plan has ``fits`` False and notes saying what would (``relax``).
    """
    spec = _resolve_model(model)
    card = _resolve_gpu(gpu)
    if isinstance(host_ram, str):
        from ..units import parse_bytes

        try:
            host_ram = parse_bytes(host_ram)
        except ValueError as exc:
            raise SpecError(f"host RAM: {exc}") from None
    if dataset_tokens is not None and (isinstance(dataset_tokens, bool) or not isinstance(dataset_tokens, int)
                                       or dataset_tokens <= 0):
        raise SpecError(f"dataset_tokens must be a positive integer; got {dataset_tokens!r}")
    if error_band is not None and not 0 <= error_band < 1:
        raise SpecError(f"error_band must be in [0, 1); got {error_band!r}")
    target = Target(card, gpus, nodes, host_ram, nvme)
    fixed = {k: v for k, v in fixed.items() if v is not None}
    check_fixed(spec, {k: v for k, v in fixed.items() if k not in ("batch", "grad_accum")}, gpus, seq)
    shape = batch_shape(seq, gpus, global_batch, tokens_per_step, fixed.get("batch"), fixed.get("grad_accum"))
    search = Search(spec, target, shape, fixed, error_band)
    result = search.run()
    chosen = result.choose()
    tight = False
    if chosen is None:
        loose_result = Search(spec, target, shape, fixed, error_band, margin=False).run()
        if loose_result.choose() is not None:
            result, chosen, tight = loose_result, loose_result.choose(), True
    if chosen is None:
        # report the smallest setup that fails on the GPU itself, so the plan's own fit is False
        judged = [c for c in result.search.ev.failures if c.breakdown is not None]
        on_gpu = [c for c in judged if not c.breakdown.fits]
        if not on_gpu:  # only host RAM stands in the way, and the fixed knobs force the offload
            raise SpecError(explain.host_bound_error(min(judged, key=lambda c: c.device_total_bytes)))
        floor = min(on_gpu, key=lambda c: c.device_total_bytes)
        host_only = [c for c in judged if c.breakdown.fits and c.host_ram_bound]
        notes = explain.no_fit_notes(floor, min(host_only, key=lambda c: c.device_total_bytes) if host_only else None)
        if relax:
            gpu_floor = result.gpu_floor()
            relaxed = what_would(spec, target, shape, fixed, error_band,
                                 global_batch_of(seq, gpus, global_batch, tokens_per_step),
                                 0 if gpu_floor is None else gpu_floor)
            notes += [explain.relaxation_note(r) for r in relaxed]
        return Plan(model=spec.name, setup=floor.setup, breakdown=floor.breakdown, gpu=card, nodes=nodes,
                    step_time_s=round(floor.step.step_s, 4), tokens_per_s=round(floor.tokens_per_s, 1),
                    alternatives=(), rejected=explain.rejected(result, None), notes=tuple(notes))

    notes = explain.fit_notes(result, chosen, tight=tight, card=card,
                              biggest=result.search.biggest_micro_batch(chosen.setup),
                              batch_fixed=shape.per_gpu is not None or "batch" in fixed,
                              host_ram_checked=host_ram is not None, dataset_tokens=dataset_tokens)
    return Plan(model=spec.name, setup=chosen.setup, breakdown=chosen.breakdown, gpu=card, nodes=nodes,
                step_time_s=round(chosen.step.step_s, 4), tokens_per_s=round(chosen.tokens_per_s, 1),
                alternatives=explain.alternatives(result, chosen), rejected=explain.rejected(result, chosen),
                notes=tuple(notes))


def _resolve_model(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from ..profiles import load_model

    return load_model(model)


def _resolve_gpu(gpu: GpuSpec | str | int) -> GpuSpec:
    """``plan``'s GPU argument, through :func:`vramplan.inputs.resolve_gpu`."""
    if isinstance(gpu, bool) or not isinstance(gpu, (GpuSpec, str, int, dict)):
        raise SpecError(f"gpu must be a GPU name, a GpuSpec or a size in bytes; got {gpu!r}")
    return resolve_gpu(gpu)
