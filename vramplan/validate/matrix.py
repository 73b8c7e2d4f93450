"""The validate matrix: every knob of Setup, estimated and checked against a truth no formula wrote.

Each :class:`Case` names a knob, a shipped model, a Setup and the truth that checks it:
- ``trace``: the fake-tensor trace of the real transformers/peft/torch step (``vramplan.run.tracer``)
  on a truncation of the shipped model at its real widths (``layers`` layers; None: the whole
  model, traced at two depths and extrapolated);
- ``cpu-run``: a real step on this CPU (``vramplan.truths.cpu_truth``) of the model narrowed by
  :func:`vramplan.model.modelspec.shrink_config`, for what fake tensors cannot run (bitsandbytes'
  quantized layers and optimizers);
- ``deepspeed-N`` / ``fsdp-N`` / ``ddp-N``: rows from the distributed truths (N real processes:
  ``vramplan.truths.distributed`` for ZeRO, ``vramplan.truths.fsdp`` for FSDP and DDP), when installed.

Knobs that cannot be checked here are rows with ``verified=False`` and the reason. The summary
gives, per knob, the median and worst relative error of the tensor peak.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

from ..specs import Setup
from .accuracy import Row
from .evaluation import EVAL_CASE_PHASES, eval_cases, eval_cpu_rows
from .knobs import KNOB_CASE_PHASES, distributed_knob_rows, knob_cases
from .objectives import DEEP_SHRINK, framework_cases, objective_cases, objective_rows, trl_loss_cases

#: Models of the matrix: three dense families for every knob, three MoE families for MoE routing.
DENSE = ("meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-7B", "google/gemma-2b")
MOE = ("mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen1.5-MoE-A2.7B")

#: Narrow CPU models: wide enough for bitsandbytes' 64-element blocks and 4096-element 8-bit
#: threshold to matter as on real models, small enough for a step in about a second.
CPU_SHRINK = {"layers": 2, "hidden": 512, "heads": 8, "vocab": 2048}

#: Knobs in table order.
KNOBS = ("canonical", "quantization", "optimizer", "precision", "attention", "grad_accum", "checkpointing",
         "selective_checkpointing",
         "moe", "loss", "framework", "modules_to_save", "dora", "optimizer_in_backward", "activation_offload",
         "liger", "padding_free", "tiled_mlp", "unsloth_gc", "gptq_awq", "zero", "fsdp", "fsdp2", "hybrid_shard",
         "ddp", "device_map",
         "tp", "cp", "pp", "ep",
         "device_overheads",
         "measured", "dpo", "orpo", "kto", "grpo", "eval")

#: Where `vramplan measure` / `sweep` append their records (vramplan.calibration.measure.RECORDS_DIR).
MEASUREMENTS = "calibration/measurements"


@dataclass(frozen=True)
class Case:
    knob: str
    model: str
    setup: Setup
    truth: str  # trace | cpu-run | eval-cpu (validate/evaluation.py) | trl-cpu | trl-trace
    layers: int | None = 4  # trace: truncation (None: whole model); cpu-run: see CPU_SHRINK
    shrink: dict = field(default_factory=lambda: dict(CPU_SHRINK))


#: Liger kernels (vramplan/run/liger.py stand-ins): full and LoRA, checkpointing, mixed precision.
LIGER_SETUPS = tuple(Setup(seq=1024, batch=4, liger=True, **kw) for kw in (
    {}, {"method": "lora"}, {"method": "lora", "checkpointing": True}, {"checkpointing": True},
    {"precision": "bf16-mixed"}, {"method": "lora", "precision": "bf16-mixed"}))


#: Liger on a quantized base, the real bitsandbytes step with the kernels' stand-ins (cpu-run: the HF recipe's
#: upcast base through transformers' apply_liger_kernel, axolotl's unprepared one; trl-cpu: TRL's SFTTrainer,
#: which applies the layer kernels and keeps its own fused head), 12 narrow layers: a 2-layer model exaggerates
#: the top layer's backward beside the rest (the HF recipe's NF4 with checkpointing is +5.1 % there, LLM.int8
#: -6.2 %, axolotl's NF4 with checkpointing +7.5 %; 12 layers: +2.8 %, -1.8 %, +4.0 %).
LIGER_QUANT_SETUPS = tuple(Setup(seq=512, batch=2, liger=True, **kw) for kw in (
    {"method": "qlora"}, {"method": "qlora", "checkpointing": True}, {"method": "lora", "quant": "int8"},
    {"method": "qlora", "checkpointing": True, "framework": "axolotl"},
    {"method": "lora", "quant": "int8", "framework": "axolotl"}))
LIGER_TRL_SETUPS = tuple(Setup(seq=512, batch=2, liger=True, framework="trl", loss="trl", **kw) for kw in (
    {"method": "qlora"}, {"method": "qlora", "checkpointing": True}, {"method": "lora", "quant": "int8"}))


def liger_quant_cases() -> list:
    """``validate --knob liger``'s rows on quantized bases: real bitsandbytes steps (see LIGER_QUANT_SETUPS)."""
    return [*[Case("liger", DENSE[0], s, "cpu-run", shrink=dict(DEEP_SHRINK)) for s in LIGER_QUANT_SETUPS],
            Case("liger", DENSE[1], LIGER_QUANT_SETUPS[1], "cpu-run", shrink=dict(DEEP_SHRINK)),
            *[Case("liger", DENSE[0], s, "trl-cpu", shrink=dict(DEEP_SHRINK)) for s in LIGER_TRL_SETUPS]]


