"""The parallel layouts of search/space_parallel.py in words: why a plan took hybrid sharding (HSDP)
or tensor parallelism x FSDP2, or why it passed them over. Rendered from the evaluator's verdicts
of the chosen family's layouts (``Search.fitting_micro_batch``, the same estimates and cost model
the search ranked them with)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..cost import model as cost
from ..cost.parallel import shard_group
from ..estimator.tensor_parallel import check_tp
from ..estimator.tp_fsdp2 import combined
from ..specs import Note, Rejected, Setup, SpecError
from .core import Result, Search
from .labels import method_name, savers_text, size
from .space import family_key
from .space_parallel import tp_fsdp2_splits
from .verdicts import Candidate, Misfit

#: how explain.py words a misfit (passed in: explain imports this module)
Words = Callable[[Misfit], str]


def fastest_fitting(search: Search, setups: Sequence[Setup]) -> Candidate | None:
    """The fastest of ``setups`` at its largest fitting micro-batch (branch and bound on the speed at
    the largest micro-batch, then the micro-batch refined, as the search itself), or None when none fits."""
    best: Candidate | None = None
    for s in sorted(setups, key=search.ev.speed_bound, reverse=True):
        if best is not None and search.ev.speed_bound(s) <= best.tokens_per_s:
            break
        c = search.fitting_micro_batch(s)
        if c is not None and (best is None or c.tokens_per_s > best.tokens_per_s):
            best = c
    return search.refine_micro_batch(best) if best is not None else None


def _layouts(result: Result, chosen: Candidate, hybrid: bool) -> list[Setup]:
    """The chosen family's HSDP (``hybrid``: of its savers) or TP x FSDP2 setups the search proposed."""
    key = family_key(chosen.setup)
    family = next((f for f in result.families if family_key(f) == key), None)
    if family is None:
        return []
    if not hybrid:  # generated alone: the whole saver space is not needed for them
        return tp_fsdp2_splits(result.search.space, family)
    own = (chosen.setup.ref_model, chosen.setup.generation, chosen.setup.vllm_memory_fraction)
    return [s for s in result.search.space.savers(family) if s.dp_replicate > 1
            and (s.ref_model, s.generation, s.vllm_memory_fraction) == own]


def _line(setup: Setup, reason: str, total: int, kind, usable: int, misfit: Misfit | None) -> Rejected:
    return Rejected(setup=setup, reason=reason, device_total_bytes=total, kind=kind,
                    limit_bytes=misfit.limit_bytes if misfit is not None else usable,
                    misfit=misfit.kind if misfit is not None else None)


def _comm_share(c: Candidate) -> str:
    return f"{c.step.comm_s / c.step.step_s:.0%} of its step communicating"


def _passed_over(result: Result, chosen: Candidate, setups: list[Setup], head: str,
                 misfit_text: Words) -> list[Rejected]:
    """One why-not line for a layout the plan did not take: it does not fit even at its smallest
    setting, or its fastest fitting setting is slower than the plan (its micro-batch and share of
    communication beside the plan's say where the time goes)."""
    search, ev = result.search, result.search.ev
    usable = search.target.gpu.usable_memory_bytes
    if not setups:
        return []
    best = fastest_fitting(search, setups)
    if best is None:  # estimated afresh: a judged setup may be answered by a lower rank's failure alone
        first = [ev.at_micro(s, search.shape.micro_batches[0]) for s in setups]
        small = min(first, key=lambda s: ev.estimate(s).device_total_bytes)
        bd = ev.estimate(small)
        misfit = ev.misfit(small, bd)
        if misfit is None:
            return []
        why = f"{misfit_text(misfit)} on each GPU even with {savers_text(small)}"
        return [_line(small, head + why, bd.device_total_bytes, "too_big", usable, misfit)]
    if best.tokens_per_s >= chosen.tokens_per_s:
        return []  # ranked with the others and not taken for another reason (tier, residency, extras)
    why = (f"fits ({savers_text(best.setup)}, micro-batch {best.setup.batch}, {size(best.device_total_bytes)}), "
           f"but {1 - best.tokens_per_s / chosen.tokens_per_s:.0%} fewer tokens/s than the plan "
           f"({best.tokens_per_s:,.0f}, {_comm_share(best)}; the plan at micro-batch {chosen.setup.batch}: "
           f"{_comm_share(chosen)})")
    return [_line(best.setup, head + why, best.device_total_bytes, "too_slow", usable, None)]


