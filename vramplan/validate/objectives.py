"""The validate cases of the DPO, ORPO, KTO and GRPO objectives (``vramplan validate --knob
dpo|orpo|kto|grpo``), and of SFT's ``--loss trl`` (TRL's SFTTrainer; rows of ``--knob loss``).

Two truths, both TRL 1.16's code: ``trl-cpu``, TRL's own DPOTrainer / ORPOTrainer / KTOTrainer /
GRPOTrainer (HF generation)
for two steps on the CPU on the narrow model of ``validate.CPU_SHRINK`` (vramplan/truths/objectives.py),
and ``trl-trace``, the same training computation with TRL's fused head on fake tensors at the real
widths of a 2-layer truncation (vramplan/truths/objective_trace.py). Both run TRL's torch fold of the
head (no Triton on the CPU; ORPO: its selective_log_softmax's torch loop), so the estimate compared
is ``Stack(trl_triton=False)``; the tensor peak is the summary's row, each phase the objective
changes (generation, kl, reference, forward, backward) a row of its own.
"""

from __future__ import annotations

from ..specs import Setup
from .accuracy import Row

DPO = Setup(objective="dpo", seq=128, batch=2)
GRPO = Setup(objective="grpo", seq=128, batch=1, num_generations=4, max_completion_length=32)
TRACE_DPO = Setup(objective="dpo", seq=512, batch=2)
TRACE_GRPO = Setup(objective="grpo", seq=1024, batch=1, num_generations=4, max_completion_length=512)
ORPO = Setup(objective="orpo", seq=128, batch=2)
KTO = Setup(objective="kto", seq=128, batch=2)
TRACE_ORPO = Setup(objective="orpo", seq=512, batch=2)
TRACE_KTO = Setup(objective="kto", seq=512, batch=2)
#: ``--loss trl`` (SFTTrainer's fused head; knob ``loss``): CPU run and trace
SFT_TRL = Setup(seq=128, batch=2, loss="trl")
TRACE_SFT_TRL = Setup(seq=512, batch=2, loss="trl")


def trl_loss_cases(quick: bool, case_type, dense: tuple[str, ...]) -> list:
    """The ``--loss trl`` rows of ``validate --knob loss``: TRL's SFTTrainer on the CPU and its
    fused head traced at real widths (several 4096-token chunks at seq 4096)."""
    if quick:
        return [case_type("loss", dense[0], SFT_TRL.replace(method="lora"), "trl-cpu")]
    return [
        *[case_type("loss", name, TRACE_SFT_TRL.replace(**kw), "trl-trace", 2) for name in dense
          for kw in ({}, {"method": "lora"}, {"method": "lora", "checkpointing": True})],
        case_type("loss", dense[0], TRACE_SFT_TRL.replace(method="lora", seq=4096), "trl-trace", 2),
        *[case_type("loss", dense[0], SFT_TRL.replace(**kw), "trl-cpu") for kw in ({}, {"method": "lora"})],
    ]


def framework_cases(quick: bool, case_type, dense: tuple[str, ...]) -> list:
    """The ``--framework`` rows of ``validate --knob framework``: TRL 1.16's own SFTTrainer on the CPU
    preparing the model itself (peft_config handed to it: no fp32 upcast of the quantized base, its
    adapters cast to bf16), NF4 and 8-bit bases, checkpointing, a 16-bit LoRA base
    (setup/frameworks.py). (TRL's head on the HF recipe's upcast NF4 base, ``--framework hf --loss
    trl``, is +5.5 % / +6.0 % on these shapes: a ``loss`` knob gap, not a framework's.)"""
    trl = SFT_TRL.replace(framework="trl")
    if quick:
        return [case_type("framework", dense[0], trl.replace(method="qlora"), "trl-cpu")]
    return [*[case_type("framework", name, trl.replace(**kw), "trl-cpu") for name in dense[:2]
              for kw in ({"method": "qlora"}, {"method": "qlora", "checkpointing": True}, {"method": "lora"},
                         {"method": "lora", "quant": "int8"})],
            *offload_cases(case_type, dense)]


#: A deeper, narrower CPU model (validate/matrix.py's cpu-run cases): what a checkpointed layer keeps (its input,
#: an int8 base's Linear inputs) and what offloading moves show per layer.
DEEP_SHRINK = {"layers": 12, "hidden": 256, "heads": 4, "vocab": 2048}

#: TRL's activation offloading (SFTConfig activation_offloading) on the base TRL prepares, 12 narrow layers so
#: that the offloaded layer inputs show: NF4, LLM.int8, a 16-bit LoRA base, gradient accumulation; and with
#: Liger's layer kernels (use_liger_kernel, TRL's fused head kept): NF4, a 16-bit LoRA base, full fine-tuning.
OFFLOAD_TRL = tuple(SFT_TRL.replace(framework="trl", checkpointing=True, activation_offload=True, seq=1024, **kw)
                    for kw in ({"method": "qlora"}, {"method": "lora", "quant": "int8"}, {"method": "lora"},
                               {"method": "qlora", "batch": 1, "grad_accum": 2}, {"method": "qlora", "liger": True},
                               {"method": "lora", "liger": True}, {"method": "full", "liger": True}))


