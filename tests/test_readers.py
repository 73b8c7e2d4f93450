"""The training-config readers (vramplan.readers): the corpus of real configs in tests/data/configs
(each with its repository, path and commit in the folder's SOURCES.json), detection, --format,
the estimate from a file against the same setup given as flags, warnings, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.commands.from_config import FORMAT_NAMES
from vramplan.commands.options import FLAG
from vramplan.readers import FORMATS, ReadWarning, detect, read_config
from vramplan.specs import Setup, SpecError

CONFIGS = Path(__file__).parent / "data" / "configs"

#: file -> (format, model as written, the Setup fields it determines): checked by hand against
#: each file and its framework's defaults (docs/formats/*.md say which default comes from where)
EXPECTED = {
    "accelerate/handbook_fsdp.yaml": ("accelerate", None, {"fsdp": "full_shard", "gpus": 8}),
    "accelerate/handbook_zero3.yaml": (
        "accelerate",
        None,
        {"zero_stage": 3, "offload_optimizer": "none", "offload_params": "none", "gpus": 8},
    ),
    "accelerate/trl_deepspeed_zero2.yaml": (
        "accelerate",
        None,
        {"zero_stage": 2, "offload_optimizer": "none", "offload_params": "none", "gpus": 8},
    ),
    "accelerate/trl_deepspeed_zero3.yaml": (
        "accelerate",
        None,
        {"zero_stage": 3, "offload_optimizer": "none", "offload_params": "none", "gpus": 8},
    ),
    "accelerate/trl_fsdp1.yaml": ("accelerate", None, {"fsdp": "full_shard", "gpus": 8}),
    "accelerate/trl_multi_gpu.yaml": ("accelerate", None, {"gpus": 8}),
    "accelerate/trl_single_gpu.yaml": ("accelerate", None, {"gpus": 1}),
    "peft/configs/fsdp_config_qlora.yaml": ("accelerate", None, {"offload_params": "cpu", "fsdp": "full_shard",
                                                                "gpus": 2}),
    # peft's own SFT example (issue 29): its ModelArguments flags (--use_peft_lora, --use_4bit_quantization,
    # --lora_r 8, --use_flash_attn) under TRL's SFTTrainer, not full fine-tuning
    "peft/run_peft_qlora_fsdp.sh": (
        "trl",
        "meta-llama/Llama-2-70b-hf",
        {"offload_params": "cpu", "fsdp": "full_shard", "batch": 2, "grad_accum": 2, "checkpointing": True,
         "optimizer": "adamw-fused", "seq": 2048, "padding_free": True, "loss": "trl", "attn": "flash",
         "method": "qlora", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.1, "lora_targets": "all-linear",
         "quant": "nf4", "double_quant": True, "precision": "bf16", "gpus": 2},
    ),
    "hf/cbdetect-training_args.json": (
        "hf",
        "facebook/detr-resnet-50",
        {
            "batch": 8,
            "eval_batch": 8,  # do_eval: the Trainer's per_device_eval_batch_size default
            "grad_accum": 1,
            "checkpointing": False,
            "optimizer": "adamw-fused",
            "precision": "bf16",
            "attn": "auto",
        },
    ),
    "axolotl/deepspeed_configs/zero1.json": (
        "deepspeed",
        None,
        {"zero_stage": 1, "offload_optimizer": "none", "offload_params": "none"},
    ),
    "axolotl/deepspeed_configs/zero2.json": (
        "deepspeed",
        None,
        {"zero_stage": 2, "offload_optimizer": "cpu", "offload_params": "none"},
    ),
    "axolotl/deepspeed_configs/zero3_bf16.json": (
        "deepspeed",
        None,
        {"zero_stage": 3, "offload_optimizer": "none", "offload_params": "none"},
    ),
    "axolotl/fft-8b-liger-fsdp.yaml": (
        "axolotl",
        "NousResearch/Meta-Llama-3.1-8B",
        {
            "method": "full",
            "seq": 4096,
            "batch": 2,
            "grad_accum": 4,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-fused",
            "precision": "bf16",
            "offload_params": "cpu",
            "fsdp": "full_shard",
            "liger": True,
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/fft-8b.yaml": (
        "axolotl",
        "NousResearch/Meta-Llama-3.1-8B",
        {"framework": "axolotl",
            "method": "full",
            "seq": 8192,
            "batch": 1,
            "grad_accum": 8,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "paged-adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/llama-2-fft_optimized.yml": (
        "axolotl",
        "NousResearch/Llama-2-7b-hf",
        {"framework": "axolotl",
            "method": "full",
            "seq": 4096,
            "batch": 1,
            "grad_accum": 1,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/llama-2-lora.yml": (
        "axolotl",
        "NousResearch/Llama-2-7b-hf",
        {"framework": "axolotl",
            "method": "lora",
            "quant": "int8",
            "lora_rank": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "all-linear",
            "seq": 4096,
            "batch": 2,
            "grad_accum": 4,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/lora-1b.yml": (
        "axolotl",
        "NousResearch/Llama-3.2-1B",
        {"framework": "axolotl",
            "method": "lora",
            "lora_rank": 16,
            "lora_alpha": 32,
            "lora_dropout": 0.05,
            "lora_targets": "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj",
            "seq": 2048,
            "batch": 2,
            "grad_accum": 2,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/mistral-qlora.yml": (
        "axolotl",
        "mistralai/Mistral-7B-v0.1",
        {"framework": "axolotl",
            "method": "qlora",
            "lora_rank": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "all-linear",
            "seq": 8192,
            "batch": 2,
            "grad_accum": 4,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/qlora-1b.yml": (
        "axolotl",
        "NousResearch/Llama-3.2-1B",
        {"framework": "axolotl",
            "method": "qlora",
            "lora_rank": 32,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj",
            "seq": 2048,
            "batch": 2,
            "grad_accum": 4,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "axolotl/stablelm-2-1.6b-fft.yml": (
        "axolotl",
        "stabilityai/stablelm-2-1_6b",
        {"framework": "axolotl",
            "method": "full",
            "seq": 4096,
            "batch": 1,
            "grad_accum": 1,
            "checkpointing": True,
            "attn": "flash",
            "optimizer": "adamw-8bit",
            "precision": "bf16",
            "padding_free": True,  # sample_packing with flash attention
        },
    ),
    "llamafactory/examples/deepspeed/ds_z0_config.json": (
        "deepspeed",
        None,
        {"zero_stage": 0, "offload_optimizer": "none", "offload_params": "none"},
    ),
    "llamafactory/examples/deepspeed/ds_z2_offload_config.json": (
        "deepspeed",
        None,
        {"zero_stage": 2, "offload_optimizer": "cpu", "offload_params": "none"},
    ),
    "llamafactory/examples/deepspeed/ds_z3_config.json": (
        "deepspeed",
        None,
        {"zero_stage": 3, "offload_optimizer": "none", "offload_params": "none"},
    ),
    "llamafactory/examples/deepspeed/ds_z3_offload_config.json": (
        "deepspeed",
        None,
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    ),
    "llamafactory/fsdp_qlora_llama3_lora_sft.yaml": (
        "llamafactory",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        {"framework": "llamafactory",
            "batch": 1,
            "grad_accum": 8,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "auto",
            "lora_rank": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all-linear",
            "method": "qlora",
            "quant": "nf4",
            "double_quant": True,
            "precision": "bf16",
        },
    ),
    "llamafactory/galore_llama3_full_sft.yaml": (
        "llamafactory",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        {"framework": "llamafactory",
            "batch": 1,
            "grad_accum": 1,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "auto",
            "method": "full",
            "precision": "bf16",
        },
    ),
    "llamafactory/qwen3_full_sft.yaml": (
        "llamafactory",
        "Qwen/Qwen3-4B-Instruct-2507",
        {
            "batch": 1,
            "grad_accum": 2,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "zero_stage": 3,
            "offload_optimizer": "none",
            "offload_params": "none",
            "seq": 2048,
            "attn": "auto",
            "method": "full",
            "precision": "bf16-mixed",
        },
    ),
    "llamafactory/qwen3_lora_dpo.yaml": (
        "llamafactory",
        "Qwen/Qwen3-4B-Instruct-2507",
        {"framework": "llamafactory",
            "batch": 1,
            "grad_accum": 8,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "auto",
            "lora_rank": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all-linear",
            "method": "lora",
            "precision": "bf16",
        },
    ),
    "llamafactory/qwen3_lora_sft.yaml": (
        "llamafactory",
        "Qwen/Qwen3-4B-Instruct-2507",
        {"framework": "llamafactory",
            "batch": 1,
            "grad_accum": 8,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "auto",
            "lora_rank": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all-linear",
            "method": "lora",
            "precision": "bf16",
        },
    ),
    "llamafactory/qwen3_lora_sft_ds3.yaml": (
        "llamafactory",
        "Qwen/Qwen3-4B-Instruct-2507",
        {
            "batch": 1,
            "grad_accum": 2,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "zero_stage": 3,
            "offload_optimizer": "none",
            "offload_params": "none",
            "seq": 2048,
            "attn": "auto",
            "lora_rank": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all-linear",
            "method": "lora",
            "precision": "bf16",
        },
    ),
    "llamafactory/qwen3_lora_sft_otfq.yaml": (
        "llamafactory",
        "Qwen/Qwen3-4B-Instruct-2507",
        {"framework": "llamafactory",
            "batch": 1,
            "grad_accum": 8,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "auto",
            "lora_rank": 8,
            "lora_dropout": 0.0,
            "lora_targets": "all-linear",
            "method": "qlora",
            "quant": "nf4",
            "double_quant": True,
            "precision": "bf16",
        },
    ),
    "torchtune/gemma2_2B_lora_single_device.yaml": (
        "torchtune",
        "google/gemma-2-2b",
        {
            "method": "lora",
            "lora_rank": 64,
            "lora_alpha": 128,
            "lora_dropout": 0.0,
            "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "batch": 8,
            "grad_accum": 8,
            "checkpointing": True,
            "precision": "bf16",
            "optimizer": "adamw-fused",
        },
    ),
    "torchtune/llama3_1_8B_full.yaml": (
        "torchtune",
        "meta-llama/Llama-3.1-8B",
        {
            "method": "full",
            "batch": 2,
            "grad_accum": 1,
            "checkpointing": True,
            "precision": "bf16",
            "optimizer": "adamw-fused",
            "fsdp": "full_shard",
            "gpus": 4,
        },
    ),
    "torchtune/llama3_1_8B_lora_single_device.yaml": (
        "torchtune",
        "meta-llama/Llama-3.1-8B",
        {"framework": "torchtune",
            "method": "lora",
            "lora_rank": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "batch": 2,
            "grad_accum": 8,
            "checkpointing": True,
            "precision": "bf16",
            "optimizer": "adamw-fused",
        },
    ),
    "torchtune/llama3_2_1B_full_single_device.yaml": (
        "torchtune",
        "meta-llama/Llama-3.2-1B",
        {"framework": "torchtune",
            "method": "full",
            "batch": 4,
            "grad_accum": 1,
            "checkpointing": False,
            "precision": "bf16",
            "optimizer": "paged-adamw-8bit",
            "optimizer_in_backward": True,  # optimizer_in_bwd: True
        },
    ),
    "torchtune/llama3_2_1B_lora_single_device.yaml": (
        "torchtune",
        "meta-llama/Llama-3.2-1B",
        {"framework": "torchtune",
            "method": "lora",
            "lora_rank": 64,
            "lora_alpha": 128,
            "lora_dropout": 0.0,
            "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "batch": 4,
            "grad_accum": 8,
            "checkpointing": False,
            "precision": "bf16",
            "optimizer": "adamw-fused",
        },
    ),
    "torchtune/llama3_2_1B_qlora_single_device.yaml": (
        "torchtune",
        "meta-llama/Llama-3.2-1B",
        {"framework": "torchtune",
            "method": "qlora",
            "quant": "nf4",
            "double_quant": True,
            "lora_rank": 64,
            "lora_alpha": 128,
            "lora_dropout": 0.0,
            "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "batch": 4,
            "grad_accum": 8,
            "checkpointing": False,
            "precision": "bf16",
            "optimizer": "adamw-fused",
        },
    ),
    "torchtune/qwen2_5_0.5B_full_single_device.yaml": (
        "torchtune",
        "Qwen/Qwen2.5-0.5B",
        {"framework": "torchtune",
            "method": "full",
            "batch": 2,
            "grad_accum": 8,
            "checkpointing": False,
            "precision": "bf16",
            "optimizer": "adamw-fused",
        },
    ),
    "trl/example_config.yaml": (
        "trl",
        "Qwen/Qwen2.5-0.5B",
        {"framework": "trl",
            "batch": 8,
            "grad_accum": 1,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 1024,
            "attn": "auto",
            "precision": "bf16-mixed",
        },
    ),
    "trl/smollm2-sft-config.yaml": (
        "trl",
        "HuggingFaceTB/SmolLM2-1.7B",
        {"framework": "trl",
            "batch": 4,
            "grad_accum": 4,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 8192,
            "attn": "flash",
            "precision": "bf16",
            "loss": "trl",  # SFTTrainer's fused LM head (TRL 1.16)
        },
    ),
    "trl/zephyr-7b-beta-dpo-config_qlora.yaml": (
        "trl",
        "alignment-handbook/zephyr-7b-sft-qlora",
        {"framework": "trl",
            "batch": 4,
            "grad_accum": 4,
            "checkpointing": True,
            "optimizer": "adamw",
            "seq": 1024,
            "attn": "flash",
            "method": "qlora",
            "lora_rank": 128,
            "lora_alpha": 128,
            "lora_dropout": 0.05,
            "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "quant": "nf4",
            "double_quant": False,
            "precision": "bf16",
            "loss": "trl",  # SFTTrainer's fused LM head (TRL 1.16)
        },
    ),
    "trl/zephyr-7b-beta-sft-config_full.yaml": (
        "trl",
        "mistralai/Mistral-7B-v0.1",
        {"framework": "trl",
            "batch": 16,
            "grad_accum": 1,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "flash",
            "precision": "bf16",
            "loss": "trl",  # SFTTrainer's fused LM head (TRL 1.16)
        },
    ),
    "trl/zephyr-7b-beta-sft-config_qlora.yaml": (
        "trl",
        "mistralai/Mistral-7B-v0.1",
        {"framework": "trl",
            "batch": 4,
            "grad_accum": 2,
            "checkpointing": True,
            "optimizer": "adamw-fused",
            "seq": 2048,
            "attn": "flash",
            "method": "qlora",
            "lora_rank": 16,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            "quant": "nf4",
            "double_quant": False,
            "precision": "bf16",
            "loss": "trl",  # SFTTrainer's fused LM head (TRL 1.16)
        },
    ),
}

#: the model each corpus file trains -> a shipped profile of the same architecture
SHIPPED = {
    "NousResearch/Meta-Llama-3.1-8B": "llama-3.1-8b",
    "NousResearch/Llama-2-7b-hf": "llama-2-7b",
    "NousResearch/Llama-3.2-1B": "llama-3.2-1b",
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "stabilityai/stablelm-2-1_6b": "stablelm-2-1_6b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3-4b",
    "google/gemma-2-2b": "gemma-2-2b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "Qwen/Qwen2.5-0.5B": "qwen2-0.5b",
    "HuggingFaceTB/SmolLM2-1.7B": "smollm2-1.7b",
    "alignment-handbook/zephyr-7b-sft-qlora": "mistral-7b",
    "facebook/detr-resnet-50": "llama-3.2-1b",  # not an LLM: the file's TrainingArguments on a shipped one
    None: "llama-3.2-1b",
}


def corpus_files():
    return sorted(p for p in CONFIGS.rglob("*") if p.is_file() and p.name != "SOURCES.json")


def test_corpus_is_complete_with_provenance():
    files = corpus_files()
    assert sorted(str(p.relative_to(CONFIGS)) for p in files) == sorted(EXPECTED)
    training = [f for f, (fmt, *_) in EXPECTED.items() if fmt not in ("accelerate", "deepspeed")]
    assert len(training) >= 20
    assert {fmt for fmt, *_ in EXPECTED.values()} >= {
        "axolotl",
        "llamafactory",
        "trl",
        "torchtune",
        "accelerate",
        "deepspeed",
        "hf",
    }
    for p in files:
        sources = json.loads((CONFIGS / p.relative_to(CONFIGS).parts[0] / "SOURCES.json").read_text())
        entry = sources[str(p.relative_to(CONFIGS / p.relative_to(CONFIGS).parts[0]))]
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), p
        assert entry["repo"].count("/") == 1 and entry["path"], p


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_setup_matches_the_hand_checked_mapping(name):
    fmt, model, fields = EXPECTED[name]
    read = read_config(CONFIGS / name)
    assert (read.format, read.model) == (fmt, model)
    assert read.setup == Setup(**fields)
    assert read.fields == fields
    assert all(isinstance(w, ReadWarning) and w.field and w.why for w in read.warnings)


def _flags(fields: dict) -> list[str]:
    args: list[str] = []
    for key, value in fields.items():
        flag = FLAG[key]
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_estimate_from_the_file_equals_the_explicit_flags(name):
    fmt, model, fields = EXPECTED[name]
    shipped = SHIPPED[model]
    runner = CliRunner()
    from_file = runner.invoke(
        main, ["estimate", str(CONFIGS / name), "--model", shipped, "--gpu", "a100-80gb", "--json"]
    )
    assert from_file.exit_code == 0, from_file.output
    explicit = runner.invoke(main, ["estimate", shipped, *_flags(fields), "--gpu", "a100-80gb", "--json"])
    assert explicit.exit_code == 0, explicit.output
    assert json.loads(from_file.stdout) == json.loads(explicit.stdout)


def test_warnings_name_the_ignored_fields():
    read = read_config(CONFIGS / "axolotl/fft-8b-liger-fsdp.yaml")
    ignored = {w.field for w in read.warnings if w.kind == "ignored"}
    assert "sample_packing" not in ignored and read.setup.padding_free  # multipack with flash attention
    assert not any(name.startswith("liger_") for name in ignored)  # LigerPlugin with its kernels: --liger
    tt = {w.field for w in read_config(CONFIGS / "torchtune/llama3_2_1B_full_single_device.yaml").warnings}
    assert {"tokenizer.max_seq_len", "loss._component_"} <= tt
    assert "optimizer_in_bwd" not in tt  # mapped: --optimizer-in-backward
    lf = {w.field for w in read_config(CONFIGS / "llamafactory/galore_llama3_full_sft.yaml").warnings}
    assert "use_galore" in lf
    result = CliRunner().invoke(main, ["estimate", str(CONFIGS / "axolotl/fft-8b.yaml"), "--model", "llama-3.1-8b"])
    assert result.exit_code == 0
    assert "warning: " in result.stderr and "assumed: bf16" in result.stderr
    assert "sample_packing" not in result.stderr  # mapped: --padding-free (flash attention)


def test_detection():
    assert detect({"base_model": "x", "micro_batch_size": 2}) == "axolotl"
    assert detect({"model_name_or_path": "x", "finetuning_type": "lora"}) == "llamafactory"
    assert detect({"model_name_or_path": "x", "use_peft": True}) == "trl"
    assert detect({"model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"}}) == "torchtune"
    assert detect({"per_device_train_batch_size": 4, "optim": "adamw_torch"}) == "hf"
    assert detect({"distributed_type": "DEEPSPEED"}) == "accelerate"
    assert detect({"zero_optimization": {"stage": 2}}) == "deepspeed"
    assert detect({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) is None  # a model's config.json
    assert detect({"foo": 1}) is None and detect([1, 2]) is None
    assert set(FORMATS) == set(FORMAT_NAMES)


def test_format_forcing(tmp_path):
    # a TRL/alignment-handbook YAML read as plain TrainingArguments: HF's defaults instead of TRL's
    name = "trl/example_config.yaml"
    trl = read_config(CONFIGS / name)
    hf = read_config(CONFIGS / name, format="hf")
    assert hf.format == "hf" and hf.setup.checkpointing is False and trl.setup.checkpointing is True
    result = CliRunner().invoke(
        main, ["estimate", str(CONFIGS / name), "--format", "hf", "--model", "qwen2-0.5b", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["setup"]["checkpointing"] is False


def test_flags_typed_override_the_file():
    result = CliRunner().invoke(
        main,
        [
            "estimate",
            str(CONFIGS / "axolotl/lora-1b.yml"),
            "--model",
            "llama-3.2-1b",
            "--seq",
            "512",
            "--no-checkpointing",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    setup = json.loads(result.stdout)["setup"]
    assert (setup["seq"], setup["checkpointing"], setup["lora_rank"], setup["batch"]) == (512, False, 16, 2)


def test_deepspeed_file_resolved_relative_to_the_config(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "z3.json").write_text(
        json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    )
    sub = tmp_path / "runs"
    sub.mkdir()
    cfg = sub / "cfg.yml"
    cfg.write_text("base_model: x\nmicro_batch_size: 1\ndeepspeed: ds/z3.json\n")
    read = read_config(cfg)
    assert (read.setup.zero_stage, read.setup.offload_params) == (3, "cpu")


def test_accelerate_config_with_a_training_config():
    read = read_config(
        CONFIGS / "trl/zephyr-7b-beta-sft-config_full.yaml", accelerate=CONFIGS / "accelerate/handbook_zero3.yaml"
    )
    assert (read.gpus, read.setup.gpus, read.setup.zero_stage) == (8, 8, 3)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("foo: 1\n", ("not a training config",)),
        ("base_model: x\nmicro_batch_size: two\n", ("micro_batch_size", "an integer")),
        ("base_model: x\ngradient_checkpointing: maybe\n", ("gradient_checkpointing",)),
        ("base_model: x\nadapter: ia3\n", ("adapter",)),
        ("model_name_or_path: x\nfinetuning_type: lora\nquantization_bit: 3\n", ("quantization_bit",)),
        ("model_name_or_path: x\nfinetuning_type: lora\ndeepspeed: nowhere.json\n", ("nowhere.json",)),
        (
            "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_attn_modules: [wq]\n",
            ("lora_attn_modules",),
        ),
        ("base_model: [\n", ("not valid YAML",)),
        # YAML's non-finite floats: an integer field, and a number field
        ("base_model: x\nmicro_batch_size: .inf\n", ("micro_batch_size", "out of range")),
        ("base_model: x\nadapter: lora\nlora_dropout: .nan\n", ("lora_dropout", "out of range")),
    ],
)
def test_bad_input_is_one_line_naming_file_and_field(tmp_path, text, fragments):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(text)
    result = CliRunner().invoke(main, ["estimate", str(cfg)])
    assert_user_error(result, str(cfg), *fragments)


def test_a_config_without_a_model_needs_one():
    result = CliRunner().invoke(main, ["estimate", str(CONFIGS / "accelerate/trl_multi_gpu.yaml")])
    assert_user_error(result, "names no model", "--model")
    ok = CliRunner().invoke(
        main, ["estimate", str(CONFIGS / "accelerate/trl_multi_gpu.yaml"), "--model", "llama-3.2-1b", "--json"]
    )
    assert ok.exit_code == 0 and json.loads(ok.stdout)["setup"]["gpus"] == 8


def test_model_config_json_is_still_a_model(tmp_path):
    result = CliRunner().invoke(main, ["estimate", "llama-3.2-1b", "--model", "x"])
    assert_user_error(result, "--model")


def test_plain_training_arguments_json_warns_about_what_it_assumes():
    read = read_config(CONFIGS / "hf/cbdetect-training_args.json")
    shown = {(w.kind, w.field) for w in read.warnings}
    assert {("assumed", "max_length"), ("assumed", "dtype"), ("ignored", "fp16")} <= shown
    assert read.setup.seq == 2048  # TrainingArguments has no sequence length: vramplan's default


def test_json_with_script_arguments_is_hf_not_trl(tmp_path):
    # transformers' example scripts share model_name_or_path / dataset_name / max_seq_length with TRL,
    # but their JSON goes to HfArgumentParser.parse_json_file; TRL's own fields still mean TRL
    args = {"model_name_or_path": "x", "dataset_name": "d", "max_seq_length": 512, "per_device_train_batch_size": 2}
    assert detect(args, json=True) == "hf" and detect(args) == "trl"
    assert detect({**args, "use_peft": True}, json=True) == "trl"
    cfg = tmp_path / "args.json"
    cfg.write_text(json.dumps(args))
    read = read_config(cfg)
    assert (read.format, read.setup.seq, read.setup.checkpointing) == ("hf", 512, False)


@pytest.mark.parametrize(
    "name, forced, detected",
    [
        ("axolotl/lora-1b.yml", "trl", "axolotl"),
        ("llamafactory/qwen3_lora_sft.yaml", "axolotl", "llamafactory"),
        ("torchtune/llama3_2_1B_lora_single_device.yaml", "hf", "torchtune"),
        ("accelerate/handbook_zero3.yaml", "deepspeed", "accelerate"),
        ("axolotl/deepspeed_configs/zero2.json", "hf", "deepspeed"),
    ],
)
def test_forcing_another_detected_format_is_refused(name, forced, detected):
    with pytest.raises(SpecError) as exc:
        read_config(CONFIGS / name, format=forced)
    message = str(exc.value)
    assert f"reads as {detected}" in message and f"not {forced}" in message and str(CONFIGS / name) in message
    result = CliRunner().invoke(main, ["estimate", str(CONFIGS / name), "--format", forced, "--model", "llama-3.2-1b"])
    assert_user_error(result, f"reads as {detected}", f"--format {forced}")


def test_forcing_is_allowed_between_hf_and_trl_and_on_undetected_files(tmp_path):
    assert read_config(CONFIGS / "trl/example_config.yaml", format="hf").format == "hf"
    assert read_config(CONFIGS / "hf/cbdetect-training_args.json", format="trl").format == "trl"
    cfg = tmp_path / "bare.yaml"
    cfg.write_text("base_model_config: x\n")  # no field detection knows
    with pytest.raises(SpecError, match="not a training config"):
        read_config(cfg)
    assert read_config(cfg, format="axolotl").format == "axolotl"


# ----------------------------------------------------------------------------------------------
# TRL / HF command lines (vramplan.readers.trl_args), unknown TrainingArguments fields, FSDP's bf16


def test_trl_flags_parse_as_hf_argument_parser_does():
    from vramplan.readers import read_trl_args

    read = read_trl_args(
        "--model_name_or_path Qwen/Qwen2-0.5B --per-device-train-batch-size 2 --gradient_accumulation_steps=4 "
        "--use_peft --lora_r 32 --lora_alpha 16 --lora_target_modules q_proj k_proj v_proj --no_gradient_checkpointing "
        "--bf16 false --model_init_kwargs '{\"dtype\": \"bfloat16\"}' --max_length 512 --foo 3 --output_dir out")
    assert read.format == "trl" and read.model == "Qwen/Qwen2-0.5B"
    assert read.setup == Setup(method="lora", lora_rank=32, lora_alpha=16, lora_dropout=0.05,
                               lora_targets="q_proj,k_proj,v_proj", precision="bf16", optimizer="adamw-fused",
                               checkpointing=False, batch=2, seq=512, grad_accum=4, loss="trl", framework="trl")
    assert "ignored: --foo (not a TrainingArguments/TRL field vramplan reads)" in {str(w) for w in read.warnings}
    # a list of words is the same as the string; a bare boolean is True; hf reads TrainingArguments only
    assert read_trl_args(["--use_peft", "--max_length", "128"]).setup.method == "lora"
    hf = read_trl_args("--per_device_train_batch_size 3 --gradient_checkpointing --bf16", format="hf")
    assert (hf.format, hf.setup.batch, hf.setup.checkpointing, hf.setup.precision) == ("hf", 3, True, "bf16")


@pytest.mark.parametrize("argv, message", [
    ("--per_device_train_batch_size two", "--per_device_train_batch_size must be an integer"),
    ("--use_peft maybe", "--use_peft takes true or false"),
    ("--lora_r", "--lora_r needs a value"),
])
def test_bad_trl_flags_are_one_line(argv, message):
    from vramplan.readers import read_trl_args

    with pytest.raises(SpecError, match=re.escape(message)):
        read_trl_args(argv)


def test_command_file_reads_the_launcher_the_config_and_the_flags(tmp_path):
    run = tmp_path / "run.sh"
    run.write_text(
        "#!/bin/bash\n# SFT on 8 GPUs\n"
        f"ACCELERATE_LOG_LEVEL=info accelerate launch --config_file {CONFIGS / 'accelerate/handbook_zero3.yaml'} \\\n"
        f"  trl/scripts/sft.py --config {CONFIGS / 'trl/example_config.yaml'} \\\n"
        "  --per_device_train_batch_size 4 --max_length 1024 --dtype bfloat16\n")
    read = read_config(run)
    assert read.format == "trl" and read.model == "Qwen/Qwen2.5-0.5B" and read.gpus == 8
    base = read_config(CONFIGS / "trl/example_config.yaml", accelerate=CONFIGS / "accelerate/handbook_zero3.yaml")
    # the flags win over the --config YAML; the accelerate config gives ZeRO-3 on 8 GPUs
    # (bf16 weights: SFTTrainer's fused head is modelled, loss trl; the YAML's bf16 autocast reads loss hf)
    assert base.setup.loss == "hf" and any(w.field == "loss" for w in base.warnings)
    assert read.setup == base.setup.replace(batch=4, seq=1024, precision="bf16", loss="trl")
    assert (read.setup.zero_stage, read.setup.gpus) == (3, 8)
    runner = CliRunner()
    from_file = runner.invoke(main, ["estimate", str(run), "--model", "qwen2-0.5b", "--json"])
    assert from_file.exit_code == 0, from_file.output
    explicit = runner.invoke(main, ["estimate", "qwen2-0.5b", *_flags(read.fields), "--json"])
    assert explicit.exit_code == 0, explicit.output
    assert json.loads(from_file.stdout) == json.loads(explicit.stdout)
    # `trl sft` itself, TRL's --num_processes, a predefined accelerate config name is a warning
    cmd = tmp_path / "cmd.txt"
    cmd.write_text("trl sft --model_name_or_path x --num_processes 2 --accelerate_config zero2 --use_peft\n")
    read = read_config(cmd)
    assert read.gpus == 2 and read.setup.method == "lora"
    assert any(w.field == "--accelerate_config" and "zero2" in w.why for w in read.warnings)
    empty = tmp_path / "empty.sh"
    empty.write_text("#!/bin/sh\necho hi\n")
    assert_user_error(runner.invoke(main, ["estimate", str(empty)]), "no command line with flags")


def test_unknown_training_arguments_fields_are_warnings(tmp_path):
    cfg = tmp_path / "args.json"
    cfg.write_text(json.dumps({"per_device_batch_size": 4, "per_device_train_batch_size": 2, "learning_rate": 1e-4,
                               "evaluation_strategy": "epoch", "model_name_or_path": "x"}))
    read = read_config(cfg)
    ignored = {w.field: w.why for w in read.warnings if w.kind == "ignored"}
    # a misspelt field and one transformers 5 removed (evaluation_strategy -> eval_strategy)
    assert set(ignored) == {"per_device_batch_size", "evaluation_strategy"}
    assert "not a field of TrainingArguments (transformers 5.24.0)" in ignored["per_device_batch_size"]
    assert read.setup.batch == 2
    # TRL's own fields are known in a TRL config, not in a plain TrainingArguments file
    trl = tmp_path / "sft.yaml"
    trl.write_text("model_name_or_path: x\nuse_peft: true\npacking_strategy: bfd\nenv: {A: 1}\nnot_a_field: 1\n")
    assert {w.field for w in read_config(trl).warnings if "not a field" in w.why} == {"not_a_field"}


def test_activation_checkpointing_is_transformers_5_name(tmp_path):
    cfg = tmp_path / "args.yaml"
    cfg.write_text("per_device_train_batch_size: 1\nactivation_checkpointing: true\n"
                   "activation_checkpointing_kwargs: {every_n_layers: 2}\n")
    read = read_config(cfg, format="hf")
    assert read.setup.checkpointing is True
    assert read.setup.checkpoint_every == 2  # selective checkpointing (estimator/selective.py)
    # the new name wins over its deprecated alias (TrainingArguments.__post_init__)
    cfg.write_text("per_device_train_batch_size: 1\nactivation_checkpointing: false\ngradient_checkpointing: true\n")
    assert read_config(cfg, format="hf").setup.checkpointing is False


@pytest.mark.parametrize("fields, precision", [
    # accelerate upcasts trainable flat parameters to fp32 under mixed_precision: bf16-mixed, whatever the load
    ("dtype: bfloat16\nbf16: true\n", "bf16-mixed"),
    ("dtype: float32\nbf16: true\n", "bf16-mixed"),
    # no flag: no MixedPrecision policy, the shards stay as loaded
    ("dtype: bfloat16\nbf16: false\n", "bf16"),
    ("dtype: float32\n", "fp32"),
])
def test_fsdp_bf16_flag_is_mixed_precision_with_fp32_shards(tmp_path, fields, precision):
    cfg = tmp_path / "args.yaml"
    cfg.write_text(f"per_device_train_batch_size: 1\nfsdp: full_shard auto_wrap\n{fields}")
    read = read_config(cfg, format="hf")
    assert (read.setup.fsdp, read.setup.precision) == ("full_shard", precision)


def test_fsdp_bf16_flag_over_a_16_bit_lora_base_stays_pure(tmp_path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("model_name_or_path: x\nuse_peft: true\nfsdp: full_shard\ndtype: bfloat16\nbf16: true\n")
    read = read_config(cfg)
    assert (read.setup.method, read.setup.precision) == ("lora", "bf16")
    assert any(w.kind == "assumed" and "frozen base stays bf16" in w.why for w in read.warnings)


def _generated_fields() -> str:
    """vramplan/readers/hf_fields.py as the installed transformers' and trl's parsers give it."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from transformers import HfArgumentParser, TrainingArguments
    from transformers.hf_argparser import string_to_bool

    dict_fields = set(TrainingArguments._VALID_DICT_FIELDS) | {"model_init_kwargs", "ref_model_init_kwargs",
                                                                "dataset_kwargs"}

    def kinds_of(cls) -> dict[str, str]:
        parser = HfArgumentParser((cls,))
        negated = {a.dest for a in parser._actions if any(o.startswith("--no_") for o in a.option_strings)}
        out = {}
        for a in parser._actions:
            if not a.option_strings or a.dest == "help" or any(o.startswith("--no_") for o in a.option_strings):
                continue
            if a.dest in dict_fields:
                kind = "dict"
            elif a.type is string_to_bool:
                kind = "bool_true" if a.dest in negated else "bool"
            elif a.nargs == "+":
                kind = "list"
            else:
                kind = {int: "int", float: "float"}.get(a.type, "str")
            out[a.dest] = kind
        return out

    ta = kinds_of(TrainingArguments)
    own: dict[str, str] = {}
    for cls in (trl.ScriptArguments, trl.ModelConfig, trl.SFTConfig, trl.DPOConfig, trl.GRPOConfig):
        for k, v in kinds_of(cls).items():
            if k not in ta or ta[k] != v:
                own.setdefault(k, v)

    def table(d: dict) -> str:
        return "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(d.items()))

    return (
        '"""The fields HfArgumentParser knows (generated from the installed libraries by\n'
        "tests/test_readers.py::test_known_fields_match_the_installed_parsers;\n"
        "VRAMPLAN_REGEN_FIELDS=1 rewrites it).\n\n"
        "Name -> how the command line takes it: ``bool`` (``--x``, ``--x true|false``), ``bool_true`` (also\n"
        "``--no_x``: the default is True), ``list`` (``nargs=\"+\"``), ``dict`` (a JSON string or a path),\n"
        '``int``, ``float``, ``str``. Data only: no import of transformers or trl at runtime.\n"""\n\n'
        f"TRANSFORMERS_VERSION = {transformers.__version__!r}\nTRL_VERSION = {trl.__version__!r}\n\n"
        "#: transformers' ``TrainingArguments`` (training_args.py)\n"
        f"TRAINING_ARGUMENTS = {{\n{table(ta)}}}\n\n"
        "#: TRL's own fields (``ScriptArguments``, ``ModelConfig``, ``SFTConfig``, ``DPOConfig``,\n"
        "#: ``GRPOConfig``) that TrainingArguments lacks, and the TrainingArguments fields TRL takes\n"
        "#: differently (``gradient_checkpointing`` defaults to True there: ``--no_gradient_checkpointing``)\n"
        f"TRL_FIELDS = {{\n{table(own)}}}\n"
    )