def parallel_rejections(result: Result, chosen: Candidate | None, misfit_text: Words) -> list[Rejected]:
    """Why-not lines for HSDP (several nodes) and TP x FSDP2 (one node) when the plan did not take
    them, for the chosen family (none when nothing fits: the families' own lines say why)."""
    if chosen is None:
        return []
    target, s = result.search.target, chosen.setup
    out: list[Rejected] = []
    if target.nodes > 1 and s.dp_replicate <= 1:
        per_node = target.gpus // target.nodes
        head = (f"hybrid sharding over {target.nodes} nodes (HSDP, FSDP within each node's {per_node} GPUs, "
                f"{method_name(s)}): ")
        out += _passed_over(result, chosen, _layouts(result, chosen, True), head, misfit_text)
    if target.nodes == 1 and not combined(s):
        head = f"tensor parallelism x FSDP2 on {target.gpus} GPUs ({method_name(s)}): "
        out += _passed_over(result, chosen, _layouts(result, chosen, False), head, misfit_text)
    return out


def _other(search: Search, s: Setup, misfit_text: Words) -> str:
    """``s`` at its micro-batch, in words: its speed and share of communication, or why it does not fit."""
    c = search.ev.judge(s)
    if c.breakdown is None or c.misfit is not None:
        return f"does not fit ({misfit_text(c.misfit)})" if c.misfit is not None else "does not fit"
    return f"~{c.tokens_per_s:,.0f} tokens/s ({_comm_share(c)})"


def parallel_notes(result: Result, chosen: Candidate, misfit_text: Words) -> list[Note]:
    """Why the plan took HSDP or TP x FSDP2: what it saves, and the same family's setting without it."""
    search, s = result.search, chosen.setup
    gpu, nodes = search.target.gpu, search.target.nodes
    comm = _comm_share(chosen)
    if s.dp_replicate > 1:
        group = shard_group(s, nodes)

        def link(n: int) -> str:
            return (f"the {gpu.interconnect or 'GPU'} link, " if n == 1 else "the network, ") + \
                f"{cost.ring_bandwidth(gpu, n) / 1e9:,.0f} GB/s"

        flat = _other(search, s.replace(dp_replicate=1), misfit_text)
        return [Note(f"hybrid sharding: FSDP shards within groups of {group.ranks} GPUs, whose all-gathers and "
                     f"reduce-scatters of every layer run over {link(group.nodes)}, and all-reduces one gradient "
                     f"shard per GPU across the {s.dp_replicate} replicas (over {link(nodes)}); {comm}. FSDP over "
                     f"all {s.gpus} GPUs at the same settings: {flat}", "layout")]
    if combined(s):
        fsdp = _other(search, s.replace(tp=1), misfit_text)
        alone = s.replace(tp=s.gpus, fsdp="none", fsdp_version=1)
        try:
            check_tp(search.space.model, alone)
            tp_alone = _other(search, alone, misfit_text)
        except SpecError as exc:  # e.g. tp does not divide the heads
            tp_alone = f"not modelled ({exc})"
        return [Note(f"tensor parallelism x FSDP2: each of {s.gpus // s.tp} groups of {s.tp} GPUs splits every "
                     f"layer (1/{s.tp} of its activations and matmuls per GPU) and FSDP2 shards the groups' "
                     f"TP shards over {s.gpus // s.tp} GPUs; {comm}. At the same settings FSDP2 alone: {fsdp}; "
                     f"tensor parallelism over all {s.gpus} GPUs: {tp_alone}", "layout")]
    return []

