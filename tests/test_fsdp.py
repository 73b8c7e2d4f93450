"""PyTorch FSDP and DDP: the Setup knob, the per-rank estimate, and the real N-process truth.

The truth (vramplan/truths/fsdp.py) launches N CPU processes (gloo) on the tiny Llama the ZeRO truth
uses, wraps it as accelerate does (FSDP1 with the emitted plugin values; DDP with accelerate's
defaults), runs the canonical step twice and counts each rank's live tensors, FSDP's CPU-offloaded
ones apart. One 2-rank launch runs every setup (about 25 s on 2 cores); the 1/2/4-rank matrix is
`vramplan validate --knob fsdp --knob ddp` and benchmarks/fsdp_accuracy.py.
"""

from __future__ import annotations

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner
from conftest import selected, selected_params

from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.estimator.fsdp import fsdp_memory
from vramplan.model.profiles import load_model
from vramplan.specs import Setup, SpecError

MODEL = "meta-llama/Llama-3.1-8B"
TOLERANCE = 0.05  # every knob's bar (the distributed bar is 10%)


# ----------------------------------------------------------------------------------------------
# the Setup knob


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"fsdp": "full_shard", "zero_stage": 2}, "ZeRO or FSDP, not both"),
    ({"fsdp": "full_shard", "offload_params": "nvme"}, "FSDP offloads to CPU only"),
    ({"fsdp": "full_shard", "offload_optimizer": "cpu"}, "use --offload-params cpu"),
    ({"fsdp": "hybrid"}, "fsdp must be one of"),
    ({"offload_params": "cpu"}, "or --fsdp full_shard for FSDP"),
    # what torch 2.13's FSDP1 cannot run (each seen in vramplan.truths.fsdp)
    ({"fsdp": "full_shard", "method": "lora", "quant": "int8"}, "Cannot flatten integer dtype tensors"),
    ({"fsdp": "full_shard", "method": "qlora", "precision": "bf16-mixed"}, "element by element"),
    ({"fsdp": "shard_grad_op", "method": "qlora"}, "changing the parameters between forward and backward"),
])
def test_invalid_fsdp_setups_say_why(kw, fragment):
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Setup(**kw, gpus=2)


def test_fsdp_cpu_offload_steps_the_optimizer_on_the_host():
    s = Setup(fsdp="full_shard", offload_params="cpu", gpus=2)
    assert s.offload_optimizer == "cpu"
    assert Setup.from_dict(s.to_dict()) == s
    assert Setup().fsdp == "none"


