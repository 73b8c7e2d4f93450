"""The optimizer in backward on the HF Trainer path and as a plan dimension (issue 16).

train.py builds what transformers 5.24 builds for its layer-wise optimizers (trainer_optimizer.py
``_setup_low_rank_optimizer``): one optimizer per parameter, a post-accumulate-grad hook stepping it,
a ``LayerWiseDummyOptimizer`` for the Trainer. One subprocess runs the emitted train.py of a tiny model
with and without the knob (real Trainer steps on the CPU, counted by vramplan's live-tensor callback).
The plan tries the knob for full fine-tuning on one GPU at grad accumulation 1 and takes it where only
it fits, as an extra part that must otherwise buy 10 % (search/rank.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cost.counts import in_backward_overhead_s
from vramplan.cost.model import step_cost
from vramplan.emit import emit_to_dir
from vramplan.emit.frameworks import framework_limits
from vramplan.emit.trainer import script_plan, train_script
from vramplan.search.labels import savers_text
from vramplan.search.planner import plan
from vramplan.specs import Plan, SpecError

#: 2 layers, 256 wide, 8 tokens: the gradients are a large share of the step, so freeing them shows
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256, "max_window_layers": 2}
FULL = Setup(batch=1, seq=8, optimizer="adamw")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("oib")
    (root / "tiny").mkdir()
    (root / "tiny" / "config.json").write_text(json.dumps({**load_model("qwen2-0.5b").config, **TINY}))
    return root, load_model(str(root / "tiny" / "config.json")), load_gpu("rtx-4090")


def _plan(model, gpu, setup: Setup) -> Plan:
    return Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu)


def test_emit_names_the_knob_only_when_on(tiny):
    _, model, gpu = tiny
    on = script_plan(_plan(model, gpu, FULL.replace(optimizer_in_backward=True)), model)
    off = script_plan(_plan(model, gpu, FULL), model)
    assert on["optimizer_in_backward"] is True and on["optim"] == "adamw_torch"
    assert "optimizer_in_backward" not in off
    assert {k: v for k, v in on.items() if k != "optimizer_in_backward"} == off
    text = train_script(_plan(model, gpu, FULL.replace(optimizer_in_backward=True)), model)
    assert "'optimizer_in_backward': True" in text and "LayerWiseDummyOptimizer" in text


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "adafactor", "lion"])
def test_emit_refuses_optimizers_train_py_cannot_split(tiny, optimizer):
    _, model, gpu = tiny
    with pytest.raises(SpecError, match="torch's optimizers only"):
        script_plan(_plan(model, gpu, FULL.replace(optimizer=optimizer, optimizer_in_backward=True)), model)


RUN = """
import importlib.util, json, sys, torch
from transformers import TrainerCallback
from vramplan.run.callback import make_callback

class Grads(TrainerCallback):  # what is left of the gradients when the Trainer would step
    def __init__(self):
        self.alive = []
    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.alive.append(sum(p.grad is not None for p in model.parameters()))

out = {}
for name in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("train_" + name, f"{name}/train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    grads, measure = Grads(), make_callback({"device": "cpu", "steps": 2, "tokens_per_step": 8}, None)
    args = train.parse_args(["--cpu", "--max-steps", "2", "--output-dir", name + "-out", "--no-save"])
    trainer = train.build_trainer(args, callbacks=[grads, measure])
    measure.accelerator = trainer.accelerator
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    per_param = list(getattr(inner, "optimizer_dict", {}).values())
    out[name] = {"alive": grads.alive, "params": len(before), "optimizer": type(inner).__name__,
                 "moved": sorted(n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)),
                 "per_param": len(per_param), "steps": [o.state[o.param_groups[0]["params"][0]].get("step", 0).item()
                                                        for o in per_param[:3]],
                 "lrs": sorted({g["lr"] for o in per_param for g in o.param_groups}),
                 "max_grad_norm": trainer.args.max_grad_norm, **measure.result()}
