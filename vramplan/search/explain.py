"""The plan in words: why-not lines, notes, the alternatives' notes, and every verdict's text.

All the planner's prose is rendered here from typed values (:class:`~.verdicts.Misfit`,
:class:`~.relax.Relaxation`, candidates); code elsewhere branches on kinds, never on words.
"""

from __future__ import annotations

import dataclasses

from .. import cost
from ..specs import Alternative, GpuSpec, Note, Rejected
from ..units import GiB
from .core import Result
from .labels import describe, duration, method_name, quality_label, savers_text, size
from .rank import SPEED_TOLERANCE, front, quality
from .relax import Relaxation
from .space import family_key
from .verdicts import Candidate, Misfit

#: At most this many why-not lines about the chosen family's faster settings.
MAX_SAME_FAMILY_REJECTIONS = 4


def misfit_text(m: Misfit) -> str:
    """Why a setup does not fit, in words ("needs 9.8 GiB > 4.3 GiB usable")."""
    if m.kind == "gpu":
        return f"needs {size(m.need_bytes)} > {size(m.limit_bytes)} usable"
    if m.kind == "error_band":
        return f"needs {size(m.need_bytes)} of {size(m.limit_bytes)} usable, inside the ±{m.band:.0%} error band"
    if m.kind == "host_ram":
        return f"offload needs {size(m.need_bytes)} of host RAM > {size(m.limit_bytes)} available"
    if m.kind == "lower_rank":
        return f"does not fit (rank {m.rank} already fails)"
    raise ValueError(f"unknown misfit kind {m.kind!r}")


def summary(c: Candidate) -> str:
    """A fitting candidate in one phrase: its setup, memory and speed."""
    return f"{describe(c.setup)} ({size(c.device_total_bytes)}, ~{c.tokens_per_s:,.0f} tokens/s)"


# ----------------------------------------------------------------------------------------------
# why not


def rejected(result: Result, chosen: Candidate | None) -> tuple[Rejected, ...]:
    """Why-not lines: one per family of higher quality than the chosen (every family when nothing
    fits), naming the memory it needs as it would run fastest; then the chosen family's faster
    settings and the next micro-batch, which do not fit."""
    search = result.search
    ev = search.ev
    q0 = quality(chosen.setup) if chosen else -1
    usable = search.target.gpu.usable_memory_bytes
    best_of = {family_key(c.setup): c for c in result.bests}
    lowest_of = {family_key(c.setup): c for c in result.floors}
    out: list[Rejected] = []
    for fam in sorted(result.families, key=lambda f: -quality(f)):
        if quality(fam) <= q0:
            continue
        key = family_key(fam)
        fastest = max(search.space.savers(fam), key=ev.speed_bound)
        plain = ev.judge(ev.at_micro(fastest, search.shape.micro_batches[0]))
        if plain.breakdown is None:  # answered by a lower rank's failure: estimate it for the number
            plain = dataclasses.replace(plain, breakdown=ev.estimate(plain.setup))
        head = f"{method_name(fam)}: {misfit_text(Misfit('gpu', plain.device_total_bytes, usable))}"
        if plain.fits or plain.device_total_bytes <= usable:
            head = f"{method_name(fam)} ({savers_text(plain.setup)}): {misfit_text(plain.misfit) if plain.misfit else 'fits'}"
        if key in best_of:
            b = best_of[key]
            host = ev.host_need(b.setup, b.breakdown)
            reason = (f"{head}; fits with {savers_text(b.setup)}, micro-batch {b.setup.batch}"
                      + (f" ({size(host)} of host RAM)" if host else "")
                      + f", at {b.tokens_per_s:,.0f} tokens/s, too slow for its quality")
            kind = "too_slow"
        else:
            low = lowest_of.get(key)
            reason = head
            if low is not None and low.breakdown is not None and low.setup != plain.setup:
                reason += f"; {size(low.device_total_bytes)} even with {savers_text(low.setup)}"
                if low.host_ram_bound:
                    reason += f" ({misfit_text(low.misfit)})"
            kind = "too_big"
        out.append(Rejected(setup=plain.setup, reason=reason, device_total_bytes=plain.device_total_bytes, kind=kind))
    if chosen is None:
        return tuple(out)
    # the chosen family's faster settings: other savers at the chosen micro-batch, the next micro-batch
    mbs = search.shape.micro_batches
    i = mbs.index(chosen.setup.batch)
    trials = [ev.at_micro(s, chosen.setup.batch) for s in search.space.savers(chosen.setup)]
    if i + 1 < len(mbs):
        trials.append(ev.at_micro(chosen.setup, mbs[i + 1]))
    same: list[Rejected] = []
    for s in sorted(trials, key=lambda s: -ev.step(s).tokens_per_s):
        if len(same) == MAX_SAME_FAMILY_REJECTIONS or ev.step(s).tokens_per_s <= chosen.tokens_per_s:
            break
        c = ev.judge(s)
        if c.fits:
            continue
        bd = c.breakdown or ev.estimate(s)
        misfit = c.misfit if c.breakdown is not None else Misfit("gpu", bd.device_total_bytes, usable)
        same.append(Rejected(setup=s, reason=f"{describe(s)}: {misfit_text(misfit)}",
                             device_total_bytes=bd.device_total_bytes, kind="faster_setting"))
    return tuple(out) + tuple(same)


# ----------------------------------------------------------------------------------------------
# alternatives


