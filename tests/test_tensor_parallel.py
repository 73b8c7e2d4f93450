"""Tensor parallelism (``--tp N``): one rank's shard of the model (estimator/tensor_parallel.py)
against transformers 5.24's own DTensor plan run on N gloo ranks (vramplan/truths/tp_truth.py), the
refusals, the per-rank numbers of uneven shards, the cost model's all-reduces and the plan."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main as cli
from vramplan.cost.model import step_cost
from vramplan.estimator.optimizers import trainable_tensors
from vramplan.estimator.tensor_parallel import (
    COLWISE,
    comm_bytes_per_micro_step,
    optimizer_groups,
    rank_model,
    rank_setup,
    shard_size,
)
from vramplan.specs import SpecError

COL = ",".join(COLWISE)


def test_shard_size_is_torchs_chunking():
    # torch 2.13 Shard.local_shard_size_and_offset: ceil-sized chunks, the last ranks shorter
    assert [shard_size(511, 2, r) for r in range(2)] == [256, 255]
    assert [shard_size(10, 4, r) for r in range(4)] == [3, 3, 3, 1]
    assert [shard_size(9, 4, r) for r in range(4)] == [3, 3, 3, 0]
    assert sum(shard_size(128256, 8, r) for r in range(8)) == 128256


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen3-8b", "qwen2.5-7b"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_model_shards_what_the_plan_shards(name, tp):
    model = load_model(name)
    ranks = [rank_model(model, tp, r) for r in range(tp)]
    norms = sum(n for k, n in model.other_params if k != "embed_tokens")
    # everything but the norms is split exactly over the ranks; the norms are on every rank
    assert sum(r.params_total - norms for r in ranks) == model.params_total - norms
    for r in ranks:
        assert r.hidden_size == model.hidden_size and r.num_layers == model.num_layers
        assert r.num_heads == model.num_heads // tp and r.num_kv_heads == model.num_kv_heads // tp
        assert sum(n for k, n in r.other_params if k != "embed_tokens") == norms


def test_tp_estimate_is_one_ranks_share():
    model = load_model("llama-3.1-8b")
    one, two = estimate(model, Setup(seq=1024)), estimate(model, Setup(seq=1024, tp=2, gpus=2))
    w1 = next(c.bytes for c in one.components if c.name == "weights")
    w2 = next(c.bytes for c in two.components if c.name == "weights")
    norms = 2 * sum(n for k, n in model.other_params if k == "norms")
    assert w2 == (w1 - norms) // 2 + norms
    # the loss sees the gathered logits: the same logits term as one GPU
    logits = [next(c.bytes for c in b.components if c.name == "logits_loss") for b in (one, two)]
    assert logits[0] == logits[1]
    assert two.tensor_peak_bytes < one.tensor_peak_bytes
    assert any(c.name == "nccl" for c in two.components) and two.per_rank == ()
    assert two.setup.tp == 2 and two.params_total == model.params_total


def test_tp1_is_unchanged():
    model = load_model("llama-3.2-1b")
    assert estimate(model, Setup(seq=512)) == estimate(model, Setup(seq=512, tp=1))


def test_optimizer_groups_cover_the_trainable_parameters():
    model = load_model("qwen2.5-7b")
    for s in (Setup(tp=2, gpus=2), Setup(tp=2, gpus=2, method="lora", lora_targets=COL)):
        rank, one = rank_model(model, 2), rank_setup(s)
        total = sum(a * b * n for (a, b), n in
                    ((shape if len(shape) == 2 else (shape[0], 1), n) for shape, n in trainable_tensors(rank, one)))
        assert sum(optimizer_groups(rank, one)) == total


def test_uneven_shards_report_each_rank():
    from vramplan.truths.tiny import TINY_SHAPE, tiny_config, tiny_model

    model = tiny_model(tiny_config(shape={**TINY_SHAPE, "vocab_size": 511, "intermediate_size": 129}))
    b = estimate(model, Setup(seq=64, tp=2, gpus=2))
    assert [r.rank for r in b.per_rank] == [0, 1]
    assert b.per_rank[0].tensor_peak_bytes > b.per_rank[1].tensor_peak_bytes
    assert b.tensor_peak_bytes == b.per_rank[0].tensor_peak_bytes  # the headline is the fullest rank's


@pytest.mark.parametrize("kw,fragment", [
    (dict(method="lora"), "row-parallel"),  # all-linear adapts o_proj/down_proj: peft 0.21 fails there
    (dict(method="qlora"), "--quant"),
    (dict(gpus=4), "data parallelism"),
    (dict(precision="bf16-mixed"), "-mixed"),
    (dict(optimizer="adamw-8bit"), "--optimizer"),
    (dict(checkpointing=True, liger=True), "liger"),
])
def test_refusals(kw, fragment):
    kw = {"tp": 2, "gpus": 2, **kw}
    with pytest.raises(SpecError, match=fragment):
        estimate(load_model("llama-3.1-8b"), Setup(**kw))


def test_refuses_heads_that_do_not_divide_and_moe():
    with pytest.raises(SpecError, match="heads"):
        estimate(load_model("llama-3.1-8b"), Setup(tp=3, gpus=3))
    with pytest.raises(SpecError, match="dense plans"):
        estimate(load_model("mixtral-8x7b"), Setup(tp=2, gpus=2))


def test_cli_json_and_one_line_errors():
    from cli_helpers import assert_user_error

    runner = CliRunner()
    r = runner.invoke(cli, ["estimate", "llama-3.1-8b", "--tp", "2", "--gpus", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["setup"]["tp"] == 2 and d["tensor_peak_bytes"] > 0
    assert_user_error(runner.invoke(cli, ["estimate", "llama-3.1-8b", "--tp", "2", "--gpus", "2", "--method", "lora"]),
                      "row-parallel", "--lora-targets")


def test_cost_prices_the_all_reduces_over_the_link():
    model = load_model("llama-3.1-8b")
    s = Setup(seq=2048, tp=2, gpus=2, checkpointing=True)
    assert comm_bytes_per_micro_step(model, Setup(seq=2048)) == 0
    # four (six with checkpointing) all-reduces of tokens x hidden per layer, 2 (n-1)/n of them each
    per_layer = 6 * 2048 * model.hidden_size * 2
    assert comm_bytes_per_micro_step(model, s) >= model.num_layers * per_layer
    pcie, nvlink = step_cost(model, s, load_gpu("rtx-4090")), step_cost(model, s, load_gpu("h100"))
    assert pcie.comm_s / pcie.step_s > 3 * nvlink.comm_s / nvlink.step_s
    one = step_cost(model, Setup(seq=2048, checkpointing=True), load_gpu("h100"))
    assert nvlink.compute_s == pytest.approx(one.compute_s / 2)
    assert nvlink.tokens_per_step == one.tokens_per_step  # the two GPUs share each micro-batch


def test_plan_picks_tp_only_where_data_parallelism_does_not_fit():
    from vramplan.search.planner import plan

    # 8B full fine-tuning on four 24 GB cards: only sharded placements fit; TP without offload is fastest
    p = plan(load_model("llama-3.1-8b"), load_gpu("rtx-4090"), gpus=4, method="full")
    assert p.setup.tp == 4 and p.fits
    assert p.global_batch == p.setup.batch * p.setup.grad_accum
    # a 1B model fits each card whole: data parallelism beats TP's all-reduces
    p = plan(load_model("llama-3.2-1b"), load_gpu("h100"), gpus=2, method="full")
    assert p.setup.tp == 1


# ----------------------------------------------------------------------------------------------
# the truth: transformers' DTensor plan on gloo ranks


def test_truth_two_ranks_within_5_percent():
    from vramplan.truths.tiny import TINY_SEQ
    from vramplan.truths.tp_truth import COLWISE_TARGETS, compare_setups

    setups = [Setup(tp=2, gpus=2, seq=TINY_SEQ), Setup(tp=2, gpus=2, seq=TINY_SEQ, method="lora",
                                                         lora_targets=COLWISE_TARGETS, checkpointing=True)]
    for run, est in compare_setups(setups, 2):
        assert len(run.ranks) == 2
        truth = run.worst.device_bytes
        assert abs(est.tensor_peak_bytes / truth - 1) <= 0.05, (run.setup, truth, est.tensor_peak_bytes)
        assert run.worst.phase == est.phase


@pytest.mark.slow
def test_truth_matrix_within_5_percent():
    from vramplan.truths.tp_truth import TP_UNVERIFIED, tp_rows

    rows = [r for r in tp_rows(quick=False) if r.why not in {why for _, why in TP_UNVERIFIED}]  # the refused
    assert rows and all(r.verified for r in rows), [r.why for r in rows if not r.verified]
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.05, worst
    assert any(" rank 1" in r.model for r in rows)  # the uneven shards, per rank


STEP = """
import importlib.util, json, os, sys
import torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("train", "train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)
torch.set_num_threads(1)
model = train.build_model(train.parse_args(["--cpu"]))  # from_pretrained(distributed_config=tp_plan auto)
from torch.distributed.tensor import DTensor
from collections import defaultdict
groups = defaultdict(list)  # the Trainer's groups by mesh (Trainer.create_optimizer)
for p in model.parameters():
    groups[p.device_mesh if isinstance(p, DTensor) else None].append(p)
opt = torch.optim.AdamW([{"params": g} for g in groups.values()], foreach=True)
ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
loss = model(input_ids=ids, labels=ids).loss
loss.backward(); opt.step()
q = model.model.layers[0].self_attn.q_proj.weight
json.dump({"loss": float(loss), "q_local": list(q._local_tensor.shape), "q_global": list(q.shape),
           "tp": model.tp_size}, open(f"rank{os.environ['RANK']}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_emitted_train_py_loads_the_tp_plan_and_steps_on_cpu_ranks(tmp_path):
    """train.py passes DistributedConfig(tp_plan="auto") to from_pretrained and launches one process
    per GPU; its build_model runs on 2 gloo ranks (each a 1/2 shard) and takes a step. The HF
    Trainer itself cannot run TP on the CPU: accelerate 1.15's ParallelismConfig._validate_accelerator
    accepts MULTI_GPU, FSDP2 and DeepSpeed states, not MULTI_CPU."""
    import os
    import subprocess
    import sys

    from vramplan.emit import emit_to_dir
    from vramplan.run import free_port
    from vramplan.specs import Plan

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
            "max_position_embeddings": 256}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("llama-3.2-1b").config, **tiny}))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    setup = Setup(batch=2, seq=32, gpus=2, tp=2)
    out = tmp_path / "out"
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), out)
    script = (out / "train.py").read_text()
    assert "'tp': 2" in script and 'DistributedConfig(tp_plan="auto"' in script
    assert "num_processes: 2" in (out / "accelerate_config.yaml").read_text()
    assert "torchrun --nproc_per_node 2 train.py" in script
    (out / "step.py").write_text(STEP)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "step.py"], cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}) for r in range(2)]
    logs = [p.communicate(timeout=300)[0].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["tp"] == 2 and r["q_local"] == [32, 64] and r["q_global"] == [64, 64] for r in ranks)
    assert ranks[0]["loss"] == pytest.approx(ranks[1]["loss"])


def test_unmodelled_knobs_still_refused():
    # context parallelism without FSDP2 is refused (estimator/context_parallel.py check_cp)
    with pytest.raises(SpecError, match="context parallelism"):
        estimate(load_model("llama-3.2-1b"), Setup(cp=2, gpus=2))
    assert dataclasses.replace(Setup(), tp=2, gpus=2).tp == 2
