"""CPU truth for the transformers 4.x MoE stack (vramplan/estimator/moe_4x.py): one tiny Mixtral
(shrink_config of mixtral-8x7b: 2 layers, hidden 256, 4 experts of width 896, top-2, vocab 2048)
trained two steps on the real transformers 4.48.1 + peft 0.13.2 (the fms-acceleration Mixtral
rows' stack), LoRA on a bf16 base and QLoRA (bitsandbytes NF4, double quant), with and without
checkpointing, counted with vramplan's live-tensor counter (vramplan/truths/cpu_truth.py
``run_step``, its base loaded the 4.48 way), against ``estimate(..., stack=Stack("4.48.1"))``.

Not part of the package or the tests' fast tier (tests/test_moe_4x.py runs it, ``slow``, when the
venv exists): it needs a venv with the rows' stack,

    python -m venv /tmp/v448 --system-site-packages
    /tmp/v448/bin/pip install transformers==4.48.1 peft==0.13.2 accelerate==1.0.1
    /tmp/v448/bin/python calibration/published/moe_4x_probe.py [CASE ...]

bitsandbytes: the system-wide 0.50.2 (0.43.3, the rows' version, has no CPU 4-bit kernels). Both
``MatMul4Bit.forward`` keep only the packed weight for the backward (``ctx.tensors = (None, B)``:
read off the 0.43.3 wheel and 0.50.2), never the input. transformers 4.48.1's bitsandbytes
quantizer refuses a CUDA-less machine unless bitsandbytes reports its "multi_backend" feature:
the probe sets that flag and skips the backend check (the kernels it then runs are 0.50.2's CPU
ones). LLM.int8 does not load this way (4.48.1's ``Int8Params`` creation reads
``MatmulLtState.memory_efficient_backward``, gone from bitsandbytes 0.50), so no int8 case runs.
Prints one JSON line per case: the measured phase peaks, the estimate's, and the error.

Measured (2 CPU threads, torch 2.13.0+cpu, transformers 4.48.1, peft 0.13.2, bitsandbytes 0.50.2;
batch 2 x seq 256, rank 16, adamw, bf16 weights):

    case            measured B   estimate B    error   (before moe_4x.py: 5's fused experts)
    qlora-qkvo        54977336     54547136   -0.78 %   +28.4 %
    qlora-qkvo-ck     28248076     28789440   +1.92 %   +72.1 %
    qlora-all         71330312     70899904   -0.60 %   +56.0 %
    qlora-all-ck      38783840     40243904   +3.76 %   +104.0 %
    lora-all          69689672     69472256   -0.31 %   +8.3 %
    lora-all-ck       40775962     40997376   +0.54 %   +20.5 %
    olmoe-qlora-all   42537400     42106992   -1.01 %   (OLMoE, MHA: top-k weights not renormalised)
    olmoe-lora-all-ck 23386440     23166976   -0.94 %

Since MODEL_VERSION 6 the estimate counts two things of this stack it missed: without checkpointing the first
layer's input norm saves nothing (its input needs no gradient; estimator/activations.py
``untracked_input_norm_bytes_per_token``: -0.5 MB), and 4.48.1's SDPA repeats K/V to every head before the call
(``repeat_kv``; transformers 5 passes ``enable_gqa``: estimator/stack.py ``sdpa_repeats_kv``), which a GQA layer
keeps (+0.8 MB without checkpointing, +0.4..0.8 MB in the recomputed layer with it). The no-checkpointing rows were
-2.7 / -2.1 / -0.7 % before. With checkpointing the estimate is over by 0.5-3.8 %: 4.48.1 checkpoints reentrantly,
the estimate's recompute moment is 5's non-reentrant one (it was +1.7 % on qlora-all-ck before the repeated K/V).

The weights (quantized experts and router, LoRA on every expert under all-linear) are exact to 64 bytes;
one MoE layer's saved tensors are exact (saved_tensors_hooks over the 4.48.1 block: 25684 B/token on
q/k/v/o QLoRA, 36372 with the experts' and router's adapters, 25616 on the bf16 LoRA base). The rest
of the no-checkpointing QLoRA gap was not the MoE: 4.48.1's SDPA path (integrations/sdpa_attention.py)
repeats K/V to every head before the call (``repeat_kv``), which the estimate now counts under a transformers
below 4.54 (2 c (q - kv) per token and layer; FlashAttention-2, the published rows' kernel, repeats nothing).
With MHA=1 (as many K/V heads as heads, nothing repeated) the same run gave qlora-qkvo 55226216 measured /
55322352 estimated (+0.17 %), lora-all 70230344 / 70539264 (+0.44 %) under MODEL_VERSION 5, -0.78 % / -0.31 %
with the first layer's norm: what the GQA rows give now that the repeated K/V are counted.

    /tmp/v448/bin/python calibration/published/moe_4x_probe.py             # the table (about 2 minutes)
    MHA=1 /tmp/v448/bin/python calibration/published/moe_4x_probe.py qlora-qkvo lora-all
"""

