"""``plan()``: the inputs checked, the host RAM resolved, the search run (again without the
margins when nothing fits with them, and under relaxed targets when nothing fits at all), and
the :class:`~vramplan.specs.Plan` assembled from what it found."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from ..estimator.corrections import DEFAULT_CORRECTIONS, Corrections
from ..estimator.stack import DEFAULT_STACK, Stack
from ..model.profiles import unsloth_checkpoint_note
from ..setup.frameworks import with_framework_defaults
from ..setup.inputs import resolve_gpu
from ..specs import GpuSpec, ModelSpec, Note, Plan, SpecError
from . import explain
from .core import Search
from .explain_framework import other_framework, switch_framework
from .geometry import DEFAULT_MARGIN, HostRamSource, Target, batch_shape, global_batch_of, typical_host_ram
from .relax import longest_seq, what_would, with_margins
from .space import check_fixed, rank_choices


def plan(model: ModelSpec | str, gpu: GpuSpec | str | int, *, gpus: int = 1, nodes: int = 1,
         host_ram: int | str | None = None, nvme: bool = False, seq: int = 2048, global_batch: int | None = None,
         tokens_per_step: int | None = None, dataset_tokens: int | None = None, error_band: float | None = None,
         margin: float = DEFAULT_MARGIN, relax: bool = True, corrections: Corrections | None = None,
         host_ram_source: HostRamSource = "given", details: bool = True, stack: Stack | None = None,
         **fixed: Any) -> Plan:
    """The setup of ``model`` an expert would run on ``gpu`` (see :mod:`vramplan.search` for how).

    ``fixed`` pins Setup knobs (``method="lora"``, ``lora_rank=64``, ``quant="none"``,
    ``checkpointing=False``, ``zero_stage=3``, ``batch=4``...); every other knob is searched.
    ``lora_rank`` may be a range, ``(8, 64)`` or ``"8..64"``: the search picks inside it; unset, the
    rank is 16. ``host_ram`` (bytes or "64GiB", per node) bounds CPU offload; None: the GPU
    profile's typical host (the same answer on every machine: this function never reads the one it
    runs on; the CLI passes this machine's RAM when it holds ``gpu``, with ``host_ram_source="local"``,
    see :func:`local_host_ram`). ``host_ram_source`` says where a given ``host_ram`` came from (the
    plan's notes name it). ``margin``: the share
    of usable memory left free. ``corrections``: the device terms every estimate uses (the
    commands pass the calibrated ones, ``estimator.corrections.calibration_for``; None: the
    published defaults, the raw model). ``nvme`` allows NVMe offload. When nothing fits, the Plan has
    ``fits`` False and notes saying what would (``relax``). ``framework="any"`` plans each modelled
    framework and takes the one that trains best (search/any_framework.py). ``details`` False: the same
    setup, Breakdown, speed and fit without the words around them (no alternatives, why-not lines or
    notes but a ``tight`` one and a framework switch's), what a comparison of cards reads (search/fleet.py).
    ``stack``: the library versions every estimate and cost of the search models (estimator/stack.py;
    None: transformers 5); another one is named by ``Plan.transformers`` and an ``estimate`` note.
    """
    stack = stack or DEFAULT_STACK
    chosen = _plan_any(model, gpu, gpus=gpus, nodes=nodes, host_ram=host_ram, nvme=nvme, seq=seq,
                       global_batch=global_batch, tokens_per_step=tokens_per_step, dataset_tokens=dataset_tokens,
                       error_band=error_band, margin=margin, relax=relax, corrections=corrections,
                       host_ram_source=host_ram_source, details=details, stack=stack, **fixed)
    if details:
        chosen = unsloth_checkpoint_named(chosen, model)
    return chosen if stack.is_default else stack_named(chosen, stack)


def unsloth_checkpoint_named(chosen: Plan, model: ModelSpec | str) -> Plan:
    """``chosen`` with an ``estimate`` note when it is an Unsloth QLoRA plan of a model whose default 4-bit
    checkpoint under Unsloth is a dynamic upload, which keeps modules in 16 bits the estimate does not count
    (model/profiles.py ``unsloth_checkpoint_note``; the emitted unsloth.yaml loads the plain one)."""
    if chosen.setup.framework != "unsloth" or chosen.setup.quant != "nf4":
        return chosen
    note = unsloth_checkpoint_note(model.name if isinstance(model, ModelSpec) else model)
    return replace(chosen, notes=(*chosen.notes, Note(note, "estimate"))) if note else chosen


def stack_named(chosen: Plan, stack: Stack) -> Plan:
    """``chosen`` naming the transformers version its estimates model (``Plan.transformers``), with its
    estimate's note saying so among the plan's notes (a plan that does not fit lists no estimate notes)."""
    said = [n for n in chosen.breakdown.notes if n.startswith("models ")]
    notes = chosen.notes + tuple(Note(n, "estimate") for n in said if n not in chosen.notes)
    return replace(chosen, transformers=stack.transformers, notes=notes)


def _plan_any(model: ModelSpec | str, gpu: GpuSpec | str | int, *, gpus: int, nodes: int,
              host_ram: int | str | None, nvme: bool, seq: int, global_batch: int | None,
              tokens_per_step: int | None, dataset_tokens: int | None, error_band: float | None, margin: float,
              relax: bool, corrections: Corrections | None, host_ram_source: HostRamSource, details: bool,
              stack: Stack, **fixed: Any) -> Plan:
    """:func:`plan` before its stack is named: each framework of ``framework="any"``, or one."""
    if fixed.get("framework") == "any":
        from .any_framework import plan_any

        return plan_any(partial(_plan_any, model, gpu, gpus=gpus, nodes=nodes, host_ram=host_ram, nvme=nvme, seq=seq,
                                global_batch=global_batch, tokens_per_step=tokens_per_step,
                                dataset_tokens=dataset_tokens, error_band=error_band, margin=margin, relax=relax,
                                corrections=corrections, host_ram_source=host_ram_source, details=details,
                                stack=stack),
                        {k: v for k, v in fixed.items() if k != "framework"})
    if fixed.get("tiled_mlp_shards"):  # axolotl's shard count is of its tiled MLP: fixing it fixes that
        fixed = {**fixed, "tiled_mlp": True}
    user_fixed = fixed
    if "framework" in fixed:  # the framework's own defaults for what is not fixed (TRL's and Unsloth's loss)
        fixed = with_framework_defaults(fixed, given=tuple(fixed))
    one = partial(_plan, model, gpu, gpus=gpus, nodes=nodes, host_ram=host_ram, nvme=nvme, seq=seq,
                  global_batch=global_batch, tokens_per_step=tokens_per_step, dataset_tokens=dataset_tokens,
                  error_band=error_band, margin=margin, corrections=corrections,
                  host_ram_source=host_ram_source, details=details, stack=stack)
    if gpus != 1 or nodes != 1:
        return one(**fixed, relax=relax)
    if "framework" in fixed:
        chosen = one(**fixed, relax=relax)
        return other_framework(one, user_fixed, chosen) if relax else chosen
    # the HF recipe's plan first without its what-would-fit re-searches (relax only adds notes to a tight
    # plan or one that does not fit): wasted where another framework's plan replaces it
    chosen = one(**fixed, relax=False)
    picked = switch_framework(one, fixed, chosen, relax)
    if picked is chosen and relax and (not chosen.fits or chosen.tight):
        return one(**fixed, relax=True)
    return picked


def _plan(model: ModelSpec | str, gpu: GpuSpec | str | int, *, gpus: int, nodes: int, host_ram: int | str | None,
          nvme: bool, seq: int, global_batch: int | None, tokens_per_step: int | None, dataset_tokens: int | None,
          error_band: float | None, margin: float, relax: bool, corrections: Corrections | None,
          host_ram_source: HostRamSource, details: bool, stack: Stack = DEFAULT_STACK, **fixed: Any) -> Plan:
    """:func:`plan` for the framework ``fixed`` names (the HF recipe when it names none)."""
    spec = _resolve_model(model)
    card = _resolve_gpu(gpu)
    if isinstance(host_ram, str):
        from ..util.units import parse_bytes

        try:
            host_ram = parse_bytes(host_ram)
        except ValueError as exc:
            raise SpecError(f"host RAM: {exc}") from None
    if dataset_tokens is not None and (isinstance(dataset_tokens, bool) or not isinstance(dataset_tokens, int)
                                       or dataset_tokens <= 0):
        raise SpecError(f"dataset_tokens must be a positive integer; got {dataset_tokens!r}")
    if error_band is not None and not 0 <= error_band < 1:
        raise SpecError(f"error_band must be in [0, 1); got {error_band!r}")
    fixed = {k: v for k, v in fixed.items() if v is not None}
    ranks = None
    if "lora_rank" in fixed:
        ranks = parse_rank(fixed.pop("lora_rank"))
        if len(ranks) == 1:
            fixed["lora_rank"] = ranks[0]
    Target(card, gpus, nodes, host_ram if isinstance(host_ram, int) else None, nvme, margin)  # checks the numbers
    if host_ram_source not in ("given", "local"):
        raise SpecError(f"host_ram_source must be 'given' or 'local'; got {host_ram_source!r}")
    ram, source = (host_ram, host_ram_source) if host_ram is not None else typical_host_ram(card, gpus, nodes)
    target = Target(card, gpus, nodes, ram, nvme, margin, source, corrections or DEFAULT_CORRECTIONS, stack)
    check_fixed(spec, {k: v for k, v in fixed.items() if k not in ("batch", "grad_accum")}, gpus, seq)
    if ranks is not None and len(ranks) > 1:
        check_fixed(spec, {**{k: v for k, v in fixed.items() if k not in ("batch", "grad_accum")},
                           "lora_rank": ranks[-1]}, gpus, seq)
    shape = batch_shape(seq, gpus, global_batch, tokens_per_step, fixed.get("batch"), fixed.get("grad_accum"))
    if fixed.get("objective") == "kto":  # TRL's KTOTrainer needs 2+ rows a micro-batch (estimator/objectives.py)
        shape = replace(shape, micro_batches=tuple(b for b in shape.micro_batches if b >= 2) or shape.micro_batches)
    search = Search(spec, target, shape, fixed, error_band, ranks=ranks, brief=not details)
    result = search.run()
    chosen = result.choose()
    tight = False
    loose_result = None
    if chosen is None:
        loose_result = Search(spec, target, shape, fixed, error_band, strict=False, ranks=ranks,
                              brief=not details).run()
        loose = loose_result.choose_tight()
        if loose is not None:
            result, chosen, tight = loose_result, loose, True
    host = {"host_ram_bytes": ram, "host_ram_source": source}
    if chosen is None:
        # report the smallest setup that fails on the GPU itself, so the plan's own fit is False
        judged = [c for c in result.search.ev.failures if c.breakdown is not None]
        on_gpu = [c for c in judged if not c.breakdown.fits]
        if not judged:  # every setup the fixed knobs leave is excluded before it is estimated
            raise SpecError("no setup the search can try satisfies the fixed options together; "
                            "drop one of them (see `vramplan plan --help`)")
        if not on_gpu:  # only host RAM stands in the way, and the fixed knobs force the offload
            raise SpecError(explain.host_bound_error(min(judged, key=lambda c: c.device_total_bytes), target))
        floor = min(on_gpu, key=lambda c: c.device_total_bytes)
        if not details:
            return Plan(model=spec.name, setup=floor.setup, breakdown=floor.breakdown, gpu=card, nodes=nodes,
                        step_time_s=round(floor.step.step_s, 4), tokens_per_s=round(floor.tokens_per_s, 1), **host)
        # without the margins a setup inside the error band may meet host RAM as its last limit (Unsloth's pinned
        # checkpoints of a long sequence): the search without them says so (its misfit is the host's)
        loose_judged = [c for c in loose_result.search.ev.failures if c.breakdown is not None] if loose_result else []
        host_only = [c for c in judged + loose_judged if c.breakdown.fits and c.host_ram_bound]
        notes = explain.no_fit_notes(floor, min(host_only, key=lambda c: c.device_total_bytes) if host_only else None)
        if relax:
            gpu_floor = result.gpu_floor()
            relaxed = what_would(spec, target, shape, fixed, error_band,
                                 global_batch_of(seq, gpus, global_batch, tokens_per_step),
                                 0 if gpu_floor is None else gpu_floor, ranks)
            notes += [explain.relaxation_note(r) for r in relaxed]
            # no setup fits with the margins at a halved sequence: the same setup's longest that does, or that
            # keeps the headroom
            shorter = ((0, None, 0, None) if any(r.kind == "shorter_seq" for r in relaxed)
                       else longest_seq(result.search.ev, floor.setup))
            if shorter[1] is not None or shorter[3] is not None:
                notes.append(explain.shorter_seq_note(result, floor, card, shorter))
        notes.append(explain.host_ram_source_note(target))
        return Plan(model=spec.name, setup=floor.setup, breakdown=floor.breakdown, gpu=card, nodes=nodes,
                    step_time_s=round(floor.step.step_s, 4), tokens_per_s=round(floor.tokens_per_s, 1),
                    alternatives=(), rejected=explain.rejected(result, None), notes=tuple(notes), **host)

    if not details:
        return Plan(model=spec.name, setup=chosen.setup, breakdown=chosen.breakdown, gpu=card, nodes=nodes,
                    step_time_s=round(chosen.step.step_s, 4), tokens_per_s=round(chosen.tokens_per_s, 1),
                    notes=(explain.tight_note(result, chosen, card),) if tight else (), **host)
    notes = explain.fit_notes(result, chosen, tight=tight, card=card,
                              biggest=result.search.biggest_micro_batch(chosen.setup),
                              batch_fixed=shape.per_gpu is not None or "batch" in fixed,
                              dataset_tokens=dataset_tokens)
    if tight and relax:  # what fits with the margins: right after the tight note
        roomy = with_margins(spec, target, shape, fixed, error_band, ranks)
        notes[1:1] = [explain.shorter_seq_note(result, chosen, card, longest_seq(result.search.ev, chosen.setup)),
                      *(explain.relaxation_note(r, margins=True) for r in roomy)]
    return Plan(model=spec.name, setup=chosen.setup, breakdown=chosen.breakdown, gpu=card, nodes=nodes,
                step_time_s=round(chosen.step.step_s, 4), tokens_per_s=round(chosen.tokens_per_s, 1),
                alternatives=explain.alternatives(result, chosen), rejected=explain.rejected(result, chosen),
                notes=tuple(notes), **host)


def parse_rank(value: Any) -> tuple[int, ...]:
    """``16`` -> (16,); ``(8, 64)`` or ``"8..64"`` -> the ranks searched in that range."""
    if isinstance(value, str):
        text = value.strip()
        lo_text, sep, hi_text = text.partition("..")
        try:
            value = (int(lo_text), int(hi_text)) if sep else int(text)
        except ValueError:
            raise SpecError("lora_rank must be a positive integer or a range LO..HI such as 8..64; "
                            f"got {text!r}") from None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = value
        for v in (lo, hi):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SpecError(f"lora_rank must be a positive integer; got {v!r}")
        if lo > hi:
            raise SpecError(f"lora_rank range {lo}..{hi} is empty; write LO..HI with LO <= HI")
        return rank_choices(lo, hi)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"lora_rank must be a positive integer; got {value!r}")
    return (value,)


def local_host_ram(card: GpuSpec, nodes: int) -> int | None:
    """This machine's RAM when it holds the card planned for (and one node is planned), else None:
    what the ``plan`` command passes as ``host_ram`` (``host_ram_source="local"``) when the user gives
    none. Reads the machine; :func:`plan` itself never does."""
    if nodes != 1:
        return None
    from ..model.profiles import load_gpu
    from ..util.machine import local_gpu_names, local_ram_bytes

    here = []
    for name in local_gpu_names():
        try:
            here.append(load_gpu(name).name)
        except SpecError:
            continue
    return (local_ram_bytes() or None) if card.name in here else None


def _resolve_model(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from ..model.profiles import load_model

    return load_model(model)


def _resolve_gpu(gpu: GpuSpec | str | int) -> GpuSpec:
    """``plan``'s GPU argument, through :func:`vramplan.setup.inputs.resolve_gpu`."""
    if isinstance(gpu, bool) or not isinstance(gpu, (GpuSpec, str, int, dict)):
        raise SpecError(f"gpu must be a GPU name, a GpuSpec or a size in bytes; got {gpu!r}")
    return resolve_gpu(gpu)
