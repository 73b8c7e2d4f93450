"""The truth for tensor parallelism (``--tp N``): N gloo processes on this machine running
transformers 5.24's own DTensor tensor parallelism, per rank.

    runs = run_tp(tiny_config(), [Setup(tp=2, gpus=2), Setup(tp=2, gpus=2, method="lora")], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes

Each rank is a subprocess (``python -m vramplan.truths.tp_truth JOB``) started by
:func:`vramplan.truths.ranks.launch_ranks`, as the ZeRO and FSDP truths' are.

What runs is what the emitted train.py runs: the random checkpoint (saved once by rank 0) loaded
with ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` (transformers
5.24 ``modeling_utils.from_pretrained`` → ``distributed/tensor_parallel.apply_tensor_parallelism``
with the model's ``base_model_tp_plan``, ``embed_tokens: embedding_rowwise`` from
``distributed/mixin.init_parallel_plans`` and ``lm_head: colwise_gather_output``), peft 0.21's
LoRA on it (``tuners/lora/model.add_lora_tp_hooks_dtensor``: a colwise Linear's ``lora_B`` and a
rowwise one's ``lora_A`` sharded), HF gradient checkpointing, and torch AdamW (foreach) over the
HF Trainer's parameter groups split by device mesh (``Trainer.create_optimizer``: DTensor and plain
parameters cannot share one foreach call), the step ``model(input_ids, labels).loss.backward()``,
``opt.step()``, ``zero_grad(set_to_none=True)``; the peak of the second and third steps, the lower
of the two (see below).

CPU stand-in: transformers' shard-on-read (``distributed/sharding_utils.DtensorShardOperation``)
slices each weight with ``source[slices].to(device)``; on a GPU that copies the rank's slice to the
device, on the CPU ``.to("cpu")`` is a no-op and the local shard stays a view of the whole tensor
read from the checkpoint. :func:`_own_shards` gives every local shard its own storage, as on a GPU.
The counter (:class:`DTensorCounter`) counts a DTensor by its local tensor's storage. gloo's worker
threads free a collective's tensors when it completes (the counter's bookkeeping is locked for it),
a moment after the main thread has moved on (``ProcessGroupGloo::runLoop``): such a late release
only ever adds to a peak, by a tensor of the step (+9 % of the tiny model once, on a 2-core CI
machine). The ranks run gloo on one worker thread (:func:`vramplan.truths.ranks.one_thread_gloo`) and
the counter waits after each collective until that worker has let go of it
(:meth:`DTensorCounter._after_op`); each rank still reports the lower of two measured steps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..run.live import SplitCounter
from ..specs import Setup, SpecError
from .ranks import RankPeak, failed_launch_rows, launch_ranks, rank_worker, saved_checkpoint
from .tiny import TINY_BASE, TINY_SEQ, tiny_config, tiny_model


@dataclass(frozen=True)
class TpRun:
    """A setup run by real tensor-parallel ranks: one RankPeak per rank."""

    setup: Setup
    ranks: tuple[RankPeak, ...]

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


def run_tp(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ, timeout_s: float = 600) -> list[TpRun]:
    """Run each setup (``tp == world``) on ``world`` processes, in one launch."""
    for s in setups:
        if s.tp != world or s.gpus != world:
            raise SpecError(f"setup has tp={s.tp}, gpus={s.gpus} but the launch has {world} processes")
    got = launch_ranks("vramplan.truths.tp_truth", {"config": config, "setups": [s.to_dict() for s in setups],
                                                 "seq": seq}, world, timeout_s, {}, "TP")
    return [TpRun(s, tuple(RankPeak(**got[r][i]) for r in range(world))) for i, s in enumerate(setups)]


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, peft)


#: The dispatcher namespaces of torch's collectives (c10d's ops, the functional ones DTensor issues).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
#: Ops there that start no work to drain: the wait for one, its autograd wrapper, barriers.
_NOT_DRAINED = frozenset({"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier"})


def _group_of(func, args, kwargs):
    """The process group a c10d op runs on: its ``group_name`` (the functional collectives) or
    its ``ProcessGroup`` argument (c10d's in-place ones)."""
    from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group

    for i, arg in enumerate(func._schema.arguments):
        value = kwargs[arg.name] if arg.name in kwargs else args[i] if i < len(args) else None
        if arg.name == "group_name" and value is not None:
            return _resolve_process_group(value)
        if isinstance(value, ProcessGroup):
            return value
        if type(value).__name__ == "ScriptObject":  # under a dispatch mode c10d's ops see it boxed (FSDP2's)
            return ProcessGroup.unbox(value)
    raise RuntimeError(f"no process group in the arguments of {func}")


def _storage_holder(tensor):
    """The tensor whose storage holds ``tensor``'s bytes: a DTensor's local shard; the tensor an
    ``AsyncCollectiveTensor`` (what torch's functional collectives hand back) wraps: a wrapper
    subclass whose own storage reports the full size and holds nothing (counted as it is, every
    collective's output would count twice while the wrapper lives)."""
    local = getattr(tensor, "_local_tensor", None)
    if local is not None:
        return local
    elem = getattr(tensor, "elem", None)
    if elem is not None and type(tensor).__name__ == "AsyncCollectiveTensor":
        return elem
    return tensor


class DTensorCounter(SplitCounter):
    """SplitCounter that counts a DTensor by its local tensor's storage (a DTensor is a wrapper
    without storage of its own)."""

    def _track(self, tensor) -> int | None:
        return super()._track(_storage_holder(tensor))

    def sid_of(self, tensor) -> int | None:
        return super().sid_of(_storage_holder(tensor))

    def _after_op(self, func, args, kwargs) -> None:
        """After a collective is issued, wait until its process group's (single,
        :func:`vramplan.truths.ranks.one_thread_gloo`) gloo worker has dropped it: a one-element
        all-reduce on the same group, queued behind it, returns only once the worker has run it,
        that is after it let go of the collective before (``runLoop`` resets its work before it
        takes the next), so the tensors that collective held die on this thread's time, not a
        moment later on the worker's. Not a barrier: gloo's ``AsyncBarrierWork`` keeps weak
        references to the work before it, and a c10d ``Work`` frees its tensors only when the last
        weak reference goes (``intrusive_ptr``: the object is deleted then), on the worker, late.
        Each process group has a worker of its own (transformers' tensor-parallel mesh is a new
        group per model), so the drain runs on the collective's group. Every rank of a group issues
        the same collectives, so the same drains."""
        if func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_DRAINED:
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1), group=_group_of(func, args, kwargs))


