"""Activation offloading (``--activation-offload``): TRL 1.16's OffloadActivations, run for real in the
fake-tensor tracer (vramplan/run/act_offload.py), against the estimate (vramplan/estimator/act_offload.py);
the refusals, the readers and writers, the plan dimension and its cost."""

from __future__ import annotations

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.cost import model as cost
from vramplan.emit.frameworks import refusal
from vramplan.emit.hf_configs import axolotl_config, trl_config
from vramplan.estimator import estimate
from vramplan.estimator.act_offload import device_saving_bytes, host_bytes
from vramplan.model.architecture import with_layers
from vramplan.model.profiles import load_model
from vramplan.readers import read_config
from vramplan.specs import Setup, SpecError

LLAMA = "meta-llama/Llama-3.2-1B"
OFF = Setup(checkpointing=True, activation_offload=True, seq=512)


@pytest.fixture(scope="module")
def llama2():
    return with_layers(load_model(LLAMA), 2)


def _trace(model, setup):
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    from vramplan.run.tracer import trace

    return trace(model, setup)


@pytest.mark.parametrize("kw", [{}, {"batch": 2, "seq": 1024}, {"grad_accum": 2}, {"precision": "fp16"},
                                {"method": "lora"}, {"method": "lora", "seq": 128}])
def test_estimate_meets_the_trace_of_trls_offloader(llama2, kw):
    setup = OFF.replace(**kw)
    t, e = _trace(llama2, setup), estimate(llama2, setup)
    for ph in ("forward", "backward", "optimizer"):
        assert abs(e.phase_peaks_bytes[ph] - t.phase_peaks_bytes[ph]) <= 0.01 * t.phase_peaks_bytes[ph], ph
    assert e.host_bytes == t.host_bytes > 0  # every host copy, byte for byte


def test_the_offloaded_layer_inputs_leave_the_device_at_the_loss(llama2):
    """Against checkpointing alone the trace's forward peak falls by exactly the layer inputs the
    estimate moves to the host (c * N * h each), and the backward's top/bottom moments stay."""
    on, off = _trace(llama2, OFF), _trace(llama2, OFF.replace(activation_offload=False))
    saved = off.phase_peaks_bytes["forward"] - on.phase_peaks_bytes["forward"]
    # two layer inputs, less the shifted labels' clone the manager keeps in its forward stash
    assert saved == device_saving_bytes(llama2, OFF) == 2 * 512 * llama2.hidden_size * 2 - 8 * 512


def test_with_adapters_the_first_input_stays_and_the_last_step_lingers(llama2):
    """LoRA: the embedding output (a leaf, peft's enable_input_require_grads) stays on the device, and
    TRL's curr_autograd_node keeps it and its gradient alive into the optimizer step."""
    from vramplan.estimator.act_offload import backward_start_saving_bytes, stale_bytes

    lora = OFF.replace(method="lora")
    on, off = _trace(llama2, lora), _trace(llama2, lora.replace(activation_offload=False))
    layer_input = 512 * llama2.hidden_size * 2
    assert off.phase_peaks_bytes["backward"] - on.phase_peaks_bytes["backward"] >= 0
    # two layers, the first resident and two held through the backward (ON_DEVICE_IN_BACKWARD): none moved
    assert backward_start_saving_bytes(llama2, lora) == 0
    assert on.phase_peaks_bytes["optimizer"] - off.phase_peaks_bytes["optimizer"] == stale_bytes(llama2, lora) \
        == 2 * layer_input


def test_the_tracer_runs_trls_own_manager(llama2):
    pytest.importorskip("trl")
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trl.models.activation_offloading import OffloadActivations

    from vramplan.run.act_offload import offload_manager

    class Counter:
        host_context = False
        marked: list = []

        def mark_host(self, t):
            self.marked.append(t)

        def unmark_host(self, t):
            pass

    from vramplan.run.act_offload import offload_step

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    counter = Counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # fake parameters, as the tracer's
        ctx = offload_manager(model, counter, lambda t: t)
        assert isinstance(ctx, OffloadActivations) and ctx.use_streams
        x = torch.randn(32, 64, requires_grad=True)
        with offload_step(ctx):
            model(x).sum().backward()
    # the input (8 KiB) and the ReLU output were offloaded; the weights (parameters) stayed
    assert {tuple(t.shape) for t in counter.marked} == {(32, 64)} and len(counter.marked) >= 2