def test_cli_flag_and_its_errors():
    ok = CliRunner().invoke(main, ["estimate", MODEL, "--gpus", "8", "--fsdp", "full_shard", "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"fsdp": "full_shard"' in ok.output
    bad = CliRunner().invoke(main, ["estimate", MODEL, "--gpus", "2", "--fsdp", "shard_grad_op", "--zero", "3"])
    assert_user_error(bad, "not both")


# ----------------------------------------------------------------------------------------------
# the estimate


def test_sharding_divides_the_model_states():
    m = load_model(MODEL)
    peaks = {n: estimate(m, Setup(fsdp="full_shard", gpus=n)) for n in (1, 2, 8)}
    assert peaks[1].tensor_peak_bytes > peaks[2].tensor_peak_bytes > peaks[8].tensor_peak_bytes
    # pure bf16 (accelerate mixed_precision "no"): the bf16 parameters sharded as loaded, their
    # AdamW states bf16 too: 2 + 4 bytes/param over 8 ranks
    assert peaks[8].component("weights") == pytest.approx(2 * m.params_total / 8, rel=1e-3)
    assert peaks[8].component("optimizer_states") == pytest.approx(4 * m.params_total / 8, rel=1e-3)
    # bf16 MixedPrecision: fp32 masters (accelerate upcasts trainable flat parameters), 4 + 8
    mixed = estimate(m, Setup(fsdp="full_shard", gpus=8, precision="bf16-mixed"))
    assert mixed.component("weights") == pytest.approx(4 * m.params_total / 8, rel=1e-3)
    assert mixed.component("optimizer_states") == pytest.approx(8 * m.params_total / 8, rel=1e-3)
    # accumulation (accelerate's no_sync): every unit's unsharded 16-bit gradient stays on the device
    ga = estimate(m, Setup(fsdp="full_shard", gpus=8, grad_accum=4))
    assert ga.phase_peaks_bytes["forward"] - peaks[8].phase_peaks_bytes["forward"] == 2 * m.params_total
    # NO_SHARD keeps everything whatever the ranks; FULL_SHARD on one rank is NO_SHARD
    no = [estimate(m, Setup(fsdp="no_shard", gpus=n)).tensor_peak_bytes for n in (2, 8)]
    assert no[0] == no[1] == peaks[1].tensor_peak_bytes
    # SHARD_GRAD_OP keeps the gathered layers from forward to backward
    sgo = estimate(m, Setup(fsdp="shard_grad_op", gpus=8))
    assert sgo.tensor_peak_bytes > peaks[8].tensor_peak_bytes


def test_cpu_offload_moves_shards_grads_and_states_to_the_host():
    m = load_model(MODEL)
    on = estimate(m, Setup(fsdp="full_shard", gpus=8))
    off = estimate(m, Setup(fsdp="full_shard", gpus=8, offload_params="cpu"))
    fm = fsdp_memory(m, Setup(fsdp="full_shard", gpus=8))
    assert off.host_bytes == fm.shards + fm.grad_shards + fm.states + fm.step
    assert off.tensor_peak_bytes < on.tensor_peak_bytes
    assert off.component("weights") == 0 and off.component("fsdp_gathered") == on.component("fsdp_gathered")


def test_ddp_keeps_a_bucket_copy_of_the_gradients():
    m = load_model(MODEL)
    one, ddp = estimate(m, Setup()), estimate(m, Setup(gpus=4))
    assert ddp.component("ddp_buckets") == one.component("gradients")
    assert ddp.phase_peaks_bytes["optimizer"] - one.phase_peaks_bytes["optimizer"] == one.component("gradients")
    lora = estimate(m, Setup(method="lora", gpus=4))
    assert lora.component("ddp_buckets") == lora.component("gradients")  # fp32 adapter gradients only


def test_8bit_adamw_states_follow_the_shard_slices():
    """8-bit AdamW steps each original parameter's slice of the rank's shard: uint8 states and
    block scales, but two fp32 states for the embedding's slice (the HF Trainer's override)."""
    m = load_model(MODEL)
    fm = fsdp_memory(m, Setup(fsdp="full_shard", gpus=8, optimizer="adamw-8bit"))
    embed = sum(n for name, n in m.other_params if name == "embed_tokens")
    root = 2 * embed + m.hidden_size  # embeddings, final norm, untied head: one unit, 8 slices
    # the fullest rank: its root slice all embedding (fp32 states), its layer slices 8-bit
    assert fm.states == pytest.approx((8 * root + 2 * (1 + 4 / 256) * (m.params_total - root)) / 8, rel=0.01)
    lora = fsdp_memory(m, Setup(fsdp="full_shard", gpus=8, method="lora", optimizer="adamw-8bit"))
    assert 0 < lora.states < fsdp_memory(m, Setup(fsdp="full_shard", gpus=8, method="lora")).states


def test_qlora_shards_the_packed_weights_and_keeps_the_quant_states():
    m = load_model(MODEL)
    q = {n: fsdp_memory(m, Setup(fsdp="full_shard", gpus=n, method="qlora")) for n in (2, 8)}
    lora = fsdp_memory(m, Setup(fsdp="full_shard", gpus=8, method="lora"))
    assert q[8].layer < lora.layer / 3  # a gathered layer: 4-bit packed weights, 16-bit norms
    assert q[8].shards < q[2].shards < 2 * q[8].shards * 4  # quant states whole on every rank
    assert q[2].shards - 4 * q[8].shards < 0  # (and the sharded part shrinks with the ranks)


def test_lora_unsharded_on_tied_embeddings_warns_and_is_not_planned():
    """torch 2.13's FSDP1 fails NO_SHARD (or one rank) + peft LoRA + tied embeddings (plain torch
    FSDP too): estimate says so; the search does not propose it; untied models run (verified)."""
    import vramplan
    from vramplan.truths.tiny import tiny_model

    tied, untied = tiny_model(), tiny_model(base="meta-llama/Llama-3.1-8B")
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    for s in (Setup(fsdp="no_shard", gpus=2, method="lora"), Setup(fsdp="full_shard", gpus=1, method="qlora")):
        assert any("_use_unsharded_views" in n for n in estimate(tied, s).notes)
        assert not any("_use_unsharded_views" in n for n in estimate(untied, s).notes)
    assert not any("_use_unsharded_views" in n
                   for n in estimate(tied, Setup(fsdp="full_shard", gpus=2, method="lora")).notes)
    plan = vramplan.plan(tied, "a100-80gb", gpus=2, zero_stage=0, method="lora")
    setups = [plan.setup] + [a.setup for a in plan.alternatives]
    assert not any(s.fsdp == "no_shard" for s in setups)


def test_emitted_qlora_under_fsdp_skips_kbit_preparation():
    from vramplan.emit import render
    from vramplan.emit.common import TRAIN_SCRIPT
    from vramplan.specs import Plan

    m = load_model(MODEL)
    setup = Setup(fsdp="full_shard", gpus=2, method="qlora")
    script = render(Plan(model=m.name, setup=setup, breakdown=estimate(m, setup)), ["trainer"])[TRAIN_SCRIPT]
    assert "'fsdp': 'full_shard'" in script and "'quant_storage': 'bfloat16'" in script
    assert 'if quant is not None and "fsdp" not in PLAN:' in script


# ----------------------------------------------------------------------------------------------
# the plan search


def test_plan_weighs_fsdp_against_zero_on_several_gpus():
    import vramplan
    from vramplan.search import savers_text

    free = vramplan.plan(MODEL, "a100-80gb", gpus=8)
    fixed = vramplan.plan(MODEL, "a100-80gb", gpus=8, fsdp="full_shard")
    assert fixed.fits and fixed.setup.fsdp == "full_shard" and fixed.setup.zero_stage == 0
    assert all("FSDP FULL_SHARD" in r.reason for r in fixed.rejected)
    # FSDP is in the free search's space: at the same method it never beats the free plan
    assert fixed.setup.method != free.setup.method or free.tokens_per_s >= fixed.tokens_per_s * 0.999
    lines = [savers_text(a.setup) for a in fixed.alternatives] + [savers_text(fixed.setup)]
    assert all("FSDP" in line for line in lines), lines
    one = vramplan.plan(MODEL, "a100-80gb", zero_stage=0)  # one GPU: FSDP only when asked for
    assert one.setup.fsdp == "none" and all(a.setup.fsdp == "none" for a in one.alternatives)


def test_plan_cli_fsdp_flag():
    ok = CliRunner().invoke(main, ["plan", MODEL, "--gpu", "a100-80gb", "--gpus", "8", "--fsdp", "shard_grad_op",
                                   "--method", "lora", "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"fsdp": "shard_grad_op"' in ok.output
    bad = CliRunner().invoke(main, ["plan", MODEL, "--gpu", "a100-80gb", "--gpus", "8", "--fsdp", "full_shard",
                                    "--zero", "3"])
    assert_user_error(bad, "not both")


# ----------------------------------------------------------------------------------------------
# the emitted accelerate config is what the truth runs


def test_emitted_fsdp_config_is_what_the_truth_wraps(tmp_path, monkeypatch):
    """The YAML loads in accelerate; the FSDP plugin `accelerate launch` builds from it has the
    strategy, offload, wrap policy and prefetch that vramplan.truths.fsdp wraps the model with."""
    pytest.importorskip("accelerate")
    import dataclasses

    import accelerate.utils.dataclasses as acc_dc
    import torch
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    from vramplan.emit import render
    from vramplan.emit.common import ACCELERATE_CONFIG
    from vramplan.specs import Plan
    from vramplan.truths.fsdp import _fsdp_plugin, _mixed_precision

    m = load_model(MODEL)
    # the plugin looks for an accelerator device when sync_module_states is on (emitted: on)
    monkeypatch.setattr(acc_dc, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for setup in (Setup(fsdp="full_shard", gpus=4), Setup(fsdp="shard_grad_op", gpus=2, offload_params="cpu"),
                  Setup(fsdp="no_shard", gpus=2, method="lora"),
                  Setup(fsdp="full_shard", gpus=2, precision="bf16-mixed")):
        plan = Plan(model=m.name, setup=setup, breakdown=estimate(m, setup))
        path = tmp_path / ACCELERATE_CONFIG
        path.write_text(render(plan, ["accelerate"])[ACCELERATE_CONFIG])
        args, _, _ = _validate_launch_command(
            launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
        assert args.use_fsdp and args.num_processes == setup.gpus
        env = prepare_multi_gpu_env(args)
        # pure bf16 runs without a MixedPrecision policy (16-bit shards), bf16-mixed with one
        assert env["ACCELERATE_MIXED_PRECISION"] == _mixed_precision(setup) == (
            "bf16" if setup.precision == "bf16-mixed" else "no")
        for k, v in env.items():
            if k.startswith(("FSDP_", "ACCELERATE_")):
                monkeypatch.setenv(k, v)
        launched = FullyShardedDataParallelPlugin()
        truth = _fsdp_plugin(setup, None)
        assert launched.fsdp_version == truth.fsdp_version == 1
        for field in ("sharding_strategy", "backward_prefetch", "use_orig_params", "cpu_offload"):
            assert getattr(launched, field) == getattr(truth, field), field
        assert launched.auto_wrap_policy == truth.auto_wrap_policy  # the policy's name until prepare
        assert dataclasses.asdict(launched.cpu_offload) == {"offload_params": setup.offload_params == "cpu"}


# ----------------------------------------------------------------------------------------------
# the truth: one 2-rank launch


pytest.importorskip("torch")
from vramplan.truths.fsdp import UNVERIFIED, compare_setups  # noqa: E402 (after the importorskip)
from vramplan.truths.tiny import TINY_SEQ  # noqa: E402

N2 = [{"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"}, {"fsdp": "no_shard"},
      {"fsdp": "full_shard", "offload_params": "cpu"}, {"fsdp": "full_shard", "method": "lora"},
      {"fsdp": "full_shard", "grad_accum": 2}, {"fsdp": "full_shard", "method": "qlora"},
      {"fsdp": "full_shard", "optimizer": "adamw-8bit"}, {"fsdp": "full_shard", "precision": "fp16-mixed"},
      {"fsdp": "full_shard", "precision": "bf16-mixed"}, {}]


#: the fast tier's cases: the ones test_sharding_shows_in_the_truth compares, and DDP (the rest:
#: `pytest -m slow`)
FAST = [{"fsdp": "full_shard"}, {"fsdp": "shard_grad_op"}, {"fsdp": "no_shard"},
        {"fsdp": "full_shard", "offload_params": "cpu"}, {"fsdp": "full_shard", "precision": "bf16-mixed"}, {}]


@pytest.fixture(scope="module")
def measured(request):
    """One 2-rank launch of the cases this session runs (test_sharding_shows_in_the_truth's among them)."""
    wanted = selected_params(request, "test_estimate_matches_every_rank", "kw")
    if selected(request, "test_sharding_shows_in_the_truth"):
        wanted += FAST
    kws = [kw for kw in N2 if kw in wanted]
    setups = [Setup(**kw, gpus=2, seq=TINY_SEQ) for kw in kws]
    return {tuple(sorted(kw.items())): pair for kw, pair in zip(kws, compare_setups(setups, 2), strict=True)}


@pytest.mark.parametrize("kw", [kw if kw in FAST else pytest.param(kw, marks=pytest.mark.slow) for kw in N2],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "ddp")
def test_estimate_matches_every_rank(measured, kw):
    run, est = measured[tuple(sorted(kw.items()))]
    assert run.wrapper == ("FullyShardedDataParallel" if kw.get("fsdp") else "DistributedDataParallel")
    for rank in run.ranks:
        err = est.tensor_peak_bytes / rank.device_bytes - 1
        assert abs(err) <= TOLERANCE, (kw, rank, est.phase_peaks_bytes, f"{err:+.1%}")
    if kw.get("offload_params") == "cpu":
        host = max(r.host_bytes for r in run.ranks)
        assert host > 0 and abs(est.host_bytes / host - 1) <= TOLERANCE, (host, est.host_bytes)
    else:
        assert all(r.host_bytes == 0 for r in run.ranks)


def test_sharding_shows_in_the_truth(measured):
    """What the estimate's formulas rest on, seen in the real run: FULL_SHARD < SHARD_GRAD_OP <
    NO_SHARD per rank, and offload takes the shards off the device."""
    peak = {k: pair[0].worst.device_bytes for k, pair in measured.items()}
    full, sgo, no = (peak[(("fsdp", s),)] for s in ("full_shard", "shard_grad_op", "no_shard"))
    assert full < sgo < no
    assert peak[(("fsdp", "full_shard"), ("offload_params", "cpu"))] < full
    # pure bf16 (no policy) shards the bf16 parameters as loaded; bf16 MixedPrecision upcasts them
    # to fp32 masters (shards, gradients and AdamW states twice the bytes)
    run = {k: pair[0] for k, pair in measured.items()}
    pure, mixed = run[(("fsdp", "full_shard"),)], run[(("fsdp", "full_shard"), ("precision", "bf16-mixed"))]
    assert mixed.worst.device_bytes > pure.worst.device_bytes * 1.2


def test_unverified_cases_say_why():
    assert {knob for knob, *_ in UNVERIFIED} == {"fsdp"}
    assert all(len(why) > 40 for *_, why in UNVERIFIED)
