"""DeepSpeed ZeRO settings shared by the estimator (memory of its buffers) and the emitter (the
values written into ds_config.json), so that what is estimated is what is launched.

``zero_config`` returns the ``zero_optimization`` numbers vramplan chooses for a plan. The values
start as DeepSpeed's own defaults (deepspeed/runtime/zero/config.py) and are refined by the ZeRO
accuracy work (issue 3); callers must not hard-code them elsewhere.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup


def zero_config(model: ModelSpec, setup: Setup) -> dict:
    """The ``zero_optimization`` block's numeric knobs for ``setup`` (stage, buckets, prefetch)."""
    cfg: dict = {
        "stage": setup.zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": int(5e8),
        "allgather_bucket_size": int(5e8),
    }
    if setup.zero_stage == 3:
        cfg.update({
            "stage3_prefetch_bucket_size": int(5e7),
            "stage3_param_persistence_threshold": int(1e5),
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    return cfg
