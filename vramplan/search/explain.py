"""The plan in words: why-not lines, notes, the alternatives' notes, and every verdict's text.

All the planner's prose is rendered here from typed values (:class:`~.verdicts.Misfit`,
:class:`~.relax.Relaxation`, candidates); code elsewhere branches on kinds, never on words.
"""

from __future__ import annotations

from ..specs import Alternative, Breakdown, GpuSpec, Note, Rejected
from ..util.units import GiB, gib
from .core import Result
from .explain_cp import cp_notes
from .explain_objectives import objective_notes
from .explain_parallel import parallel_notes, parallel_rejections
from .geometry import DEFAULT_HOST_RAM_PER_GPU, Target
from .labels import describe, duration, method_name, quality_label, savers_text, size
from .rank import (
    TIER_SLOWDOWN_MAX,
    TIERS,
    fastest_lower,
    front,
    much_faster_lower_tier,
    passed_over,
    placement,
    quality,
    residency,
    tier,
)
from .relax import MIN_SEQ, Relaxation
from .space import family_key
from .verdicts import Candidate, Misfit

#: At most this many why-not lines about the chosen family's faster settings.
MAX_SAME_FAMILY_REJECTIONS = 4
#: The plan options that fix a quality tier (:data:`~.rank.TIERS`): what a note tells a user who
#: wants a tier passed over for speed.
TIER_FLAGS = {3: "--method full", 2: "--method lora --quant none", 1: "--method lora --quant int8",
              0: "--method qlora"}


def sizes(a: float, b: float) -> tuple[str, str]:
    """Two byte counts in words, with a second decimal when one would show them equal."""
    sa, sb = size(a), size(b)
    if sa == sb and a != b:
        sa, sb = f"{a / GiB:.2f} GiB", f"{b / GiB:.2f} GiB"
    return sa, sb


def misfit_text(m: Misfit) -> str:
    """Why a setup does not fit, in words ("needs 9.8 GiB > 4.3 GiB usable"); "needs X > Y" is
    said only of a ``gpu`` misfit, where X > Y."""
    if m.kind == "gpu":
        need, limit = sizes(m.need_bytes, m.limit_bytes)
        return f"needs {need} > {limit} usable"
    if m.kind == "error_band":
        extra = f" and the {m.allowance / 2**20:.0f} MiB allocator allowance" if m.allowance else ""
        return f"needs {size(m.need_bytes)} of {size(m.limit_bytes)} usable, inside the ±{m.band:.0%} error band{extra}"
    if m.kind == "headroom":
        return (f"needs {size(m.need_bytes)} of {size(m.limit_bytes)} usable, leaving "
                f"{size(m.limit_bytes - m.need_bytes)} free, under the {m.margin:.0%} headroom kept "
                f"({size(m.margin * m.limit_bytes)})")
    if m.kind == "host_ram":
        return f"offload needs {size(m.need_bytes)} of host RAM > {size(m.limit_bytes)} available"
    if m.kind == "vllm":
        need, limit = sizes(m.need_bytes, m.limit_bytes)
        return (f"vLLM's share ({limit}) cannot hold its weights, profile peak and one sequence's KV cache "
                f"({need}): vLLM would not start")
    if m.kind == "lower_rank":
        return f"does not fit (rank {m.rank} already fails)"
    raise ValueError(f"unknown misfit kind {m.kind!r}")


def summary(c: Candidate) -> str:
    """A fitting candidate in one phrase: its setup, memory and speed."""
    return f"{describe(c.setup)} ({size(c.device_total_bytes)}, ~{c.tokens_per_s:,.0f} tokens/s)"


# ----------------------------------------------------------------------------------------------
# why not


def _fits_text(c: Candidate, ev) -> str:
    """A fitting candidate's savers, micro-batch, host RAM and speed, for a why-not line."""
    host = ev.host_need(c.setup, c.breakdown)
    return (f"{savers_text(c.setup)}, micro-batch {c.setup.batch}" + (f" ({size(host)} of host RAM)" if host else "")
            + f", at {c.tokens_per_s:,.0f} tokens/s")


def _slower_text(slow: Candidate, quick: Candidate) -> str:
    """Why a better tier that fits was passed over: how much slower it is, the rule, the flag."""
    return (f"{quick.tokens_per_s / slow.tokens_per_s:.1f}x slower than {quality_label(quick.setup)} "
            f"({TIERS[tier(quick.setup)]}, {quick.tokens_per_s:,.0f} tokens/s); a better tier is taken only "
            f"while at most {TIER_SLOWDOWN_MAX:g}x slower than a lower one ({TIER_FLAGS[tier(slow.setup)]} keeps it)")


