"""Emitters: every DeepSpeed config parses with DeepSpeed's own parser and every Accelerate YAML
with accelerate's loader, for every plan shape; golden files per emitter; emit never mutates the
plan; the CLI refuses bad plan files and existing directories with one line.

Regenerate the golden files after an intended change with ``VRAMPLAN_REGEN_GOLDEN=1 pytest
tests/test_emit.py`` and review the diff.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vramplan import Setup, SpecError, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.emit import accelerate_config, deepspeed_config, emit_to_dir, launch_commands, render
from vramplan.emit.common import ACCELERATE_CONFIG, DS_CONFIG, HOSTFILE, LAUNCH_SCRIPT, PLAN_FILE, TRAIN_SCRIPT
from vramplan.plans.planfile import plan_to_json, save_plan
from vramplan.specs import Plan

GOLDEN = Path(__file__).parent / "golden" / "emit"
REGEN = os.environ.get("VRAMPLAN_REGEN_GOLDEN") == "1"
MODEL = "meta-llama/Llama-3.1-8B"

#: name -> (Setup, nodes): every shape the emitters distinguish.
SHAPES = {
    "single": (Setup(method="lora", checkpointing=True, batch=4, grad_accum=8), 1),
    "qlora": (Setup(method="qlora", lora_rank=64, lora_targets="q_proj,v_proj", checkpointing=True,
                    optimizer="paged-adamw-8bit"), 1),
    "ddp-4gpu": (Setup(batch=2, gpus=4, precision="bf16-mixed", optimizer="adamw-fused"), 1),
    "zero1": (Setup(zero_stage=1, gpus=2), 1),
    "zero2-offload-cpu": (Setup(zero_stage=2, offload_optimizer="cpu", gpus=8, grad_accum=4), 1),
    "zero2-fp16": (Setup(zero_stage=2, precision="fp16-mixed", gpus=2), 1),
    "zero2-qlora": (Setup(method="qlora", zero_stage=2, gpus=2, checkpointing=True), 1),
    "zero3": (Setup(zero_stage=3, gpus=8, checkpointing=True), 1),
    "zero3-offload-cpu": (Setup(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", gpus=4), 1),
    "zero3-nvme": (Setup(zero_stage=3, offload_optimizer="nvme", offload_params="nvme", gpus=2), 1),
    "zero3-offload-8bit": (Setup(zero_stage=3, offload_optimizer="cpu", optimizer="adamw-8bit", gpus=2), 1),
    "zero3-lion-offload": (Setup(zero_stage=3, offload_optimizer="cpu", optimizer="lion", gpus=2), 1),
    "multinode-zero3": (Setup(zero_stage=3, gpus=16, checkpointing=True), 2),
    "multinode-ddp": (Setup(method="lora", gpus=16), 2),
    "gptq": (Setup(method="lora", quant="gptq", quant_bits=4, quant_group_size=128, checkpointing=True,
                   precision="fp16"), 1),
}
#: shapes whose files are pinned as golden files (one per distinct emitter path)
GOLDEN_SHAPES = ("single", "qlora", "ddp-4gpu", "zero2-offload-cpu", "zero3-nvme", "multinode-zero3", "multinode-ddp",
                 "gptq")


def make_plan(setup: Setup, nodes: int = 1, fixed: bool = False) -> Plan:
    """A plan as `vramplan plan` would make it; ``fixed`` pins the headline numbers, so golden
    files change with the emitters, not with every refinement of the estimator."""
    model, gpu = load_model(MODEL), load_gpu("a100-80gb")
    bd = estimate(model, setup, gpu)
    if fixed:
        bd = dataclasses.replace(bd, tensor_peak_bytes=30 * 2**30, peak_allocated_bytes=31 * 2**30,
                                 peak_reserved_bytes=33 * 2**30, device_total_bytes=34 * 2**30,
                                 host_bytes=(5 * 2**30 if bd.host_bytes else 0))
    return Plan(model=model.name, setup=setup, breakdown=bd, gpu=gpu, nodes=nodes, tokens_per_s=1000.0)


@pytest.fixture(params=sorted(SHAPES), scope="module")
def shape(request):
    setup, nodes = SHAPES[request.param]
    return request.param, make_plan(setup, nodes)


# ----------------------------------------------------------------------------------------------
# DeepSpeed's and accelerate's own parsers


def test_deepspeed_config_parses_with_deepspeed(shape, tmp_path):
    """The emitted JSON (HF "auto" values filled the way the Trainer fills them) and the
    concrete variant both load with DeepSpeed's own DeepSpeedConfig."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    _, plan = shape
    s = plan.setup
    path = tmp_path / DS_CONFIG
    path.write_text(render(plan, ["deepspeed"])[DS_CONFIG])

    # exactly what TrainingArguments(deepspeed=...) does: substitute the "auto" values
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=s.batch,
                             gradient_accumulation_steps=s.grad_accum, bf16=s.precision.startswith("bf16"),
                             report_to="none")
    args.fp16 = s.precision.startswith("fp16")  # set after validation: it refuses fp16 on a CPU
    hf = HfTrainerDeepSpeedConfig(str(path))
    hf.trainer_config_process(args)
    assert "auto" not in json.dumps({k: v for k, v in hf.config.items() if k != "optimizer"})
    parsed = DeepSpeedConfig(hf.config)

    concrete = DeepSpeedConfig(deepspeed_config(plan, hf_auto=False))
    for ds in (parsed, concrete):
        assert ds.zero_optimization_stage == s.zero_stage
        assert ds.train_micro_batch_size_per_gpu == s.batch
        assert ds.gradient_accumulation_steps == s.grad_accum
        assert ds.bfloat16_config.enabled == s.precision.startswith("bf16")
        assert ds.float16_config.enabled == s.precision.startswith("fp16")
        zero = ds.zero_config
        assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == s.offload_optimizer
        assert (zero.offload_param.device if zero.offload_param else "none") == s.offload_params
        if s.zero_stage:
            from vramplan.estimator.distributed import zero_config

            knobs = zero_config(load_model(MODEL), s)
            assert zero.reduce_bucket_size == knobs["reduce_bucket_size"]
            if s.zero_stage == 3:
                assert zero.prefetch_bucket_size == knobs["stage3_prefetch_bucket_size"]
                assert zero.param_persistence_threshold == knobs["stage3_param_persistence_threshold"]
    if s.offload_optimizer != "none" and s.optimizer in ("adamw", "lion"):
        assert parsed.optimizer_name == {"adamw": "adamw", "lion": "lion"}[s.optimizer]


