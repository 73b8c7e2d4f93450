"""Context parallelism (``--cp N``, issue 17): refused by the estimate, with why, until the ring
attention's buffers are modelled; what this CPU machine can and cannot run of it (the probe), and the
N-rank truth (vramplan.run.cp_truth) that a modelling change will be checked against."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_model
from vramplan.cli import main as cli
from vramplan.specs import SpecError

CP2 = {"cp": 2, "gpus": 2, "fsdp": "full_shard", "fsdp_version": 2}


@pytest.mark.parametrize("kw", [CP2, {"cp": 2, "gpus": 2}, {**CP2, "method": "lora", "checkpointing": True}])
def test_estimate_refuses_cp_with_why(kw):
    with pytest.raises(SpecError, match=r"context parallelism .* not modelled yet: .*ring attention.*run\.cp_truth"):
        estimate(load_model("llama-3.2-1b"), Setup(**kw))


def test_cli_refuses_cp_in_one_line():
    from cli_helpers import assert_user_error

    r = CliRunner().invoke(cli, ["estimate", "llama-3.2-1b", "--cp", "2", "--gpus", "2", "--fsdp", "full_shard",
                                 "--fsdp-version", "2", "--gpu", "rtx-4090"])
    assert_user_error(r, "context parallelism", "not modelled yet", "--cp")


def test_cp1_is_the_default_step():
    model = load_model("llama-3.2-1b")
    assert estimate(model, Setup(cp=1, seq=512)).tensor_peak_bytes == estimate(model, Setup(seq=512)).tensor_peak_bytes


def test_probe_cpu_sdpa_refused_by_torch_ring_runs_with_cpu_flash():
    """What the truth's CPU stand-in rests on, on 2 gloo ranks: torch 2.13's CP dispatch refuses CPU
    SDPA (so the stand-in is needed; when a torch release accepts it, this fails and the stand-in
    can go), torch's own ring with the CPU flash kernel per block gives unsharded SDPA's gradients,
    and the truth's counter counts a functional all-gather's buffer once."""
    from vramplan.run.cp_truth import probe

    ranks = probe(world=2)
    for r in ranks:
        assert "_scaled_dot_product_flash_attention_for_cpu" in r["refused"], r
        assert "sharding strategy" in r["refused"], r
        assert r["grad_err"] < 1e-4, r
        assert r["gather_counted"] == r["gather_bytes"], r


@pytest.mark.slow
def test_truth_two_ranks_runs_the_ring_on_half_the_sequence():
    """accelerate's FSDP2 + CP on 2 gloo ranks: every attention call ran the ring on the local half
    (2 layers x 2 steps), and each rank's peak is above FSDP2's estimate at half the sequence (what
    CP adds: the ring's buffers, the Trainer's shift_labels and position_ids) by less than a fifth.
    Measured 842,748 / 838,396 B against 789,568 B (backward) at seq 64 on the tiny Llama."""
    from vramplan.run.cp_truth import run_cp
    from vramplan.run.tiny import tiny_config, tiny_model

    (run,) = run_cp(tiny_config(), [Setup(**CP2, seq=64)], world=2, seq=64)
    assert run.ring_seqs == (32, 32, 32, 32)
    half = estimate(tiny_model(), Setup(fsdp="full_shard", fsdp_version=2, gpus=2, seq=32))
    for rank in run.ranks:
        assert rank.phase == "backward"
        assert 1.0 < rank.device_bytes / half.phase_peaks_bytes["backward"] < 1.2, rank