def _rejection(setup, head: str, reason: str, misfit: Misfit | None, total: int, kind, usable: int) -> Rejected:
    return Rejected(setup=setup, reason=f"{head}{reason}", device_total_bytes=total, kind=kind,
                    limit_bytes=misfit.limit_bytes if misfit is not None else usable,
                    misfit=misfit.kind if misfit is not None else None)


def rejected(result: Result, chosen: Candidate | None) -> tuple[Rejected, ...]:
    """Why-not lines: one per family of a higher tier than the chosen (every family when nothing
    fits), naming the memory it needs as it would run fastest and the real verdict of it; then
    the chosen family's faster settings and the next micro-batch, which do not fit."""
    search = result.search
    ev = search.ev
    t0 = tier(chosen.setup) if chosen else -1
    usable = search.target.gpu.usable_memory_bytes
    bests_of: dict[tuple, list[Candidate]] = {}
    for c in result.bests:
        bests_of.setdefault(family_key(c.setup), []).append(c)
    lowest_of = {family_key(c.setup): c for c in result.floors}
    out: list[Rejected] = []
    over = passed_over(result.bests, chosen) if chosen else []
    over_by = {id(c): fastest_lower(result.bests, c) for c in over}
    for fam in sorted(result.families, key=lambda f: -quality(f)):
        if tier(fam) <= t0:
            continue
        key = family_key(fam)
        fastest = max(search.space.savers(fam), key=ev.speed_bound, default=None)
        if fastest is None:
            continue
        plain = ev.judge(ev.at_micro(fastest, search.shape.micro_batches[0]))
        bd = plain.breakdown or ev.estimate(plain.setup)
        misfit = plain.misfit if plain.breakdown is not None else ev.misfit(plain.setup, bd)
        head = f"{method_name(fam)}: " + (f"{misfit_text(misfit)} as it runs fastest ({savers_text(plain.setup)})"
                                          if misfit is not None else f"fits with {savers_text(plain.setup)}")
        found = sorted(bests_of.get(key, []), key=lambda c: placement(c.setup))
        slow = next((c for c in over if family_key(c.setup) == key), None)
        if slow is not None:
            reason = f"; fits with {_fits_text(slow, ev)}: {_slower_text(slow, over_by[id(slow)])}"
            kind = "too_slow"
        elif found:
            b = found[0]
            if chosen is not None and placement(b.setup) == 3 and placement(chosen.setup) == 2:
                why = "NVMe offload is a last resort while a plan with CPU offload fits"
            else:
                why = ("CPU/NVMe offload" if residency(b.setup) == 2 else "a distributed engine on one GPU") + \
                    " is a last resort while a plan without it fits"
            reason = f"; fits only with {_fits_text(b, ev)}: {why}"
            kind = "needs_offload"
        else:
            low = lowest_of.get(key)
            reason = ""
            kind = "too_big"
            if low is not None and low.breakdown is not None and low.setup != plain.setup:
                reason = f"; {size(low.device_total_bytes)} even with {savers_text(low.setup)}"
                if low.misfit is not None and low.misfit.kind != "gpu":
                    reason += f" ({misfit_text(low.misfit)})"
                if low.misfit is not None and low.misfit.tight:
                    kind = "tight"
        out.append(_rejection(plain.setup, head, reason, misfit, bd.device_total_bytes, kind, usable))
    out += _layer_split_rejections(result, chosen, usable)
    out += _tensor_split_rejections(result, chosen, usable)
    out += parallel_rejections(result, chosen, misfit_text)  # HSDP, TP x FSDP2 (explain_parallel.py)
    if chosen is None:
        return tuple(out)
    # the chosen family's faster settings: other savers at the chosen micro-batch, the next micro-batch
    mbs = search.shape.micro_batches
    # DPO/GRPO: the other references / generation engines and vLLM shares at the chosen savers come first
    knobs = [chosen.setup.replace(**k) for k in search.space.objective_knobs(chosen.setup) if k]
    knobs = sorted((s for s in knobs if s != chosen.setup), key=lambda s: (s.generation, s.vllm_memory_fraction))
    own = (chosen.setup.ref_model, chosen.setup.generation, chosen.setup.vllm_memory_fraction)
    trials = [ev.at_micro(s, chosen.setup.batch) for s in search.space.savers(chosen.setup)
              if residency(s) <= residency(chosen.setup) and (s.ref_model, s.generation, s.vllm_memory_fraction) == own]
    bigger = [m for m in mbs if m > chosen.setup.batch]
    if bigger:
        trials.append(ev.at_micro(chosen.setup, bigger[0]))
    same: list[Rejected] = []
    share_over = False  # a vLLM share over the card: the larger shares are, too
    for s in knobs + sorted(trials, key=lambda s: -ev.step(s).tokens_per_s):
        if len(same) == MAX_SAME_FAMILY_REJECTIONS:
            break
        if ev.step(s).tokens_per_s <= chosen.tokens_per_s or (share_over and s in knobs):
            continue
        c = ev.judge(s)
        if c.fits:
            continue
        bd = c.breakdown or ev.estimate(s)
        misfit = c.misfit if c.breakdown is not None else ev.misfit(s, bd)
        if misfit is None:
            continue
        share_over = share_over or (s in knobs and s.generation == "vllm-colocate" and misfit.kind != "vllm")
        same.append(_rejection(s, f"{describe(s)}: ", misfit_text(misfit), misfit, bd.device_total_bytes,
                               "faster_setting", usable))
    return tuple(out) + tuple(same)


