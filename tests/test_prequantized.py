"""Pre-quantized uploads named as users name them (unsloth's -bnb-4bit, Qwen's own -AWQ / -GPTQ-Int4/-Int8,
TheBloke's -GPTQ): resolved offline to the base's config, their quantization read from the name unless given,
the inference said in one warning line, and a setup that cannot train such a checkpoint refused in one line."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.model.profiles import prequantized, resolve


@pytest.mark.parametrize("name, base, knobs", [
    ("unsloth/llama-3-8b-bnb-4bit", "meta-llama/Meta-Llama-3-8B", {"method": "qlora", "quant": "nf4"}),
    ("unsloth/Qwen2.5-7B-Instruct-unsloth-bnb-4bit", "Qwen/Qwen2.5-7B", {"method": "qlora", "quant": "nf4"}),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "Qwen/Qwen2.5-7B", {"method": "lora", "quant": "awq"}),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen/Qwen2.5-7B", {"method": "lora", "quant": "gptq", "quant_bits": 4}),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "Qwen/Qwen2.5-7B", {"method": "lora", "quant": "gptq", "quant_bits": 8}),
    ("TheBloke/Llama-2-7B-GPTQ", "meta-llama/Llama-2-7b-hf", {"method": "lora", "quant": "gptq", "quant_bits": 4}),
    ("NousResearch/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B", {}),  # a 16-bit re-upload: nothing implied
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", {}),  # shipped: its own config decides
])
def test_a_quantized_uploads_name_resolves_with_its_quantization(name, base, knobs):
    assert resolve(name)[1] == base
    assert prequantized(name) == knobs


def _estimate(*args):
    return CliRunner().invoke(main, ["estimate", *args, "--json"])


def test_estimate_trains_adapters_on_the_quantized_base_and_says_why():
    result = _estimate("unsloth/llama-3-8b-bnb-4bit", "--gpu", "rtx-4090")
    assert result.exit_code == 0, result.output
    setup = json.loads(result.stdout)["setup"]
    assert (setup["method"], setup["quant"]) == ("qlora", "nf4")
    assert "read as a re-upload of meta-llama/Meta-Llama-3-8B" in result.stderr
    assert "bnb-4bit quantization read from the name" in result.stderr
    awq = json.loads(_estimate("Qwen/Qwen2.5-7B-Instruct-AWQ").stdout)["setup"]
    assert (awq["method"], awq["quant"]) == ("lora", "awq")
    given = json.loads(_estimate("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "--quant-bits", "4",
                                 "--lora-rank", "8").stdout)["setup"]
    assert (given["quant"], given["quant_bits"], given["lora_rank"]) == ("gptq", 4, 8)
    plain = _estimate("meta-llama/Llama-3.1-8B")
    assert json.loads(plain.stdout)["setup"]["method"] == "full" and "read as" not in plain.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--method", "full"], "full fine-tuning refused); use --method qlora"),
    (["--quant", "none"], "--quant none cannot load it; use --quant nf4"),
])
def test_a_setup_that_cannot_train_the_checkpoint_is_one_line(args, fragment):
    assert_user_error(CliRunner().invoke(main, ["estimate", "unsloth/llama-3-8b-bnb-4bit", *args]), fragment)


def test_plan_fixes_the_quantization_the_name_says():
    result = CliRunner().invoke(main, ["plan", "unsloth/llama-3-8b-bnb-4bit", "--gpu", "rtx-4090", "--json"])
    assert result.exit_code == 0, result.output
    setup = json.loads(result.stdout)["setup"]
    assert setup["quant"] == "nf4" and setup["method"] == "qlora"