from __future__ import annotations

import json
import os
import sys
import warnings

#: case -> Setup keywords (batch 2, seq 256; bf16 weights; adamw)
CASES = {
    "qlora-qkvo": dict(method="qlora", lora_targets="q_proj,k_proj,v_proj,o_proj"),
    "qlora-qkvo-ck": dict(method="qlora", lora_targets="q_proj,k_proj,v_proj,o_proj", checkpointing=True),
    "qlora-all": dict(method="qlora"),
    "qlora-all-ck": dict(method="qlora", checkpointing=True),
    "lora-all": dict(method="lora"),
    "lora-all-ck": dict(method="lora", checkpointing=True),
    # OLMoE (4.48.1 OlmoeSparseMoeBlock: the same loop, no renormalisation of the top-k weights)
    "olmoe-qlora-all": dict(method="qlora"),
    "olmoe-lora-all-ck": dict(method="lora", checkpointing=True),
}
#: the shipped model each case shrinks (mixtral-8x7b unless named)
MODELS = {"olmoe-qlora-all": "allenai/OLMoE-1B-7B-0924", "olmoe-lora-all-ck": "allenai/OLMoE-1B-7B-0924"}
COMMON = dict(batch=2, seq=256, lora_rank=16, precision="bf16")


def tiny_config(case: str = "") -> dict:
    """The tiny model both sides see (vramplan's shrink_config of the shipped mixtral-8x7b, or the case's)."""
    from vramplan.model.modelspec import shrink_config
    from vramplan.model.profiles import load_model

    cfg = shrink_config(load_model(MODELS.get(case, "mixtral-8x7b")).config, layers=2, hidden=256, heads=8,
                        vocab=2048, experts=4)
    if os.environ.get("MHA") == "1":  # no grouped K/V: 4.48's SDPA path repeats K/V to every head (see above)
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def setup_of(case: str):
    from vramplan.specs import Setup

    return Setup(**COMMON, **CASES[case])


def estimated(case: str) -> dict:
    """The estimate side (torch-free): the tiny model under transformers 4.48.1."""
    from vramplan.estimator.stack import Stack
    from vramplan.estimator.step import estimate
    from vramplan.model.architecture import model_spec_from_config

    b = estimate(model_spec_from_config(tiny_config(case), name="tiny-" + case), setup_of(case),
                 stack=Stack(transformers="4.48.1"))
    return {"tensor_peak_bytes": b.tensor_peak_bytes, "phase_peaks_bytes": dict(b.phase_peaks_bytes)}


def _load_base_448(config: dict, setup):
    """cpu_truth.load_base, the transformers 4.48 way (``torch_dtype``; the quantizer's CUDA check)."""
    import tempfile

    import bitsandbytes as bnb
    import peft
    import torch
    import transformers
    import transformers.integrations as integrations

    from vramplan.run.models import hf_config
    from vramplan.util.units import PRECISION_COMPUTE_DTYPE, PRECISION_WEIGHT_DTYPE

    assert transformers.__version__.startswith("4."), transformers.__version__
    dtype = getattr(torch, PRECISION_WEIGHT_DTYPE[setup.precision])
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = hf_config(config, None)
    cfg.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    if setup.quant == "none":
        return model
    path = tempfile.mkdtemp(prefix="vramplan-moe4x-")
    model.save_pretrained(path)
    bnb.features = set(getattr(bnb, "features", set())) | {"multi_backend"}
    integrations.validate_bnb_backend_availability = lambda *a, **k: True
    qcfg = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=setup.quant, bnb_4bit_use_double_quant=setup.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, PRECISION_COMPUTE_DTYPE[setup.precision]))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=qcfg, torch_dtype=dtype, device_map="cpu", attn_implementation="sdpa",
        use_cache=False)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def measured(case: str) -> dict:
    """The real step (needs the 4.48.1 venv)."""
    import torch

    from vramplan.truths import cpu_truth

    torch.set_num_threads(2)
    cpu_truth.load_base = _load_base_448  # build_model looks it up at call time
    t = cpu_truth.run_step(tiny_config(case), setup_of(case))
    return {"tensor_peak_bytes": t.tensor_peak_bytes, "phase_peaks_bytes": t.phase_peaks_bytes,
            "weights_bytes": t.weights_bytes, "params_trainable": t.params_trainable}


def main(cases: list[str]) -> None:
    warnings.filterwarnings("ignore")
    for case in cases or list(CASES):
        m, e = measured(case), estimated(case)
        err = (e["tensor_peak_bytes"] - m["tensor_peak_bytes"]) / m["tensor_peak_bytes"]
        print(json.dumps({"case": case, "measured": m, "estimate": e, "error_pct": round(100 * err, 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
