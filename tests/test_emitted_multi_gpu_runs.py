"""The emitted multi-GPU accelerate configs and their train.py run real steps on CPU gloo processes.

Launched as the emitted header says (``accelerate launch --config_file accelerate_config.yaml
train.py``) with the port and one module in front of the script (vramplan/truths/cpu_launch.py):
accelerate 1.15's launcher, the YAML, the environment it exports, the emitted train.py, the HF
Trainer, accelerate's FSDP prepare, torch 2.13's FSDP1 / ``fully_shard`` and transformers 5.24's
tensor-parallel plan are real; the module's five stand-ins are what accelerate's accelerator branch
does where it has no CPU branch (without them the FSDP1 YAML fails on every rank and the FSDP2 one
trains unsharded under MULTI_CPU: :func:`test_accelerate_alone_runs_no_fsdp_on_cpu` pins both).
Runs: FSDP1 (LoRA, CPU offload), FSDP2 (LoRA, bf16 MixedPrecisionPolicy), tensor parallelism 2 (and with LoRA),
and tensor parallelism 2 x FSDP2 2 on 4 ranks; QLoRA under FSDP1 fails in the Trainer (pinned below).
The launches are ``slow`` (about 40-55 s each on 2 busy cores). Also here: why FSDP2 CPU offload
stays refused (torch 2.13's offload copies are identities on a CPU mesh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.emit import emit_to_dir, launch_command
from vramplan.run import free_port
from vramplan.specs import Plan, SpecError
from vramplan.truths.cpu_launch import REPORT, cpu_command

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 1,
        "max_position_embeddings": 256, "max_window_layers": 2}
#: FSDP1: LoRA (peft's wrap policy, as the Trainer's update_fsdp_plugin_peft sets it) with CPU offload;
#: FSDP2: LoRA under bf16 MixedPrecisionPolicy, reshard_after_forward false (shard_grad_op)
SHAPES = {
    "fsdp1-lora-offload": Setup(fsdp="full_shard", offload_params="cpu", method="lora", lora_rank=4, gpus=2,
                                batch=2, seq=32),
    # QLoRA: before train.py kept the YAML's precision, transformers 5.24's update_fsdp_plugin_peft gave
    # the bf16-stored 4-bit base a bf16 MixedPrecision and peft's fp32 lora_A got bf16 weights and fp32 x
    "fsdp1-qlora": Setup(fsdp="full_shard", method="qlora", lora_rank=4, gpus=2, batch=2, seq=32),
    "fsdp2-lora-bf16-mixed": Setup(fsdp="shard_grad_op", fsdp_version=2, method="lora", lora_rank=4,
                                   precision="bf16-mixed", gpus=2, batch=2, seq=32),
}


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _emit(tmp_path, setup: Setup):
    (tmp_path / "tiny").mkdir(exist_ok=True)
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**load_model("qwen2-0.5b").config, **TINY}))
    model, gpu = load_model(str(tmp_path / "tiny" / "config.json")), load_gpu("rtx-4090")
    plan = Plan(model=model.name, setup=setup, breakdown=estimate(model, setup, gpu), gpu=gpu)
    emit_to_dir(plan, tmp_path / "out")
    return tmp_path / "out", plan


def test_cpu_command_keeps_the_emitted_launch(tmp_path):
    folder, plan = _emit(tmp_path, SHAPES["fsdp2-lora-bf16-mixed"])
    emitted = launch_command(plan)
    assert emitted == "accelerate launch --config_file accelerate_config.yaml train.py"
    assert f"# run (from this directory): {emitted}" in (folder / "train.py").read_text()
    assert cpu_command(emitted, 1234) == ["accelerate", "launch", "--config_file", "accelerate_config.yaml",
                                          "--main_process_port", "1234", "-m", "vramplan.truths.cpu_launch",
                                          "train.py"]
    with pytest.raises(ValueError, match="not an accelerate launch"):
        cpu_command("torchrun --nproc_per_node 2 train.py", 1234)


ALONE = textwrap.dedent("""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    out = {}
    try:
        FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=True)
    except RuntimeError as exc:
        out["fsdp1_plugin"] = str(exc)
    fsdp2 = FullyShardedDataParallelPlugin(fsdp_version=2)
    state = Accelerator(mixed_precision="bf16", cpu=True, fsdp_plugin=fsdp2).state
    out["alone"] = [str(state.distributed_type), "fsdp_plugin" in state.__dict__]
    AcceleratorState._reset_state(reset_partial_state=True)
    from vramplan.truths.cpu_launch import install_stand_ins
    install_stand_ins()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    state = Accelerator(mixed_precision="bf16", cpu=True, fsdp_plugin=plugin).state
    out["stood_in"] = [str(state.distributed_type), str(PartialState().distributed_type), str(state.device),
                       state.fsdp_plugin is plugin, str(plugin.mixed_precision_policy.param_dtype)]
    fsdp1 = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=True)
    with torch.device("meta"):
        lin = torch.nn.Linear(2, 2)
    fsdp1.param_init_fn(lin)
    out["param_init_fn"] = str(lin.weight.device)
    print(json.dumps(out))