def test_offloading_everything_can_take_more_device_memory_than_checkpointing_alone(llama2):
    """axolotl#3733: without checkpointing TRL offloads every saved tensor, but a storage saved twice
    within the forward stash (the norms' fp32 inputs and normalised outputs that q/k/v and gate/up all
    save) keeps its device tensor: more stays on the GPU than checkpointing's one input per layer."""
    import vramplan.setup.checks as checks

    setup = Setup(seq=2048)
    ckpt = _trace(llama2, setup.replace(checkpointing=True))
    everything = pytest.MonkeyPatch()
    everything.setattr(checks, "check_activation_offload", lambda model, s: None)  # a setup the estimate refuses
    try:
        offload_all = _trace(llama2, setup.replace(activation_offload=True))
    finally:
        everything.undo()
    assert offload_all.phase_peaks_bytes["forward"] > ckpt.phase_peaks_bytes["forward"]
    assert offload_all.host_bytes > 0


@pytest.mark.parametrize("kw, fragment", [
    ({"checkpointing": False}, "add --checkpointing"),
    ({"method": "qlora"}, "quantized base"),
    ({"precision": "bf16-mixed"}, "16-bit step"),
    ({"liger": True}, "fused linear cross-entropy"),
    ({"loss": "chunked"}, "default loss"),
    ({"pad_mask": True}, "padded"),
])
def test_what_is_not_modelled_is_refused_in_one_line(kw, fragment):
    with pytest.raises(SpecError, match=fragment):
        estimate(load_model(LLAMA), OFF.replace(**kw))


def test_cli_refuses_with_one_line():
    r = CliRunner().invoke(main, ["estimate", LLAMA, "--activation-offload"])
    assert_user_error(r, "--activation-offload", "--checkpointing")


def test_off_by_default_and_nothing_moves_without_it():
    m, s = load_model(LLAMA), Setup(checkpointing=True)
    assert not s.activation_offload
    assert device_saving_bytes(m, s) == host_bytes(m, s) == 0
    assert not any(c.name == "activation_offload_host" for c in estimate(m, s).components)


def test_the_host_term_is_a_host_component():
    e = estimate(load_model(LLAMA), OFF)
    comp = next(c for c in e.components if c.name == "activation_offload_host")
    assert comp.where == "host" and comp.bytes == e.host_bytes > 0


def test_the_cost_model_prices_the_copies_over_the_host_link():
    m = load_model(LLAMA)
    base, off = cost.step_cost(m, OFF.replace(activation_offload=False)), cost.step_cost(m, OFF)
    assert base.offload_s == 0 < off.offload_s
    assert off.step_s > base.step_s


def test_plan_offloads_only_when_that_is_what_fits():
    from vramplan.search.planner import plan

    name, seq = "meta-llama/Llama-3.2-3B", 8192
    m = load_model(name)
    s = Setup(checkpointing=True, seq=seq, optimizer="adamw-fused")
    need_ck, need_off = (estimate(m, x).device_total_bytes for x in (s, s.replace(activation_offload=True)))
    fixed = {"seq": seq, "method": "full", "liger": False, "global_batch": 1, "optimizer": "adamw-fused"}
    tight = plan(name, int((need_ck + need_off) / 2 / 0.9), **fixed)
    roomy = plan(name, int(need_ck / 0.8), **fixed)
    assert tight.setup.activation_offload and tight.setup.checkpointing
    assert not roomy.setup.activation_offload