def test_accelerate_config_loads_with_accelerate(shape, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    _, plan = shape
    s = plan.setup
    path = tmp_path / ACCELERATE_CONFIG
    path.write_text(render(plan, ["accelerate"])[ACCELERATE_CONFIG])
    cfg = load_config_from_file(str(path))
    assert isinstance(cfg, ClusterConfig)
    expected = "DEEPSPEED" if s.zero_stage else ("MULTI_GPU" if s.gpus > 1 else "NO")
    assert cfg.distributed_type.value == expected
    assert cfg.num_processes == s.gpus and cfg.num_machines == plan.nodes
    if s.zero_stage:
        assert cfg.deepspeed_config["deepspeed_config_file"] == DS_CONFIG
        assert cfg.deepspeed_config["zero3_init_flag"] == (s.zero_stage == 3)
        assert cfg.mixed_precision is None  # owned by ds_config.json: accelerate refuses it in both
    else:
        # autocast only for "-mixed": pure bf16/fp16 is the step without autocast that vramplan estimates
        assert cfg.mixed_precision == {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(s.precision, "no")
    # what `accelerate launch --config_file` does with it before launching
    argv = ["--config_file", str(path)]
    if plan.nodes > 1:
        argv += ["--machine_rank", "1", "--main_process_ip", "10.0.0.1"]
    args, _, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv + ["train.py"]))
    assert args.num_processes == s.gpus and args.num_machines == plan.nodes
    assert bool(args.use_deepspeed) == bool(s.zero_stage)
    assert not (args.use_deepspeed and mp_from_config)
    if not s.zero_stage:  # the precision the launched Trainer runs: the YAML's, through the env
        from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

        env = prepare_multi_gpu_env(args) if args.multi_gpu else prepare_simple_launcher_cmd_env(args)[1]
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", env.get("ACCELERATE_MIXED_PRECISION", "no"))
        from transformers import TrainingArguments

        targs = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                  bf16=s.precision == "bf16-mixed", fp16=False, report_to=[])
        assert targs.mixed_precision == ("bf16" if s.precision == "bf16-mixed" else "no")


