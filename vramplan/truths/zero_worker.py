"""The DeepSpeed ZeRO truth's rank: ``python -m vramplan.truths.zero_worker JOB`` (started by
:func:`vramplan.truths.distributed.run_zero` through :func:`vramplan.truths.ranks.launch_ranks`).

Each rank has RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, DeepSpeed's CPU accelerator
(``DS_ACCELERATOR=cpu``) and gloo. It builds the model with random weights from ``config`` in
bf16 (stage 3: inside ``deepspeed.zero.Init``, as transformers does), wraps the client optimizer
vramplan's Setup names (torch AdamW foreach; DeepSpeed's CPU Adam when AdamW is offloaded, as the
emitter writes it) with ``deepspeed.initialize`` and the ds_config vramplan emits
(:func:`vramplan.truths.distributed.ds_config`), and runs the canonical step twice:
``engine(input_ids, labels=input_ids).loss``, ``engine.backward(loss)``, ``engine.step()``. One
launch runs several setups one after the other (each with its own model, engine and counter).
Counting, and what is host and what device, is described in :mod:`vramplan.truths.distributed`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ..run.live import SplitCounter
from ..specs import Setup, SpecError
from .distributed import ds_config
from .ranks import counter_peak, saved_checkpoint


def _worker(job_path: str) -> None:
    """One rank: run every setup of the job and write ``rank{RANK}.json`` next to it."""
    import faulthandler
    import logging
    import warnings

    import torch

    faulthandler.register(signal.SIGUSR1)  # launch_ranks asks for the stacks of a rank that hangs
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.ERROR)
    job = json.loads(Path(job_path).read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    nvme = Path(job["out"]) / f"nvme{rank}"
    nvme.mkdir(exist_ok=True)
    out = [_run_one(job["config"], Setup.from_dict(s), job["seq"], job["detail"], str(nvme), job["out"])
           for s in job["setups"]]
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def _tensors_in(obj: Any, depth: int = 3):
    """Tensors held by obj (a tensor, or lists/tuples/dicts of them), with their ``.grad``."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif depth and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o, depth - 1)
    elif depth and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o, depth - 1)


#: DeepSpeed attributes that live on the offload device (see :mod:`vramplan.truths.distributed`).
_HOST_ATTRS = {
    ("stage12", "optimizer"): ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
                               "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu"),
    ("stage3", "optimizer"): ("fp32_partitioned_groups_flat", "grad_partitions_flat_buffer"),
    ("stage3", "params"): ("param_groups_fp16_flat_cpu_memory",),
}


def _host_tensors(engine, setup: Setup):
    """The storages DeepSpeed keeps on the host for ``setup``'s offload."""
    zopt = engine.optimizer
    kind = "stage3" if setup.zero_stage == 3 else "stage12"
    found = []
    if setup.offload_optimizer != "none":
        for attr in _HOST_ATTRS[(kind, "optimizer")]:
            found += list(_tensors_in(getattr(zopt, attr, None)))
        for state in zopt.optimizer.state.values():
            found += list(_tensors_in(state))
    swapper = getattr(zopt, "optimizer_swapper", None)  # NVMe: page-locked host swap buffers
    if swapper is not None:
        found += list(_tensors_in(getattr(swapper.swap_buffer_manager, "all_buffers", None)))
    if setup.offload_params != "none":
        for attr in _HOST_ATTRS[("stage3", "params")]:
            found += list(_tensors_in(getattr(zopt, attr, None)))
        for p in engine.module.parameters():
            if getattr(p, "ds_tensor", None) is not None:
                found.append(p.ds_tensor)
    return found


def _client_optimizer(setup: Setup, model):
    """The torch optimizer of ``setup`` over the parameter groups the HF Trainer gives it
    (``Trainer.create_optimizer``, which every emitted train.py runs): the trainable parameters with
    weight decay, then those without (biases, norms; empty under LoRA, passed all the same).
    ZeRO-1/2 keep the gradient partition until the last group's gradients are freed, so the first
    group's inner step runs beside it (docs/deepspeed.md): the groups change the step's peak."""
    import transformers

    from ..run.models import torch_optimizer

    if setup.optimizer not in ("adamw", "adamw-fused", "sgd"):
        raise SpecError(f"the ZeRO truth runs torch optimizers (adamw, adamw-fused, sgd); not {setup.optimizer!r}")
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay]}]
    return torch_optimizer(setup, groups)


def _init_left_empty(model, std: float) -> None:
    """Random values for the parameters transformers 5 leaves uninitialized under ``zero.Init``:
    an MoE block's router and fused 3-D experts (``torch.empty``: NaN, 1e30 or zeros), which make
    the loss NaN, so DeepSpeed skips the optimizer step (gradient overflow) and never allocates the
    optimizer states. A real run loads a checkpoint instead. Gathered on every rank, written on rank 0."""
    import deepspeed
    import torch

    for p in model.parameters():
        if p.ds_numel <= 0 or len(p.ds_shape) < 2:
            continue
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            bad = not bool(torch.isfinite(p).all()) or float(p.float().abs().max()) > 1e3 or not bool(p.any())
            if bad:
                p.normal_(0.0, std)