""")


def test_accelerate_alone_runs_no_fsdp_on_cpu():
    """What accelerate 1.15 does on this CPU machine without the stand-ins, and with them (one
    process, gloo): the FSDP1 plugin of the emitted YAML (sync_module_states) cannot be built, and a
    CPU state drops an FSDP2 plugin; stand-in 1 makes it the FSDP state the accelerator branch
    builds, stand-in 2 materializes FSDP1's meta modules on the CPU."""
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", ALONE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "no available devices" in got["fsdp1_plugin"]
    assert got["alone"] == ["DistributedType.MULTI_CPU", False]
    assert got["stood_in"] == ["DistributedType.FSDP", "DistributedType.FSDP", "cpu", True, "torch.bfloat16"]
    assert got["param_init_fn"] == "cpu"


def _launch(folder, plan, world: int = 2) -> list[dict]:
    """The emitted launch (plus the port and vramplan.truths.cpu_launch), two steps on ``world`` gloo
    ranks; each rank's launch report."""
    cmd = cpu_command(launch_command(plan), free_port())
    cmd += ["--cpu", "--max-steps", "2", "--no-save", "--memory-report", "memory.json"]
    run = subprocess.run(cmd, cwd=folder, env=_env(), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stdout[-2000:]}\n{run.stderr[-5000:]}"
    ranks = [json.loads((folder / REPORT.format(rank=r)).read_text()) for r in range(world)]
    for r, got in enumerate(ranks):
        assert (got["rank"], got["world_size"], got["backend"], got["global_step"]) == (r, world, "gloo", 2)
        adapters = plan.breakdown.params_trainable if plan.setup.adapters else 0  # params_total: the base's
        if plan.setup.quant in ("nf4", "fp4"):  # Params4bit packed in bf16: 4 weights per element
            assert plan.breakdown.params_total / 4 < got["model_param_numel"] - adapters < plan.breakdown.params_total
        else:
            assert got["model_param_numel"] == plan.breakdown.params_total + adapters
        memory = json.loads((folder / f"memory.rank{r}.json").read_text())  # train.py's own report
        assert [row["step"] for row in memory["steps"]] == [1, 2] and memory["world_size"] == world
    return ranks


@pytest.mark.parametrize("shape", [s if s == "fsdp1-qlora" else pytest.param(s, marks=pytest.mark.slow)
                                   for s in sorted(SHAPES)])  # one emitted FSDP launch in the fast tier
def test_emitted_fsdp_config_and_train_py_run_on_two_cpu_ranks(tmp_path, shape):
    """Two optimizer steps of the emitted train.py under the emitted YAML on 2 gloo ranks: each rank
    trained an FSDP-wrapped model of the YAML's version and settings, holding half the parameters."""
    folder, plan = _emit(tmp_path, SHAPES[shape])
    setup = plan.setup
    emitted = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    for got in _launch(folder, plan):
        assert got["distributed_type"] == "FSDP" and got["is_fsdp_enabled"]
        assert got["fsdp"]["version"] == emitted["fsdp_config"]["fsdp_version"] == setup.fsdp_version
        # the launcher exported the YAML, the plugin read it back
        assert got["env"]["ACCELERATE_USE_FSDP"] == "true"
        assert got["env"]["ACCELERATE_MIXED_PRECISION"] == emitted["mixed_precision"] == got["mixed_precision"]
        assert got["env"]["FSDP_OFFLOAD_PARAMS"] == str(emitted["fsdp_config"]["fsdp_offload_params"]).lower()
        if setup.fsdp_version == 1:
            assert got["fsdp1_modules"] > TINY["num_hidden_layers"] and got["fsdp2_modules"] == 0
            assert got["fsdp"]["sharding_strategy"] == emitted["fsdp_config"]["fsdp_sharding_strategy"]
            assert got["fsdp"]["offload"] is (setup.offload_params == "cpu")
        else:
            assert got["fsdp2_modules"] > TINY["num_hidden_layers"] and got["fsdp1_modules"] == 0
            assert got["fsdp"]["reshard_after_forward"] is emitted["fsdp_config"]["fsdp_reshard_after_forward"]
            assert got["fsdp"]["mixed_precision_policy"] == ("torch.bfloat16" if setup.precision == "bf16-mixed"
                                                             else None)
        # half of every parameter (padded) on each rank
        assert got["model_param_numel"] / 2 <= got["local_param_numel"] < got["model_param_numel"] * 0.51


@pytest.mark.slow
def test_emitted_tp_config_and_train_py_run_on_two_cpu_ranks(tmp_path):
    """Tensor parallelism: the emitted MULTI_GPU YAML and train.py (DistributedConfig(tp_plan="auto"))
    on 2 gloo ranks, through the HF Trainer: no DDP wrapper, the Trainer's ParallelismConfig tp 2, each
    rank a 1/2 shard of every Linear (norms replicated). Before this train.py saved its random base
    after the process group existed: rank 1 loaded an empty directory."""
    folder, plan = _emit(tmp_path, Setup(batch=2, seq=32, gpus=2, tp=2))
    assert yaml.safe_load((folder / "accelerate_config.yaml").read_text())["distributed_type"] == "MULTI_GPU"
    for got in _launch(folder, plan):
        assert got["distributed_type"] == "MULTI_CPU" and not got["is_fsdp_enabled"]
        assert got["wrapper"] != "DistributedDataParallel" and "ACCELERATE_USE_FSDP" not in got["env"]
        assert got["tp_size"] == got["parallelism"]["tp"] == 2 and got["dtensor_params"] > 0
        assert got["model_param_numel"] / 2 < got["local_param_numel"] < got["model_param_numel"] * 0.55