def _own_shards(model) -> None:
    """Each DTensor parameter's local shard in its own storage (see the module docstring); tied
    parameters stay tied."""
    import torch
    from torch.distributed.tensor import DTensor

    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not isinstance(p.data, DTensor):
                continue
            if id(p) not in done:
                local = p.data._local_tensor
                if local.untyped_storage().nbytes() > local.numel() * local.element_size():
                    fresh = DTensor.from_local(local.clone(), p.data.device_mesh, p.data.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
                    done[id(p)] = torch.nn.Parameter(fresh, requires_grad=p.requires_grad)
                else:
                    done[id(p)] = p
            module._parameters[name] = done[id(p)]


own_shards = _own_shards  # (what truths/tp_fsdp2.py calls: the same CPU stand-in under FSDP2)


def _build_model(config: dict, setup: Setup, work: str):
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..run.models import adapt_for_training

    transformers.logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    path = saved_checkpoint(config, dtype, work)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", use_cache=False,
        distributed_config=DistributedConfig(tp_plan="auto"))
    _own_shards(model)
    return adapt_for_training(model, setup)


def trainer_mesh_groups(model):
    """The HF Trainer's parameter groups (decay / no decay), each split by device mesh as
    ``Trainer.create_optimizer`` does when DTensor and plain parameters mix (``has_mixed_dtensor``)."""
    from collections import defaultdict

    import transformers
    from torch.distributed.tensor import DTensor

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = []
    for wanted in (True, False):
        by_mesh = defaultdict(list)
        for n, p in named:
            if (n in decay) == wanted:
                by_mesh[p.device_mesh if isinstance(p, DTensor) else None].append(p)
        groups += [{"params": ps} for ps in by_mesh.values()]
    return groups


