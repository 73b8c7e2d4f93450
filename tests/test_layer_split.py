"""The layer split (``--device-map``): the placement against transformers' own on the meta-device
model, each GPU's memory against the per-GPU traced step, the CLI's per-GPU numbers, the plan's
why-not line, the cost model's one-GPU-at-a-time speed, and the emitted train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main as cli
from vramplan.cost.model import step_cost
from vramplan.emit import emit_to_dir
from vramplan.estimator.corrections import DEFAULT_CORRECTIONS
from vramplan.estimator.layer_split import clean_device_map, free_memory_bytes, place
from vramplan.specs import Plan, SpecError

CTX = DEFAULT_CORRECTIONS.cuda_context_bytes

#: (model, setup, GPUs, GPU): QLoRA 70B (the issue's), dense LoRA and full splits over 2-4 cards,
#: an 8-bit base (its quantizer's 90 % caps), a tied head (placed with the embedding)
PLACEMENTS = [
    ("llama-3.1-70b", dict(method="qlora"), 2, "rtx-3090"),
    ("llama-3.1-8b", dict(method="full"), 4, "rtx-3090"),
    ("qwen2.5-7b", dict(method="lora", quant="int8"), 3, "rtx-4090"),
    ("llama-3.2-1b", dict(method="lora"), 2, "rtx-3090"),
]


@pytest.mark.parametrize("strategy", ["auto", "sequential"])
@pytest.mark.parametrize("name,kw,gpus,gpu_name", PLACEMENTS)
def test_placement_is_transformers_own(name, kw, gpus, gpu_name, strategy):
    from vramplan.truths.layer_split_truth import layer_devices, placed_bytes, real_device_map

    model, gpu = load_model(name), load_gpu(gpu_name)
    setup = Setup(gpus=gpus, device_map=strategy, **kw)
    split = place(model, setup, gpu, CTX)
    real = real_device_map(model.config, setup, (free_memory_bytes(gpu, CTX),) * gpus)
    assert split.layer_devices() == layer_devices(real, model.num_layers)
    assert dict(split.placement) == real  # embeddings, norm, rotary embedding and head too, cleaned alike
    truth = placed_bytes(model.config, setup, real)
    for r in range(gpus):
        assert split.placed_bytes[r] == pytest.approx(truth.get(r, 0), rel=1e-4, abs=4096)


def test_auto_spreads_the_70b_and_ties_the_head_to_the_embedding():
    gpu = load_gpu("rtx-3090")
    split = place(load_model("llama-3.1-70b"), Setup(method="qlora", gpus=2, device_map="auto"), gpu, CTX)
    assert [len(split.layers_on(r)) for r in range(2)] == [36, 44]
    assert (split.embed_rank, split.head_rank) == (0, 1)
    tied = place(load_model("llama-3.2-1b"), Setup(method="lora", gpus=2, device_map="auto"), gpu, CTX)
    assert tied.head_rank == tied.embed_rank == 0
    assert clean_device_map({"a.x": 0, "a.y": 0, "b": 1}) == {"b": 1, "a": 0}


def test_each_gpu_matches_the_per_gpu_traced_step():
    from vramplan.truths.layer_split_trace import traced_rank_peaks
    from vramplan.truths.layer_split_truth import real_device_map

    model, gpu = load_model("llama-3.2-1b"), load_gpu("rtx-3090")
    setup = Setup(method="lora", seq=512, gpus=2, device_map="auto")
    truth = traced_rank_peaks(model.config, setup, real_device_map(model.config, setup,
                                                                   (free_memory_bytes(gpu, CTX),) * 2))
    est = estimate(model, setup, gpu)
    assert len(est.per_rank) == 2
    for t, e in zip(truth, est.per_rank, strict=True):
        assert e.tensor_peak_bytes == pytest.approx(max(t.values()), rel=0.02)
    # the GPUs differ (the head and loss are on GPU 0 with the tied embedding)
    assert est.per_rank[0].tensor_peak_bytes > 2 * est.per_rank[1].tensor_peak_bytes


def test_headline_numbers_are_the_fullest_gpu():
    model, gpu = load_model("llama-3.1-70b"), load_gpu("rtx-3090")
    bd = estimate(model, Setup(method="qlora", checkpointing=True, gpus=2, device_map="auto"), gpu)
    fullest = max(bd.per_rank, key=lambda r: r.device_total_bytes)
    assert bd.device_total_bytes == fullest.device_total_bytes
    assert bd.tensor_peak_bytes == fullest.tensor_peak_bytes
    assert bd.phase == fullest.phase
    assert bd.component("ddp_buckets") == 0  # one process: no data parallelism
    assert bd.fits is False  # 44 layers and the fp32 head on a 24 GB card


def test_default_outputs_carry_no_per_rank():
    bd = estimate(load_model("llama-3.2-1b"), Setup(gpus=2), load_gpu("rtx-3090"))
    assert bd.per_rank == () and "per_rank" not in bd.to_json()


def test_cli_estimate_answers_per_gpu():
    args = ["estimate", "llama-3.1-70b", "--method", "qlora", "--checkpointing", "--gpus", "2", "--device-map",
            "auto", "--gpu", "rtx-3090"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    assert "per GPU" in out.output and "0-35 (36)" in out.output and "36-79 (44)" in out.output
    data = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)
    assert [r["layers"][0] for r in data["per_rank"]] == [0, 36]
    assert data["device_total_bytes"] == max(r["device_total_bytes"] for r in data["per_rank"])


@pytest.mark.parametrize("setup_kw,message", [
    (dict(device_map="auto"), "--gpus 2 or more"),
    (dict(device_map="auto", gpus=2, zero_stage=3), "does not combine"),
    (dict(device_map="balanced_low_0", gpus=2), "device_map"),
])
def test_setup_refuses_what_a_split_is_not(setup_kw, message):
    with pytest.raises(SpecError, match=message):
        Setup(**setup_kw)


def test_cost_model_runs_one_gpu_at_a_time():
    model, gpu = load_model("llama-3.1-8b"), load_gpu("rtx-3090")
    one = step_cost(model, Setup(method="qlora"), gpu)
    split = step_cost(model, Setup(method="qlora", gpus=2, device_map="auto"), gpu)
    assert split.tokens_per_step == one.tokens_per_step  # one micro-batch, not one per GPU
    assert split.compute_s == one.compute_s
    assert split.comm_s > 0  # the hidden states and logits copied over PCIe
    assert split.tokens_per_s < one.tokens_per_s


def test_plan_says_why_not_the_layer_split():
    from vramplan.search import plan

    p = plan("llama-3.1-70b", "rtx-3090", gpus=2)
    lines = [r.reason for r in p.rejected if r.setup.device_map == "auto"]
    assert lines and "layer split over 2 GPUs" in lines[0] and "fullest GPU" in lines[0]


@pytest.mark.slow  # the full tier
def test_emitted_split_is_one_process_and_runs_a_step_on_cpu(tmp_path):
    """train.py passes device_map to from_pretrained and launches as ``python train.py``; on this
    CPU machine (no two GPUs to split over) it falls back to ``{"": "cpu"}`` and runs two steps."""
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
            "max_position_embeddings": 256, "max_window_layers": 2}
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("qwen2-0.5b").config, **tiny}))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    setup = Setup(batch=2, seq=32, gpus=2, device_map="auto", optimizer="adamw-fused")
    emit_to_dir(Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu), tmp_path / "out")
    script = (tmp_path / "out" / "train.py").read_text()
    assert "'device_map': 'auto'" in script and "# run (from this directory): python train.py" in script
    assert "num_processes: 1" in (tmp_path / "out" / "accelerate_config.yaml").read_text()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "train.py", "--cpu", "--max-steps", "2", "--memory-report", "memory.json"],
                         cwd=tmp_path / "out", env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "memory.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2] and report["world_size"] == 1
