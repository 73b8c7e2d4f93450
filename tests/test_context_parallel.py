"""Context parallelism (``--cp N``, issue 17): the estimate (estimator/context_parallel.py: FSDP2 on
seq/cp tokens plus torch 2.13's ring buffers), what it still refuses and why, the CLI and the emitted
accelerate config; what this CPU machine can and cannot run of it (the probe), and the N-rank truth
(vramplan.truths.cp_truth) the estimate is checked against (``vramplan validate --knob cp``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_model
from vramplan.cli import main as cli
from vramplan.estimator.context_parallel import attention_floor, input_bytes, mask_bytes, ring_backward_bytes
from vramplan.specs import SpecError

CP2 = {"cp": 2, "gpus": 2, "fsdp": "full_shard", "fsdp_version": 2}
CP4 = {"cp": 4, "gpus": 4, "fsdp": "full_shard", "fsdp_version": 2}


def test_ring_buffers_are_torchs_on_llama_8b():
    """Llama-3.1-8B (32 heads, 8 KV heads, head_dim 128) at seq 32768 over cp 4: 8192 tokens per rank;
    q = 32 x 8192 x 128 and kv = 8 x 8192 x 128 elements. The ring's backward: fp32 accumulators
    4 (q + 2 kv), the dK/dV all-to-all's two fp32 flat buffers 16 kv, the all-gathered K/V of 4 ranks
    and two of this rank's concatenations 6 x 2 c kv (c = 2, bf16), the previous block's gradients
    c (q + 2 kv): K/V at their own head count (CUDA flash takes enable_gqa unrepeated)."""
    model = load_model("llama-3.1-8b")
    setup = Setup(**CP4, seq=32768, checkpointing=True)
    q, kv = 32 * 8192 * 128, 8 * 8192 * 128
    assert ring_backward_bytes(model, setup) == 4 * (q + 2 * kv) + 16 * kv + 24 * kv + 2 * (q + 2 * kv)
    assert attention_floor(model, setup) == ring_backward_bytes(model, setup) + 2 * q + 2 * (q + 2 * kv)
    assert mask_bytes(setup) == 8192 * 8192 and mask_bytes(setup.replace(checkpointing=False)) == 0
    assert input_bytes(setup) == 4 * 8 * 32768


def test_cp_rank_is_fsdp2_on_the_sequence_share_plus_the_ring():
    """One CP rank: every term of FSDP2 over all GPUs at seq/cp; the forward only the batch's buffers
    (and, checkpointed, the mask) above it; the backward at least that, more where a layer's attention
    backward is its peak (the tiny Llama checkpointed, as in its truth; on Llama-3.1-8B the loss's
    N x V gradients stay the backward's peak)."""
    from vramplan.truths.tiny import tiny_model

    for model, seq, kw in ((load_model("llama-3.1-8b"), 16384, {}),
                           (load_model("llama-3.1-8b"), 16384, {"method": "lora", "checkpointing": True, "batch": 2}),
                           (tiny_model(), 256, {"checkpointing": True})):
        setup = Setup(**CP4, seq=seq, **kw)
        cp, local = estimate(model, setup), estimate(model, Setup(**{**CP4, "cp": 1}, seq=seq // 4, **kw))
        assert cp.setup == setup and cp.per_rank == ()
        extra = input_bytes(setup) + mask_bytes(setup)
        assert cp.phase_peaks_bytes["forward"] == local.phase_peaks_bytes["forward"] + extra
        assert cp.phase_peaks_bytes["optimizer"] == local.phase_peaks_bytes["optimizer"]
        grown = cp.phase_peaks_bytes["backward"] - local.phase_peaks_bytes["backward"] - extra
        assert grown > 0 if model.vocab_size == 512 else grown == 0, grown
        names = {c.name: c.bytes for c in cp.components}
        assert names["cp_ring_backward"] == ring_backward_bytes(model, setup)
        assert ("cp_packed_mask" in names) == setup.checkpointing
        assert any("--cp 4" in n and "head count" in n for n in cp.notes)


def test_cp1_is_the_default_step():
    model = load_model("llama-3.2-1b")
    assert estimate(model, Setup(cp=1, seq=512)).tensor_peak_bytes == estimate(model, Setup(seq=512)).tensor_peak_bytes


@pytest.mark.parametrize(("model", "kw", "why"), [
    ("llama-3.2-1b", {"cp": 2, "gpus": 2}, r"under FSDP2 only .* --fsdp full_shard --fsdp-version 2"),
    ("llama-3.2-1b", {**CP2, "fsdp_version": 1}, r"under FSDP2 only"),
    ("llama-3.2-1b", {**CP2, "attn": "eager"}, r"eager attention: transformers 5.24's Trainer refuses it"),
    ("gemma-2-9b", {**CP2, "attn": "sdpa"}, r"sliding-window attention layers\): accelerate 1.15 refuses it"),
    ("llama-3.2-1b", {**CP2, "seq": 1022}, r"--seq 1022 does not divide by 2 x --cp \(4\)"),
    ("llama-3.2-1b", {**CP2, "method": "qlora"}, r"quantized base .* not modelled yet"),
    ("llama-3.2-1b", {**CP2, "precision": "fp32"}, r"fp32: CUDA flash attention takes 16-bit inputs only"),
    ("llama-3.2-1b", {**CP2, "pad_mask": True}, r"--pad-mask is not modelled yet"),
    ("llama-3.2-1b", {**CP2, "liger": True}, r"context parallelism with --liger is not modelled yet"),
])
def test_estimate_refuses_what_the_truth_does_not_run(model, kw, why):
    with pytest.raises(SpecError, match=why):
        estimate(load_model(model), Setup(**{"seq": 1024, **kw}))


def test_cli_refuses_cp_without_fsdp2_in_one_line():
    from cli_helpers import assert_user_error

    r = CliRunner().invoke(cli, ["estimate", "llama-3.2-1b", "--cp", "2", "--gpus", "2", "--gpu", "rtx-4090"])
    assert_user_error(r, "context parallelism", "FSDP2 only", "--fsdp-version 2")


def test_cli_estimate_cp_json():
    """``estimate --cp 4 --json``: the rank's numbers (every rank the same: no per_rank), the setup's cp and
    full seq, the ring's component."""
    r = CliRunner().invoke(cli, ["estimate", "llama-3.1-8b", "--cp", "4", "--gpus", "4", "--fsdp", "full_shard",
                                 "--fsdp-version", "2", "--seq", "32768", "--checkpointing", "--gpu", "h100-sxm",
                                 "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["setup"]["cp"] == 4 and got["setup"]["seq"] == 32768 and got["fits"] is True
    assert "per_rank" not in got or not got["per_rank"]
    want = estimate(load_model("llama-3.1-8b"), Setup(**CP4, seq=32768, checkpointing=True))
    assert got["tensor_peak_bytes"] == want.tensor_peak_bytes
    assert any(c["name"] == "cp_ring_backward" for c in got["components"])


def test_emitted_cp_config_loads_with_accelerate(tmp_path, monkeypatch):
    """The emitted accelerate YAML for --cp 2: accelerate 1.15's loader reads it, ``accelerate launch``
    turns its parallelism_config into PARALLELISM_CONFIG_* and accelerate's ParallelismConfig built from
    those is cp 2 (allgather, torch) over FSDP2 with dp_shard 1, as estimated."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    from vramplan.emit import emit_to_dir
    from vramplan.model.profiles import load_gpu
    from vramplan.specs import Plan

    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-4090")
    setup = Setup(**CP2, seq=4096, method="lora", checkpointing=True)
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), tmp_path / "o")
    path = tmp_path / "o" / "accelerate_config.yaml"
    assert "context parallel (cp 2)" in path.read_text()
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == "FSDP" and cfg.fsdp_config["fsdp_version"] == 2 and cfg.num_processes == 2
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "t.py"]))
    assert args.use_fsdp and args.use_parallelism_config
    env = prepare_extend_env_parallelism_config(args, {})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pc = ParallelismConfig()
    assert (pc.cp_size, pc.dp_shard_size, pc.tp_size, pc.dp_replicate_size, pc.cp_backend) == (2, 1, 1, 1, "torch")
    assert pc.cp_handler.cp_comm_strategy == "allgather"


def test_probe_cpu_sdpa_refused_by_torch_ring_runs_with_cpu_flash():
    """What the truth's CPU stand-in rests on, on 2 gloo ranks: torch 2.13's CP dispatch refuses CPU
    SDPA (so the stand-in is needed; when a torch release accepts it, this fails and the stand-in
    can go), torch's own ring with the CPU flash kernel per block gives unsharded SDPA's gradients,
    and the truth's counter counts a functional all-gather's buffer once."""
    from vramplan.truths.cp_truth import probe

    ranks = probe(world=2)
    for r in ranks:
        assert "_scaled_dot_product_flash_attention_for_cpu" in r["refused"], r
        assert "sharding strategy" in r["refused"], r
        assert r["grad_err"] < 1e-4, r
        assert r["gather_counted"] == r["gather_bytes"], r


def test_truth_two_ranks_meets_the_bar(monkeypatch):  # the CP truth at its smallest shape: the fast tier
    """accelerate's FSDP2 + CP on 2 gloo ranks (the quick rows of ``validate --knob cp``): every
    attention call ran the ring on the local half, and the estimate is within 5 % of the fullest rank
    (measured -1.6 % full, +0.4 % LoRA at seq 128 on the tiny Llama). One launch: the ring's local
    lengths are read off the runs cp_rows makes."""
    from vramplan.truths import cp_truth

    launches = []

    def run_cp(config, setups, world, seq, *args, **kwargs):
        runs = real(config, setups, world, seq, *args, **kwargs)
        launches.append((seq, runs))
        return runs

    real = cp_truth.run_cp
    monkeypatch.setattr(cp_truth, "run_cp", run_cp)
    rows = [r for r in cp_truth.cp_rows(quick=True) if r.verified]
    ((seq, runs),) = launches
    assert seq == 128 and len(runs) == 2
    for run in runs:  # 2 layers x 2 steps, each on half the sequence
        assert run.setup.cp == 2 and run.ring_seqs == (seq // 2,) * 4, run
    assert len(rows) == 2
    for row in rows:
        assert abs(row.estimated_bytes / row.truth_bytes - 1) <= 0.05, row


def test_cost_shares_the_sequence_and_adds_the_ring():
    """cost.step_cost of a CP rank: the sequence's compute over cp ranks (load-balanced causal
    attention), the ring's K/V all-gathers (forward, backward, the recompute) and fp32 dK/dV exchanges
    over the card's link, the tokens of gpus/cp groups; a 4090 (PCIe, no NVLink) pays more for it than
    an H100 (NVLink)."""
    from vramplan.cost.cp import ring_bytes_per_micro_step
    from vramplan.cost.model import ring_bandwidth, step_cost
    from vramplan.model.profiles import load_gpu

    model = load_model("llama-3.1-8b")
    setup = Setup(**CP4, seq=32768, checkpointing=True, method="lora")
    kv = 8192 * 8 * 128
    assert ring_bytes_per_micro_step(model, setup) == 32 * (3 * 3 * 2 * 2 * kv + 4 * 8 * kv)
    assert ring_bytes_per_micro_step(model, setup.replace(cp=1)) == 0
    for name in ("rtx-4090", "h100-sxm"):
        gpu = load_gpu(name)
        cp, whole = step_cost(model, setup, gpu), step_cost(model, setup.replace(cp=1), gpu)
        assert cp.compute_s == pytest.approx(whole.compute_s / 4) and cp.lora_s == pytest.approx(whole.lora_s / 4)
        assert cp.comm_s == pytest.approx(whole.comm_s + ring_bytes_per_micro_step(model, setup)
                                          / ring_bandwidth(gpu, 1))
        assert cp.tokens_per_step == whole.tokens_per_step // 4 == 32768
    assert load_gpu("rtx-4090").interconnect_gbps < load_gpu("h100-sxm").interconnect_gbps


def test_plan_takes_cp_for_a_sequence_fsdp2_cannot_hold():
    """``plan`` on 4 x RTX 4090: at seq 32768 LoRA of Llama-3.1-8B fits only with the sequence split
    (cp 4 over FSDP2); at seq 4096, where plain data parallelism fits, the ring is not worth it."""
    def planned(seq: int) -> dict:
        r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", str(seq),
                                     "--method", "lora", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    long = planned(32768)
    assert long["fits"] and long["setup"]["cp"] == 4 and long["setup"]["fsdp_version"] == 2
    layout = [n for n, k in zip(long["notes"], long["note_kinds"], strict=True) if k == "layout"]
    assert len(layout) == 1 and "context parallelism" in layout[0] and "does not fit" in layout[0], layout
    assert planned(4096)["setup"]["cp"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_emitted_cp_config_and_train_py_run_on_two_cpu_ranks(tmp_path, method):
    """The emitted CP YAML and train.py through ``accelerate launch`` on 2 gloo ranks (truths/cpu_launch.py,
    stand-in 6: torch's ring with the truth's per-block kernel, as torch's CP dispatcher takes CUDA SDPA
    only): the HF Trainer's accelerator has cp 2 over FSDP2, and every attention call of its two steps
    ran on half the sequence (the Trainer sharded each batch under maybe_context_parallel)."""
    import os
    import subprocess

    from vramplan.emit import emit_to_dir, launch_command
    from vramplan.model.profiles import load_gpu
    from vramplan.run import free_port
    from vramplan.specs import Plan
    from vramplan.truths.cpu_launch import REPORT, cpu_command

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
            "max_position_embeddings": 256}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("llama-3.2-1b").config, **tiny}))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    setup = Setup(**CP2, batch=2, seq=32, method=method)
    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu)
    folder = tmp_path / "out"
    emit_to_dir(plan, folder)
    cmd = cpu_command(launch_command(plan), free_port()) + ["--cpu", "--max-steps", "2", "--no-save"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stdout[-2000:]}\n{run.stderr[-5000:]}"
    for r in range(2):
        got = json.loads((folder / REPORT.format(rank=r)).read_text())
        assert (got["rank"], got["world_size"], got["global_step"]) == (r, 2, 2)
        assert got["distributed_type"] == "FSDP" and got["fsdp"]["version"] == 2 and got["fsdp2_modules"] > 2
        assert got["parallelism"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 2}
        assert got["ring_seqs"] == [16] * 4  # 2 layers x 2 steps, each on its half of the 32 tokens
        assert got["model_param_numel"] / 2 <= got["local_param_numel"] < got["model_param_numel"] * 0.51


def test_accelerate_yaml_reads_back_cp_and_warns_of_alltoall(tmp_path):
    """``estimate accelerate_config.yaml``: an emitted CP YAML reads back as cp over FSDP2; accelerate's
    other rotate method (``cp_comm_strategy: alltoall``) is said to be estimated as allgather."""
    import yaml

    from vramplan.emit import emit_to_dir
    from vramplan.model.profiles import load_gpu
    from vramplan.readers import read_config
    from vramplan.specs import Plan

    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-4090")
    setup = Setup(**CP2, seq=4096)
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), tmp_path / "o")
    path = tmp_path / "o" / "accelerate_config.yaml"
    got = read_config(path)
    assert (got.setup.cp, got.setup.gpus, got.setup.fsdp, got.setup.fsdp_version) == (2, 2, "full_shard", 2)
    assert not any("cp_comm_strategy" in str(w) for w in got.warnings)
    data = yaml.safe_load(path.read_text())
    data["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "alltoall"
    path.write_text(yaml.safe_dump(data))
    assert any("cp_comm_strategy" in str(w) and "allgather" in str(w) for w in read_config(path).warnings)


def test_wide_heads_are_refused_where_transformers_repeats_kv():
    """head_dim > 256: transformers 5.24's use_gqa_in_sdpa answers False and repeat_kv hands the ring K/V
    at the query heads (and CUDA flash takes head_dim <= 256): refused, not estimated at the KV heads."""
    from vramplan.truths.tiny import TINY_SHAPE, tiny_config, tiny_model

    wide = tiny_model(tiny_config(shape={**TINY_SHAPE, "head_dim": 272}))
    with pytest.raises(SpecError, match=r"head_dim 272 > 256.*repeats K/V"):
        estimate(wide, Setup(**CP2, seq=256))
    estimate(tiny_model(), Setup(**CP2, seq=256))  # head_dim 16: estimated


def test_cp_beside_fsdp2_data_sharding():
    """cp 2 on 4 GPUs: FSDP2 shards over all 4 (dp_shard 2 x cp 2, accelerate's joint dp_shard_cp mesh),
    the sequence over 2 — the same rank as cp 4 on 4 GPUs at twice the sequence; the emitted YAML says
    dp_shard 2, and the plan on 8 x RTX 4090 at seq 32768 takes the smallest cp that fits (cp 4 x dp 2)."""
    from vramplan.emit.accelerate import accelerate_config
    from vramplan.model.profiles import load_gpu
    from vramplan.search.space_cp import cp_degrees
    from vramplan.specs import Plan

    model = load_model("llama-3.1-8b")
    two, four = Setup(**{**CP4, "cp": 2}, seq=16384), Setup(**CP4, seq=32768)
    gap = estimate(model, four).tensor_peak_bytes - estimate(model, two).tensor_peak_bytes
    # at most the wider ring (4 ranks' K/V gathered) and the longer batch's buffers
    assert 0 < gap <= (ring_backward_bytes(model, four) - ring_backward_bytes(model, two)
                       + input_bytes(four) - input_bytes(two))
    gpu = load_gpu("rtx-4090")
    pc = accelerate_config(Plan(model=model.name, setup=two, breakdown=estimate(model, two, gpu), gpu=gpu))
    assert pc["parallelism_config"]["parallelism_config_dp_shard_size"] == 2 and pc["num_processes"] == 4
    assert cp_degrees(8, 32768) == (2, 4, 8) and cp_degrees(4, 1028) == (2,)
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "8", "--seq", "32768",
                                 "--method", "lora", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["setup"]["cp"] == 4


def test_plan_says_how_the_gpus_share_a_context_parallel_step():
    """The speed line counts data-parallel groups, not GPUs, when CP splits each sequence (it said
    "x 4 GPUs" for one 32k sequence split over 4 before)."""
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--gpus", "4", "--seq", "32768"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # the console wraps at 80 columns
    speed = text[text.index("speed:"):text.index(")", text.index("speed:"))]
    assert "context parallelism: each sequence split over 4 GPUs" in speed and "x 4 GPUs" not in speed, speed
