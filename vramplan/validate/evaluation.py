"""The validate cases of the eval step (``--eval-batch``, estimator/eval_step.py): the fake-tensor
trace of the real transformers 5.24 step followed by an eval step through the Trainer's own
``prediction_step`` (vramplan/run/eval_trace.py), on the dense families.
"""

from __future__ import annotations

from ..specs import Setup

__all__ = ["EVAL_CASE_PHASES", "eval_cases", "eval_cpu_rows"]

#: the phase compared besides the tensor peak (which is often the train step's)
EVAL_CASE_PHASES = {"eval": ("eval",)}


def eval_cases(quick: bool, case, dense) -> list:
    """The eval cases (``case``: validate.Case) on the ``dense`` families, or the quick subset."""
    lora = Setup(method="lora", seq=512, eval_batch=8)
    full = Setup(seq=128, eval_batch=16)
    cpu = [Setup(seq=128, eval_batch=8), Setup(method="lora", seq=128, eval_batch=8),
           Setup(method="lora", seq=256, eval_batch=8, precision="fp32"),
           Setup(method="lora", seq=128, eval_batch=4, lora_targets="q_proj,v_proj")]
    if quick:
        return [case("eval", dense[0], lora, "trace", 2), case("eval", dense[0], cpu[1], "eval-cpu")]
    setups = (lora, full, lora.replace(eval_batch=4, precision="bf16-mixed"), full.replace(precision="bf16-mixed"),
              lora.replace(checkpointing=True, precision="fp32"), lora.replace(seq=256, grad_accum=2),
              Setup(method="lora", seq=1024, batch=1, eval_batch=2, checkpointing=True))
    return ([case("eval", m, s, "trace", 4) for m in dense for s in setups]
            + [case("eval", dense[0], s, "eval-cpu") for s in cpu])


def eval_cpu_rows(case, row) -> list:
    """A real ``Trainer.evaluate`` on this CPU (vramplan/truths/eval_truth.py) of the narrowed model
    (``case.shrink``): its eval phase's live-tensor peak against the estimate's (``row``: accuracy.Row)."""
    from ..estimator import estimate
    from ..model.architecture import model_spec_from_config
    from ..model.modelspec import shrink_config
    from ..model.profiles import load_model
    from ..truths.eval_truth import eval_run

    model = load_model(case.model)
    cfg = shrink_config(model.config, **case.shrink)
    spec = model_spec_from_config(cfg, name=f"{model.name}[narrow]", source=model.source)
    truth, est = eval_run(cfg, case.setup), estimate(spec, case.setup).phase_peaks_bytes["eval"]
    return [row(case.model, spec.family, case.setup, truth, est, "eval", "eval", truth="cpu-run", knob=case.knob,
                quantity="eval_peak_bytes")]
