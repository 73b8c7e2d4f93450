"""FSDP2 (torch 2.13 ``fully_shard``, accelerate 1.15 ``fsdp_version: 2``): the knob, the per-rank
estimate (vramplan/estimator/fsdp2.py), the emitted and read configs, and the real N-process truth
(vramplan/truths/fsdp2.py: gloo CPU ranks running accelerate's own FSDP2 prepare; the full 2/4-rank
matrix is ``vramplan validate --knob fsdp2``).
"""

from __future__ import annotations

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.model.profiles import load_model
from vramplan.specs import Setup, SpecError

MODEL = "meta-llama/Llama-3.1-8B"
TOLERANCE = 0.05


def _v2(**kw) -> Setup:
    return Setup(fsdp_version=2, **({"fsdp": "full_shard", "gpus": 2} | kw))


# ----------------------------------------------------------------------------------------------
# the knob


@pytest.mark.parametrize(("kw", "flags", "fragment"), [
    ({"fsdp": "no_shard"}, ["--fsdp", "no_shard"], "no NO_SHARD"),
    ({"gpus": 1}, ["--gpus", "1"], "one GPU"),
    ({"offload_params": "cpu"}, ["--offload-params", "cpu"], "CPUOffloadPolicy"),
    ({"optimizer": "adamw-8bit"}, ["--optimizer", "adamw-8bit"], "--optimizer adamw-8bit"),
    ({"liger": True}, ["--liger"], "--liger"),
    ({"loss": "chunked"}, ["--loss", "chunked"], "--loss"),
])
def test_what_fsdp2_does_not_model_is_refused_with_one_line(kw, flags, fragment):
    with pytest.raises(SpecError, match=fragment):
        estimate(load_model(MODEL), _v2(**kw))
    args = ["estimate", MODEL, "--fsdp-version", "2", "--fsdp", "full_shard", "--gpus", "2", *flags]
    assert_user_error(CliRunner().invoke(main, args), fragment)


def test_fsdp2_on_a_moe_model_is_refused():
    with pytest.raises(SpecError, match="mixture-of-experts"):
        estimate(load_model("mistralai/Mixtral-8x7B-v0.1"), _v2(method="lora"))


def test_fsdp_version_1_is_unchanged_and_2_differs_where_fully_shard_does():
    m = load_model(MODEL)
    one = estimate(m, Setup(fsdp="full_shard", gpus=8))
    assert one.tensor_peak_bytes == estimate(m, Setup(fsdp="full_shard", gpus=8, fsdp_version=1)).tensor_peak_bytes
    two = estimate(m, _v2(gpus=8))
    assert two.tensor_peak_bytes != one.tensor_peak_bytes
    # the states are sharded alike (both pad to the ranks); what differs is gathered and transient
    assert abs(two.tensor_peak_bytes - one.tensor_peak_bytes) < 0.25 * one.tensor_peak_bytes


def test_per_rank_states_shrink_with_the_ranks_and_reshard_after_forward_false_holds_every_layer():
    from vramplan.estimator.fsdp2 import fsdp2_memory

    m = load_model(MODEL)
    two, eight = fsdp2_memory(m, _v2(gpus=2)), fsdp2_memory(m, _v2(gpus=8))
    assert 3.9 < two.static / eight.static < 4.01
    full = estimate(m, _v2(gpus=8, checkpointing=True))
    sgo = estimate(m, _v2(gpus=8, checkpointing=True, fsdp="shard_grad_op"))
    # shard_grad_op (reshard_after_forward=False) keeps all L layers gathered: about L - 2 layers more
    layer = eight.layer
    assert sgo.tensor_peak_bytes - full.tensor_peak_bytes > (m.num_layers - 3) * layer


