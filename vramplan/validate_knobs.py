"""The validate cases of three knobs (estimator/knobs.py): peft's ``modules_to_save``, DoRA and the
optimizer in backward, each against the fake-tensor trace of the real peft/torch/torchtune step
(vramplan.run.knob_paths applies them) and, for a 4-bit base or a bitsandbytes optimizer, a real
CPU step (vramplan.run.cpu_truth).
"""

from __future__ import annotations

from .specs import Setup

__all__ = ["KNOB_CASE_PHASES", "knob_cases"]

#: The phases each knob acts on (compared besides the tensor peak).
KNOB_CASE_PHASES = {"modules_to_save": ("backward", "optimizer"), "dora": ("forward", "backward"),
                    "optimizer_in_backward": ("backward", "optimizer")}

_BOTH = "embed_tokens,lm_head"


def knob_cases(quick: bool, case, dense) -> list:
    """The cases (``case``: validate.Case) on the ``dense`` families, or the quick subset."""
    lora = Setup(method="lora", seq=256)
    full = Setup(seq=256)
    short = Setup(method="lora", seq=128)
    if quick:
        m = dense[:1]
        return [*_trace(case, "modules_to_save", m, [lora.replace(modules_to_save=_BOTH)], 2),
                *_trace(case, "dora", m, [lora.replace(dora=True, seq=512)], 2),
                *_trace(case, "optimizer_in_backward", m, [full.replace(optimizer_in_backward=True)], 2)]
    return [
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
    ]


def _trace(case, knob: str, models, setups, layers: int | None = 4) -> list:
    return [case(knob, m, s, "trace", layers) for m in models for s in setups]


def _cpu(case, knob: str, models, setups) -> list:
    return [case(knob, m, s, "cpu-run") for m in models for s in setups]
