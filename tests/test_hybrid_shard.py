"""Hybrid sharding (HSDP, ``Setup.dp_replicate``): FSDP shards within groups of gpus / dp_replicate
GPUs and replicates across dp_replicate groups. The knob and its refusals, the per-rank estimate
(vramplan/estimator/hybrid_shard.py), the cost of the all-reduce across replicas, the emitted and
read accelerate configs (loaded with accelerate 1.15's own launcher), and the real 4-rank truth
(vramplan/truths/hsdp_truth.py: a 2 x 2 mesh; the full matrix is ``vramplan validate --knob hybrid_shard``).
"""

from __future__ import annotations

import pytest
import yaml
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.estimator import estimate
from vramplan.model.profiles import load_gpu, load_model
from vramplan.specs import Plan, Setup, SpecError

MODEL = "meta-llama/Llama-3.1-8B"
TOLERANCE = 0.05


def _hsdp(**kw) -> Setup:
    return Setup(**({"fsdp": "full_shard", "gpus": 8, "dp_replicate": 2} | kw))


# ----------------------------------------------------------------------------------------------
# the knob


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"fsdp": "none"}, "use --fsdp full_shard or shard_grad_op"),
    ({"fsdp": "no_shard"}, "use --fsdp full_shard or shard_grad_op"),
    ({"gpus": 6, "dp_replicate": 4}, "groups of 2 or more GPUs"),
    ({"gpus": 4, "dp_replicate": 4}, "groups of 2 or more GPUs"),
    ({"dp_replicate": 0}, "dp_replicate must be a positive integer"),
])
def test_a_setup_that_cannot_be_hybrid_is_refused_in_one_line(kw, fragment):
    with pytest.raises(SpecError, match=fragment) as err:
        _hsdp(**kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("kw", "flags", "fragment"), [
    ({"offload_params": "cpu"}, ["--offload-params", "cpu"], "CPU offload"),
    ({"method": "qlora", "precision": "bf16"}, ["--method", "qlora"], "FSDP1 hybrid sharding"),
    ({"fsdp_version": 2, "optimizer": "adamw-8bit"}, ["--fsdp-version", "2", "--optimizer", "adamw-8bit"],
     "--optimizer adamw-8bit"),
])
def test_what_hybrid_sharding_does_not_model_is_refused(kw, flags, fragment):
    m = load_model(MODEL)
    with pytest.raises(SpecError, match=fragment):
        estimate(m, _hsdp(**kw))
    r = CliRunner().invoke(main, ["estimate", MODEL, "--fsdp", "full_shard", "--gpus", "8", "--dp-replicate", "2",
                                  *flags])
    assert_user_error(r, fragment)


def test_the_cli_refuses_a_bad_group_size_in_one_line():
    r = CliRunner().invoke(main, ["estimate", MODEL, "--fsdp", "full_shard", "--gpus", "6", "--dp-replicate", "4"])
    assert_user_error(r, "groups of 2 or more GPUs")


# ----------------------------------------------------------------------------------------------
# the estimate


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kw", [{}, {"method": "lora"}, {"fsdp": "shard_grad_op"}, {"checkpointing": True}])
def test_a_rank_holds_what_fsdp_over_its_shard_group_holds(version, kw):
    """Without a MixedPrecisionPolicy each rank holds exactly FSDP's per-rank bytes on S = gpus / R
    ranks: shards, gathers and reduce-scatters within the group; the all-reduce is in place."""
    m = load_model(MODEL)
    hybrid = estimate(m, _hsdp(fsdp_version=version, **kw))
    group = estimate(m, _hsdp(fsdp_version=version, gpus=4, dp_replicate=1, **kw))
    flat = estimate(m, _hsdp(fsdp_version=version, dp_replicate=1, **kw))
    assert hybrid.tensor_peak_bytes == group.tensor_peak_bytes
    assert hybrid.phase_peaks_bytes == group.phase_peaks_bytes
    assert hybrid.tensor_peak_bytes > flat.tensor_peak_bytes  # sharded over 4, not 8


def test_fsdp2_hsdp_holds_every_groups_16_bit_reduce_output_to_the_end_of_the_backward():
    """torch 2.13 foreach_reduce: under bf16 MixedPrecisionPolicy the all-reduce runs on the 16-bit
    reduce-scatter output, which FSDPParamGroup._all_reduce_state keeps until finalize_backward."""
    from vramplan.estimator.fsdp2 import fsdp2_memory
    from vramplan.estimator.hybrid_shard import held_reduce_bytes

    m = load_model(MODEL)
    mixed = _hsdp(fsdp_version=2, precision="bf16-mixed")
    fm, plain = fsdp2_memory(m, mixed), fsdp2_memory(m, mixed.replace(gpus=4, dp_replicate=1))
    # the held 16-bit output is half the fp32 gradient shard, per group
    assert fm.ar_held * 2 == fm.layer_grad_shard and plain.ar_held == 0
    assert fm.ar_held_end > m.num_layers * fm.ar_held and fm.shards == plain.shards  # + the tail group's
    assert held_reduce_bytes(_hsdp(fsdp_version=2), 100) == 0  # bf16 shards: gradients are views of it
    assert held_reduce_bytes(_hsdp(fsdp_version=1, precision="bf16-mixed"), 100) == 0  # FSDP1: in place
    short = mixed.replace(seq=16)  # the end of the backward is the peak
    est = estimate(m, short)
    got = est.phase_peaks_bytes["backward"]
    assert got - estimate(m, short.replace(gpus=4, dp_replicate=1)).phase_peaks_bytes["backward"] == fm.ar_held_end
    held = next(c for c in est.components if c.name == "hsdp_reduce_held")
    assert held.bytes == fm.ar_held_end and held.phases == ("backward",) and "_all_reduce_state" in held.note