def test_shards_are_padded_per_parameter():
    """torch 2.13 FSDPParam: every rank holds ceil(d0 / N) rows of each parameter (chunk 0's size)."""
    from vramplan.estimator.fsdp2 import fsdp2_memory

    m = load_model(MODEL)  # 32 layers, k/v 1024 rows, vocab 128256
    fm3 = fsdp2_memory(m, _v2(gpus=3))
    # a flat (per-unit) split would hold ceil(params / 3); per parameter each pads on its own
    assert fm3.shards >= 2 * (m.params_total // 3)
    assert fm3.shards - 2 * (m.params_total // 3) < 2 * 3 * 4096 * (2 + 7 * 32)


# ----------------------------------------------------------------------------------------------
# the emitted accelerate config is what the truth prepares


def test_emitted_fsdp2_config_loads_in_accelerate_as_the_truth_prepares(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    import accelerate.utils.dataclasses as acc_dc
    import torch
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    from vramplan.emit import render
    from vramplan.emit.accelerate import MIXED_PRECISION
    from vramplan.emit.common import ACCELERATE_CONFIG
    from vramplan.specs import Plan
    from vramplan.truths.fsdp2 import fsdp2_plugin

    m = load_model(MODEL)
    monkeypatch.setattr(acc_dc, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for setup in (_v2(gpus=4), _v2(fsdp="shard_grad_op", method="lora"), _v2(precision="bf16-mixed")):
        plan = Plan(model=m.name, setup=setup, breakdown=estimate(m, setup))
        text = render(plan, ["accelerate"])[ACCELERATE_CONFIG]
        cfg = yaml.safe_load(text)["fsdp_config"]
        assert cfg["fsdp_version"] == 2 and "fsdp_sharding_strategy" not in cfg and "fsdp_use_orig_params" not in cfg
        path = tmp_path / ACCELERATE_CONFIG
        path.write_text(text)
        args, _, _ = _validate_launch_command(
            launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
        assert args.use_fsdp and args.num_processes == setup.gpus
        env = prepare_multi_gpu_env(args)
        assert env["ACCELERATE_MIXED_PRECISION"] == MIXED_PRECISION[setup.precision]
        for k, v in env.items():
            if k.startswith(("FSDP_", "ACCELERATE_")):
                monkeypatch.setenv(k, v)
        launched, truth = FullyShardedDataParallelPlugin(), fsdp2_plugin(setup)
        assert launched.fsdp_version == truth.fsdp_version == 2
        assert launched.reshard_after_forward is truth.reshard_after_forward is (setup.fsdp == "full_shard")
        assert launched.auto_wrap_policy == truth.auto_wrap_policy
        assert type(launched.cpu_offload) is type(truth.cpu_offload)


def test_readers_map_fsdp_version_2(tmp_path):
    import yaml

    from vramplan.readers import read_config

    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 4,
           "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                                      "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(acc))
    read = read_config(path)
    assert (read.setup.fsdp, read.setup.fsdp_version, read.gpus) == ("shard_grad_op", 2, 4)
    ax = {"base_model": MODEL, "sequence_len": 1024, "micro_batch_size": 1, "bf16": True, "fsdp_version": 2,
          "fsdp_config": {"reshard_after_forward": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump(ax))
    read = read_config(path, "axolotl")
    assert (read.setup.fsdp, read.setup.fsdp_version) == ("full_shard", 2)
    assert not any("fsdp_version" in w.field for w in read.warnings)


def test_axolotl_writer_writes_fsdp2_and_reads_back():
    from vramplan.emit.hf_configs import axolotl_config, refusal

    m = load_model(MODEL)
    for fsdp in ("full_shard", "shard_grad_op"):
        s = _v2(fsdp=fsdp, precision="bf16")
        assert refusal("axolotl", s, m) is None
        cfg = axolotl_config(s, m, model_id=MODEL)
        assert cfg["fsdp_version"] == 2 and cfg["fsdp_config"]["reshard_after_forward"] is (fsdp == "full_shard")
        assert "use_orig_params" not in cfg["fsdp_config"]
    assert refusal("axolotl", Setup(fsdp="shard_grad_op", gpus=2), m) is not None  # FSDP1: unchanged


def test_plan_searches_fsdp1_unless_fsdp2_is_fixed_and_emits_what_it_estimated():
    import yaml

    import vramplan
    from vramplan.emit import render
    from vramplan.emit.common import ACCELERATE_CONFIG

    free = vramplan.plan(MODEL, "a100-80gb", gpus=8, fsdp="full_shard")
    assert free.setup.fsdp_version == 1 and all(a.setup.fsdp_version == 1 for a in free.alternatives)
    fixed = vramplan.plan(MODEL, "a100-80gb", gpus=8, fsdp="full_shard", fsdp_version=2, method="lora")
    assert fixed.fits and all(p.setup.fsdp_version == 2 for p in (fixed, *fixed.alternatives))
    assert fixed.breakdown.tensor_peak_bytes == estimate(load_model(MODEL), fixed.setup,
                                                         fixed.gpu).tensor_peak_bytes
    cfg = yaml.safe_load(render(fixed, ["accelerate"])[ACCELERATE_CONFIG])
    assert cfg["fsdp_config"]["fsdp_version"] == 2 and cfg["num_processes"] == 8
    bad = CliRunner().invoke(main, ["plan", MODEL, "--gpu", "a100-80gb", "--gpus", "2", "--fsdp-version", "2"])
    assert_user_error(bad, "give a sharding strategy with --fsdp")


# ----------------------------------------------------------------------------------------------
# the truth: accelerate's real FSDP2 prepare on 2 gloo ranks


def test_fsdp2_estimate_within_5_percent_of_every_rank():  # the FSDP2 truth: the fast tier
    pytest.importorskip("accelerate")
    from vramplan.truths.fsdp2 import FSDP2_MATRIX, compare_setups
    from vramplan.truths.tiny import TINY_SEQ

    setups = [Setup(**kw, gpus=2, seq=TINY_SEQ, fsdp_version=2) for kw in FSDP2_MATRIX[:3]]
    for run, est in compare_setups(setups, 2):
        assert run.groups >= 3  # the layers, the tail (norm, head, tied embedding), the root
        for rank in run.ranks:  # every rank holds the same padded shards
            assert abs(est.tensor_peak_bytes - rank.device_bytes) <= TOLERANCE * rank.device_bytes, (run.setup, rank)
        assert run.worst.phase == est.phase == "forward"  # the loss, with the top layer's all-gather buffer


def test_what_validate_lists_as_unverified_the_estimate_refuses():
    from vramplan.truths.fsdp2 import FSDP2_UNVERIFIED
    from vramplan.truths.tiny import MOE_BASES, tiny_model

    for kw, why in FSDP2_UNVERIFIED:
        if "hybrid" in kw:  # not a Setup choice at all
            assert "HYBRID_SHARD" in why
            continue
        model = tiny_model(base=MOE_BASES[0]) if kw.get("moe") else tiny_model()
        with pytest.raises(SpecError):
            estimate(model, Setup(**{k: v for k, v in kw.items() if k != "moe"}, gpus=2, fsdp_version=2))


def test_the_trainer_callback_reads_an_fsdp2_plugin_with_cpu_offload():
    """VramplanCallback's setup (integrations/trainer_setup.py) off accelerate's live FSDP2 state:
    version, reshard_after_forward and a CPUOffloadPolicy (no ``offload_params`` field in FSDP2)."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from vramplan.integrations.trainer_setup import _accelerate_state
    from vramplan.readers.common import Mapped

    AcceleratorState._reset_state()
    try:
        state = Accelerator(cpu=True).state
        for st in (PartialState(), state):  # AcceleratorState() re-reads PartialState's
            st.distributed_type = DistributedType.FSDP
        for offload in (False, True):
            state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False,
                                                               cpu_offload=offload)
            m = Mapped()
            _accelerate_state(m)
            assert m.setup["fsdp"] == "shard_grad_op" and m.setup["fsdp_version"] == 2
            assert (m.setup.get("offload_params") == "cpu") is offload
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
