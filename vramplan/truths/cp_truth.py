"""The truth for context parallelism (``--cp N``): N gloo processes on this machine running accelerate
1.15's FSDP2 + context parallelism and torch 2.13's own ring attention, per rank; :func:`cp_rows`
compares it with estimator/context_parallel.py (``vramplan validate --knob cp``).

    runs = run_cp(tiny_config(), [Setup(cp=2, gpus=2, fsdp="full_shard", fsdp_version=2)], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes

What runs (each rank a subprocess, ``python -m vramplan.truths.cp_truth JOB``, as the FSDP2 truth's):
an Accelerator with ``ParallelismConfig(dp_shard_size=world / cp, cp_size=cp)`` (set on its state once the
state is FSDP, as the FSDP2 truth sets the plugin: accelerate only turns FSDP on for accelerators)
prepares the model as :mod:`vramplan.truths.fsdp2` does (accelerate ``_prepare_cp``: ``set_rotate_method("allgather")``,
the hooks that drop the attention mask for ``is_causal``; then ``fsdp2_prepare_model`` sharding over
the joint ``dp_shard_cp`` mesh, i.e. all N ranks); each micro-step builds the inputs as the HF
Trainer 5.24 does (``Trainer._prepare_context_parallel_inputs``: ``shift_labels``, ``position_ids``
made, then ``input_ids``, ``labels``, ``shift_labels``, ``position_ids`` sharded along the sequence
under ``Accelerator.maybe_context_parallel``, i.e. torch's ``context_parallel`` with its head-tail
load balancer when ``seq % 2N == 0``) and runs forward and backward inside it.

CPU stand-in (why: torch 2.13's CP dispatcher, ``_context_parallel/_attention._sdpa_handler``, only
takes CUDA's ``_scaled_dot_product_{flash,efficient,cudnn}_attention``; on CPU SDPA lowers to
``_scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding strategy, and the step
stops with NotImplementedError, :func:`probe` pins it): inside the CP context
``F.scaled_dot_product_attention`` is an autograd function over torch's own ring,
``_templated_ring_attention`` forward and ``_templated_ring_attention_backward`` backward (its
all-gather rotater for K/V, all-to-all for dK/dV, the fp32 merger, the load-balanced halves), on the
local tensors the DTensor handler would hand it, with gloo's real collectives. Only the per-block
kernel is a stand-in with CUDA flash's outputs (an output like q, a fp32 logsumexp (b, heads, s);
backward dq, dk, dv like q, k, v; K/V at their own head count as flash takes ``enable_gqa``): the
tensors it allocates, not its values. Saved for backward: q, k, v, the output and the logsumexp, as
flash's autograd node saves them. :func:`probe` runs the same ring with the real CPU flash kernel
and checks it against unsharded SDPA. Counting: :class:`CpCounter`, the FSDP2 truth's counter that
also sees through the functional collectives' wrapper and drains every group's gloo worker.

The estimate (estimator/context_parallel.py) is checked against it by :func:`cp_rows`
(``vramplan validate --knob cp``). K/V at their own head count is what CUDA does: torch's CUDA SDPA
dispatch (aten attention.cpp) hands flash and cuDNN the unrepeated K/V when transformers passes
``enable_gqa`` (no mask under CP), so the stand-in takes them as flash does. Not verified here: the
ring buffers' lifetimes under NCCL (the caching allocator frees a collective's buffers when its
stream is done, not when gloo's worker lets go of them).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from ..specs import Setup, SpecError
from .fsdp import ResizingCounter
from .ranks import RankPeak, counter_peak, exit_rank, launch_ranks, one_thread_gloo, rank_worker
from .tiny import TINY_SEQ
from .tp_truth import DTensorCounter


@dataclass(frozen=True)
class CpRun:
    """A setup run by real context-parallel ranks: one RankPeak per rank."""

    setup: Setup
    ranks: tuple[RankPeak, ...]
    ring_seqs: tuple[int, ...] = ()  # rank 0's local sequence length at each ring attention call

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


def run_cp(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ, timeout_s: float = 600) -> list[CpRun]:
    """Run each setup (``gpus == world``, ``cp`` dividing it: FSDP2 dp_shard = world / cp) on ``world``
    processes, in one launch."""
    for s in setups:
        if s.cp < 2 or world % s.cp or s.gpus != world or s.fsdp_version != 2:
            raise SpecError(f"run_cp runs FSDP2 setups with a cp dividing {world} on {world} ranks; got cp={s.cp} "
                            f"gpus={s.gpus} fsdp_version={s.fsdp_version}")
    got = launch_ranks("vramplan.truths.cp_truth", {"config": config, "setups": [s.to_dict() for s in setups],
                                                 "seq": seq}, world, timeout_s, {"ACCELERATE_USE_CPU": "true"}, "CP")
    return [CpRun(s, tuple(RankPeak(**got[r][i]["peak"]) for r in range(world)), tuple(got[0][i]["ring_seqs"]))
            for i, s in enumerate(setups)]


class CpCounter(DTensorCounter, ResizingCounter):
    """The FSDP2 truth's counter: a DTensor counted by its local shard, an ``AsyncCollectiveTensor``
    (what the ring's ``all_gather_single``/``permute_tensor`` hand back) by the tensor it wraps,
    resized storages re-read, and each collective drained on its group's gloo worker
    (:meth:`vramplan.truths.tp_truth.DTensorCounter._after_op`) so its tensors die on this thread's
    time: without a drain the same ring (same rank, same shapes) still held its gathered K/V and
    their concatenation (98 KB) after its forward in one run of two."""



# ----------------------------------------------------------------------------------------------
# the ring (imports torch)


def _block_stand_in():
    """Per-block ops with CUDA flash's allocations (forward: out, lse; backward: dq, dk, dv)."""
    import torch

    def forward(q, k, v, **_kw):
        b, h, s, _ = q.shape
        return q.new_zeros(b, s, h, v.shape[-1]).transpose(1, 2), q.new_zeros(b, h, s, dtype=torch.float32)

    def backward(query, key, value, **_kw):
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    return forward, backward


def _cpu_flash():
    """Per-block ops running CPU flash for real (K/V at the query's head count): the numerics check."""
    import torch

    aten = torch.ops.aten

    def forward(q, k, v, is_causal, dropout_p=0.0, scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)

    def backward(query, key, value, out, logsumexp, is_causal, grad_out, dropout_p=0.0, scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    return forward, backward


@contextlib.contextmanager
def ring_sdpa(group, block_ops=None, seen: list | None = None):
    """``F.scaled_dot_product_attention`` as torch 2.13's ring attention over ``group`` (q, k, v
    sharded on dim 2 as context_parallel shards them); restores what was there on exit. Each call's
    local sequence length is appended to ``seen``."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    fwd_op, bwd_op = block_ops or _block_stand_in()

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal, scale):
            out, lse = ring._templated_ring_attention(group, 2, fwd_op, q, k, v, is_causal=is_causal,
                                                      dropout_p=0.0, scale=scale)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.is_causal, ctx.scale = is_causal, scale
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = ring._templated_ring_attention_backward(
                group, 2, bwd_op, grad_out, "grad_out", q, k, v, out, lse, ctx.is_causal,
                dropout_p=0.0, scale=ctx.scale)[:3]
            return dq, dk, dv, None, None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise NotImplementedError("context parallelism runs SDPA without a mask or dropout")
        if seen is not None:
            seen.append(query.shape[2])
        return RingAttention.apply(query, key, value, is_causal, scale)

    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, accelerate)


def _prepare(setup: Setup, world: int, model, opt):
    """accelerate's CP + FSDP2 preparation (``Accelerator.prepare(model, optimizer)``), on CPU."""
    from accelerate.parallelism_config import ParallelismConfig

    from .fsdp2 import cpu_fsdp_accelerator

    acc, plugin = cpu_fsdp_accelerator(setup)
    # what Accelerator(parallelism_config=...) does once the state is FSDP (accelerate only turns
    # FSDP on for accelerators, so the config is set after the state, as the FSDP2 truth sets it)
    config = ParallelismConfig(dp_shard_size=world // setup.cp, cp_size=setup.cp)
    acc.state.parallelism_config = config
    acc.state.device_mesh = config.get_device_mesh("cpu")
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    config._validate_accelerator(acc)
    wrapped, opt = acc.prepare(model, opt)
    return acc, wrapped, opt


def trainer_inputs(ids):
    """The batch as ``Trainer._prepare_context_parallel_inputs`` (transformers 5.24) hands it to
    ``maybe_context_parallel``: labels, shift_labels (labels padded with -100 and shifted),
    position_ids; all four sharded along dim 1."""
    import torch
    import torch.nn.functional as F

    labels = ids.clone()
    inputs = {"input_ids": ids.clone(), "labels": labels,
              "shift_labels": F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous(),
              "position_ids": torch.arange(ids.size(1)).expand(ids.size(0), -1).contiguous()}
    return inputs


def _run_one(config: dict, setup: Setup, seq: int, work: str = "") -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from ..model.architecture import model_spec_from_config
    from .cpu_truth import make_optimizer
    from .fsdp import build_model, trainer_groups

    spec = model_spec_from_config(config, name="tiny")
    world = dist.get_world_size()
    model = build_model(config, setup, work)
    counter = CpCounter()
    counter.detail = bool(os.environ.get("VRAMPLAN_CP_DETAIL"))  # diagnostics: what is live at the peak
    counter.track(model)
    ids = torch.randint(0, spec.vocab_size, (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    with counter:
        counter.phase("init")
        opt = make_optimizer(setup, trainer_groups(model), model)
        acc, wrapped, opt = _prepare(setup, world, model, opt)
        mesh = acc.torch_device_mesh
        group = mesh["cp"].get_group()
        seen: list[int] = []
        for step in range(2):
            if step == 1:
                counter.start_measuring()
            for micro in range(setup.grad_accum):
                wrapped.set_requires_gradient_sync(micro == setup.grad_accum - 1)
                counter.phase("forward")
                inputs = trainer_inputs(ids)
                buffers = list(inputs.values())
                with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                no_restore_buffers=set(buffers)), ring_sdpa(group, seen=seen):
                    loss = wrapped(**inputs).loss
                    counter.phase("backward")
                    acc.backward(loss)
                del loss, inputs, buffers
            counter.phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
        counter.phase(None)
    peak = counter_peak(counter)
    if counter.detail:
        listing = sorted(((n, counter.sites.get(sid, "tracked")) for sid, n in counter.at_peak.items()), reverse=True)
        with open(os.path.join(os.environ["VRAMPLAN_CP_DETAIL"], f"rank{peak['rank']}.txt"), "w") as f:
            f.writelines(f"{n} {site}\n" for n, site in listing)
    del wrapped, model, opt, acc
    gc.collect()
    return {"peak": peak, "ring_seqs": seen}


# ----------------------------------------------------------------------------------------------
# the probes (what the CPU allows, pinned by tests/test_context_parallel.py)


def _probe_worker(job_path: str) -> None:
    """A rank of :func:`probe`: torch's own CP dispatch on CPU SDPA (refused), then the ring of
    :func:`ring_sdpa` with the real CPU flash kernel against unsharded SDPA."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    one_thread_gloo()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    b, h, s, d = 1, 4, job["seq"], 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    refused = ""
    shards = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(shards)):
        try:
            F.scaled_dot_product_attention(*shards, is_causal=True)
        except NotImplementedError as exc:
            refused = str(exc).splitlines()[0]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True).square().sum().backward()
    expected = [full[0].grad, full[1].grad, full[2].grad]
    with context_parallel(mesh, buffers=expected, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(expected)):
        pass  # shards the reference gradients in place as the inputs were sharded
    local = [t.clone().requires_grad_() for t in shards]
    with ring_sdpa(mesh.get_group(), _cpu_flash()):
        F.scaled_dot_product_attention(*local, is_causal=True).square().sum().backward()
    err = max(float((t.grad - e).abs().max()) for t, e in zip(local, expected, strict=True))
    # one all-gather the ring issues, counted by CpCounter: the gathered buffer's bytes, once
    import torch.distributed._functional_collectives as ft_c

    counter = CpCounter()
    with counter:
        gathered = ft_c.all_gather_single(q.contiguous(), gather_dim=0, group=mesh.get_group()).wait()
        counted = counter.current_bytes
    result = {"refused": refused, "grad_err": err, "gather_counted": counted, "gather_bytes": gathered.nbytes}
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    exit_rank()


def probe(world: int = 2, seq: int = 32, timeout_s: float = 300) -> list[dict]:
    """Each rank's ``refused`` (torch's CP dispatch on CPU SDPA: the first line of its error, "" if
    it ran), ``grad_err`` (the ring with CPU flash against unsharded SDPA: max |dq, dk, dv| gap), and
    ``gather_counted`` / ``gather_bytes`` (what :class:`CpCounter` counts for one functional
    all-gather, and that buffer's size)."""
    return launch_ranks("vramplan.truths.cp_truth", {"probe": True, "seq": seq}, world, timeout_s, {}, "CP probe")


# ----------------------------------------------------------------------------------------------
# estimate versus truth (vramplan validate --knob cp)

#: The verified CP matrix on the tiny Llama (cp 2 at seq 128, cp 4 at seq 256: 64 tokens per rank):
#: full and LoRA, with and without checkpointing, micro-batch 1 and 2; then the other knobs on 2 ranks,
#: and cp 2 beside FSDP2's dp_shard 2 on 4 ranks.
CP_CORE = tuple({"method": m, "checkpointing": ck, "batch": b}
                for b in (1, 2) for ck in (False, True) for m in ("full", "lora"))
CP_MORE = ({"fsdp": "shard_grad_op"}, {"fsdp": "shard_grad_op", "method": "lora"}, {"precision": "bf16-mixed"},
           {"precision": "bf16-mixed", "method": "lora", "checkpointing": True}, {"grad_accum": 2},
           {"method": "lora", "grad_accum": 2}, {"optimizer": "sgd"},
           {"precision": "fp16-mixed", "checkpointing": True, "batch": 2})
#: What the other shapes (untied head: Llama-3.1; q/k/v biases: Qwen2.5) run on 2 ranks.
CP_SHAPES = (CP_CORE[0], CP_CORE[7])

#: Refused (estimator/context_parallel.py check_cp), with why.
CP_UNVERIFIED = (
    ({"method": "qlora"}, "a bitsandbytes 4-bit base under CP is not run by the truth: refused"),
    ({"precision": "fp32"}, "fp32: CUDA flash takes 16-bit inputs only; the ring over memory-efficient attention "
     "is not modelled: refused"),
)


def cp_launches(quick: bool) -> list[tuple[str, int, int, int, tuple]]:
    """(base model, world size, cp, sequence length, setups) of each launch of the validate matrix
    (world / cp is FSDP2's dp_shard beside CP)."""
    from .tiny import OTHER_BASES, TINY_BASE

    if quick:
        return [(TINY_BASE, 2, 2, 128, CP_CORE[:2])]
    return ([(TINY_BASE, 2, 2, 128, CP_CORE + CP_MORE), (TINY_BASE, 4, 4, 256, CP_CORE),
             (TINY_BASE, 4, 2, 128, CP_CORE[::3])] + [(b, 2, 2, 128, CP_SHAPES) for b in OTHER_BASES])


def cp_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob cp``: per (setup, cp) the fullest rank's device peak against
    the estimate (``truth="cp-N"``), then what is refused, with why. A launch that fails gives its
    setups' failed rows (truths/ranks.py)."""
    from ..estimator import estimate
    from .ranks import failed_launch_rows
    from .row import Row
    from .tiny import TINY_BASE, tiny_config, tiny_model

    rows = []
    for base, world, cp, seq, kws in cp_launches(quick):
        model = tiny_model(base=base)
        setups = [Setup(**{"fsdp": "full_shard", **kw}, fsdp_version=2, cp=cp, gpus=world, seq=seq) for kw in kws]
        try:
            runs = run_cp(tiny_config(base), setups, world, seq)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so, the rest stand
            rows += failed_launch_rows(setups, world, base, model.family, exc, lambda s: ("cp", "cp"))
            continue
        for run in runs:
            est, worst = estimate(model, run.setup), run.worst
            rows.append(Row(f"{base}[tiny]", model.family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"cp-{world}", knob="cp"))  # (world = gpus; cp in setup)
    model = tiny_model()
    for kw, why in CP_UNVERIFIED:
        setup = Setup(**{"fsdp": "full_shard", "fsdp_version": 2, "cp": 2, "gpus": 2, "seq": 128, **kw})
        rows.append(Row(f"{TINY_BASE}[tiny]", model.family, setup, 0, 0, "", "", truth="cp-2", knob="cp",
                        verified=False, why=why))
    return rows


def _main(job_path: str) -> None:
    import json
    from pathlib import Path

    if json.loads(Path(job_path).read_text()).get("probe"):
        _probe_worker(job_path)
    else:
        rank_worker(job_path, _run_one)


if __name__ == "__main__":
    _main(sys.argv[1])