def test_fsdp_plan_emits_fsdp(tmp_path):
    """A Setup that shards with FSDP (the ``fsdp`` field, where the Setup has it) gets an FSDP YAML."""
    from accelerate.commands.config.config_args import load_config_from_file

    setup = Setup(gpus=4, fsdp="full_shard")
    plan = make_plan(setup)
    path = tmp_path / ACCELERATE_CONFIG
    path.write_text(render(plan, ["accelerate"])[ACCELERATE_CONFIG])
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value == "FSDP"
    assert cfg.fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD"
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "t.py"]))
    assert args.use_fsdp and args.num_processes == 4 and args.fsdp_sharding_strategy == "FULL_SHARD"
    assert "    'sharded': True,\n" in render(plan, ["trainer"])[TRAIN_SCRIPT]  # 4-bit storage fit for sharding
    assert launch_commands(plan)[0] == f"accelerate launch --config_file {ACCELERATE_CONFIG} {TRAIN_SCRIPT}"
    object.__setattr__(setup, "fsdp", "everything")
    with pytest.raises(SpecError, match="fsdp must be"):
        accelerate_config(plan)


def test_stage0_plan_gets_deepspeed_only_when_asked(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = make_plan(Setup(method="lora"))
    assert DS_CONFIG not in render(plan)
    assert launch_commands(plan)[0] == f"python {TRAIN_SCRIPT}"
    cfg = json.loads(render(plan, ["deepspeed"])[DS_CONFIG])
    assert cfg["zero_optimization"]["stage"] == 0
    assert any("does not use ZeRO" in line for line in cfg["_comment"])
    assert DeepSpeedConfig(deepspeed_config(plan, hf_auto=False)).zero_optimization_stage == 0


def test_multinode_launchers():
    from deepspeed.launcher.runner import _parse_hostfile

    plan = make_plan(*SHAPES["multinode-zero3"])
    files = render(plan)
    assert _parse_hostfile(files[HOSTFILE].splitlines()) == {"node-0": 8, "node-1": 8}
    ds_cmd, acc_cmd = launch_commands(plan)
    assert ds_cmd.startswith("deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 ")
    assert '--machine_rank "$NODE_RANK" --main_process_ip "$MAIN_IP"' in acc_cmd
    assert 'MAIN_IP:?' in files[LAUNCH_SCRIPT]
    ddp = render(make_plan(*SHAPES["multinode-ddp"]))
    assert HOSTFILE not in ddp and 'NODE_RANK:?' in ddp[LAUNCH_SCRIPT]


# ----------------------------------------------------------------------------------------------
# Golden files, purity, I/O


def _split_train_py(text: str) -> tuple[str, str]:
    """(the plan-specific parts: the comment header and the PLAN dict; the template around them)."""
    lines = text.splitlines(keepends=True)
    n_header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    header, rest = "".join(lines[:n_header]), "".join(lines[n_header:])
    start = rest.index("PLAN = {")
    end = rest.index("\n}\n", start) + 3
    return header + rest[start:end], rest[:start] + "PLAN = ...\n" + rest[end:]


@pytest.mark.parametrize("name", GOLDEN_SHAPES)
def test_golden_files(name):
    setup, nodes = SHAPES[name]
    plan = make_plan(setup, nodes, fixed=True)
    files = render(plan, ["deepspeed", "accelerate", "trainer"] if setup.zero_stage else None)
    folder = GOLDEN / name
    pinned = {n: t for n, t in files.items() if n not in (PLAN_FILE, "config.json")}
    if name != "single":
        # train.py differs between shapes in its header and PLAN only: the template body is pinned
        # once (single) and must be the same here
        head, body = _split_train_py(pinned["train.py"])
        assert body == _split_train_py((GOLDEN / "single" / "train.py").read_text())[1]
        pinned["train.py"] = head
    if REGEN:
        folder.mkdir(parents=True, exist_ok=True)
        for n, text in pinned.items():
            (folder / n).write_text(text)
    assert sorted(p.name for p in folder.iterdir()) == sorted(pinned), "golden files differ in which files exist"
    for n, text in pinned.items():
        assert text == (folder / n).read_text(), f"{name}/{n} differs from its golden file (VRAMPLAN_REGEN_GOLDEN=1)"
    # the non-pinned files: the plan with its estimate, and the model's own config
    assert json.loads(files[PLAN_FILE]) == plan_to_json(plan)
    assert json.loads(files["config.json"]) == load_model(MODEL).config


def test_headers_name_the_command_and_the_estimate():
    plan = make_plan(*SHAPES["zero2-offload-cpu"])
    files = render(plan)
    run = f"run (from this directory): {launch_commands(plan)[0]}"
    gib = f"{plan.breakdown.device_total_bytes / 2**30:.2f} GiB per GPU"
    for name, text in files.items():
        if name in (PLAN_FILE, "config.json"):
            continue
        head = "\n".join(json.loads(text)["_comment"]) if name == DS_CONFIG else text[:2000]
        assert run in head and gib in head and plan.gpu.display_name in head, name


def test_emit_never_mutates_the_plan(tmp_path):
    for name in ("zero3-nvme", "multinode-zero3", "qlora"):
        plan = make_plan(*SHAPES[name])
        before, json_before = copy.deepcopy(plan), json.dumps(plan_to_json(plan), sort_keys=True)
        config_before = json.dumps(load_model(MODEL).config, sort_keys=True)
        emit_to_dir(plan, tmp_path / name, formats=["deepspeed", "accelerate", "trainer"])
        deepspeed_config(plan, hf_auto=False)
        assert plan == before
        assert json.dumps(plan_to_json(plan), sort_keys=True) == json_before
        assert json.dumps(load_model(MODEL).config, sort_keys=True) == config_before


def test_emit_to_dir_refuses_existing_directory(tmp_path):
    plan = make_plan(*SHAPES["zero2-offload-cpu"])
    out = tmp_path / "out"
    paths = emit_to_dir(plan, out)
    assert {p.name for p in paths} == {DS_CONFIG, ACCELERATE_CONFIG, TRAIN_SCRIPT, LAUNCH_SCRIPT, PLAN_FILE,
                                       "config.json"}
    assert os.access(out / LAUNCH_SCRIPT, os.X_OK)
    (out / TRAIN_SCRIPT).write_text("edited")
    with pytest.raises(SpecError, match="not empty; pass --force") as info:
        emit_to_dir(plan, out)
    assert "\n" not in str(info.value)
    assert (out / TRAIN_SCRIPT).read_text() == "edited"
    emit_to_dir(plan, out, force=True)
    assert (out / TRAIN_SCRIPT).read_text() != "edited"
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporary files
    (tmp_path / "empty").mkdir()
    assert emit_to_dir(plan, tmp_path / "empty")  # an existing empty directory is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="not a directory"):
        emit_to_dir(plan, tmp_path / "file")


# ----------------------------------------------------------------------------------------------
# CLI


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def test_cli_emit_writes_the_files(tmp_path):
    plan_path = save_plan(make_plan(*SHAPES["zero3"]), tmp_path / "plan.yaml")
    result = _cli("emit", str(plan_path), "--format", "deepspeed,accelerate", "--out", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == sorted([DS_CONFIG, ACCELERATE_CONFIG, PLAN_FILE])
    assert json.loads((tmp_path / "o" / DS_CONFIG).read_text())["zero_optimization"]["stage"] == 3
    again = _cli("emit", str(plan_path), "--out", str(tmp_path / "o"))
    assert again.exit_code == 2 and again.output.count("\n") == 1 and "--force" in again.output
    assert _cli("emit", str(plan_path), "--out", str(tmp_path / "o"), "--force").exit_code == 0
    assert (tmp_path / "o" / TRAIN_SCRIPT).is_file()


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"vramplan_plan": 1, "model": "gpt2", "setup": {"zero_stage": 7}}', "zero_stage"),
    ('{"vramplan_plan": 1, "model": "no-such-model-xyz", "setup": {}}', "no-such-model-xyz"),
    ('{"model": "gpt2", "setup": {}}', "not a vramplan plan file"),
])
def test_cli_bad_plan_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    result = _cli("emit", str(path), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1 and message in result.output
    assert not (tmp_path / "o").exists()


def test_cli_bad_format_is_one_line(tmp_path):
    plan_path = save_plan(make_plan(*SHAPES["single"]), tmp_path / "plan.json")
    result = _cli("emit", str(plan_path), "--format", "deepspeed,megatron", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and result.output == (
        "error: unknown format 'megatron'; use a comma-separated list of deepspeed, accelerate, trainer, axolotl, "
        "llamafactory, trl, torchtune, unsloth\n")


def test_emitted_yaml_is_plain_yaml():
    """The header is comments: any YAML reader sees only the mapping."""
    text = render(make_plan(*SHAPES["zero3"]), ["accelerate"])[ACCELERATE_CONFIG]
    assert text.startswith("# vramplan plan for ")
    assert yaml.safe_load(text)["distributed_type"] == "DEEPSPEED"
