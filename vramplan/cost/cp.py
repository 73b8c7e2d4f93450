"""Step time under context parallelism (``--cp N``, estimator/context_parallel.py): what
:func:`vramplan.cost.model.step_cost` prices for the whole sequence, shared by the N ranks of a CP group,
plus torch 2.13's ring over the GPUs' links.

- **compute** / **recompute** / **lora**: the CP group runs one micro-batch of ``seq`` tokens; torch's
  head-tail load balancer gives every rank the same share of the causal attention (each rank's two
  chunks together see half the keys) and of every matmul, so each rank's time is the sequence's over
  N. The FSDP2 terms (the all-gathers and reduce-scatters over all ``gpus``, the optimizer over this
  rank's shards) and the per-layer overhead are the setup's as they are.
- **comm** (the ring, ``_context_parallel/_attention.py``, rotate method ``allgather``): per layer the
  forward all-gathers every rank's ``cat([k, v])`` (``_AllGatherRotater``: each rank receives
  ``(N - 1) x 2 c kv`` bytes, K/V at their own head count), the backward all-gathers them again and
  passes the fp32 dK/dV round the ring (``_AllToAllRotater``: N exchanges of ``8 kv`` bytes), and a
  checkpointed layer's recompute all-gathers once more. Priced over ``interconnect_gbps`` (the PCIe
  link of a consumer card without NVLink) and not hidden behind compute: torch waits for the
  all-gather after the first block and for each dK/dV exchange at the next step, so at most one
  block's attention overlaps it. Not fitted: no published CP throughput.
- **tokens per step**: the ``gpus / (tp x cp)`` data-parallel groups' micro-batches.
"""

from __future__ import annotations

import dataclasses

from ..specs import ModelSpec, Setup


def ring_bytes_per_micro_step(model: ModelSpec, setup: Setup) -> int:
    """Bytes each rank receives over its link for torch's ring in one micro-step (module docstring)."""
    from ..estimator.precision import compute_bytes

    P = setup.cp
    if P <= 1:
        return 0
    kv = setup.batch * (setup.seq // P) * model.num_kv_heads * model.head_dim
    c = compute_bytes(dataclasses.replace(setup, cp=1))
    gathers = 2 + (1 if setup.checkpointing else 0)  # forward, backward (and the recompute's forward)
    return model.num_layers * (gathers * (P - 1) * 2 * c * kv + P * 8 * kv)


def cp_cost(model: ModelSpec, setup: Setup, link_bytes_per_s: float, whole):
    """``whole`` (the StepCost of ``setup`` as one GPU's sequence) as one CP rank's: its compute shared
    by the ``cp`` ranks, the ring's traffic added over ``link_bytes_per_s`` (cost.ring_bandwidth), the
    tokens of ``gpus / (tp x cp)`` groups. ``whole`` as it is without CP."""
    P = setup.cp
    if P <= 1:
        return whole
    ring_s = setup.grad_accum * ring_bytes_per_micro_step(model, setup) / link_bytes_per_s
    return dataclasses.replace(
        whole, compute_s=whole.compute_s / P, recompute_s=whole.recompute_s / P, lora_s=whole.lora_s / P,
        kbit_s=whole.kbit_s / P, attention_s=whole.attention_s / P, comm_s=whole.comm_s + ring_s,
        tokens_per_step=whole.tokens_per_step // P)


__all__ = ["cp_cost", "ring_bytes_per_micro_step"]