def measured_steps(counter: DTensorCounter, model, ids, opt, grad_accum: int) -> dict:
    """Three steps (``model(input_ids=ids, labels=ids).loss`` forward, backward, per micro-batch; ``opt.step()``,
    ``zero_grad(set_to_none=True)``) counted by ``counter``; this rank's :class:`RankPeak` fields
    from the second and third, the lower of the two (the module docstring says why), per phase too."""
    measured = []  # (peak, phase, phase peaks) of steps 2 and 3
    with counter:
        for step in range(3):
            if step == 2:
                measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks)))
            if step >= 1:
                counter.start_measuring()
            for _ in range(grad_accum):
                counter.phase("forward")
                loss = model(input_ids=ids, labels=ids).loss
                counter.phase("backward")
                loss.backward()
                del loss
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.phase(None)
    measured.append((counter.device_peak, counter.device_phase, dict(counter.device_phase_peaks)))
    device, phase, _ = min(measured, key=lambda m: m[0])
    phases = {p: min(m[2].get(p, 0) for m in measured) for p in measured[0][2]}
    return {"rank": int(os.environ["RANK"]), "device_bytes": device, "phase": phase,
            "phase_peaks": phases, "host_bytes": 0, "init_bytes": 0}


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import gc

    import torch

    from .cpu_truth import make_optimizer

    model = _build_model(config, setup, work)
    counter = DTensorCounter()
    counter.track(model)
    vocab = int(config["vocab_size"])
    ids = torch.randint(0, vocab, (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    opt = make_optimizer(setup, trainer_mesh_groups(model), model)
    peak = measured_steps(counter, model, ids, opt, setup.grad_accum)
    del model, opt
    gc.collect()
    return peak


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: LoRA on the column-parallel Linears (the row-parallel ones' adapters fail in peft 0.21:
#: estimator/tensor_parallel.py).
COLWISE_TARGETS = "q_proj,k_proj,v_proj,gate_proj,up_proj"
#: The verified TP matrix: full fine-tuning and LoRA, checkpointing, accumulation, batch 2.
TP_MATRIX = (
    {}, {"checkpointing": True}, {"method": "lora", "lora_targets": COLWISE_TARGETS},
    {"method": "lora", "lora_targets": COLWISE_TARGETS, "checkpointing": True}, {"grad_accum": 2}, {"batch": 2},
)
#: What is refused, and why (estimator/tensor_parallel.py check_tp; run and pinned by tests/test_tp_lora.py).
TP_UNVERIFIED = (
    ({"method": "lora"},
     "LoRA on o_proj/down_proj (all-linear): peft 0.21's _get_in_out_features builds lora_A with the shard's "
     "in_features, which transformers 5.24's RowwiseParallel takes as the input's global width: the first forward "
     "fails (RuntimeError: shape '[64, 16]' is invalid for input of size 2048, in tp_forward): refused"),
)
#: An untied head (Llama-3.1's shape: lm_head its own colwise_gather_output Linear) and Qwen3's
#: per-head q/k norms (replicated_with_grad_allreduce); 4 ranks need 4 KV heads.
OTHER_BASES = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B")
FOUR_KV = {"num_key_value_heads": 4}
#: Widths that do not divide by 2: rank 1 holds one vocabulary row and one intermediate column less.
UNEVEN = {"vocab_size": 511, "intermediate_size": 129}


def compare_setups(setups: list[Setup], world: int, base: str = TINY_BASE,
                   shape: dict | None = None) -> list[tuple[TpRun, object]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate
    from .tiny import TINY_SHAPE

    config = tiny_config(base, shape={**TINY_SHAPE, **shape} if shape else None)
    model = tiny_model(config, base)
    return [(run, estimate(model, run.setup)) for run in run_tp(config, setups, world)]


def launches(quick: bool) -> list[tuple[str, int, dict, tuple]]:
    """(base model, world size, shape overrides, setups) of each launch of the validate matrix."""
    if quick:
        return [(TINY_BASE, 2, {}, TP_MATRIX[:3])]
    out = [(TINY_BASE, 2, {}, TP_MATRIX), (TINY_BASE, 4, FOUR_KV, TP_MATRIX[:3]), (TINY_BASE, 2, UNEVEN, TP_MATRIX[:3])]
    return out + [(b, 2, {}, TP_MATRIX[:3]) for b in OTHER_BASES]


def tp_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob tp``: per (setup, world size) the worst rank's device
    peak against the estimate (``truth="tp-N"``)."""
    from .row import Row

    rows = []
    for base, world, shape, kws in launches(quick):
        family = tiny_model(base=base).family
        setups = [Setup(**kw, tp=world, gpus=world, seq=TINY_SEQ) for kw in kws]
        try:
            compared = compare_setups(setups, world, base, shape)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so
            rows += failed_launch_rows(setups, world, base, family, exc, lambda s: ("tp", "tp"))
            continue
        for run, est in compared:
            if est.per_rank:  # the ranks' shares differ: each rank against its own estimate
                rows += [Row(f"{base}[tiny] rank {r.rank}", family, run.setup, r.device_bytes,
                             e.tensor_peak_bytes, r.phase, e.phase, truth=f"tp-{world}", knob="tp")
                         for r, e in zip(run.ranks, est.per_rank, strict=True)]
                continue
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"tp-{world}", knob="tp"))
    model = tiny_model()
    for kw, why in TP_UNVERIFIED:
        rows.append(Row(model.name, model.family, Setup(**kw, tp=2, gpus=2, seq=TINY_SEQ), 0, 0, "", "", truth="tp-2",
                        knob="tp", verified=False, why=why))
    return rows


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