#: Padding-free batches: one row of batch x seq tokens, positions restarting per sequence, flash varlen.
PADDING_FREE_SETUPS = tuple(Setup(seq=1024, batch=4, attn="flash", padding_free=True, **kw) for kw in (
    {}, {"method": "lora"}, {"method": "lora", "checkpointing": True}, {"method": "lora", "liger": True}))


def _trace_cases(knob: str, models, setups, layers: int | None = 4) -> list[Case]:
    return [Case(knob, m, s, "trace", layers) for m in models for s in setups]


def _cpu_cases(knob: str, models, setups) -> list[Case]:
    return [Case(knob, m, s, "cpu-run") for m in models for s in setups]


def matrix(quick: bool = False) -> list[Case]:
    """The default matrix (every knob on three families), or the ``quick`` subset run in CI."""
    s = Setup(seq=512)
    short = Setup(seq=128)  # weights and states dominate: the optimizer and quantization terms show
    long = Setup(seq=2048)  # attention's s^2 terms show
    if quick:
        m = DENSE[:1]
        return [
            *_trace_cases("canonical", m, [Setup(seq=256), Setup(method="lora", seq=256)], layers=2),
            *_cpu_cases("quantization", m, [short.replace(method="qlora"), short.replace(method="lora", quant="int8")]),
            *_cpu_cases("optimizer", m, [short.replace(optimizer="adamw-8bit")]),
            *_trace_cases("optimizer", m, [short.replace(optimizer="adafactor")], layers=2),
            *_trace_cases("precision", m, [s.replace(precision="bf16-mixed")], layers=2),
            *_trace_cases("attention", m, [s.replace(attn="eager"), s.replace(pad_mask=True)], layers=2),
            *_trace_cases("grad_accum", m, [s.replace(grad_accum=2)], layers=2),
            *_trace_cases("loss", m, [s.replace(loss="chunked", batch=2)], layers=2),
            *trl_loss_cases(True, Case, DENSE),
            *framework_cases(True, Case, DENSE),
            *_trace_cases("checkpointing", m, [s.replace(method="lora", checkpointing=True)], layers=2),
            *_trace_cases("moe", MOE[1:2], [Setup(method="lora", seq=128)], layers=2),
            *_trace_cases("liger", m, [s.replace(method="lora", liger=True, batch=2)], layers=2),
            *_trace_cases("padding_free", m, [s.replace(method="lora", padding_free=True, attn="flash", batch=2)],
                          layers=2),
            *objective_cases(True, Case, DENSE),
            *knob_cases(True, Case, DENSE),
            *eval_cases(True, Case, DENSE),
        ]
    return [
        *_trace_cases("canonical", DENSE, [Setup(), Setup(method="lora")], layers=None),
        *_cpu_cases("canonical", DENSE, [short, short.replace(method="lora")]),
        *_cpu_cases("quantization", DENSE, [
            short.replace(method="qlora"),
            short.replace(method="qlora", double_quant=False),
            short.replace(method="qlora", quant="fp4"),
            short.replace(method="qlora", precision="fp16"),
            short.replace(method="qlora", checkpointing=True, batch=2),
            short.replace(method="qlora", precision="bf16-mixed"),
            short.replace(method="lora", quant="int8"),
            short.replace(method="lora", quant="int8", precision="bf16-mixed"),
        ]),
        # LLM.int8 with checkpointing: each int8 Linear's input outlives the checkpoint (MatMul8bitLt's
        # ctx.tensors); 12 narrow layers so that the per-layer term shows against the recomputed layer
        *[Case("quantization", m, Setup(method="lora", quant="int8", checkpointing=True, seq=1024, batch=2, **kw),
               "cpu-run", shrink=DEEP_SHRINK) for m in DENSE[:2] for kw in ({}, {"framework": "axolotl"})],
        # without checkpointing on a 16-bit stream (axolotl: no upcast, fp32 adapters), MatMul8bitLt's inputs add
        # to the adapters' casts; LoRA dropout (CUDA's fused dropout: a bool mask) on NF4 and LLM.int8
        *[Case("quantization", DENSE[0], Setup(**{"method": "lora", "seq": 512, "batch": 2, **kw}), "cpu-run",
               shrink=DEEP_SHRINK)
          for kw in ({"quant": "int8", "framework": "axolotl"}, {"method": "qlora", "lora_dropout": 0.05},
                     {"quant": "int8", "lora_dropout": 0.05})],
        *_trace_cases("optimizer", DENSE, [short.replace(optimizer=o) for o in ("adamw-fused", "sgd", "adafactor")]
                      + [short.replace(method="lora", optimizer="adafactor")]),
        *_cpu_cases("optimizer", DENSE, [short.replace(optimizer=o) for o in ("adamw-8bit", "paged-adamw-8bit", "lion")]
                    + [short.replace(method="qlora", optimizer="paged-adamw-8bit")]),
        *_trace_cases("precision", DENSE, [s.replace(precision=p) for p in ("fp32", "fp16", "bf16-mixed", "fp16-mixed")]
                      + [s.replace(method="lora", precision="bf16-mixed")]),
        # LoRA under autocast with checkpointing: a frozen weight's half copy is its matmul's saved tensor, which the
        # checkpointed layers drop (was +11.2 % on Llama-3.2-1B at 4 layers, 2 x 512 tokens)
        *_trace_cases("precision", DENSE,
                      [s.replace(method="lora", precision="bf16-mixed", checkpointing=True, batch=2)]),
        *_trace_cases("attention", DENSE, [long.replace(attn=a) for a in ("sdpa", "eager", "flash")]
                      + [long.replace(attn="eager", method="lora"), long.replace(attn="eager", checkpointing=True)]
                      + [long.replace(attn=a, pad_mask=True) for a in ("sdpa", "eager")]
                      + [long.replace(method="lora", pad_mask=True)]),
        # a sliding window past its length (Mistral v0.1: 4096) under checkpointing: every layer's recompute
        # keeps the additive mask SDPA makes of the bool one the checkpoints hold (was -4.0 % at 8k, -6.3 % at 16k)
        Case("attention", "mistralai/Mistral-7B-v0.1", Setup(method="lora", checkpointing=True, seq=8192), "trace", 4),
        *_cpu_cases("attention", DENSE[:1], [Setup(seq=512, pad_mask=True),
                                             Setup(seq=512, attn="eager", pad_mask=True)]),
        *_trace_cases("grad_accum", DENSE, [s.replace(grad_accum=4), s.replace(method="lora", grad_accum=4)]),
        *_trace_cases("checkpointing", DENSE, [s.replace(checkpointing=True, batch=2),
                                               s.replace(method="lora", checkpointing=True, batch=2)]),
        *_trace_cases("moe", MOE, [Setup(seq=256), Setup(method="lora", seq=256)], layers=2),
        # LoRA on the attention only: the expert stack runs on its frozen weights (was +4.4 % on Mixtral)
        *_trace_cases("moe", MOE[:2], [Setup(method="lora", seq=512, batch=4,
                                             lora_targets="q_proj,k_proj,v_proj,o_proj")], layers=2),
        *_trace_cases("loss", DENSE, [s.replace(loss="chunked", batch=4),
                                      s.replace(method="lora", loss="chunked", batch=4)]),
        *_cpu_cases("loss", DENSE[:1], [short.replace(loss="chunked", seq=512, batch=4)]),
        *trl_loss_cases(False, Case, DENSE),
        *framework_cases(False, Case, DENSE),
        *_trace_cases("liger", DENSE, LIGER_SETUPS),
        *liger_quant_cases(),
        *_trace_cases("padding_free", DENSE, PADDING_FREE_SETUPS),
        *objective_cases(False, Case, DENSE),
        *knob_cases(False, Case, DENSE),
        *eval_cases(False, Case, DENSE),
    ]