def _layer_split_rejections(result: Result, chosen: Candidate | None, usable: int) -> list[Rejected]:
    """Several GPUs and a plan that is not a layer split: why not ``device_map="auto"`` (one
    process, the layers over the GPUs) for the chosen family (every family when nothing fits):
    its smallest setting at the first micro-batch, and the fullest GPU's need."""
    search, ev = result.search, result.search.ev
    if search.target.gpus < 2 or (chosen is not None and chosen.setup.device_map != "none"):
        return []
    fams = [chosen.setup] if chosen is not None else result.families
    out = []
    for fam in fams:
        key = family_key(fam)
        splits = [ev.at_micro(s, search.shape.micro_batches[0]) for s in search.space.layer_splits(fam)]
        splits = [s for s in splits if family_key(s) == key]
        if not splits:
            continue
        smallest = min(splits, key=lambda s: ev.estimate(s).device_total_bytes)
        bd = ev.estimate(smallest)
        misfit = ev.misfit(smallest, bd)
        if misfit is None:  # it fits: ranked with the others (one GPU computes at a time, so rarely the fastest)
            continue
        gpus = " / ".join(gib(r.device_total_bytes, 1) for r in bd.per_rank)
        head = f"layer split over {search.target.gpus} GPUs (device_map=auto, {method_name(fam)}): "
        savers = savers_text(smallest.replace(device_map="none"))
        why = f"{misfit_text(misfit)} on its fullest GPU even with {savers} (GPUs {gpus} GiB)"
        out.append(_rejection(smallest, head, why, misfit, bd.device_total_bytes, "too_big", usable))
    return out


def _tensor_split_rejections(result: Result, chosen: Candidate | None, usable: int) -> list[Rejected]:
    """Several GPUs and a plan without tensor parallelism: why not ``--tp`` over all of them for the
    chosen family (every family when nothing fits): its smallest setting at the first micro-batch
    does not fit, or it fits but its all-reduces (cost/model.py) make it slower than the plan."""
    search, ev = result.search, result.search.ev
    if search.target.gpus < 2 or (chosen is not None and chosen.setup.tp > 1):
        return []
    out = []
    for fam in [chosen.setup] if chosen is not None else result.families:
        key = family_key(fam)
        splits = [s for s in (ev.at_micro(s, search.shape.micro_batches[0]) for s in search.space.tensor_splits(fam))
                  if family_key(s) == key]
        if not splits:
            continue
        smallest = min(splits, key=lambda s: ev.estimate(s).device_total_bytes)
        bd = ev.estimate(smallest)
        misfit = ev.misfit(smallest, bd)
        head = f"tensor parallelism over {search.target.gpus} GPUs (tp_plan=auto, {method_name(fam)}): "
        if misfit is not None:
            why = f"{misfit_text(misfit)} on each GPU even with {savers_text(smallest.replace(tp=1))}"
            out.append(_rejection(smallest, head, why, misfit, bd.device_total_bytes, "too_big", usable))
        elif chosen is not None and ev.step(smallest).tokens_per_s < chosen.tokens_per_s:
            comm = ev.step(smallest).comm_s / ev.step(smallest).step_s
            why = (f"fits, but {1 - ev.step(smallest).tokens_per_s / chosen.tokens_per_s:.0%} fewer tokens/s: the GPUs "
                   f"share each micro-batch and all-reduce every layer's activations over the "
                   f"{search.target.gpu.interconnect or 'GPU'} link ({comm:.0%} of its step)")
            out.append(_rejection(smallest, head, why, None, bd.device_total_bytes, "too_slow", usable))
    return out


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
        out.append(Alternative(setup=c.setup, device_total_bytes=c.device_total_bytes,
                               tokens_per_s=round(c.tokens_per_s, 1), quality=quality_label(c.setup), note=note))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# notes


