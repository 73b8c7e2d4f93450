"""Does peft 0.21's LoRA run on transformers 5.24's tensor-parallel model, and is its step right?
A probe on real gloo ranks (the TP and TP x FSDP2 truths' load, :mod:`vramplan.truths.tp_truth`,
:mod:`vramplan.truths.tp_fsdp2`), against one unsharded LoRA step of the same checkpoint.

    probe, = probe_tp_lora(tiny_config(), [Setup(tp=2, gpus=2, method="lora", lora_targets=COL)], world=2)
    probe[0]["error"]            # rank 0: None when the step ran, else "RuntimeError: ..." (and "where")
    probe[0]["grad_error"]       # worst relative |grad - reference grad| over the adapters

Each rank loads the model the truth loads (``--tp`` alone: ``DistributedConfig(tp_plan="auto")``;
beside FSDP2: ``DistributedConfig(tp_plan="auto", tp_size=T, fsdp_size=D)``), wraps it with
``peft.get_peft_model`` (vramplan/run/models.py ``adapt_for_training``), and records how peft placed
each adapter (a DTensor's placements and local shape, or a plain tensor's shape; ``widths``: the
``in_features``/``out_features`` peft built each adapter Linear with). It sets every
adapter to one deterministic full tensor (seeded by its name, ``lora_B`` non-zero so ``lora_A`` gets a
gradient), distributed as peft placed it (``malformed``: the DTensors whose local tensor is not
their placements' share of their global shape, left as they are), runs one fp32 step (``loss.backward()``, torch AdamW
``step()``) and compares the loss, every adapter's full gradient (``DTensor.full_tensor``) and its
value after the step with an unsharded model of the same checkpoint given the same adapters and
batch. A step that raises is recorded: the exception's line and the library function it came from.
"""

from __future__ import annotations

import sys
import traceback
import zlib

from ..specs import Setup, SpecError
from .ranks import launch_ranks, rank_worker, saved_checkpoint
from .tiny import TINY_SEQ


def probe_tp_lora(config: dict, setups: list[Setup], world: int, seq: int = TINY_SEQ,
                  timeout_s: float = 600) -> list[list[dict]]:
    """Run the probe of each setup (LoRA, ``tp > 1``, ``gpus == world``) on ``world`` ranks, in one
    launch: per setup, each rank's record (rank order)."""
    for s in setups:
        if not s.adapters or s.tp < 2 or s.gpus != world:
            raise SpecError(f"probe_tp_lora runs LoRA with --tp on {world} ranks; got method={s.method} "
                            f"tp={s.tp} gpus={s.gpus}")
    got = launch_ranks("vramplan.truths.tp_lora", {"config": config, "setups": [s.to_dict() for s in setups],
                                                "seq": seq}, world, timeout_s, {"ACCELERATE_USE_CPU": "true"},
                       "TP-LoRA")
    return [sorted((r[i] for r in got), key=lambda x: x["rank"]) for i in range(len(setups))]


# ----------------------------------------------------------------------------------------------
# the worker (imports torch, transformers, peft)


def _load(path: str, setup: Setup, distributed: bool):
    import torch
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig

    from ..run.models import adapt_for_training
    from .tp_truth import own_shards

    transformers.logging.set_verbosity_error()
    kwargs = {}
    if distributed:
        fsdp = setup.gpus // setup.tp
        kwargs["distributed_config"] = (DistributedConfig(tp_plan="auto", tp_size=setup.tp, fsdp_size=fsdp)
                                        if fsdp > 1 else DistributedConfig(tp_plan="auto"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                              use_cache=False, **kwargs)
    if distributed:
        own_shards(model)
    return adapt_for_training(model, setup)


def _adapters(model) -> dict:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _full_value(name: str, shape) -> object:
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g) * 0.05


def _set_adapters(model) -> list[str]:
    """Set each adapter to its :func:`_full_value`; the names of DTensor adapters whose local tensor
    is not their placements' share of their global shape (left as peft made them)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    malformed = []
    with torch.no_grad():
        for name, p in _adapters(model).items():
            full = _full_value(name, p.shape)
            if isinstance(p, DTensor):  # every rank holds the same full tensor: no scatter
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                if local.shape != p.to_local().shape:
                    malformed.append(name)
                    continue
                p.to_local().copy_(local)
            else:
                p.copy_(full)
    return malformed


def _placement(p) -> dict:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return {"dtensor": True, "placements": [str(x) for x in p.placements], "mesh": list(p.device_mesh.shape),
                "shape": list(p.shape), "local": list(p.to_local().shape)}
    return {"dtensor": False, "shape": list(p.shape), "local": list(p.shape)}


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def _step(model, ids) -> tuple[float, dict, dict]:
    """One step: the loss, each adapter's full gradient, each adapter's full value after AdamW."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: _full(p.grad) for n, p in _adapters(model).items()}
    opt.step()
    return float(_full(loss)), grads, {n: _full(p) for n, p in _adapters(model).items()}


def _worst(got: dict, ref: dict) -> float:
    """The worst ``max |got - ref| / max |ref|`` over the adapters (inf where a shape differs)."""
    worst = 0.0
    for n, r in ref.items():
        g = got.get(n)
        if g is None or g.shape != r.shape:
            return float("inf")
        worst = max(worst, float((g - r).abs().max()) / max(float(r.abs().max()), 1e-12))
    return worst


def _where(exc: BaseException) -> str:
    """The innermost three transformers or peft frames of ``exc``'s traceback, ``package/file.py:function``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "site-packages/transformers/" in f.filename or "site-packages/peft/" in f.filename]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.name}" for f in frames[::-1][:3])


def _run_one(config: dict, setup: Setup, seq: int, work: str) -> dict:
    import os

    import torch

    path = saved_checkpoint(config, torch.float32, work)
    rank = int(os.environ["RANK"])
    ids = torch.randint(0, int(config["vocab_size"]), (setup.batch, seq), generator=torch.Generator().manual_seed(1))
    out = {"rank": rank, "error": None, "where": "", "placements": {}, "widths": {}, "malformed": [], "loss": None,
           "ref_loss": None, "grad_error": None, "step_error": None}
    try:
        model = _load(path, setup, distributed=True)
        out["placements"] = {n: _placement(p) for n, p in _adapters(model).items()}
        out["widths"] = {n: [m.in_features, m.out_features] for n, m in model.named_modules()
                         if n.endswith((".lora_A.default", ".lora_B.default"))}  # what peft built each with
        out["malformed"] = _set_adapters(model)
        loss, grads, after = _step(model, ids)
    except Exception as exc:  # the finding: what fails, and where
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["where"] = _where(exc)
        out["trace"] = traceback.format_exc()[-1500:]
        return out
    ref = _load(path, setup, distributed=False)
    _set_adapters(ref)
    ref_loss, ref_grads, ref_after = _step(ref, ids)
    out.update(loss=loss, ref_loss=ref_loss, grad_error=_worst(grads, ref_grads), step_error=_worst(after, ref_after))
    return out


if __name__ == "__main__":
    rank_worker(sys.argv[1], _run_one)