def run_case(case: Case) -> list[Row]:
    """Estimate and truth of one case: the tensor-peak row (and, for a quantized base, the
    weights row: bytes of the loaded base, quantization state included)."""
    from ..estimator import estimate
    from ..model.architecture import model_spec_from_config, with_layers
    from ..model.profiles import load_model

    if case.truth in ("trl-cpu", "trl-trace"):  # the DPO/GRPO objectives (validate/objectives.py)
        return objective_rows(case)
    if case.truth == "eval-cpu":  # a real Trainer.evaluate (validate/evaluation.py)
        return eval_cpu_rows(case, Row)
    model = load_model(case.model)
    if case.truth == "trace":
        from ..run.tracer import trace

        spec = model if case.layers is None else with_layers(model, case.layers)
        t = trace(spec, case.setup)
        e = estimate(spec, case.setup)
        rows = [Row(case.model, spec.family, case.setup, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase,
                    truth="trace", knob=case.knob, estimate_headline=_headline(e))]
        return rows + _phase_rows(case, spec.family, t.phase_peaks_bytes, e.phase_peaks_bytes, "trace")
    from ..model.modelspec import shrink_config
    from ..truths.cpu_truth import run_step

    cfg = shrink_config(model.config, **case.shrink)
    spec = model_spec_from_config(cfg, name=f"{model.name}[narrow]", source=model.source)
    t = run_step(cfg, case.setup)
    e = estimate(spec, case.setup)
    rows = [Row(case.model, spec.family, case.setup, t.tensor_peak_bytes, e.tensor_peak_bytes, t.phase, e.phase,
                truth="cpu-run", knob=case.knob, estimate_headline=_headline(e))]
    rows += _phase_rows(case, spec.family, t.phase_peaks_bytes, e.phase_peaks_bytes, "cpu-run")
    if case.setup.quant != "none":
        rows.append(Row(case.model, spec.family, case.setup, t.weights_bytes,
                        e.component("weights") + e.component("adapters") + e.component("trained_modules"), "-", "-",
                        truth="cpu-run", knob=case.knob, quantity="weights_bytes"))
    if t.paged_bytes:
        rows.append(Row(case.model, spec.family, case.setup, t.paged_bytes, e.component("paged_optimizer_states"),
                        "-", "-", truth="cpu-run", knob=case.knob, quantity="paged_bytes"))
    return rows