def host_bound_error(c: Candidate, target: Target) -> str:
    """The error when only host RAM stands in the way and the fixed knobs force the offload."""
    return (f"nothing fits: {describe(c.setup)} fits the GPU but {misfit_text(c.misfit)} "
            f"({host_ram_source_text(target)}); raise --host-ram or drop the fixed offload")


def host_ram_source_text(target: Target) -> str:
    """Which host RAM a plan was checked against, in a phrase."""
    ram = size(target.host_ram_bytes) if target.host_ram_bytes else "?"
    nodes = " per node" if target.nodes > 1 else ""
    src = target.host_ram_source
    if src == "given":
        return f"host RAM {ram}{nodes}, as given (--host-ram)"
    if src == "local":
        return f"host RAM {ram}: this machine's, which holds the {target.gpu.display_name}"
    if src == "profile":
        per = size(target.gpu.host_ram_per_gpu_bytes or 0)
        each = f", {per} per GPU" if target.gpus // target.nodes > 1 else ""
        return (f"host RAM {ram}{nodes}: a typical host{each} ({target.gpu.host_ram_note or 'GPU profile'}); "
                "--host-ram to change it")
    if src == "default":
        return (f"host RAM {ram}{nodes}: {size(DEFAULT_HOST_RAM_PER_GPU)} per GPU assumed for a GPU given by its "
                "memory; --host-ram to change it")
    return "host RAM not checked"


def host_ram_source_note(target: Target) -> Note:
    return Note(f"checked against {host_ram_source_text(target)}", "host_ram_source")


def no_fit_notes(floor: Candidate, host_only: Candidate | None) -> list[Note]:
    """What a plan that does not fit says first: the smallest setup, and one that fits the GPU
    but not host RAM."""
    notes = [Note(f"does not fit: the smallest setup, {describe(floor.setup)}, {misfit_text(floor.misfit)}", "no_fit")]
    if host_only is not None:
        notes.append(Note(f"{describe(host_only.setup)} would fit the GPU ({size(host_only.device_total_bytes)}) "
                          f"but {misfit_text(host_only.misfit)}", "gpu_only"))
    return notes


def relaxation_note(r: Relaxation, *, margins: bool = False) -> Note:
    """One "what would fit" line: the relaxed target, and what fits there (``margins``: for a tight
    plan, what fits with the error band and the headroom kept)."""
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
    return Note(f"{head}: {'fits with the margins, ' if margins else ''}{what}", "what_would_fit")


def tight_note(result: Result, chosen: Candidate, card: GpuSpec) -> Note:
    """A plan that fits only without the margins (``Plan.tight`` reads it)."""
    ev, bd = result.search.ev, chosen.breakdown
    band_limit, margin_limit = ev.limits(bd)
    return Note(f"tight: needs {size(bd.device_total_bytes)} of {size(card.usable_memory_bytes)} usable; "
                f"no plan fits within the ±{ev.band_of(bd):.0%} error band of the estimate and the "
                f"{result.search.target.margin:.0%} headroom kept ({size(min(band_limit, margin_limit))}), so the "
                "step may run out of memory", "tight")


def shorter_seq_note(result: Result, chosen: Candidate, card: GpuSpec, found: tuple) -> Note:
    """For a tight plan: the longest sequence at which the same setup fits with the margins; else, when the
    plan keeps the headroom margin at its own length, that only the band is missed; else the longest
    sequence at which it keeps the headroom alone (``found``: :func:`vramplan.search.relax.longest_seq`)."""
    ev = result.search.ev
    both_seq, both_bd, hr_seq, hr_bd = found
    margin = f"{result.search.target.margin:.0%} headroom"

    def at(bd: Breakdown) -> str:
        free = 1 - bd.device_total_bytes / card.usable_memory_bytes
        return f"{size(bd.device_total_bytes)} of {size(card.usable_memory_bytes)}, {free:.0%} free"

    never = (f"the ±{ev.band_of(chosen.breakdown):.0%} error band it keeps at no length down to {MIN_SEQ} tokens "
             "(the weights alone take most of the card)")
    if both_bd is not None:
        return Note(f"with seq {both_seq}: the same setup fits with the margins ({at(both_bd)})", "what_would_fit")
    if chosen.breakdown.device_total_bytes <= ev.limits(chosen.breakdown)[1]:
        return Note(f"at seq {chosen.setup.seq} the plan keeps the {margin} ({at(chosen.breakdown)}); {never}",
                    "what_would_fit")
    if hr_bd is not None:
        return Note(f"with seq {hr_seq}: the same setup keeps the {margin} ({at(hr_bd)}); {never}",
                    "what_would_fit")
    return Note(f"no sequence down to {MIN_SEQ} tokens leaves the same setup the {margin}", "what_would_fit")


