"""The validate cases of three knobs (estimator/knobs.py): peft's ``modules_to_save``, DoRA and the
optimizer in backward, each against the fake-tensor trace of the real peft/torch/torchtune step
(vramplan.run.knob_paths applies them) and, for a 4-bit base or a bitsandbytes optimizer, a real
CPU step (vramplan.truths.cpu_truth); selective checkpointing against the trace of transformers'
``every_n_layers`` at full depth; modules_to_save on 2 ranks (ZeRO 1/2, DDP) against the real engines
(``distributed_knob_rows``, not in ``--quick``).
"""

from __future__ import annotations

from ..specs import Setup

__all__ = ["DISTRIBUTED_KNOB_SETUPS", "KNOB_CASE_PHASES", "OFFLOAD_SETUPS", "distributed_knob_rows", "knob_cases"]

#: The phases each knob acts on (compared besides the tensor peak).
KNOB_CASE_PHASES = {"modules_to_save": ("backward", "optimizer"), "dora": ("forward", "backward"),
                    "optimizer_in_backward": ("backward", "optimizer"),
                    "selective_checkpointing": ("forward", "backward"), "activation_offload": ("forward", "backward")}

#: Activation offloading: TRL 1.16's OffloadActivations run in the tracer (vramplan/run/act_offload.py),
#: full fine-tuning and LoRA with checkpointing (what estimator/act_offload.py models).
OFFLOAD_SETUPS = tuple(Setup(checkpointing=True, activation_offload=True, **kw) for kw in (
    {"seq": 1024}, {"seq": 2048, "batch": 2}, {"seq": 4096, "precision": "fp16"}, {"seq": 2048, "grad_accum": 2},
    {"method": "lora", "seq": 1024, "batch": 2}, {"method": "lora", "seq": 128}, {"method": "lora", "seq": 4096}))

#: Selective checkpointing (estimator/selective.py): traced at full depth (its layers differ, so
#: no per-layer extrapolation), 6 layers so that both ends and both layer kinds occur.
SELECTIVE_LAYERS = 6

_BOTH = "embed_tokens,lm_head"


def knob_cases(quick: bool, case, dense) -> list:
    """The cases (``case``: validate.Case) on the ``dense`` families, or the quick subset."""
    lora = Setup(method="lora", seq=256)
    full = Setup(seq=256)
    short = Setup(method="lora", seq=128)
    if quick:
        m = dense[:1]
        return [*_trace(case, "modules_to_save", m, [lora.replace(modules_to_save=_BOTH)], 2),
                *_trace(case, "activation_offload", m, OFFLOAD_SETUPS[:1], 2),
                *_trace(case, "dora", m, [lora.replace(dora=True, seq=512)], 2),
                *_trace(case, "optimizer_in_backward", m, [full.replace(optimizer_in_backward=True)], 2),
                *_trace(case, "selective_checkpointing", m, [
                    lora.replace(seq=1024, checkpointing=True, checkpoint_every=2)], SELECTIVE_LAYERS)]
    return [
        *_trace(case, "activation_offload", dense, OFFLOAD_SETUPS),
        # deep and long: the layer inputs offloaded against the two the backward holds (act_offload.py);
        # v0.3: no sliding window (v0.1's 4096-token window masks s^2 at 16k)
        *_trace(case, "activation_offload", ("mistralai/Mistral-7B-v0.3",), [
            Setup(method="lora", checkpointing=True, activation_offload=True, seq=16384)], 16),
        *_trace(case, "modules_to_save", dense, [
            lora.replace(modules_to_save=_BOTH), lora.replace(modules_to_save="embed_tokens"),
            lora.replace(modules_to_save="lm_head", checkpointing=True, batch=2),
            lora.replace(modules_to_save=_BOTH, precision="bf16-mixed")]),
        *_cpu(case, "modules_to_save", dense[:1], [
            short.replace(method="qlora", modules_to_save=_BOTH),
            short.replace(modules_to_save=_BOTH, optimizer="adamw-8bit")]),
        *_trace(case, "dora", dense, [
            lora.replace(dora=True, seq=512), lora.replace(dora=True, seq=512, checkpointing=True, batch=2),
            lora.replace(dora=True, seq=512, precision="bf16-mixed"),
            lora.replace(dora=True, lora_targets="q_proj,v_proj", seq=1024)]),
        *_cpu(case, "dora", dense[:1], [short.replace(method="qlora", dora=True)]),
        *_trace(case, "optimizer_in_backward", dense, [
            full.replace(optimizer_in_backward=True), full.replace(optimizer_in_backward=True, optimizer="adamw-fused"),
            full.replace(optimizer_in_backward=True, checkpointing=True, batch=2),
            lora.replace(optimizer_in_backward=True, modules_to_save=_BOTH)]),
        *_trace(case, "selective_checkpointing", dense, [
            s.replace(checkpointing=True, checkpoint_every=k, **kw) for k, kw in (
                (2, {}), (4, {}), (2, {"method": "lora"}), (3, {"method": "lora"}), (5, {"method": "lora"}),
                (2, {"precision": "bf16-mixed"}), (2, {"method": "lora", "precision": "bf16-mixed"}),
                (3, {"method": "lora", "modules_to_save": _BOTH}))
            for s in [Setup(seq=2048)]], SELECTIVE_LAYERS),
    ]