def _headline(bd) -> tuple[int, int, int, int]:
    return bd.tensor_peak_bytes, bd.peak_allocated_bytes, bd.peak_reserved_bytes, bd.device_total_bytes


#: The phase each knob acts on, compared besides the tensor peak (which may lie elsewhere).
KNOB_PHASES = {"optimizer": ("optimizer",), "grad_accum": ("forward",), "loss": ("forward", "backward"),
               "attention": ("forward", "backward"), "precision": ("forward", "backward", "optimizer"),
               "liger": ("backward",), "padding_free": ("forward", "backward"), **KNOB_CASE_PHASES,
               **EVAL_CASE_PHASES}


def _phase_rows(case: Case, family: str, truth: dict, est: dict, truth_name: str) -> list[Row]:
    return [Row(case.model, family, case.setup, truth[ph], est[ph], ph, ph, truth=truth_name, knob=case.knob,
                quantity=f"{ph}_peak_bytes") for ph in KNOB_PHASES.get(case.knob, ())]


def measured_rows(records: str | os.PathLike = MEASUREMENTS) -> list[Row]:
    """The "measured" truth: every complete (not OOM, not failed) record ``vramplan measure`` /
    ``sweep`` appended under ``records``, one Row per headline quantity it measured (the tensor
    peak on CPU; allocated, reserved and device total on CUDA), against the estimate recorded
    with it. None recorded: one unverified row saying how to record some."""
    from ..calibration.measure import Measurement, comparison, read_records

    rows = []
    for data in read_records(records):
        m = Measurement.from_json(data)
        if not m.ok or m.oom:
            continue
        truth = "measured" if m.device == "cuda" else f"measured-{m.device}"
        for quantity, c in comparison(m).items():
            rows.append(Row(m.model, "-", m.setup, int(c["measured"]), int(c["estimate"]), "-",
                            m.estimate.get("phase", "-"), truth=truth, knob="measured", quantity=quantity))
    if not rows:
        rows.append(_unverified("measured", Setup(), f"no measurements under {records}: `vramplan measure` or "
                                "`vramplan sweep` records them (calibration/gpu_sweep.sh on a GPU machine)"))
    return rows


