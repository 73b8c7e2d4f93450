"""The emitted train.py runs: launched exactly as its header says (plus ``--cpu``, two steps and a
memory report), on a tiny model scaled down from a shipped profile, random weights, offline.

One subprocess per shape (each imports torch, transformers, peft): full, LoRA, QLoRA (bitsandbytes
4-bit on the CPU), DeepSpeed ZeRO-2 through the ``deepspeed`` launcher and QLoRA under ZeRO-3 through
``accelerate launch`` with the emitted YAML (the header's second command; bf16-mixed on two ranks,
each loading the same random 4-bit checkpoint; DeepSpeed picks its CPU accelerator and gloo by
itself). One more run (LoRA on an int8 base)
imports train.py the way ``vramplan measure`` will, adding a TrainerCallback. The first DeepSpeed
run on a machine also compiles DeepSpeed's shared-memory op once (about 30 s; cached in ~/.cache/torch_extensions).
ZeRO-Offload is checked by DeepSpeed's parser only: running it compiles DeepSpeed's CPU Adam
(about 2 min on 2 cores) on a fresh machine.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.emit import emit_to_dir
from vramplan.run import free_port, release_deepspeed_shm
from vramplan.specs import Plan

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256, "max_window_layers": 2}
SHAPES = {
    "full": Setup(batch=2, seq=32, optimizer="adamw-fused"),
    "lora": Setup(method="lora", lora_rank=4, lora_dropout=0.1, lora_targets="q_proj,v_proj", batch=2, seq=32,
                  checkpointing=True, optimizer="adamw-8bit"),
    "lora-int8": Setup(method="lora", lora_rank=4, quant="int8", batch=2, seq=16),
    "qlora": Setup(method="qlora", lora_rank=4, batch=2, seq=32, checkpointing=True),
    "zero2": Setup(zero_stage=2, batch=2, seq=32, grad_accum=2, optimizer="adamw-fused"),
    # on 2 ranks, as -mixed: every rank loads the same random 4-bit checkpoint, stored 16-bit
    "zero3": Setup(method="qlora", lora_rank=4, zero_stage=3, batch=2, seq=32, checkpointing=True,
                   precision="bf16-mixed", gpus=2),
}


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """shape -> emitted directory, for a 2-layer, 64-wide Qwen2 from the shipped Qwen2-0.5B config."""
    root = tmp_path_factory.mktemp("emit")
    config = {**load_model("qwen2-0.5b").config, **TINY}
    (root / "tiny").mkdir()
    (root / "tiny" / "config.json").write_text(json.dumps(config))
    model, gpu = load_model(str(root / "tiny" / "config.json")), load_gpu("rtx-4090")
    dirs = {}
    for name, setup in SHAPES.items():
        plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu)
        emit_to_dir(plan, root / name)
        dirs[name] = (root / name, plan)
    return dirs


def _env() -> dict:
    # offline: proves nothing is downloaded; one thread: the tiny steps are faster than thread start-up
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def header_command(script: Path, which: int = 0) -> list[str]:
    """The ``which``-th launch command in train.py's header (0: ``run ...:``, 1: the first ``or:``)."""
    lines = [l[2:] for l in script.read_text().splitlines() if l.startswith("# ")]
    commands = [l.split(": ", 1)[1] for l in lines if l.startswith("run (from this directory): ")]
    commands += [l.split("or: ", 1)[1] for l in lines if l.strip().startswith("or: ")]
    return shlex.split(commands[which])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_emitted(folder: Path, which: int = 0, extra: tuple[str, ...] = ()) -> dict:
    cmd = header_command(folder / "train.py", which)
    if cmd[0] == "python":
        cmd[0] = sys.executable
    elif cmd[0] == "deepspeed" and not _port_free(29500):
        cmd[1:1] = ["--master_port", str(free_port())]  # another process holds the launcher's default port
    cmd += ["--cpu", "--max-steps", "2", "--memory-report", "memory.json", *extra]
    port = cmd[cmd.index("--master_port") + 1] if "--master_port" in cmd else 29500  # both launchers' default
    for attempt in (1, 2):
        for stale in folder.glob("memory*.json"):
            stale.unlink()
        try:
            out = subprocess.run(cmd, check=False, cwd=folder, env=_env(), capture_output=True, text=True, timeout=300)
        finally:
            release_deepspeed_shm(port)  # DeepSpeed's CPU ranks leave ~64 MiB of /dev/shm each
        if out.returncode == 0 or attempt == 2 or not _aborted_in_teardown(out, folder):
            break
    assert out.returncode == 0, f"{shlex.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert "gradient_checkpointing_enable` is deprecated" not in out.stderr  # transformers 5's old name, gone in v6
    single = folder / "memory.json"  # several ranks: one report per rank, memory.rankN.json
    return json.loads((single if single.exists() else folder / "memory.rank0.json").read_text())


def _aborted_in_teardown(out: subprocess.CompletedProcess, folder: Path) -> bool:
    """A CPU rank that trained, saved and wrote its report, then aborted while its gloo groups were torn
    down ("terminate called without an active exception", exit -6: seen once in CI on a 2-rank ZeRO-3
    run, not reproduced in 20 runs here; the emitted script's barrier before it leaves the group is the
    fix tried; vramplan/truths/cpu_launch.py skips that teardown for the same reason). Such a run is
    repeated once; a second failure fails the test."""
    return ("terminate called without an active exception" in out.stderr + out.stdout
            and any(folder.glob("memory*.json")))


def _check_report(report: dict, plan: Plan) -> None:
    """Two steps of the plan's shape, training exactly the parameters the estimate counts."""
    setup = plan.setup
    assert report["params_trainable"] == plan.breakdown.params_trainable
    assert [row["step"] for row in report["steps"]] == [1, 2]
    assert report["tokens_per_step"] == setup.batch * setup.seq * setup.grad_accum * setup.gpus
    assert all(row["peak_rss_bytes"] > 0 and row["tokens_per_s"] > 0 for row in report["steps"])
    assert report["device"] == "cpu" and report["world_size"] == setup.gpus
    assert report["plan"]["method"] == setup.method


# LoRA in the full tier: the fast tier's emitted LoRA step is test_plan_judgement's (llama-3.1-8b on an RTX 4090)
@pytest.mark.parametrize("shape", [pytest.param("full", marks=pytest.mark.slow),
                                   pytest.param("lora", marks=pytest.mark.slow), "qlora"])
def test_single_gpu_plans_run(emitted, shape):
    folder, plan = emitted[shape]
    report = run_emitted(folder)
    _check_report(report, plan)
    assert report["deepspeed_zero_stage"] is None
    assert (report["bnb_modules"] > 0) == (plan.setup.quant != "none")
    library = "bitsandbytes.optim." if plan.setup.optimizer == "adamw-8bit" else "torch.optim."
    assert report["optimizer"].startswith(library)
    if plan.setup.adapters:
        config = json.loads((folder / "output" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_dropout"] == plan.setup.lora_dropout
        if plan.setup.lora_targets != "all-linear":
            assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    else:
        assert (folder / "output" / "model.safetensors").is_file()


@pytest.mark.slow  # the full tier
def test_zero2_runs_with_the_deepspeed_launcher(emitted):
    folder, plan = emitted["zero2"]
    assert header_command(folder / "train.py")[:3] == ["deepspeed", "--num_gpus", "1"]
    report = run_emitted(folder)
    _check_report(report, plan)
    assert report["deepspeed_zero_stage"] == 2 and report["zero3_partitioned_params"] == 0
    assert report["optimizer"] == "torch.optim.adamw.AdamW"  # the Trainer's optimizer, inside DeepSpeed's


def test_zero3_runs_with_accelerate_launch(emitted):
    folder, plan = emitted["zero3"]
    assert header_command(folder / "train.py", 1)[:4] == ["accelerate", "launch", "--config_file",
                                                          "accelerate_config.yaml"]
    report = run_emitted(folder, which=1)
    _check_report(report, plan)
    assert report["deepspeed_zero_stage"] == 3 and report["zero3_partitioned_params"] > 0
    assert report["bnb_modules"] == 2 * 7  # QLoRA under ZeRO-3: 4-bit weights stored as bf16 shards
    assert "'quant_storage': 'bfloat16'" in (folder / "train.py").read_text()  # not fp32, though -mixed
    rank1 = json.loads((folder / "memory.rank1.json").read_text())  # rank 1 loaded a full checkpoint too
    assert rank1["world_size"] == 2 and rank1["bnb_modules"] == report["bnb_modules"]
    assert rank1["params_trainable"] == report["params_trainable"]


def test_train_script_is_importable_with_extra_callbacks(emitted):
    """How `vramplan measure` runs the same code: import train.py, add a TrainerCallback. Here
    for a LoRA plan on an int8 base, on a local JSONL dataset of token ids (rows shorter than
    --seq are padded, labels -100 there); a Hub dataset id without the `datasets` package is a
    one-line error."""
    folder, _ = emitted["lora-int8"]
    rows = [{"input_ids": list(range(2, 2 + n))} for n in (16, 10, 16, 12, 16, 16)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = textwrap.dedent(f"""
        import importlib.util, json
        from transformers import TrainerCallback
        spec = importlib.util.spec_from_file_location("train", {str(folder / "train.py")!r})
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)

        class Count(TrainerCallback):
            steps = 0
            def on_step_end(self, args, state, control, **kwargs):
                Count.steps += 1

        args = train.parse_args(["--cpu", "--max-steps", "3", "--output-dir", "imported", "--dataset", "data.jsonl"])
        assert args.batch == 2 and args.seq == 16 and args.lr == 2e-4
        trainer = train.build_trainer(args, callbacks=[Count()])
        trainer.train()
        row = trainer.train_dataset[1]
        bnb = sum(type(m).__module__.startswith("bitsandbytes") and type(m).__name__ == "Linear8bitLt"
                  for m in trainer.model.modules())
        try:
            train.build_dataset(train.parse_args(["--dataset", "some-org/some-dataset"]), 256, 1)
            error = None
        except SystemExit as exc:
            error = str(exc)
        print(json.dumps({{"steps": Count.steps, "row": row, "error": error, "int8_linears": bnb}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=folder, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3
    assert result["int8_linears"] == 2 * 7  # every Linear of both layers (not the head) is 8-bit
    assert result["row"]["input_ids"] == list(range(2, 12)) + [0] * 6
    assert result["row"]["labels"] == list(range(2, 12)) + [-100] * 6
    assert result["row"]["attention_mask"] == [1] * 10 + [0] * 6
    import importlib.util

    assert result["error"].startswith("error: --dataset some-org/some-dataset: ") and "\n" not in result["error"]
    if importlib.util.find_spec("datasets") is None:
        assert "pip install datasets" in result["error"]
    else:  # the tests run offline (HF_HUB_OFFLINE): the Hub id cannot load
        assert "could not be loaded" in result["error"]
