"""The truth for DeepSpeed ZeRO: the real engine run with N processes on this machine, per rank.

    runs = run_zero(tiny_config(), [Setup(zero_stage=2, gpus=2), ...], world=2)
    runs[0].ranks[1].device_bytes            # rank 1's peak of "GPU" tensor bytes

Each rank is a subprocess (``python -m vramplan.run.distributed JOB``) with RANK/WORLD_SIZE/
LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) and
gloo. It builds the model with random weights from ``config`` in bf16 (stage 3: inside
``deepspeed.zero.Init``, as transformers does), wraps the client optimizer vramplan's Setup names
(torch AdamW foreach; DeepSpeed's CPU Adam when AdamW is offloaded, as the emitter writes it) with
``deepspeed.initialize`` and the ds_config vramplan emits
(:func:`ds_config`, whose ZeRO numbers come from ``vramplan.estimator.distributed.zero_config``),
and runs the canonical step twice: ``engine(input_ids, labels=input_ids).loss``,
``engine.backward(loss)``, ``engine.step()``. One launch runs several setups one after the other
(each with its own model, engine and counter), so the test suite pays for process start-up once.

Counting. A :class:`LiveTensorCounter` is entered before ``deepspeed.initialize`` so that every
buffer DeepSpeed allocates is seen; the peak is taken over the second step (the first allocates
the optimizer state and DeepSpeed's lazily created buffers; the second is the steady state and
the larger of the two).

Host versus device. On the CPU accelerator DeepSpeed's "GPU" tensors and its offloaded host
tensors are both CPU tensors, so they are told apart by what owns them, following the code that
places them (DeepSpeed 0.19, runtime/zero/stage_1_and_2.py and stage3.py):
- whatever the client optimizer allocates while it steps on an offloaded partition (its states
  and the step's transients): DeepSpeed runs that step on the host. Seen through torch's own
  optimizer step hooks (``register_step_pre_hook`` / ``register_step_post_hook``);
- the buffers DeepSpeed creates on its offload device (``self.device == "cpu"`` when offloading):
  stage 1/2 ``single_partition_of_fp32_groups`` (fp32 master partition) and its ``.grad``,
  ``param_buffer_of_bit16_for_cpu_offload_groups``, ``temp_grad_buffer_for_cpu_offload``,
  ``accumulated_grads_in_cpu``; stage 3 ``fp32_partitioned_groups_flat`` and their ``.grad``,
  ``grad_partitions_flat_buffer``; with parameter offload the partitioned bf16 parameters
  (``param.ds_tensor``) and ``param_groups_fp16_flat_cpu_memory``; with NVMe the optimizer
  swapper's page-locked buffers (``optimizer_swapper.swap_buffer_manager.all_buffers``).
Everything else (bf16 parameters, gathered parameters, gradient buckets, activations) is what a
GPU would hold. ``device_bytes`` is the peak of the live total minus the live host part.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..specs import ModelSpec, Setup, SpecError, truncate_config
from . import release_deepspeed_shm

#: The tiny model every ZeRO truth run uses: Llama-3.2-1B's architecture (tied embeddings, GQA,
#: SwiGLU) scaled down so that four processes on two cores finish in seconds.
TINY_BASE = "meta-llama/Llama-3.2-1B"
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
TINY_LAYERS = 2
TINY_SEQ = 64


#: MoE shapes (transformers 5's fused 3-D experts): 4 experts, top-2, expert width 64.
MOE_BASES = ("mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B")
_MOE_SHAPE = {"mistralai/Mixtral-8x7B-v0.1": {"num_local_experts": 4, "num_experts_per_tok": 2},
              "Qwen/Qwen3-30B-A3B": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}}


def tiny_config(base: str = TINY_BASE, layers: int = TINY_LAYERS, shape: dict | None = None) -> dict:
    """A shipped profile's config.json truncated to ``layers`` layers with hidden sizes shrunk
    (an MoE base also to 4 experts, top-2)."""
    from ..profiles import load_model

    cfg = truncate_config(dict(load_model(base).config), layers)
    cfg.update(TINY_SHAPE if shape is None else shape)
    if shape is None:
        cfg.update(_MOE_SHAPE.get(base, {}))
    return cfg


def tiny_model(config: dict | None = None, base: str = TINY_BASE) -> ModelSpec:
    """The ModelSpec of :func:`tiny_config` (what the estimate of a truth run is computed on)."""
    from ..architecture import model_spec_from_config

    return model_spec_from_config(config or tiny_config(base), name=f"{base}[tiny]", source=f"profile:{base}")


#: Other shapes the full matrix also runs (on 2 ranks): untied head (Llama-3.1), and q/k/v biases
#: that stage 3 keeps gathered as persistent parameters (Qwen2.5).
OTHER_BASES = ("meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B")


def uses_ds_cpu_adam(setup: Setup) -> bool:
    """Offloaded AdamW runs DeepSpeed's CPU Adam (a JIT-built C++ op), as the emitter writes it;
    other optimizers stay the client torch optimizer stepping on the host."""
    return setup.offload_optimizer != "none" and setup.optimizer in ("adamw", "adamw-fused")


def ds_config(model: ModelSpec, setup: Setup, nvme_path: str = "/local_nvme") -> dict:
    """The ds_config.json of ``setup``: bf16 (or fp16) mixed precision, the client optimizer kept
    (``zero_force_ds_cpu_optimizer: false``, so torch AdamW also steps an offloaded partition), and
    the ``zero_optimization`` block from :func:`vramplan.estimator.distributed.zero_config` with
    the offload blocks (and ``aio`` for NVMe) the emitter writes (vramplan/emit/deepspeed.py)."""
    from ..emit.deepspeed import _offload
    from ..estimator.distributed import zero_config

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": setup.batch,
        "gradient_accumulation_steps": setup.grad_accum,
        "zero_optimization": zero_config(model, setup),
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    for kind, device in (("optimizer", setup.offload_optimizer), ("param", setup.offload_params)):
        if device != "none":
            cfg["zero_optimization"][f"offload_{kind}"] = _offload(device, nvme_path, kind, model)
    if "nvme" in (setup.offload_optimizer, setup.offload_params):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
    if uses_ds_cpu_adam(setup):
        # as vramplan's emitter writes it: DeepSpeed's CPU Adam steps the offloaded partition
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.0}}
    if setup.precision in ("bf16", "bf16-mixed"):
        cfg["bf16"] = {"enabled": True}
    elif setup.precision in ("fp16", "fp16-mixed"):
        cfg["fp16"] = {"enabled": True}
    return cfg


# ----------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class RankPeak:
    """One rank's peaks over the measured step, in bytes."""

    rank: int
    device_bytes: int  # live bytes a GPU would hold (tensor peak)
    phase: str  # phase of the device peak
    phase_peaks: dict = field(default_factory=dict)  # device peak per phase
    host_bytes: int = 0  # peak of the live offloaded (host) bytes
    init_bytes: int = 0  # live bytes (host and device) peak up to the end of deepspeed.initialize