def test_writers_emit_the_framework_keys():
    m = load_model(LLAMA)
    assert axolotl_config(OFF, m, model_id=LLAMA)["activation_offloading"] is True
    assert trl_config(OFF, m, model_id=LLAMA)["activation_offloading"] is True
    assert "activation_offloading" not in trl_config(OFF.replace(activation_offload=False), m, model_id=LLAMA)
    assert refusal("llamafactory", OFF, m).startswith("activation_offload ")
    assert refusal("torchtune", OFF, m).startswith("activation_offload ")


def test_the_train_script_runs_the_step_under_trls_manager():
    from vramplan.emit.trainer import script_plan, train_script
    from vramplan.model.profiles import load_gpu
    from vramplan.specs import Plan

    m, gpu = load_model(LLAMA), load_gpu("h100-80gb")

    def plan_of(s):
        return Plan(model=m.name, setup=s, breakdown=estimate(m, s, gpu), gpu=gpu)

    assert script_plan(plan_of(OFF), m)["activation_offload"] is True
    assert "activation_offload" not in script_plan(plan_of(OFF.replace(activation_offload=False)), m)
    script = train_script(plan_of(OFF), m)
    assert "get_act_offloading_ctx_manager(model=self.model)" in script
    assert 'OffloadingTrainer if PLAN.get("activation_offload") else Trainer' in script


@pytest.mark.parametrize("fmt, text, expect", [
    ("axolotl", "base_model: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: true\n",
     True),
    ("axolotl", "base_model: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: legacy\n",
     False),
    ("trl", "model_name_or_path: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: true\n"
     "label_smoothing_factor: 0.1\n", True),  # transformers' full-logits loss: modelled
    ("trl", "model_name_or_path: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: true\n",
     True),  # TRL's fused LM head (loss trl) under TRL's own preparation (--framework trl): modelled
    ("trl", "model_name_or_path: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: true\n"
     "use_peft: true\nload_in_4bit: true\n", True),  # QLoRA: TRL's offloading on the base TRL loads, modelled
    ("trl", "model_name_or_path: meta-llama/Llama-3.2-1B\ngradient_checkpointing: true\nactivation_offloading: true\n"
     "use_peft: true\nlora_modules_to_save: [lm_head]\ndtype: bfloat16\n", False),  # TRL's head on the HF recipe
    # (modules_to_save is modelled there): not modelled with offloading, said so
])
def test_readers_map_the_key(tmp_path, fmt, text, expect):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    read = read_config(path, format=fmt)
    assert read.setup.activation_offload is expect
    fields = {w.field for w in read.warnings}
    assert ("activation_offloading" in fields) == (fmt == "axolotl" or not expect)  # assumed / ignored, said so
    if fmt == "trl" and expect and "label_smoothing" not in text:
        assert read.setup.framework == "trl"


def test_torchtunes_offloading_is_not_trls(tmp_path):
    from pathlib import Path

    src = Path(__file__).parent / "data/configs/torchtune/llama3_2_1B_full_single_device.yaml"
    path = tmp_path / src.name
    on = "enable_activation_offloading: True"
    path.write_text(src.read_text().replace("enable_activation_offloading: False", on))
    read = read_config(path)
    assert not read.setup.activation_offload
    assert "enable_activation_offloading" in {w.field for w in read.warnings}


def test_validate_has_the_knob():
    from vramplan.validate.matrix import KNOBS, matrix

    assert "activation_offload" in KNOBS
    assert any(c.knob == "activation_offload" for c in matrix(quick=True))
    assert sum(c.knob == "activation_offload" for c in matrix()) >= 9


def test_an_axolotl_config_written_with_offloading_reads_back_with_it(tmp_path):
    import yaml

    m = load_model(LLAMA)
    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump(axolotl_config(OFF, m, model_id=LLAMA)))
    read = read_config(path)
    assert read.setup.activation_offload and read.setup.checkpointing
    assert estimate(m, read.setup).host_bytes == host_bytes(m, read.setup) > 0


