"""The truth for hybrid sharding (HSDP, ``Setup.dp_replicate`` > 1): 4 gloo ranks as a 2 x 2 mesh
(2 replicas of a 2-rank shard group), per rank, with accelerate 1.15's and torch 2.13's own code.

    rows = hsdp_rows(quick=False)            # vramplan validate --knob hybrid_shard

- FSDP2: the FSDP2 truth (:func:`vramplan.truths.fsdp2.run_fsdp2`) with accelerate's
  ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` mesh (:func:`vramplan.truths.hsdp.attach_mesh`):
  ``fully_shard`` over ``mesh[("dp_replicate", "dp_shard_cp")]``, placements (Replicate, Shard(0)).
- FSDP1: the FSDP1 truth (:func:`vramplan.truths.fsdp.run_fsdp`) with ``fsdp_sharding_strategy``
  HYBRID_SHARD / HYBRID_SHARD_ZERO2 and two "GPUs per node" (:func:`vramplan.truths.hsdp.cpu_node_size`).

Each row is the fullest rank's device peak against ``estimate()`` (estimator/hybrid_shard.py).
The seq-8 rows put the end of the backward at the peak, where FSDP2's 16-bit reduce outputs held
for the all-reduce (``FSDPParamGroup._all_reduce_state``) are live.
"""

from __future__ import annotations

from ..specs import Setup
from .tiny import TINY_BASE, TINY_SEQ, tiny_config, tiny_model

#: 2 replicas x 2 shard ranks.
WORLD, REPLICAS = 4, 2

#: FSDP2 HSDP: both reshard modes, LoRA, QLoRA, mixed precision, checkpointing, accumulation.
HSDP2_MATRIX = (
    {"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"}, {"fsdp": "full_shard", "method": "lora"},
    {"fsdp": "full_shard", "precision": "bf16-mixed"},
    {"fsdp": "full_shard", "precision": "bf16-mixed", "method": "lora"},
    {"fsdp": "full_shard", "checkpointing": True}, {"fsdp": "full_shard", "grad_accum": 2},
    {"fsdp": "full_shard", "method": "qlora"},
)
#: Short sequences: the backward's end (every group's held 16-bit reduce output) is the peak.
HSDP2_SHORT_SEQ = 8
HSDP2_SHORT = ({"fsdp": "full_shard", "precision": "bf16-mixed"},
               {"fsdp": "full_shard", "precision": "bf16-mixed", "checkpointing": True})
#: FSDP1 HYBRID_SHARD / HYBRID_SHARD_ZERO2.
HSDP1_MATRIX = (
    {"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"}, {"fsdp": "full_shard", "method": "lora"},
    {"fsdp": "full_shard", "precision": "bf16-mixed"},
    {"fsdp": "full_shard", "precision": "bf16-mixed", "method": "lora"},
    {"fsdp": "full_shard", "checkpointing": True}, {"fsdp": "full_shard", "grad_accum": 2},
)

#: What hybrid sharding refuses (estimator/hybrid_shard.py check_hybrid), and why.
HSDP_UNVERIFIED = (
    ({"fsdp": "full_shard", "fsdp_version": 2, "offload_params": "cpu"},
     "FSDP CPU offload: on this CPU-only machine host and device are one device, so the split cannot be "
     "measured: refused"),
    ({"fsdp": "full_shard", "method": "qlora"},
     "FSDP1 hybrid sharding of a bitsandbytes base is not run here: refused (FSDP2 runs it)"),
)


def _setups(kws, version: int, seq: int = TINY_SEQ) -> list[Setup]:
    return [Setup(**kw, gpus=WORLD, seq=seq, fsdp_version=version, dp_replicate=REPLICAS) for kw in kws]


def launches(quick: bool) -> list[tuple[int, int, tuple]]:
    """(fsdp_version, seq, setups) of each 4-rank launch."""
    if quick:
        return [(2, TINY_SEQ, HSDP2_MATRIX[3:4])]  # FSDP2 HSDP under bf16 MixedPrecisionPolicy
    return [(2, TINY_SEQ, HSDP2_MATRIX), (2, HSDP2_SHORT_SEQ, HSDP2_SHORT), (1, TINY_SEQ, HSDP1_MATRIX)]


def run_launch(version: int, seq: int, kws) -> list:
    """Run one launch on the tiny model: (setup, fullest rank's RankPeak, every rank's bytes, Breakdown)."""
    from ..estimator import estimate
    from .fsdp import run_fsdp
    from .fsdp2 import run_fsdp2

    config = tiny_config()
    model = tiny_model(config)
    setups = _setups(kws, version, seq)
    runs = (run_fsdp2 if version == 2 else run_fsdp)(config, setups, WORLD, seq=seq)
    return [(r.setup, r.worst, [p.device_bytes for p in r.ranks], estimate(model, r.setup)) for r in runs]


def hsdp_rows(quick: bool) -> list:
    """Rows for ``vramplan validate --knob hybrid_shard`` (``truth="hsdp2-4"`` / ``"hsdp1-4"``),
    then what is refused, with why."""
    from .ranks import failed_launch_rows
    from .row import Row

    model = tiny_model()
    rows = []
    for version, seq, kws in launches(quick):
        truth = f"hsdp{version}-{WORLD}"
        try:
            compared = run_launch(version, seq, kws)
        except RuntimeError as exc:  # a crashed or timed-out launch: its rows say so, the rest stand
            rows += failed_launch_rows(_setups(kws, version, seq), WORLD, TINY_BASE, model.family, exc,
                                       lambda s, v=version: ("hybrid_shard", f"hsdp{v}"))
            continue
        for setup, worst, _, est in compared:
            rows.append(Row(model.name, model.family, setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=truth, knob="hybrid_shard"))
    for kw, why in HSDP_UNVERIFIED:
        setup = Setup(**kw, gpus=WORLD, seq=TINY_SEQ, dp_replicate=REPLICAS)
        rows.append(Row(model.name, model.family, setup, 0, 0, "", "", truth=f"hsdp{setup.fsdp_version}-{WORLD}",
                        knob="hybrid_shard", verified=False, why=why))
    return rows
