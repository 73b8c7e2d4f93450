"""DeepSpeed config (``ds_config.json``) for a plan, as the HF Trainer reads it.

What is whose:
- the plan decides the ZeRO block (stage, offloads, the bucket and prefetch sizes from
  :func:`vramplan.estimator.distributed.zero_config`, the one source shared with the estimate) and
  the precision;
- the Trainer owns what train.py lets a user change on its command line (micro-batch, gradient
  accumulation, hence the global batch; clipping; learning rate): those are HF ``"auto"`` values,
  filled from train.py's arguments, whose defaults are the plan's. ``hf_auto=False`` writes the
  plan's numbers instead, for a loop that calls ``deepspeed.initialize`` itself.

Stage 0 (a plan without ZeRO) gets a config only when asked for explicitly: DeepSpeed's data
parallelism without partitioning, which the plan's own launch (python/accelerate) does not need.
"""

from __future__ import annotations

import json

from ..estimator.distributed import zero_config
from ..specs import ModelSpec, Plan, Setup
from .common import default_lr, header_lines, plan_model

#: Where NVMe offload writes, unless the caller names a path; the header says to change it.
DEFAULT_NVME_PATH = "/local_nvme"

#: DeepSpeed's own optimizers, for ZeRO-Offload (a client torch optimizer there is refused).
_DS_OFFLOAD_OPTIMIZERS = {"adamw": "AdamW", "adamw-fused": "AdamW", "lion": "Lion"}


def _largest_param_numel(model: ModelSpec) -> int:
    """Elements of the largest single parameter: NVMe parameter buffers must hold it."""
    sizes = [l.in_features * l.out_features for l in model.linears]
    sizes.append(model.vocab_size * model.hidden_size)
    return max(sizes)


def _offload(device: str, nvme_path: str, kind: str, model: ModelSpec) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
        if kind == "param":
            # buffer_size must hold the largest parameter (DeepSpeed asserts it at start-up)
            block.update(buffer_count=5, buffer_size=max(int(1e8), _largest_param_numel(model)), max_in_cpu=int(1e9))
        else:
            block.update(buffer_count=4, fast_init=False)
    return block


def deepspeed_config(plan: Plan, *, hf_auto: bool = True, nvme_path: str = DEFAULT_NVME_PATH,
                     model: ModelSpec | None = None) -> dict:
    """The DeepSpeed config for ``plan``; a new dict each call (the plan is not touched)."""
    model = model or plan_model(plan)
    s = plan.setup
    lines = header_lines(plan)
    if not s.zero_stage:
        lines.append("this plan does not use ZeRO; stage 0 runs it as DeepSpeed data parallelism")
    if "nvme" in (s.offload_optimizer, s.offload_params):
        lines.append(f"set zero_optimization.offload_*.nvme_path ({nvme_path}) to a directory on a local NVMe drive")
    return {"_comment": lines, **setup_config(model, s, hf_auto=hf_auto, nvme_path=nvme_path)}


def setup_config(model: ModelSpec, s: Setup, *, hf_auto: bool = True, nvme_path: str = DEFAULT_NVME_PATH) -> dict:
    """The DeepSpeed config of Setup ``s`` on ``model`` without the plan's header comment: what
    :func:`deepspeed_config` writes, and what the ZeRO truth (:mod:`vramplan.truths.distributed`)
    runs. ``hf_auto=False`` writes the Setup's numbers where the HF Trainer would fill ``"auto"``."""
    zero = dict(zero_config(model, s))
    if s.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(s.offload_optimizer, nvme_path, "optimizer", model)
    if s.offload_params != "none":
        zero["offload_param"] = _offload(s.offload_params, nvme_path, "param", model)

    cfg: dict = {}
    if hf_auto:
        cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                   train_batch_size="auto", gradient_clipping="auto")
    else:
        # train_batch_size follows from these and the world size; leaving it out keeps the
        # config valid on any number of GPUs
        cfg.update(train_micro_batch_size_per_gpu=s.batch, gradient_accumulation_steps=s.grad_accum,
                   gradient_clipping=1.0)
    cfg["bf16"] = {"enabled": s.precision.startswith("bf16")}
    cfg["fp16"] = {"enabled": s.precision.startswith("fp16")}
    if s.precision.startswith("fp16"):
        cfg["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                           min_loss_scale=1)
    cfg["zero_optimization"] = zero

    if s.offload_optimizer != "none":
        ds_opt = _DS_OFFLOAD_OPTIMIZERS.get(s.optimizer)
        if ds_opt is not None:
            # DeepSpeed's CPU optimizer steps the offloaded states on the host
            params = {"lr": "auto", "weight_decay": "auto"} if hf_auto else {"lr": default_lr(s), "weight_decay": 0.0}
            if ds_opt == "AdamW":
                params.update({"betas": "auto", "eps": "auto"} if hf_auto else {"betas": [0.9, 0.999], "eps": 1e-8})
            cfg["optimizer"] = {"type": ds_opt, "params": params}
        else:
            # the plan's optimizer has no DeepSpeed CPU implementation: keep the client optimizer
            cfg["zero_force_ds_cpu_optimizer"] = False
            cfg["zero_allow_untested_optimizer"] = True
    if "nvme" in (s.offload_optimizer, s.offload_params):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
    cfg.update(steps_per_print=100, wall_clock_breakdown=False)
    return cfg


def dumps(config: dict) -> str:
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"