def test_the_all_reduce_across_replicas_is_priced_and_the_gathers_stay_in_the_node():
    from vramplan.cost import model as cost
    from vramplan.estimator.hybrid_shard import replica_bytes, shard_nodes

    m = load_model(MODEL)
    gpu = load_gpu("a100-80gb")
    flat, hybrid = Setup(fsdp="full_shard", gpus=16), _hsdp(gpus=16)
    k = cost.counts(m, flat)
    assert replica_bytes(k.trainable_params, flat) == 0
    # 2 replicas of 8: each rank all-reduces its 1/8 shard (bf16), a ring of 2 moves 2 (R-1)/R of it
    assert replica_bytes(k.trainable_params, hybrid) == pytest.approx(k.trainable_params / 8 * 2)
    assert shard_nodes(hybrid, 2) == 1 and shard_nodes(flat, 2) == 2
    slow, fast = (cost.step_cost(m, s, gpu, nodes=2) for s in (flat, hybrid))
    assert fast.comm_s < slow.comm_s  # gathers over NVLink within the node, one shard across the network
    # with no network to save, hybrid sharding only adds its all-reduce (per optimizer step)
    sgo = Setup(fsdp="shard_grad_op", gpus=8)
    one, two = (cost.comm_s(s, gpu, 1, k) for s in (sgo.replace(gpus=4), sgo.replace(dp_replicate=2)))
    assert two[0] == one[0] and two[1] == pytest.approx(one[1] + replica_bytes(k.trainable_params, sgo.replace(
        dp_replicate=2)) / cost.ring_bandwidth(gpu, 1))


# ----------------------------------------------------------------------------------------------
# emitted and read configs


def _launched(tmp_path, monkeypatch, plan):
    """The emitted accelerate config through accelerate 1.15's own launcher: (config, its env)."""
    import accelerate.utils.dataclasses as acc_dc
    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from vramplan.emit import render
    from vramplan.emit.common import ACCELERATE_CONFIG

    monkeypatch.setattr(acc_dc, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    text = render(plan, ["accelerate"])[ACCELERATE_CONFIG]
    path = tmp_path / ACCELERATE_CONFIG
    path.write_text(text)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    return yaml.safe_load(text), args, prepare_multi_gpu_env(args), path


def test_emitted_fsdp2_hsdp_config_builds_accelerates_2d_mesh_and_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.utils import ParallelismConfig

    from vramplan.readers import read_config

    m = load_model(MODEL)
    setup = _hsdp(fsdp_version=2, gpus=16)
    plan = Plan(model=m.name, setup=setup, breakdown=estimate(m, setup), nodes=2)
    cfg, args, env, path = _launched(tmp_path, monkeypatch, plan)
    assert cfg["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                         "parallelism_config_dp_shard_size": 8}
    assert args.use_fsdp and args.use_parallelism_config and args.num_processes == 16
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    for k, v in env.items():
        if k.startswith(("PARALLELISM_CONFIG_", "FSDP_")):
            monkeypatch.setenv(k, v)
    pc = ParallelismConfig()  # what Accelerator() builds from the launcher's environment
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 8) and pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    read = read_config(path)
    assert (read.setup.fsdp, read.setup.fsdp_version, read.setup.dp_replicate, read.gpus) == ("full_shard", 2, 2, 16)


@pytest.mark.parametrize(("fsdp", "strategy"), [("full_shard", "HYBRID_SHARD"),
                                                ("shard_grad_op", "HYBRID_SHARD_ZERO2")])
def test_emitted_fsdp1_hybrid_config_loads_as_torchs_hybrid_strategy_and_reads_back(tmp_path, monkeypatch, fsdp,
                                                                                    strategy):
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy

    from vramplan.readers import read_config

    m = load_model(MODEL)
    setup = _hsdp(gpus=16, fsdp=fsdp)
    plan = Plan(model=m.name, setup=setup, breakdown=estimate(m, setup), nodes=2)
    cfg, args, env, path = _launched(tmp_path, monkeypatch, plan)
    assert cfg["fsdp_config"]["fsdp_sharding_strategy"] == strategy and cfg["num_machines"] == 2
    assert "parallelism_config" not in cfg
    for k, v in env.items():
        if k.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(k, v)
    launched = FullyShardedDataParallelPlugin()
    assert launched.sharding_strategy == getattr(ShardingStrategy, "HYBRID_SHARD" if fsdp == "full_shard"
                                                 else "_HYBRID_SHARD_ZERO2")
    read = read_config(path)
    assert (read.setup.fsdp, read.setup.dp_replicate, read.gpus) == (fsdp, 2, 16)


def test_fsdp1_hybrid_needs_one_shard_group_per_node():
    from vramplan.emit import render

    m = load_model(MODEL)
    setup = _hsdp(gpus=16)
    with pytest.raises(SpecError, match="must equal the nodes"):
        render(Plan(model=m.name, setup=setup, breakdown=estimate(m, setup), nodes=1), ["accelerate"])


def test_a_one_node_hybrid_shard_reads_as_full_shard_and_says_so(tmp_path):
    from vramplan.readers import read_config

    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 8,
           "num_machines": 1, "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}}
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(acc))
    read = read_config(path)
    assert (read.setup.fsdp, read.setup.dp_replicate) == ("full_shard", 1)
    assert any("HYBRID_SHARD" in str(w.value) for w in read.warnings)