@dataclass(frozen=True)
class ZeroRun:
    """A setup run by the real engine: one RankPeak per rank, and which optimizers ran."""

    setup: Setup
    ranks: tuple[RankPeak, ...]
    zero_optimizer: str  # DeepSpeedZeroOptimizer / DeepSpeedZeroOptimizer_Stage3
    inner_optimizer: str  # the client optimizer DeepSpeed steps (torch AdamW)
    #: with ``detail``: per rank, the device bytes live at its peak by (dtype, creation site, phase)
    details: tuple = ()

    @property
    def worst(self) -> RankPeak:
        return max(self.ranks, key=lambda r: r.device_bytes)


# ----------------------------------------------------------------------------------------------
# the launcher (no torch at import)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(module: str, job: dict, world: int, timeout_s: float, env: dict, what: str) -> list:
    """Run ``python -m MODULE JOB`` as ``world`` local ranks (RANK/WORLD_SIZE/LOCAL_RANK, a free
    port on 127.0.0.1, ``env`` added) and return each rank's JSON result, which the worker writes
    to ``<job["out"]>/rank<r>.json``. Subprocesses, no fork of the caller: this works from pytest,
    a CLI command or a script alike. Past ``timeout_s`` every rank dumps its stack (SIGUSR1, the
    workers' faulthandler) and RuntimeError carries the logs; a crash raises with the log of the
    rank that crashed first, not of one that lost its peer. DeepSpeed's shared-memory buffers
    are released whatever happened."""
    with tempfile.TemporaryDirectory(prefix=f"vramplan-{what.lower()}-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps({**job, "out": tmp}))
        port = _free_port()
        procs = []
        for r in range(world):
            rank_env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env)
            log = open(Path(tmp) / f"rank{r}.log", "w")  # noqa: SIM115 (closed after the wait below)
            procs.append((subprocess.Popen([sys.executable, "-m", module, str(path)],
                                           env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout_s
        try:
            for p, _ in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            tails = "".join(f"--- rank {r}:\n" + (Path(tmp) / f"rank{r}.log").read_text()[-2000:]
                            for r in range(world))
            raise RuntimeError(f"{what} workers did not finish within {timeout_s:.0f} s\n{tails}") from None
        finally:
            for p, log in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                log.close()
            release_deepspeed_shm(port)
        results, failed = [], []
        for r, (p, _) in enumerate(procs):
            out = Path(tmp) / f"rank{r}.json"
            if p.returncode != 0 or not out.is_file():
                failed.append((r, p.returncode, (Path(tmp) / f"rank{r}.log").read_text()[-3000:]))
            else:
                results.append(json.loads(out.read_text()))
        if failed:
            r, code, tail = min(failed, key=lambda f: "closed by peer" in f[2])
            raise RuntimeError(f"rank {r} exited with {code}:\n{tail}")
        return results


def run_zero(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ, timeout_s: float = 600,
             detail: bool = False) -> list[ZeroRun]:
    """Run each setup (all with ``gpus == world``) on ``world`` processes, in one launch.

    The ranks are ``python -m vramplan.run.distributed JOB`` subprocesses (no fork of the caller,
    so this works from pytest, a CLI command or a script alike); each writes its results as JSON.
    ``detail``: each rank also reports the device tensors live at its peak by dtype, shape, creation
    site and phase (at the peak of one phase instead with ``VRAMPLAN_DETAIL_PHASE=forward``, say)."""
    for s in setups:
        if s.gpus != world:
            raise SpecError(f"setup has gpus={s.gpus} but the launch has {world} processes")
        if not s.zero_stage:
            raise SpecError("run_zero measures DeepSpeed ZeRO setups (zero_stage 1-3)")
    got = launch_ranks("vramplan.run.distributed", {"config": config, "setups": [s.to_dict() for s in setups],
                                                    "seq": seq, "detail": detail},
                       world, timeout_s, {"DS_ACCELERATOR": "cpu"}, "DeepSpeed")
    runs = []
    for i, s in enumerate(setups):
        ranks = tuple(RankPeak(**got[r][i]["peak"]) for r in range(world))
        details = tuple(tuple(tuple(kv) for kv in got[r][i].get("detail", ())) for r in range(world))
        runs.append(ZeroRun(s, ranks, got[0][i]["zero_optimizer"], got[0][i]["inner_optimizer"], details))
    return runs


# ----------------------------------------------------------------------------------------------
# the worker (imports torch and deepspeed)


def _worker(job_path: str) -> None:
    """One rank: run every setup of the job and write ``rank{RANK}.json`` next to it."""
    import faulthandler
    import logging
    import warnings

    import torch

    faulthandler.register(signal.SIGUSR1)  # run_zero asks for the stacks of a rank that hangs
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


def _split_counter_class():
    from .live import LiveTensorCounter

    class SplitCounter(LiveTensorCounter):
        """LiveTensorCounter that keeps a host part apart: storages marked host (by owner, or
        allocated while ``host_context`` is set) count to ``host_peak`` and not to the device."""

        def __init__(self, detail: bool = False) -> None:
            super().__init__(device="cpu")
            self.detail = detail
            self.sites: dict[int, str] = {}
            self.at_peak: dict[int, int] = {}
            self.host_context = False
            self.host_sids: set[int] = set()
            self.measuring = False
            self.device_peak = 0
            self.device_phase = ""
            self.device_phase_peaks: dict[str, int] = {}
            self.host_peak = 0

        def _track(self, tensor) -> None:
            before = self._by_obj.get(id(tensor.untyped_storage())) if not tensor.is_meta else None
            super()._track(tensor)
            if self.detail and before is None and not tensor.is_meta:
                sid = self._by_obj.get(id(tensor.untyped_storage()))
                if sid is not None and sid not in self.sites:
                    self.sites[sid] = f"{str(tensor.dtype)[6:]}{list(tensor.shape)} {_creation_site()} [{self._phase}]"
            if self.host_context and before is None and not tensor.is_meta:
                sid = self._by_obj.get(id(tensor.untyped_storage()))
                if sid is not None:
                    self.host_sids.add(sid)

        def host_steps(self, optimizer) -> None:
            """Count what ``optimizer.step()`` allocates as host memory (it steps on the host)."""

            def _pre(*_a):
                self.host_context = True

            def _post(*_a):
                self.host_context = False

            optimizer.register_step_pre_hook(_pre)
            optimizer.register_step_post_hook(_post)

        def mark_host(self, tensors) -> None:
            for t in tensors:
                self._track(t)
                sid = self._by_obj.get(id(t.untyped_storage()))
                if sid is not None:
                    self.host_sids.add(sid)
            self._observe()

        def host_live(self) -> int:
            dead = [s for s in self.host_sids if s not in self.live]
            for s in dead:
                self.host_sids.discard(s)
            return sum(self.live[s] for s in self.host_sids)

        def _observe(self) -> None:
            super()._observe()
            if not self.measuring:
                return
            host = self.host_live()
            dev = self.current_bytes - host
            self.host_peak = max(self.host_peak, host)
            if dev > self.device_peak:
                self.device_peak, self.device_phase = dev, self._phase or ""
                if self.detail and not os.environ.get("VRAMPLAN_DETAIL_PHASE"):
                    self.at_peak = {s: n for s, n in self.live.items() if s not in self.host_sids}
            if self._phase is not None and dev > self.device_phase_peaks.get(self._phase, 0):
                self.device_phase_peaks[self._phase] = dev
                if self.detail and os.environ.get("VRAMPLAN_DETAIL_PHASE") == self._phase:
                    self.at_peak = {s: n for s, n in self.live.items() if s not in self.host_sids}

        def start_measuring(self) -> None:
            self.measuring = True
            self.device_peak, self.device_phase, self.device_phase_peaks, self.host_peak = 0, "", {}, 0
            self._observe()

    return SplitCounter


def _creation_site() -> str:
    """The innermost DeepSpeed/transformers frames that allocated a tensor (diagnostics)."""
    import traceback

    frames = [f for f in traceback.extract_stack(limit=24)
              if "site-packages" in f.filename and "/torch/" not in f.filename]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1][:3]) or "?"


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


#: DeepSpeed attributes that live on the offload device (see the module docstring).
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

    from ..tracer import make_optimizer

    if setup.optimizer not in ("adamw", "adamw-fused", "sgd"):
        raise SpecError(f"the ZeRO truth runs torch optimizers (adamw, adamw-fused, sgd); not {setup.optimizer!r}")
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay]}]
    return make_optimizer(setup, groups)