print(json.dumps(out))
"""


@pytest.mark.slow  # the full tier
def test_emitted_train_py_steps_each_parameter_in_backward(tiny):
    """Real Trainer steps of the emitted train.py (CPU, 2 steps): no gradient is alive when the Trainer
    would step (all 26 without the knob), every parameter the plain run moves is moved, each parameter's
    AdamW stepped twice under its own scheduler (linear decay to 0 over the 2 steps), no clipping; and the
    live-tensor peak falls by what the estimate says the knob saves (within 10 %)."""
    root, model, gpu = tiny
    plans = {name: _plan(model, gpu, FULL.replace(optimizer_in_backward=on)) for name, on in (("on", True),
                                                                                             ("off", False))}
    for name, p in plans.items():
        emit_to_dir(p, root / name)
        (root / name / "config.json").write_text((root / "tiny" / "config.json").read_text())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = {}
    for name in plans:  # one process each: the live-tensor counter sees every tensor alive in its process
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN), name], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-5000:]
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    on, off = out["on"], out["off"]
    assert off["alive"] == [off["params"]] * 2 and off["optimizer"] == "AdamW"
    assert on["alive"] == [0, 0] and on["optimizer"] == "LayerWiseDummyOptimizer"
    assert on["per_param"] == on["params"] and on["steps"] == [2.0, 2.0, 2.0]
    assert on["moved"] == off["moved"] and len(on["moved"]) > on["params"] // 2
    assert on["lrs"] == [0.0] and on["max_grad_norm"] == 0.0  # the per-parameter schedulers ran to the end
    measured = off["tensor_peak_bytes"] - on["tensor_peak_bytes"]
    estimated = plans["off"].breakdown.tensor_peak_bytes - plans["on"].breakdown.tensor_peak_bytes
    assert measured > 0 and abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


# -- the plan dimension ---------------------------------------------------------------------------


def test_plan_takes_it_where_only_it_fits():
    """Full fine-tuning of SmolLM2-1.7B with torch AdamW on a 16 GB card at grad accumulation 1: the
    bf16 weights, gradients and AdamW states fit only inside the margins without it (a tight plan, which
    may run out of memory); with it each gradient is freed and the plan keeps its margins, on the GPU."""
    kw = dict(seq=1024, method="full", optimizer="adamw-fused")
    without = plan("smollm2-1.7b", "rtx-4080", optimizer_in_backward=False, relax=False, **kw)
    assert without.tight
    chosen = plan("smollm2-1.7b", "rtx-4080", **kw)
    assert chosen.fits and not chosen.tight and chosen.setup.optimizer_in_backward and chosen.setup.grad_accum == 1
    assert chosen.setup.offload_optimizer == "none" and chosen.setup.zero_stage == 0
    assert "optimizer in backward" in savers_text(chosen.setup)


def test_plan_leaves_it_off_when_everything_fits():
    chosen = plan("smollm2-360m", "rtx-4090", seq=1024, method="full", optimizer="adamw-fused")
    assert chosen.fits and not chosen.setup.optimizer_in_backward
    assert not any(a.setup.optimizer_in_backward for a in chosen.alternatives if a.setup.method == "full"
                   and a.tokens_per_s and a.tokens_per_s > chosen.tokens_per_s)


def test_plan_never_tries_it_where_it_is_not_legal():
    """Gradient accumulation (a global batch over small micro-batches), several GPUs, adapters."""
    accum = plan("smollm2-1.7b", "rtx-4080", seq=1024, method="full", optimizer="adamw-fused", global_batch=64)
    lora = plan("smollm2-1.7b", "rtx-4080", seq=1024, method="lora")
    ddp = plan("smollm2-1.7b", "rtx-4080", gpus=2, seq=1024, method="full", optimizer="adamw-fused")
    for p in (accum, lora, ddp):
        assert not p.setup.optimizer_in_backward
        assert not any(a.setup.optimizer_in_backward for a in p.alternatives)


def test_cost_adds_only_the_per_parameter_launches():
    model, gpu = load_model("smollm2-1.7b"), load_gpu("rtx-4080")
    s = Setup(method="full", optimizer="adamw-fused", batch=2, seq=1024)
    plain, oib = step_cost(model, s, gpu), step_cost(model, s.replace(optimizer_in_backward=True), gpu)
    assert in_backward_overhead_s(model, s) == 0.0
    extra = in_backward_overhead_s(model, s.replace(optimizer_in_backward=True))
    assert 0 < extra < 0.05 * plain.step_s  # a few ms of launches, not a second optimizer pass
    assert oib.optimizer_s == plain.optimizer_s and oib.overhead_s == pytest.approx(plain.overhead_s + extra)


def test_plans_from_framework_files_keep_it_off_where_the_framework_has_no_field():
    """plan --from an axolotl/LLaMA-Factory/TRL/TrainingArguments file: the search leaves it off (their
    writers refuse it, emit/hf_configs.py); torchtune's optimizer_in_bwd can take it."""
    for fmt in ("axolotl", "llamafactory", "trl", "hf"):
        assert framework_limits(fmt)["optimizer_in_backward"] is False
    assert "optimizer_in_backward" not in framework_limits("torchtune")