# ----------------------------------------------------------------------------------------------
# the truth: 4 gloo ranks as a 2 x 2 mesh


def test_what_validate_lists_as_unverified_the_estimate_refuses():
    from vramplan.truths.hsdp_truth import HSDP_UNVERIFIED, REPLICAS, WORLD
    from vramplan.truths.tiny import TINY_SEQ, tiny_model

    for kw, _why in HSDP_UNVERIFIED:
        with pytest.raises(SpecError):
            estimate(tiny_model(), Setup(**kw, gpus=WORLD, seq=TINY_SEQ, dp_replicate=REPLICAS))


@pytest.mark.parametrize("version", [2, pytest.param(1, marks=pytest.mark.slow)])  # HSDP2 in the fast tier
def test_hsdp_estimate_within_5_percent_of_every_rank(version):
    pytest.importorskip("accelerate")
    from vramplan.truths.hsdp_truth import HSDP1_MATRIX, HSDP2_MATRIX, run_launch
    from vramplan.truths.tiny import TINY_SEQ

    kws = (HSDP2_MATRIX[0], HSDP2_MATRIX[3]) if version == 2 else (HSDP1_MATRIX[0], HSDP1_MATRIX[2])
    for setup, worst, ranks, est in run_launch(version, TINY_SEQ, kws):
        for got in ranks:  # every rank holds the same padded shards
            assert abs(est.tensor_peak_bytes - got) <= TOLERANCE * got, (setup, ranks, est.tensor_peak_bytes)
        assert worst.phase == est.phase


def test_the_trainer_callback_reads_hybrid_sharding_off_accelerates_live_state():
    """VramplanCallback's setup (integrations/trainer_setup.py): FSDP2's ParallelismConfig replicas;
    FSDP1's HYBRID_SHARD on one node reads as FULL_SHARD, with a warning."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    from vramplan.integrations.trainer_setup import _accelerate_state
    from vramplan.readers.common import Mapped

    AcceleratorState._reset_state()
    try:
        state = Accelerator(cpu=True).state
        for st in (PartialState(), state):
            st.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        state.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=4)
        m = Mapped()
        _accelerate_state(m)
        assert (m.setup["fsdp"], m.setup["fsdp_version"], m.setup["dp_replicate"]) == ("full_shard", 2, 2)
        state.parallelism_config = None
        state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="HYBRID_SHARD")
        m = Mapped()
        _accelerate_state(m)
        assert m.setup["fsdp"] == "full_shard" and "dp_replicate" not in m.setup
        assert any("HYBRID_SHARD" in str(w.value) for w in m.warnings)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_plan_keeps_a_fixed_dp_replicate_and_emits_what_it_estimated():
    import vramplan
    from vramplan.emit import render
    from vramplan.emit.common import ACCELERATE_CONFIG

    fixed = vramplan.plan(MODEL, "a100-80gb", gpus=16, nodes=2, fsdp="full_shard", dp_replicate=2)
    assert fixed.fits and all(p.setup.dp_replicate == 2 for p in (fixed, *fixed.alternatives))
    assert all(p.setup.offload_params == "none" for p in (fixed, *fixed.alternatives))  # refused under HSDP
    assert fixed.breakdown.tensor_peak_bytes == estimate(load_model(MODEL), fixed.setup, fixed.gpu).tensor_peak_bytes
    cfg = yaml.safe_load(render(fixed, ["accelerate"])[ACCELERATE_CONFIG])
    assert cfg["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD" and cfg["num_machines"] == 2
    bad = CliRunner().invoke(main, ["plan", MODEL, "--gpu", "a100-80gb", "--gpus", "16", "--dp-replicate", "2"])
    assert_user_error(bad, "use --fsdp full_shard or shard_grad_op")