def unverified_rows(quick: bool = False, knobs: tuple[str, ...] = (),
                    records: str | os.PathLike = MEASUREMENTS) -> list[Row]:
    """Rows of the knobs ``matrix`` does not cover (all, or those of ``knobs``): the distributed
    truths' (N real processes: ``vramplan.truths.distributed.zero_rows`` for ZeRO,
    ``vramplan.truths.fsdp.fsdp_rows`` for FSDP and DDP), the
    measured records (``measured_rows``), and the knobs with no truth on this machine, each with
    why."""
    wanted = set(knobs or KNOBS)
    rows: list[Row] = []
    if "measured" in wanted:
        rows += measured_rows(records)
    if wanted & {"zero", "fsdp", "ddp"}:
        try:
            from ..truths import distributed
        except ImportError:
            distributed = None
        zero_rows = getattr(distributed, "zero_rows", None) if "zero" in wanted else None
        if zero_rows is not None:
            rows += [r for r in zero_rows(quick) if r.knob in wanted]
        if wanted & {"fsdp", "ddp"}:
            try:
                from ..truths import fsdp
            except ImportError:
                fsdp = None
            if fsdp is not None:
                rows += [r for r in fsdp.fsdp_rows(quick) if r.knob in wanted]
        for knob in sorted(wanted & {"zero", "fsdp"} - {r.knob for r in rows}):
            rows.append(_unverified(knob, Setup(zero_stage=2, gpus=2) if knob == "zero" else Setup(gpus=2),
                                    f"no {knob} rows from the N-process truth "
                                    "(vramplan.truths.distributed.zero_rows) yet"))
    # on 2 ranks: ZeRO 1/2 and DDP (validate/knobs.py); not in --quick, which leaves N-process truths to their tests
    if "modules_to_save" in wanted and not quick:
        try:
            rows += distributed_knob_rows(quick, Row)
        except ImportError:  # the N-process truths need torch, deepspeed and accelerate
            pass
    if "device_map" in wanted:
        try:
            from ..truths import layer_split_truth  # the real placement on the meta device, when installed
        except ImportError:
            layer_split_truth = None
        if layer_split_truth is not None:
            rows += layer_split_truth.layer_split_rows(quick)
            from ..truths.max_memory_truth import max_memory_rows  # the same placement under --max-memory caps

            rows += max_memory_rows(quick)
    if "fsdp2" in wanted:
        try:
            from ..truths import fsdp2  # FSDP2 (fully_shard through accelerate) on N gloo ranks
        except ImportError:
            fsdp2 = None
        if fsdp2 is not None:
            rows += fsdp2.fsdp2_rows(quick)
    if "hybrid_shard" in wanted:
        try:
            from ..truths import hsdp_truth  # hybrid sharding (FSDP2 HSDP, FSDP1 HYBRID_SHARD) on 4 gloo ranks
        except ImportError:
            hsdp_truth = None
        if hsdp_truth is not None:
            rows += hsdp_truth.hsdp_rows(quick)
    if "tp" in wanted:
        try:
            from ..truths import tp_truth  # tensor parallelism: transformers' DTensor plan on N gloo ranks
        except ImportError:
            tp_truth = None
        if tp_truth is not None:
            rows += tp_truth.tp_rows(quick)
            from ..truths.tp_fsdp2 import tp_fsdp2_rows  # beside FSDP2 sharding (tp x dp_shard) on 4 gloo ranks

            rows += tp_fsdp2_rows(quick)
    if "cp" in wanted:  # context parallelism: accelerate's FSDP2 + torch's ring attention on N gloo ranks
        from ..truths.cp_truth import cp_rows

        rows += cp_rows(quick)
    if "pp" in wanted:  # pipeline parallelism: torch.distributed.pipelining's schedules on N gloo ranks, per stage
        from ..truths.pipeline import pp_rows

        rows += pp_rows(quick)
    if "ep" in wanted:  # expert parallelism: transformers' ep_plan (all-to-all) beside tp == ep on N gloo ranks
        from ..truths.ep_truth import ep_rows

        rows += ep_rows(quick)
    if "framework" in wanted:  # torchtune's own step, in a Python that imports torchtune 0.6.1 (or one unverified row)
        from ..truths.torchtune_truth import torchtune_rows

        rows += torchtune_rows(quick, Row)
    if "tiled_mlp" in wanted:  # Unsloth's and axolotl's own TiledMLP in transformers' layer (their wheels' files)
        from ..truths.tiled_truth import tiled_rows

        rows += tiled_rows(quick, Row)
    if "unsloth_gc" in wanted:  # LLaMA-Factory's use_unsloth_gc, its own checkpointing file (its wheel's)
        from ..truths.lf_gc_truth import gc_rows

        rows += gc_rows(quick, Row)
    if "gptq_awq" in wanted:
        rows.append(_unverified("gptq_awq", Setup(method="lora", quant="gptq"),
                                "modelled, estimate only (--quant gptq|awq): transformers 5 loads GPTQ/AWQ "
                                "checkpoints through gptqmodel, which needs torch>=2.14.1 (this environment pins "
                                "2.13.0, so it is not installed) and a pre-quantized checkpoint; its CUDA training "
                                "kernels (TritonV2Linear, AwqGEMMLinear) need a GPU. The packed bytes and GPTQ's "
                                "saved dequantized weights were checked once against gptqmodel 7.7's CPU TorchLinear "
                                "(docs/commands/validate.md)"))
    if "device_overheads" in wanted:
        rows.append(_unverified("device_overheads", Setup(),
                                "needs a CUDA device: CUDA context, cuBLAS workspaces, NCCL and the caching "
                                "allocator's slack are published figures (estimator/corrections.py) until a GPU "
                                "measures them; CPU truths compare the tensor peak only"))
    return rows