@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_emitted_tp_with_fsdp2_config_and_train_py_run_on_four_cpu_ranks(tmp_path, grad_accum):
    """Tensor parallelism 2 beside FSDP2 sharding 2 (the YAML's parallelism_config, train.py's
    DistributedConfig(tp_size, fsdp_size): transformers 5.24 fully_shards the TP model on one 2-D mesh)
    on 4 gloo ranks: each rank about a quarter of every parameter; with gradient accumulation too
    (accelerate's no_sync is a no-op for that model: estimator/tp_fsdp2.py accumulated_grad_bytes)."""
    folder, plan = _emit(tmp_path, Setup(batch=2, seq=32, gpus=4, tp=2, fsdp="full_shard", fsdp_version=2,
                                         grad_accum=grad_accum))
    emitted = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    assert emitted["parallelism_config"]["parallelism_config_tp_size"] == 2
    for got in _launch(folder, plan, world=4):
        assert got["tp_size"] == got["parallelism"]["tp"] == 2 and got["parallelism"]["dp_shard"] == 2
        assert got["fsdp2_modules"] > TINY["num_hidden_layers"] and got["dtensor_params"] > 0
        assert got["model_param_numel"] / 4 < got["local_param_numel"] < got["model_param_numel"] * 0.26


OFFLOAD = textwrap.dedent("""
    import json
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    dist.init_process_group("gloo")
    lin = torch.nn.Linear(8, 8)
    fully_shard(lin, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fsdp_param = lin._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    lin(torch.randn(2, 8)).sum().backward()  # (the first forward sets the group's dtypes)
    gathered = fsdp_param.all_gather_inputs[0]  # what the next all-gather sends: the "device" copy
    host = fsdp_param._sharded_param_data.untyped_storage().data_ptr()
    print(json.dumps({"device": str(fsdp_param.device), "same_storage": gathered.untyped_storage().data_ptr() == host,
                      "grad": str(lin.weight.grad.to_local().device)}))
    dist.destroy_process_group()
""")


def test_fsdp2_cpu_offload_copies_nothing_on_a_cpu_mesh_so_it_stays_refused():
    """torch 2.13 ``fully_shard(offload_policy=CPUOffloadPolicy())`` runs on a gloo CPU rank, but
    there its host->device copy of a shard before the all-gather (``FSDPParam.all_gather_inputs``:
    ``.to(self.device)``) is the host shard itself, as is the device->host copy of the gradient
    (``foreach_reduce``): a truth would see neither the GPU's copies nor its freed reduce-scatter
    output, so its GPU/host split is not a measurement, and the estimate refuses it, saying so."""
    env = {**_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", OFFLOAD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"device": "cpu", "same_storage": True, "grad": "cpu"}
    with pytest.raises(SpecError, match="CPUOffloadPolicy.*no-op.*--fsdp-version 1"):
        estimate(load_model("llama-3.2-1b"), Setup(fsdp="full_shard", fsdp_version=2, gpus=2, offload_params="cpu"))


@pytest.mark.slow
def test_emitted_tp_lora_config_and_train_py_run_on_two_cpu_ranks(tmp_path):
    """LoRA on the column-parallel Linears under tensor parallelism 2: train.py applies peft 0.21's
    get_peft_model after the DTensor TP load (as vramplan/truths/tp_lora.py ran it, right against an
    unsharded step: tests/test_tp_lora.py), and the Trainer steps on 2 gloo ranks; each rank holds
    half the base, every lora_A whole and its half of every lora_B (a DTensor)."""
    from vramplan.truths.tp_truth import COLWISE_TARGETS

    setup = Setup(batch=2, seq=32, gpus=2, tp=2, method="lora", lora_rank=4, lora_targets=COLWISE_TARGETS)
    folder, plan = _emit(tmp_path, setup)
    assert "get_peft_model" in (folder / "train.py").read_text()
    h, r, outs = TINY["hidden_size"], 4, (64, 32, 32, 128, 128)  # q, k, v (head_dim 16), gate, up
    layers = TINY["num_hidden_layers"]
    adapters = layers * sum(r * h + r * o for o in outs)
    local_adapters = layers * sum(r * h + r * o // 2 for o in outs)
    norms = (2 * layers + 1) * h  # replicated; everything else of the base is halved
    assert plan.breakdown.params_trainable == adapters
    for got in _launch(folder, plan):
        assert got["tp_size"] == got["parallelism"]["tp"] == 2 and got["wrapper"] == "PeftModelForCausalLM"
        base = got["model_param_numel"] - adapters
        assert got["local_param_numel"] - local_adapters == (base - norms) // 2 + norms