def _saved_checkpoint(config: dict, dtype, work: str) -> str:
    """Random weights of ``config`` saved once per launch under ``work`` by rank 0 (transformers'
    ``save_pretrained`` writes on rank 0 only once a process group exists), read by every rank."""
    import hashlib

    import torch
    import transformers

    from ..tracer import _hf_config

    key = hashlib.sha1((json.dumps(config, sort_keys=True) + str(dtype)).encode()).hexdigest()[:12]
    path = Path(work) / f"ckpt-{key}"
    if int(os.environ.get("RANK", "0")) == 0 and not (path / "config.json").is_file():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(_hf_config(config, None), dtype=dtype).save_pretrained(path)
    torch.distributed.barrier()
    return str(path)


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

    from ..tracer import _hf_config

    load = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    stage3 = setup.zero_stage == 3
    if setup.quant == "none":
        hf_cfg = _hf_config(config, None)
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

    path = _saved_checkpoint(config, load, work)  # saved before ZeRO-3 is switched on (it would be saved empty)
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
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=setup.checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})


def _run_one(config: dict, setup: Setup, seq: int, detail: bool = False, nvme_path: str = "", work: str = "") -> dict:
    import gc

    import deepspeed
    import torch
    import transformers

    from ..architecture import model_spec_from_config
    from .cpu_truth import _int8_as_on_cuda, adapt_for_training, quant_state_tensors

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
    opt = None if uses_ds_cpu_adam(setup) else _client_optimizer(setup, model)
    host_step = setup.offload_optimizer != "none"

    counter = _split_counter_class()(detail)
    counter.track(model, [getattr(p, "ds_tensor", None) for p in model.parameters()], quant_state_tensors(model))
    ids = torch.randint(0, spec.vocab_size, (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    undo_int8 = _int8_as_on_cuda() if setup.quant == "int8" else (lambda: None)  # LLM.int8 as on CUDA
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
    peak = {"rank": int(os.environ["RANK"]), "device_bytes": counter.device_peak, "phase": counter.device_phase,
            "phase_peaks": dict(counter.device_phase_peaks), "host_bytes": counter.host_peak, "init_bytes": init_bytes}
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


# ----------------------------------------------------------------------------------------------
# estimate versus truth


#: The verified matrix: every stage, without and with CPU offload (parameters too at stage 3).
ZERO_MATRIX = (
    {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
    {"zero_stage": 1, "offload_optimizer": "cpu"}, {"zero_stage": 2, "offload_optimizer": "cpu"},
    {"zero_stage": 3, "offload_optimizer": "cpu"},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
)

#: NVMe offload (DeepSpeed's async_io op, with libaio): stage 1/2 treat an NVMe optimizer offload
#: as a CPU one; stage 3 swaps the optimizer's fp32 partition through page-locked host buffers.
NVME_MATRIX = ({"zero_stage": 2, "offload_optimizer": "nvme"}, {"zero_stage": 3, "offload_optimizer": "nvme"})

#: LoRA under ZeRO: stage 1/2 cast the adapters to 16 bits with the model, stage 3 keeps peft's
#: fp32 adapters (16-bit once their partitions are offloaded) and saves every Linear's input; with
#: checkpointing on 2+ ranks a recomputed layer keeps its parameters gathered through its backward.
LORA_MATRIX = (
    {"zero_stage": 1, "method": "lora"}, {"zero_stage": 2, "method": "lora"}, {"zero_stage": 3, "method": "lora"},
    {"zero_stage": 2, "method": "lora", "offload_optimizer": "cpu"},
    {"zero_stage": 3, "method": "lora", "offload_optimizer": "cpu", "offload_params": "cpu"},
    {"zero_stage": 2, "method": "lora", "checkpointing": True},
    {"zero_stage": 3, "method": "lora", "checkpointing": True},
)

#: Quantized bases under ZeRO (bitsandbytes; transformers builds them outside zero.Init, so the
#: engine casts everything but the packed weights to 16 bits, adapters included, at every stage).
QUANT_MATRIX = (
    {"zero_stage": 2, "method": "qlora"}, {"zero_stage": 3, "method": "qlora"},
    {"zero_stage": 3, "method": "qlora", "offload_optimizer": "cpu", "offload_params": "cpu"},
    {"zero_stage": 3, "method": "qlora", "checkpointing": True},
    {"zero_stage": 2, "method": "lora", "quant": "int8"},
)

#: bf16-mixed under ZeRO: fp32 weights loaded, cast to bf16 by DeepSpeed's engine, no autocast.
MIXED_MATRIX = (
    {"zero_stage": 1, "precision": "bf16-mixed"}, {"zero_stage": 2, "precision": "bf16-mixed"},
    {"zero_stage": 3, "precision": "bf16-mixed"},
    {"zero_stage": 1, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 2, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 3, "method": "lora", "precision": "bf16-mixed"},
    {"zero_stage": 3, "method": "qlora", "precision": "bf16-mixed"},
)

#: MoE (MOE_BASES, fused 3-D experts) under ZeRO 2 and 3.
MOE_MATRIX = (
    {"zero_stage": 2}, {"zero_stage": 3}, {"zero_stage": 3, "checkpointing": True},
    {"zero_stage": 2, "method": "lora"}, {"zero_stage": 3, "method": "lora"},
)

#: Knobs of the ZeRO matrix that are not verified here, and why.
UNVERIFIED = (
    ({"zero_stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"},
     ("parameter NVMe offload: the emitted config pins 5 swap buffers of 1e8 elements per rank "
      "(2 GB of host RAM for two ranks); not run on this shared 23 GB machine")),
    ({"zero_stage": 2, "precision": "fp16-mixed"},
     ("fp16 (and its dynamic loss scaling): DeepSpeed's CPU accelerator refuses fp16 on this CPU "
      "('Type fp16 is not supported on your device': torch.ops.mkldnn._is_mkldnn_fp16_supported() "
      "is False); the estimate counts fp16 as bf16 (same bytes; the loss scaler keeps scalars)")),
)


def nvme_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) builds here: it needs libaio's headers."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def compare_setups(setups: list[Setup], world: int, base: str = TINY_BASE) -> list[tuple[ZeroRun, Any]]:
    """Run ``setups`` on ``world`` ranks and estimate each on the same tiny model: (run, Breakdown)."""
    from ..estimator import estimate

    config = tiny_config(base)
    model = tiny_model(config, base)
    runs = run_zero(config, setups, world)
    out = []
    for run in runs:
        out.append((run, estimate(model, run.setup)))
    return out


def zero_launches(quick: bool) -> list[tuple[str, int, tuple]]:
    """(base, world size, setups) of each launch of the validate matrix. ``quick``: world sizes 1
    and 2 on stages 1-3, one offload case, LoRA, QLoRA and bf16-mixed on the tiny Llama, and one MoE
    launch; the full matrix adds every offload case, the mixed and quantized matrices, 4 ranks,
    two other dense shapes and both MoE bases on 1 and 2 ranks."""
    worlds = (1, 2) if quick else (1, 2, 4)
    if quick:
        matrix = ZERO_MATRIX[:4] + LORA_MATRIX[1:3] + QUANT_MATRIX[:2] + MIXED_MATRIX[1:2]
        launches = [(TINY_BASE, w, matrix) for w in worlds]
        return launches + [(MOE_BASES[1], 2, (MOE_MATRIX[1], MOE_MATRIX[3]))]
    matrices = (ZERO_MATRIX + (NVME_MATRIX if nvme_available() else ()), LORA_MATRIX, QUANT_MATRIX, MIXED_MATRIX)
    launches = [(TINY_BASE, w, m) for m in matrices for w in worlds]  # a launch each: each has its time limit
    launches += [(base, 2, ZERO_MATRIX) for base in OTHER_BASES]
    return launches + [(base, w, MOE_MATRIX) for base in MOE_BASES for w in (1, 2)]


def failed_launch_rows(setups, world: int, base: str, family: str, exc: Exception, label) -> list:
    """The validate rows of a launch that crashed or timed out: each setup unverified, with the
    first line of the failure; ``label(setup)`` gives its (knob, truth name without ``-N``)."""
    from ..accuracy import Row

    why = f"the {world}-process run failed here: {str(exc).splitlines()[0]}"
    return [Row(f"{base}[tiny]", family, s, 0, 0, "", "", truth=f"{label(s)[1]}-{world}", knob=label(s)[0],
                verified=False, why=why) for s in setups]


def zero_rows(quick: bool) -> list:
    """Rows for ``vramplan validate``: one per (setup, world size), the worst rank's device peak as
    the truth (``truth="deepspeed-N"``, ``knob="zero"``), plus unverifiable cases with their reason
    (see :func:`zero_launches` for the matrix)."""
    from ..accuracy import Row

    model = tiny_model()
    rows = []
    for base, world, kws in zero_launches(quick):
        family = tiny_model(base=base).family
        setups = [Setup(**kw, gpus=world, seq=TINY_SEQ) for kw in kws]
        try:
            compared = compare_setups(setups, world, base)
        except RuntimeError as exc:  # a launch that crashed or timed out: its rows say so, the rest stand
            rows += failed_launch_rows(setups, world, base, family, exc, lambda s: ("zero", "deepspeed"))
            continue
        for run, est in compared:
            worst = run.worst
            rows.append(Row(f"{base}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                            worst.phase, est.phase, truth=f"deepspeed-{world}", knob="zero"))
    unverified = list(UNVERIFIED)
    if not quick and not nvme_available():
        unverified += [(kw, "DeepSpeed's async_io op does not build here (it needs libaio-dev)") for kw in NVME_MATRIX]
    for kw, why in unverified:
        setup = Setup(**kw, gpus=2, seq=TINY_SEQ)
        rows.append(Row(model.name, model.family, setup, 0, 0, "", "", truth="deepspeed-2", knob="zero",
                        verified=False, why=why))
    return rows


if __name__ == "__main__":
    _worker(sys.argv[1])