def _unverified(knob: str, setup: Setup, why: str) -> Row:
    return Row("-", "-", setup, 0, 0, "-", "-", truth="none", knob=knob, verified=False, why=why)


@dataclass(frozen=True)
class KnobSummary:
    knob: str
    rows: int
    median_abs_error: float | None
    worst_error: float | None
    verified: bool
    why: str = ""


def summarize(rows: list[Row], quantity: str = "tensor_peak_bytes") -> list[KnobSummary]:
    """Median |error| and worst error of ``quantity`` per knob, in KNOBS order."""
    out = []
    for knob in sorted({r.knob for r in rows}, key=lambda k: KNOBS.index(k) if k in KNOBS else len(KNOBS)):
        mine = [r for r in rows if r.knob == knob]
        errs = [r.error for r in mine if r.verified and r.quantity == quantity]
        if errs:
            out.append(KnobSummary(knob, len(errs), statistics.median(abs(e) for e in errs), max(errs, key=abs), True))
        elif all(not r.verified for r in mine):
            out.append(KnobSummary(knob, 0, None, None, False, mine[0].why))
    return out


def row_json(row: Row) -> dict:
    from ..setup.wording import describe

    return {
        "knob": row.knob, "model": row.model, "family": row.family, "setup": row.setup.to_dict(),
        "setup_text": describe(row.setup), "truth": row.truth, "quantity": row.quantity,
        "truth_bytes": row.truth_bytes, "estimated_bytes": row.estimated_bytes,
        "truth_phase": row.traced_phase, "estimated_phase": row.estimated_phase,
        "error": row.error if row.verified and row.truth_bytes else None,
        "verified": row.verified, "why": row.why,
        "estimate_headline_bytes": dict(zip(("tensor_peak", "peak_allocated", "peak_reserved", "device_total"),
                                            row.estimate_headline, strict=True)) if row.estimate_headline else None,
    }
