"""`vramplan plan --from FILE`: a training config's setup estimated as written, then planned with
the file's model, GPUs, sequence length, global batch and quality choices kept and the memory
savers searched; the changes printed vs the file (vramplan.readers.planning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.readers import merge_fixed, plan_inputs, read_config, setup_changes
from vramplan.readers.planning import kept_knobs
from vramplan.specs import Setup

CONFIGS = Path(__file__).parent / "data" / "configs"
FULL = str(CONFIGS / "trl/zephyr-7b-beta-sft-config_full.yaml")  # full, batch 16, checkpointing, flash
QLORA = str(CONFIGS / "axolotl/qlora-1b.yml")  # qlora r=32 alpha=16 on 7 modules, batch 2 x accum 4


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_file_that_does_not_fit_gets_the_savers_it_needs_at_the_same_global_batch():
    # (a TRL SFT config: loss trl, TRL's fused head, fits a 24 GiB card as written; a 16 GiB T4 it does not)
    out = plan_json("llama-3.2-1b", "--from", FULL, "--gpu", "t4")
    src, setup = out["from_config"], out["setup"]
    assert src["fits"] is False and src["device_total_bytes"] > src["usable_bytes"]
    assert src["setup"]["batch"] == 16 and src["global_batch"] == 16
    assert out["fits"] is True
    assert setup["batch"] * setup["grad_accum"] * setup["gpus"] == 16  # the file's global batch
    assert (setup["method"], setup["seq"], setup["precision"]) == ("full", 2048, "bf16")  # kept
    changes = {c["field"]: (c["file"], c["plan"]) for c in src["changes"]}
    assert changes["batch"][0] == 16 and changes["batch"][1] == setup["batch"] < 16
    assert set(changes) <= {"batch", "grad_accum", "checkpointing", "optimizer", "attn", "zero_stage",
                            "offload_optimizer", "offload_params", "fsdp", "liger"}  # only memory savers move
    assert changes == {c.field: (c.file, c.plan) for c in setup_changes(Setup(**src["setup"]), Setup(**setup))}


def test_quality_choices_of_the_file_are_kept():
    out = plan_json("llama-3.2-1b", "--from", QLORA, "--gpu", "t4")
    setup = out["setup"]
    assert (setup["method"], setup["quant"], setup["lora_rank"], setup["lora_alpha"], setup["lora_dropout"]) == (
        "qlora", "nf4", 32, 16, 0.05)
    assert setup["lora_targets"] == "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj"
    assert setup["batch"] * setup["grad_accum"] == 8 and setup["seq"] == 2048 and setup["attn"] == "flash"


def test_terminal_output_says_as_written_and_the_changes():
    result = CliRunner().invoke(main, ["plan", "llama-3.2-1b", "--from", FULL, "--gpu", "t4"])
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"{FULL} (trl) as written: trl: full") and "does not fit" in first and "GiB short" in first
    assert f"changes vs {FULL} (the plan):" in result.stdout
    assert "  --batch: 16 -> " in result.stdout
    assert "assumed: dtype" in result.stderr or "warning:" in result.stderr  # the reader's warnings


def test_typed_knobs_and_settings_win_over_the_file():
    out = plan_json("llama-3.2-1b", "--from", QLORA, "--gpu", "a100-80gb", "--method", "full", "--seq", "1024",
                    "--global-batch", "16")
    setup = out["setup"]
    assert (setup["method"], setup["quant"], setup["seq"]) == ("full", "none", 1024)
    assert setup["batch"] * setup["grad_accum"] == 16
    fields = {c["field"] for c in out["from_config"]["changes"]}
    assert {"method", "quant", "seq"} <= fields and "lora_rank" not in fields  # the method change says it


def test_the_file_gpu_count_is_taken_and_gpus_typed_wins():
    acc = str(CONFIGS / "accelerate/handbook_zero3.yaml")
    out = plan_json("llama-3.2-1b", "--from", FULL, "--accelerate-config", acc, "--gpu", "a100-80gb")
    assert out["setup"]["gpus"] == 8 and out["from_config"]["global_batch"] == 16 * 8
    assert out["setup"]["batch"] * out["setup"]["grad_accum"] * 8 == 128
    four = plan_json("llama-3.2-1b", "--from", FULL, "--accelerate-config", acc, "--gpu", "a100-80gb", "--gpus", "4")
    assert four["setup"]["gpus"] == 4 and four["from_config"]["setup"]["gpus"] == 8  # as written: on its 8
    assert four["setup"]["batch"] * four["setup"]["grad_accum"] * 4 == 128  # the file's global batch


def test_plan_inputs_split_kept_from_free():
    read = read_config(QLORA)
    src = plan_inputs(read, "llama-3.2-1b")
    assert (src.model, src.gpus, src.seq, src.global_batch) == ("llama-3.2-1b", 1, 2048, 8)
    assert src.fixed == {"method": "qlora", "quant": "nf4", "precision": "bf16", "loss": "hf", "lora_rank": 32,
                         "lora_alpha": 16, "lora_dropout": 0.05, "double_quant": True, "attn": "flash",
                         "lora_targets": "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj",
                         "padding_free": True,  # sample_packing with flash attention: the file's collator, kept
                         "framework": "axolotl"}  # the framework that runs the file: its model preparation
    assert "optimizer" not in src.fixed and "checkpointing" not in src.fixed and "batch" not in src.fixed
    assert kept_knobs(Setup(optimizer="sgd"))["optimizer"] == "sgd"  # another recipe: kept
    assert kept_knobs(Setup(optimizer="paged-adamw-8bit"))["optimizer"] == "paged-adamw-8bit"
    assert "quant" not in kept_knobs(Setup()) and "lora_rank" not in kept_knobs(Setup())
    assert merge_fixed(src.fixed, {"method": "full"}).keys() == {"method", "precision", "loss", "attn", "padding_free",
                                                                "framework"}
    assert merge_fixed(src.fixed, {"lora_rank": 8})["lora_targets"] == src.fixed["lora_targets"]
    assert merge_fixed(src.fixed, {"quant": "int8"})["quant"] == "int8" and "method" not in merge_fixed(
        src.fixed, {"quant": "int8"})


def test_setup_changes_are_typed_and_ignore_unused_adapter_fields():
    a, b = Setup(batch=4, lora_rank=8), Setup(batch=2, grad_accum=2, lora_rank=64, checkpointing=True)
    assert [(c.field, c.file, c.plan) for c in setup_changes(a, b)] == [
        ("checkpointing", False, True), ("batch", 4, 2), ("grad_accum", 1, 2)]
    lora = Setup(method="lora", lora_rank=16)
    assert [c.field for c in setup_changes(lora, lora.replace(lora_alpha=32))] == []  # 32 is 2 x 16 already
    assert [c.field for c in setup_changes(lora, lora.replace(lora_rank=8))] == ["lora_rank", "lora_alpha"]
    assert [c.field for c in setup_changes(lora, Setup(lora_rank=8))] == ["method"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--gpu", "rtx-4090"], ("plan needs MODEL", "--from FILE")),
        (["llama-3.2-1b", "--gpu", "rtx-4090", "--format", "axolotl"], ("--format", "--from FILE")),
        (["--from", str(CONFIGS / "axolotl/lora-1b.yml"), "--format", "trl", "--gpu", "rtx-4090"],
         ("reads as axolotl", "not trl")),
        (["--from", str(CONFIGS / "accelerate/trl_multi_gpu.yaml"), "--gpu", "rtx-4090"], ("names no model",)),
    ],
)
def test_bad_input_is_one_line(args, fragments):
    assert_user_error(CliRunner().invoke(main, ["plan", *args]), *fragments)