def _trace(case, knob: str, models, setups, layers: int | None = 4) -> list:
    return [case(knob, m, s, "trace", layers) for m in models for s in setups]


def _cpu(case, knob: str, models, setups) -> list:
    return [case(knob, m, s, "cpu-run") for m in models for s in setups]


#: The knobs on N ranks (the real engines of vramplan.truths.distributed and vramplan.truths.fsdp on the
#: tiny model): modules_to_save under DeepSpeed ZeRO 1/2, DDP and FSDP1 full_shard. ZeRO-3 fails at
#: initialize with it (setup/spec.py: DeepSpeed 0.19.8's defragment wants one dtype); FSDP's
#: SHARD_GRAD_OP keeps the copies gathered to the backward, not modelled (-7 % on 2 ranks).
DISTRIBUTED_KNOB_SETUPS: dict[str, tuple[dict, ...]] = {"modules_to_save": (
    {"zero_stage": 2, "method": "lora", "modules_to_save": _BOTH},
    {"zero_stage": 1, "method": "lora", "modules_to_save": _BOTH},
    {"zero_stage": 2, "method": "lora", "modules_to_save": "lm_head"},
    {"zero_stage": 2, "method": "lora", "modules_to_save": "embed_tokens"},
    {"zero_stage": 2, "method": "lora", "modules_to_save": _BOTH, "precision": "bf16-mixed"},
    {"zero_stage": 2, "method": "lora", "modules_to_save": _BOTH, "checkpointing": True},
    {"zero_stage": 2, "method": "lora", "modules_to_save": _BOTH, "offload_optimizer": "cpu"},
    {"zero_stage": 2, "method": "qlora", "modules_to_save": _BOTH},
    {"method": "lora", "modules_to_save": _BOTH},  # DDP
    {"method": "lora", "modules_to_save": "lm_head", "checkpointing": True},  # DDP
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": _BOTH},  # FSDP1: each copy its own unit
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": "lm_head"},
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": "embed_tokens"},
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": _BOTH, "precision": "bf16-mixed"},
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": _BOTH, "checkpointing": True},
    {"fsdp": "full_shard", "method": "lora", "modules_to_save": "lm_head", "grad_accum": 2},
)}


def distributed_knob_rows(quick: bool, row, knobs=DISTRIBUTED_KNOB_SETUPS) -> list:
    """Rows (``row``: accuracy.Row) of the knobs on 2 ranks, the worst rank's device peak as the
    truth (``deepspeed-2`` / ``fsdp-2`` / ``ddp-2``) and each phase's worst rank (the estimate is the
    fullest GPU's, phase by phase: under ZeRO 1/2 the rank that steps the partition holding the
    largest gradient is the fullest at the optimizer step, and need not be the rank of the overall
    peak; on a tie that rank was the first one); ``quick``: the first setup of each. A launch that
    fails gives its setups' failed rows (truths/ranks.py)."""
    from ..truths import distributed, fsdp
    from ..truths.ranks import failed_launch_rows
    from ..truths.tiny import TINY_BASE, TINY_SEQ, tiny_model

    world, family, rows = 2, tiny_model().family, []
    for knob, kws in knobs.items():
        groups = {"deepspeed": [kw for kw in kws if kw.get("zero_stage")],
                  "fsdp": [kw for kw in kws if kw.get("fsdp", "none") != "none"],
                  "ddp": [kw for kw in kws if not kw.get("zero_stage") and kw.get("fsdp", "none") == "none"]}
        for truth, group in groups.items():
            module = distributed if truth == "deepspeed" else fsdp
            setups = [Setup(**kw, gpus=world, seq=TINY_SEQ) for kw in (group[:1] if quick else group)]
            if not setups:
                continue
            try:
                compared = module.compare_setups(setups, world)
            except RuntimeError as exc:
                rows += failed_launch_rows(setups, world, TINY_BASE, family, exc, lambda s, k=knob, t=truth: (k, t))
                continue
            for run, est in compared:
                worst = max(run.ranks, key=lambda r: r.device_bytes)
                name = f"{truth}-{world}"
                rows.append(row(f"{TINY_BASE}[tiny]", family, run.setup, worst.device_bytes, est.tensor_peak_bytes,
                                worst.phase, est.phase, truth=name, knob=knob))
                rows += [row(f"{TINY_BASE}[tiny]", family, run.setup, max(r.phase_peaks.get(ph, 0) for r in run.ranks),
                             est.phase_peaks_bytes[ph], ph, ph, truth=name, knob=knob, quantity=f"{ph}_peak_bytes")
                         for ph in KNOB_CASE_PHASES[knob] if ph in worst.phase_peaks]
    return rows