def offload_cases(case_type, dense: tuple[str, ...]) -> list:
    """``validate --knob activation_offload``'s TRL rows: SFTTrainer's real step with TRL's offloading
    manager (truths/objectives.py run_sft), cpu playing the device."""
    return [case_type("activation_offload", dense[0], s, "trl-cpu", shrink=DEEP_SHRINK) for s in OFFLOAD_TRL]


def objective_cases(quick: bool, case_type, dense: tuple[str, ...]) -> list:
    """The dpo, orpo, kto and grpo cases (``case_type``: validate.Case)."""
    m = dense[:1]
    if quick:
        return [case_type("dpo", m[0], TRACE_DPO.replace(method="lora"), "trl-trace", 2),
                case_type("dpo", m[0], DPO.replace(method="lora"), "trl-cpu"),
                case_type("orpo", m[0], TRACE_ORPO.replace(method="lora"), "trl-trace", 2),
                case_type("kto", m[0], KTO.replace(method="lora"), "trl-cpu"),
                case_type("grpo", m[0], TRACE_GRPO.replace(method="lora"), "trl-trace", 2)]
    return [
        *[case_type("dpo", name, TRACE_DPO.replace(**kw), "trl-trace", 2) for name in dense
          for kw in ({}, {"method": "lora"}, {"method": "lora", "ref_model": "copy"}, {"ref_model": "precomputed"},
                     {"method": "lora", "checkpointing": True})],
        *[case_type("dpo", m[0], DPO.replace(**kw), "trl-cpu")
          for kw in ({}, {"method": "lora"}, {"ref_model": "precomputed"})],
        *[case_type("orpo", name, TRACE_ORPO.replace(**kw), "trl-trace", 2) for name in dense
          for kw in ({}, {"method": "lora"}, {"method": "lora", "checkpointing": True}, {"precision": "fp32"},
                     {"batch": 1, "method": "lora", "seq": 1024})],
        *[case_type("orpo", m[0], ORPO.replace(**kw), "trl-cpu") for kw in ({}, {"method": "lora"})],
        *[case_type("kto", name, TRACE_KTO.replace(**kw), "trl-trace", 2) for name in dense
          for kw in ({}, {"method": "lora"}, {"method": "lora", "ref_model": "copy"}, {"ref_model": "precomputed"},
                     {"method": "lora", "checkpointing": True})],
        *[case_type("kto", m[0], KTO.replace(**kw), "trl-cpu")
          for kw in ({}, {"method": "lora"}, {"ref_model": "precomputed"}, {"method": "lora", "grad_accum": 2},
                     {"method": "lora", "ref_model": "precomputed"})],
        *[case_type("grpo", name, TRACE_GRPO.replace(**kw), "trl-trace", 2) for name in dense
          for kw in ({}, {"method": "lora"}, {"method": "lora", "checkpointing": True})],
        *[case_type("grpo", m[0], GRPO.replace(**kw), "trl-cpu")
          for kw in ({}, {"method": "lora", "ref_model": "adapter"})],
    ]


def objective_rows(case) -> list[Row]:
    """Estimate and truth of one objective case: the tensor peak and each phase's peak."""
    from ..estimator import estimate
    from ..estimator.stack import Stack
    from ..model.architecture import model_spec_from_config, with_layers
    from ..model.profiles import load_model

    model = load_model(case.model)
    if case.truth == "trl-trace":
        from ..truths.objective_trace import trace_objective

        spec = with_layers(model, case.layers)
        t = trace_objective(spec.config, case.setup)
    else:
        from ..model.modelspec import shrink_config
        from ..truths.objectives import run_dpo, run_grpo, run_kto, run_orpo, run_sft

        cfg = shrink_config(model.config, **case.shrink)
        spec = model_spec_from_config(cfg, name=f"{model.name}[narrow]", source=model.source)
        t = {"dpo": run_dpo, "grpo": run_grpo, "sft": run_sft, "orpo": run_orpo,
             "kto": run_kto}[case.setup.objective](cfg, case.setup)
    e = estimate(spec, case.setup, stack=Stack(trl_triton=False))
    head = (e.tensor_peak_bytes, e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_total_bytes)
    rows = [Row(case.model, spec.family, case.setup, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase,
                truth=case.truth, knob=case.knob, estimate_headline=head)]
    for ph, truth in t.phase_peaks_bytes.items():  # the phases an objective changes (optimizer: SFT's rows)
        if ph in e.phase_peaks_bytes and ph != "optimizer":
            rows.append(Row(case.model, spec.family, case.setup, truth, e.phase_peaks_bytes[ph], ph, ph,
                            truth=case.truth, knob=case.knob, quantity=f"{ph}_peak_bytes"))
    if getattr(t, "host_peak_bytes", 0):  # activation offloading's host copies
        rows.append(Row(case.model, spec.family, case.setup, t.host_peak_bytes, e.host_bytes, "-", "-",
                        truth=case.truth, knob=case.knob, quantity="host_bytes"))
    return rows