@pytest.mark.slow
@pytest.mark.parametrize("layers, seq", [(8, 16384), (16, 16384)])
def test_a_deep_models_backward_holds_two_layer_inputs(layers, seq):
    """Deep and long, where the offloaded inputs matter: the trace of TRL's manager (Mistral-7B v0.3 LoRA,
    checkpointing) peaks in the backward with exactly two layer inputs on the device beside the resident
    one, and the estimate meets it (before this was modelled the estimate kept every input: +8 % at 16
    layers)."""
    from vramplan.model.architecture import with_layers
    from vramplan.run.tracer import trace

    spec = with_layers(load_model("mistral-7b"), layers)
    setup = Setup(method="lora", checkpointing=True, activation_offload=True, seq=seq)
    t, e = trace(spec, setup), estimate(spec, setup)
    assert t.phase == e.phase == "backward"
    assert abs(e.tensor_peak_bytes / t.tensor_peak_bytes - 1) < 0.005


def test_with_trls_fused_head_the_host_holds_the_heads_input_not_log_probs(llama2):
    """TRL's fused head keeps no N x V log-probabilities: what the manager copies for the loss is the head's
    input (c * N * h), as SFTTrainer's real step with the manager shows (validate --knob activation_offload,
    the trl-cpu host rows: -0.1 %)."""
    hf = OFF.replace(method="lora")
    trl = hf.replace(framework="trl", loss="trl")
    N = hf.tokens
    assert host_bytes(llama2, hf) - host_bytes(llama2, trl) == 4 * llama2.vocab_size * N - 2 * llama2.hidden_size * N


def test_a_soft_capped_head_is_offloaded_under_trls_fused_head_only():
    """Gemma 2 soft-caps its logits: with transformers' loss the capping's saves sit outside the head (not
    traced: refused); TRL's fused head applies it inside its tiles, under the manager's NoOpManager, so
    what reaches the offloader is what it is for Gemma (layer inputs, the fp32 ``1 + w`` final norm)."""
    gemma2 = load_model("gemma-2-2b")
    trl = OFF.replace(method="lora", framework="trl", loss="trl")
    assert estimate(gemma2, trl).host_bytes > 0
    with pytest.raises(SpecError, match="soft-capping"):
        estimate(gemma2, OFF.replace(method="lora"))