def _build_model(config: dict, setup: Setup, cfg: dict, work: str):
    """The model of ``setup`` as the emitted train.py builds it (vramplan/emit/templates/train.py.tmpl):
    weights loaded in bf16/fp16, fp32 for the ``-mixed`` precisions and fp32 (DeepSpeed's bf16/fp16
    engine then casts them itself; no autocast under DeepSpeed); under stage 3 created inside
    ``deepspeed.zero.Init``, as transformers does when ZeRO-3 is enabled, which partitions each
    parameter at construction and swaps F.linear for DeepSpeed's version. A quantized base is the
    random checkpoint reloaded through bitsandbytes (4-bit weights packed in the 16-bit dtype
    DeepSpeed trains in under stage 3, ``bnb_4bit_quant_storage``, so that ZeRO-3 can partition
    them; uint8 otherwise) and prepared with ``prepare_model_for_kbit_training``; transformers builds
    a quantized model on the meta device, never under ``zero.Init``, and DeepSpeed partitions it at
    ``initialize``."""
    import deepspeed
    import torch
    import transformers

    from ..run.models import hf_config

    load = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    stage3 = setup.zero_stage == 3
    if setup.quant == "none":
        hf_cfg = hf_config(config, None)
        hf_cfg.use_cache = False
        if not stage3:
            return transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=load, attn_implementation="sdpa")
        # import the modeling module first: zero.Init patches every nn.Module subclass's __init__
        # and restores on exit what it saw, dropping a class decorator applied while inside
        # (transformers 5's fused-experts wrapper, which sets ``self.config``)
        transformers.AutoModelForCausalLM._model_mapping[type(hf_cfg)]
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=load, attn_implementation="sdpa")
        _init_left_empty(model, float(config.get("initializer_range", 0.02)))
        return model
    import peft
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    path = saved_checkpoint(config, load, work)  # saved before ZeRO-3 is switched on (it would be saved empty)
    compute = torch.float16 if setup.precision.startswith("fp16") else torch.bfloat16
    # ZeRO-3 partitions the packed 4-bit weights as tensors of the dtype it trains in: the engine
    # casts every floating parameter to 16 bits, so a packed fp32 storage (a -mixed load) would
    # be cast element-wise and broken; stage 1/2 leave frozen weights whole (uint8, bitsandbytes' default)
    storage = (torch.float32 if setup.precision == "fp32" else compute) if stage3 else torch.uint8
    if setup.quant == "int8":
        qcfg = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        qcfg = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=setup.quant, bnb_4bit_use_double_quant=setup.double_quant,
            bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage)
    hf_ds = HfDeepSpeedConfig(cfg) if stage3 else None  # noqa: F841 (transformers holds a weak reference)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=qcfg, dtype=load, attn_implementation="sdpa", use_cache=False,
            **({} if stage3 else {"device_map": "cpu"}))
    finally:
        unset_hf_deepspeed_config()
    # checkpointing is adapt_for_training's (peft's would call the deprecated gradient_checkpointing_enable)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _run_one(config: dict, setup: Setup, seq: int, detail: bool = False, nvme_path: str = "", work: str = "") -> dict:
    import gc

    import deepspeed
    import torch
    import transformers

    from ..model.architecture import model_spec_from_config
    from ..run.cuda_paths import int8_as_on_cuda, quant_state_tensors
    from ..run.models import adapt_for_training

    spec = model_spec_from_config(config, name="tiny")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = ds_config(spec, setup, nvme_path=nvme_path)
    if setup.zero_stage == 3:
        # imported inside zero.Init, these trip over its tensor-creation patches
        import torch._dynamo
        import transformers.generation.utils
        from deepspeed.runtime.zero.partition_parameters import (
            InsertPostInitMethodToModuleSubClasses as _Init,
        )
    model = _build_model(config, setup, cfg, work)
    model = adapt_for_training(model, setup)
    # the config names DeepSpeed's own optimizer (its CPU Adam for an offloaded AdamW, as emitted)
    # or the client optimizer steps
    opt = None if "optimizer" in cfg else _client_optimizer(setup, model)
    host_step = setup.offload_optimizer != "none"

    counter = SplitCounter(detail)
    counter.track(model, [getattr(p, "ds_tensor", None) for p in model.parameters()], quant_state_tensors(model))
    ids = torch.randint(0, spec.vocab_size, (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    undo_int8 = int8_as_on_cuda() if setup.quant == "int8" else (lambda: None)  # LLM.int8 as on CUDA
    with counter:
        counter.phase("init")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        init_bytes = counter.peak_bytes
        if host_step:
            counter.host_steps(engine.optimizer.optimizer)
        for step in range(2):
            counter.mark_host(_host_tensors(engine, setup))
            if step == 1:
                counter.start_measuring()
            for _ in range(setup.grad_accum):
                counter.phase("forward")
                loss = engine(input_ids=ids, labels=ids).loss
                counter.phase("backward")
                engine.backward(loss)
                del loss
                counter.phase("optimizer")
                engine.step()
        counter.phase(None)
    undo_int8()
    peak = counter_peak(counter, init_bytes)
    out = {"peak": peak, "zero_optimizer": type(engine.optimizer).__name__,
           "inner_optimizer": type(engine.optimizer.optimizer).__name__}
    if detail:
        agg: dict[str, int] = {}
        for sid, n in counter.at_peak.items():
            key = counter.sites.get(sid, "existing before initialize")
            agg[key] = agg.get(key, 0) + n
        out["detail"] = sorted(agg.items(), key=lambda kv: -kv[1])
    engine.destroy()
    if setup.zero_stage == 3 and getattr(_Init, "linear_bk", None) is not None:
        torch.nn.functional.linear = _Init.linear_bk  # zero.Init leaves its F.linear installed
    del engine, model, opt
    gc.collect()
    return out


if __name__ == "__main__":
    _worker(sys.argv[1])