def test_known_fields_match_the_installed_parsers():
    import os

    import vramplan.readers.hf_fields as committed

    path = Path(committed.__file__)
    generated = _generated_fields()
    if os.environ.get("VRAMPLAN_REGEN_FIELDS"):
        path.write_text(generated)
    import transformers
    import trl

    if (transformers.__version__, trl.__version__) != (committed.TRANSFORMERS_VERSION, committed.TRL_VERSION):
        pytest.skip("the committed table is for other versions")
    assert path.read_text() == generated, "regenerate: VRAMPLAN_REGEN_FIELDS=1 pytest tests/test_readers.py -k known"


def test_peft_sft_examples_flags_are_its_model_arguments(tmp_path):
    """peft's examples/sft/train.py flags read as its utils.create_and_prepare_model uses them: without
    --use_flash_attn the model runs eager attention, without a 4-bit storage dtype it loads in fp32 (--bf16:
    autocast), the LoRA defaults are its own (r 64, the seven projections), --use_8bit_quantization alone loads
    no 8-bit model (its branch sits inside the 4-bit one), and each assumption is said."""
    script = tmp_path / "run_peft.sh"
    script.write_text("python train.py --model_name_or_path meta-llama/Llama-3.2-1B --bf16 True "
                      "--use_peft_lora True --use_8bit_quantization True --max_seq_length 1024 "
                      "--per_device_train_batch_size 4 --gradient_checkpointing True\n")
    read = read_config(script)
    s = read.setup
    assert (read.format, s.method, s.quant, s.lora_rank, s.attn) == ("trl", "lora", "none", 64, "eager")
    assert s.precision == "bf16-mixed" and s.seq == 1024 and s.framework == "trl"
    assert s.lora_targets == "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"
    why = {w.field: w.why for w in read.warnings}
    assert "inside the 4-bit branch" in why["--use_8bit_quantization"] and "torch.float32" in why["dtype"]
    plain = tmp_path / "run_plain.sh"  # a train.py without peft's flags: read as before (full fine-tuning)
    plain.write_text("python train.py --model_name_or_path meta-llama/Llama-3.2-1B --bf16 True\n")
    plain_read = read_config(plain)
    assert plain_read.setup.method == "full" and not any(w.field == "dtype" for w in plain_read.warnings)