def test_the_torch_folds_backward_keeps_tanh_for_a_soft_capped_head():
    """TRL's torch fold (no Triton) keeps ``tanh``'s output through ``_backward_tile``: one fp32 tile more
    (read off the fold: 9.25 tiles with the cap, 8.25 without); the Triton kernel keeps it in registers."""
    import dataclasses

    from vramplan.estimator.objectives import _tile_fp32, head_terms
    from vramplan.estimator.stack import Stack

    gemma2 = load_model("gemma-2-2b")
    uncapped = dataclasses.replace(gemma2, traits=dataclasses.replace(gemma2.traits, final_logit_softcapping=None))
    s = Setup(method="lora", loss="trl", seq=1024)
    fold, triton = Stack(trl_triton=False), Stack(trl_triton=True)
    tile = _tile_fp32(gemma2, s, 1024)
    assert head_terms(gemma2, s, 1024, True, fold)[1] - head_terms(uncapped, s, 1024, True, fold)[1] == tile
    assert head_terms(gemma2, s, 1024, True, triton) == head_terms(uncapped, s, 1024, True, triton)
    assert head_terms(gemma2, s, 1024, True, fold)[0] == head_terms(uncapped, s, 1024, True, fold)[0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_gemma2_under_trls_head_and_offloading_meets_sftrainers_real_step(method):
    """TRL 1.16's SFTTrainer with its offloading manager on a narrow Gemma 2 (12 layers, the CPU playing the
    device): the tensor peak and the host copies. The forward's phase peak is 5-6 % over the estimate, as
    it is without offloading (the torch fold's boolean masks and eager soft-capped attention on the CPU)."""
    from vramplan.validate.matrix import Case, run_case
    from vramplan.validate.objectives import DEEP_SHRINK, OFFLOAD_TRL

    setup = next(s for s in OFFLOAD_TRL if s.method == method and s.quant in ("none", "nf4") and s.grad_accum == 1
                 and not s.liger)
    rows = {r.quantity: r for r in run_case(Case("activation_offload", "google/gemma-2-2b", setup, "trl-cpu",
                                                 shrink=dict(DEEP_SHRINK)))}
    err = {q: r.estimated_bytes / r.traced_bytes - 1 for q, r in rows.items()}
    assert abs(err["tensor_peak_bytes"]) <= 0.03 and abs(err["host_bytes"]) <= 0.01, err
    assert abs(err["forward_peak_bytes"]) <= 0.06, err


def test_liger_under_trls_fused_head_is_modelled_and_its_final_norm_saves_its_16_bit_input():
    """TRL's use_liger_kernel applies Liger's layer kernels and keeps its own fused head (trl/trainer/sft_trainer.py
    sets fused_linear_cross_entropy False), so the head still runs under the manager's NoOpManager. What the
    final norm hands the manager is LigerRMSNormFunction's X (16-bit), its weight (kept) and a fp32 rstd a row,
    where transformers' RMSNorm saves its fp32 input and rsqrt: the host holds 2 bytes a hidden unit less a token."""
    llama = load_model(LLAMA)
    trl = OFF.replace(method="lora", framework="trl", loss="trl")
    liger = trl.replace(liger=True)
    assert host_bytes(llama, trl) - host_bytes(llama, liger) == 2 * llama.hidden_size * trl.tokens
    assert estimate(llama, liger.replace(method="qlora")).host_bytes > 0  # TRL's quantized base too


def test_the_plan_takes_liger_and_offloading_together_under_trl():
    """On a 12 GB card at 16k tokens TRL's plan (the card's calibration, as the command applies it) runs Liger's
    kernels and the offloading together: tight either way, and at the same speed the two take 0.4 GiB less than
    offloading alone (search/rank.py roomiest: a tight plan trades up to 10 % of speed for headroom)."""
    import vramplan
    from vramplan.estimator.corrections import calibration_for

    corrections, _ = calibration_for("rtx-3060-12gb")
    p = vramplan.plan("llama-3.1-8b", "rtx-3060-12gb", seq=16384, framework="trl", corrections=corrections)
    assert p.fits and p.setup.liger and p.setup.activation_offload
    alone = vramplan.plan("llama-3.1-8b", "rtx-3060-12gb", seq=16384, framework="trl", corrections=corrections,
                          liger=False)
    assert alone.setup.activation_offload and alone.breakdown.device_total_bytes > p.breakdown.device_total_bytes
    assert p.tokens_per_s >= alone.tokens_per_s / 1.1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["qlora", "lora", "full"])
def test_liger_under_trls_head_and_offloading_meets_sftrainers_real_step(method):
    """SFTTrainer's real step with TRL's manager and Liger's layer kernels (their stand-ins, vramplan/run/liger.py)
    on 12 narrow Llama layers: the tensor peak within 1 % (+0.7..+0.9 %), the host copies -0.1 %."""
    from vramplan.validate.matrix import Case, run_case
    from vramplan.validate.objectives import DEEP_SHRINK, OFFLOAD_TRL

    setup = next(s for s in OFFLOAD_TRL if s.liger and s.method == method)
    rows = {r.quantity: r for r in run_case(Case("activation_offload", "meta-llama/Llama-3.1-8B", setup, "trl-cpu",
                                                 shrink=dict(DEEP_SHRINK)))}
    err = {q: r.estimated_bytes / r.traced_bytes - 1 for q, r in rows.items()}
    assert abs(err["tensor_peak_bytes"]) <= 0.015 and abs(err["host_bytes"]) <= 0.005, err
    assert abs(err["forward_peak_bytes"]) <= 0.025, err