def fit_notes(result: Result, chosen: Candidate, *, tight: bool, card: GpuSpec, biggest: int, batch_fixed: bool,
              dataset_tokens: int | None) -> list[Note]:
    """The notes of a plan that fits, in order: tight, offload, a much faster lower tier, the
    largest micro-batch, host RAM, flash-attn, the run's time, the speed model, then the
    estimate's own notes."""
    ev = result.search.ev
    target = result.search.target
    bd = chosen.breakdown
    notes: list[Note] = [tight_note(result, chosen, card)] if tight else []
    if residency(chosen.setup) == 2 and not any(k in result.search.space.fixed for k in
                                                 ("offload_optimizer", "offload_params")):
        notes.append(Note("offload: no plan without CPU/NVMe offload fits at any quality tier"
                          + (", nor one with CPU offload (host RAM)" if placement(chosen.setup) == 3 else ""),
                          "offload"))
    for slow in passed_over(result.bests, chosen):
        notes.append(Note(f"{TIERS[tier(slow.setup)]} fits ({savers_text(slow.setup)}, "
                          f"~{slow.tokens_per_s:,.0f} tokens/s) but is "
                          f"{_slower_text(slow, fastest_lower(result.bests, slow))}", "higher_tier_slower"))
    quick = much_faster_lower_tier(result.bests, chosen)
    if quick is not None:
        notes.append(Note(f"{quality_label(quick.setup)} ({TIERS[tier(quick.setup)]}) would be "
                          f"{quick.tokens_per_s / chosen.tokens_per_s - 1:.0%} faster "
                          f"({quick.tokens_per_s:,.0f} tokens/s, {savers_text(quick.setup)}); kept "
                          f"{TIERS[tier(chosen.setup)]}, the better quality tier that fits within "
                          f"{TIER_SLOWDOWN_MAX:g}x of its speed", "lower_tier_faster"))
    notes += parallel_notes(result, chosen, misfit_text) + cp_notes(result, chosen, misfit_text)  # explain_cp.py
    text = f"largest micro-batch that fits this setup: {biggest}"
    if biggest > chosen.setup.batch:
        text += (f" (the global batch allows {chosen.setup.batch})" if batch_fixed
                 else f" (at most {result.search.shape.micro_batches[-1]} are tried)")
    notes.append(Note(text, "micro_batch"))
    need = ev.host_need(chosen.setup, bd)
    nvme = bd.component("nvme_offload")
    if need and nvme and "cpu" not in (chosen.setup.offload_optimizer, chosen.setup.offload_params):
        notes.append(Note(f"NVMe offload needs {size(need)} of host RAM per node (page-locked gradient and swap "
                          f"buffers); the offloaded state, {size(nvme)} per GPU, is on NVMe", "host_ram"))
    elif need:
        notes.append(Note(f"CPU offload needs {size(need)} of host RAM per node", "host_ram"))
    notes.append(host_ram_source_note(target))
    if chosen.setup.attn == "flash":  # on a card before Ampere the estimate's own note says it cannot run
        notes.append(Note("attn flash needs the flash-attn package (FlashAttention-2)", "flash_attn"))
    if dataset_tokens:
        secs = dataset_tokens / chosen.tokens_per_s
        notes.append(Note(f"{dataset_tokens:,} tokens take about {duration(secs)} at "
                          f"{chosen.tokens_per_s:,.0f} tokens/s",
                          "duration"))
    notes.append(Note("speed: first-order cost model (vramplan.cost.model: the card's dense TFLOP/s at a modelled "
                      "utilisation, offload and communication over its links"
                      + ("; DPO/GRPO phases: vramplan.cost.objectives" if chosen.setup.objective != "sft" else "")
                      + "); memory: the analytic estimate", "speed_model"))
    notes += objective_notes(result, chosen, misfit_text)  # DPO/GRPO: the phases' time, the reference, vLLM's share
    notes += [Note(n, "estimate") for n in bd.notes if n not in notes]
    return notes