def alternatives(result: Result, chosen: Candidate) -> tuple[Alternative, ...]:
    """The Pareto front of the families' best plans (:func:`~.rank.front`), each with a note
    relative to the chosen plan."""
    out = []
    for c in front(result.bests, chosen):
        rel = c.tokens_per_s / chosen.tokens_per_s - 1
        diff = (c.device_total_bytes - chosen.device_total_bytes) / GiB
        note = f"{rel:+.0%} tokens/s, {diff:+.1f} GiB"  # relative to the chosen plan
        host = result.search.ev.host_need(c.setup, c.breakdown)
        if host:
            note += f", host RAM {size(host)}"
        out.append(Alternative(setup=c.setup, device_total_bytes=c.device_total_bytes, tokens_per_s=round(c.tokens_per_s, 1),
                               quality=quality_label(c.setup), note=note))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# notes


def host_bound_error(c: Candidate) -> str:
    """The error when only host RAM stands in the way and the fixed knobs force the offload."""
    return (f"nothing fits: {describe(c.setup)} fits the GPU but {misfit_text(c.misfit)}; "
            "raise --host-ram or drop the fixed offload")


def no_fit_notes(floor: Candidate, host_only: Candidate | None) -> list[Note]:
    """What a plan that does not fit says first: the smallest setup, and one that fits the GPU
    but not host RAM."""
    notes = [Note(f"does not fit: the smallest setup, {describe(floor.setup)}, {misfit_text(floor.misfit)}", "no_fit")]
    if host_only is not None:
        notes.append(Note(f"{describe(host_only.setup)} would fit the GPU ({size(host_only.device_total_bytes)}) "
                          f"but {misfit_text(host_only.misfit)}", "gpu_only"))
    return notes


def relaxation_note(r: Relaxation) -> Note:
    """One "what would fit" line: the relaxed target, and what fits there."""
    if r.kind == "nothing":
        return Note("nothing tried fits: no bigger shipped card, up to 64 GPUs, shorter sequences or offload",
                    "nothing_would_fit")
    what = summary(r.candidate)
    if r.kind == "more_gpus":
        head = f"with {r.gpus} x {r.gpu.display_name}"
    elif r.kind == "bigger_card":
        head = f"on {r.gpu.display_name} ({size(r.gpu.usable_memory_bytes)} usable)"
    elif r.kind == "shorter_seq":
        head = f"with seq {r.seq}"
    elif r.kind == "nvme":
        head = "with NVMe offload (--nvme)"
    elif r.kind == "host_ram":
        head = f"with {size(r.host_ram_bytes)} of host RAM"
    elif r.kind == "unpinned":
        head = f"without the fixed {', '.join(r.unpinned)}"
    else:
        raise ValueError(f"unknown relaxation kind {r.kind!r}")
    return Note(f"{head}: {what}", "what_would_fit")


def fit_notes(result: Result, chosen: Candidate, *, tight: bool, card: GpuSpec, biggest: int, batch_fixed: bool,
              host_ram_checked: bool, dataset_tokens: int | None) -> list[Note]:
    """The notes of a plan that fits, in order: tight, quality over speed, the largest micro-batch,
    host RAM, flash-attn, the run's time, the speed model, then the estimate's own notes."""
    ev = result.search.ev
    bd = chosen.breakdown
    notes: list[Note] = []
    if tight:
        notes.append(Note(f"tight: needs {size(bd.device_total_bytes)} of {size(card.usable_memory_bytes)} usable; "
                          f"within the ±{ev.band_of(bd):.0%} error band of the estimate the step may run out of memory",
                          "tight"))
    fastest = result.fastest()
    if fastest and chosen.tokens_per_s < fastest:
        quick = max(result.bests, key=lambda c: c.tokens_per_s)
        notes.append(Note(f"chose {quality_label(chosen.setup)} over the {fastest / chosen.tokens_per_s - 1:.0%} "
                          f"faster {quality_label(quick.setup)} for quality: it uses the card within "
                          f"{SPEED_TOLERANCE:.0%} as well (tokens/s x FLOPs per token)", "quality"))
    text = f"largest micro-batch that fits this setup: {biggest}"
    if biggest > chosen.setup.batch and batch_fixed:
        text += f" (the global batch allows {chosen.setup.batch})"
    notes.append(Note(text, "micro_batch"))
    if "cpu" in (chosen.setup.offload_optimizer, chosen.setup.offload_params):
        need = ev.host_need(chosen.setup, bd)
        notes.append(Note(f"CPU offload needs {size(need)} of host RAM per node"
                          + ("" if host_ram_checked else " (not checked: pass host_ram / --host-ram)"), "host_ram"))
    if chosen.setup.attn == "flash":
        notes.append(Note("attn flash needs the flash-attn package (FlashAttention-2)", "flash_attn"))
    if dataset_tokens:
        secs = dataset_tokens / chosen.tokens_per_s
        notes.append(Note(f"{dataset_tokens:,} tokens take about {duration(secs)} at {chosen.tokens_per_s:,.0f} tokens/s",
                          "duration"))
    notes.append(Note(f"speed: first-order cost model (vramplan.cost: {cost.MFU:.0%} MFU of the card's dense TFLOP/s, "
                      "offload and communication over its links); memory: the analytic estimate", "speed_model"))
    notes += [Note(n, "estimate") for n in bd.notes if n not in notes]
    return notes
