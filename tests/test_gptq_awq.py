"""GPTQ/AWQ 4-bit (and 2/3/8-bit GPTQ) bases: LoRA on a pre-quantized checkpoint, estimate only.

The packing arithmetic is pinned byte for byte against hand-computed buffer shapes of gptqmodel
7.7 (``GPTQQuantLinear._register_gptq_buffers``, ``AWQuantLinear``), whose module sizes were read
off the real classes once (docs/commands/validate.md); the gptqmodel cross-check below runs only
where gptqmodel imports (it needs torch>=2.14.1, newer than the pinned torch).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from cli_helpers import assert_user_error
from click.testing import CliRunner

from vramplan.cli import main
from vramplan.cost import model as cost
from vramplan.emit import emit_to_dir
from vramplan.estimator import estimate, weights_bytes
from vramplan.model.profiles import load_gpu, load_model
from vramplan.plans.planfile import load_plan, save_plan
from vramplan.search import plan
from vramplan.specs import Plan, Setup, SpecError
from vramplan.util.units import awq_linear_bytes, gptq_linear_bytes
from vramplan.validate.matrix import unverified_rows

LLAMA = "llama-3.1-8b"
GPTQ = Setup(method="lora", quant="gptq")
AWQ = Setup(method="lora", quant="awq")


@pytest.fixture(scope="module")
def llama():
    return load_model(LLAMA)


# ----------------------------------------------------------------------------------------------
# packing arithmetic


def test_gptq_linear_bytes_match_gptqmodel_buffers():
    # gate_proj of Llama-3.1-8B (in 4096, out 14336), 4 bits, g=128:
    # qweight int32 [4096*4/32, 14336] = 512 x 14336 x 4 B = 29,360,128
    # qzeros  int32 [4096/128, 14336*4/32] = 32 x 1792 x 4 B =    229,376
    # scales  fp16  [32, 14336] x 2 B                       =    917,504
    # g_idx   int32 [4096] x 4 B                            =     16,384
    assert gptq_linear_bytes(4096, 14336, 4, 128, False) == 29_360_128 + 229_376 + 917_504 + 16_384 == 30_523_392
    # the sizes gptqmodel 7.7's TorchLinear(register_buffers=True) registered for the same Linear
    assert gptq_linear_bytes(4096, 14336, 3, 128, False) == 23_126_016  # qweight [384, 14336]
    assert gptq_linear_bytes(4096, 14336, 2, 64, False) == 16_760_832  # 64 groups
    assert gptq_linear_bytes(4096, 14336, 8, 128, False) == 60_112_896
    assert gptq_linear_bytes(4096, 14336, 4, -1, False) == 29_412_352  # one group: per output channel
    # bias: an fp16 buffer [out]
    assert gptq_linear_bytes(4096, 14336, 4, 128, True) - 30_523_392 == 2 * 14336


def test_awq_linear_bytes_match_the_gemm_layout():
    # AWQ packs along the outputs: qweight int32 [in, out*4/32], qzeros [in/g, out*4/32], scales
    # fp16 [in/g, out], no g_idx (read off gptqmodel 7.7's AwqTorchLinear: 1024 x 2816, g=128)
    assert awq_linear_bytes(1024, 2816, 4, 128, False) == 1024 * 352 * 4 + 8 * 352 * 4 + 8 * 2816 * 2 == 1_498_112
    assert awq_linear_bytes(4096, 14336, 4, 128, False) == 29_360_128 + 229_376 + 917_504


def test_llama_8b_gptq_4bit_weights_byte_exact(llama):
    # per layer: q/o 8,732,672 each; k/v 2,195,456 each; gate/up 30,523,392 each;
    # down (in 14336): qweight 1792 x 4096 x 4 + qzeros 112 x 512 x 4 + scales 112 x 4096 x 2
    # + g_idx 14336 x 4 = 30,564,352
    layer = 2 * 8_732_672 + 2 * 2_195_456 + 2 * 30_523_392 + 30_564_352
    assert layer == 113_467_392
    # embeddings and the untied head (128256 x 4096 each) and 65 RMSNorms stay bf16: GPTQ is not
    # upcast by prepare_model_for_kbit_training
    rest = (2 * 128256 * 4096 + 65 * 4096) * 2
    assert weights_bytes(llama, GPTQ) == 32 * layer + rest == 5_732_835_328  # 5.34 GiB, 5.73 GB


def test_llama_8b_awq_weights_upcast_the_rest_to_fp32(llama):
    layer = 2 * (8_388_608 + 65_536 + 262_144) + 2 * (2_097_152 + 16_384 + 65_536) + 3 * 30_507_008
    rest = (2 * 128256 * 4096 + 65 * 4096) * 4  # peft upcasts an AWQ model's fp16 parameters
    assert weights_bytes(llama, AWQ) == 32 * layer + rest == 7_829_733_376


def test_bits_and_group_size_move_the_weights(llama):
    w = {b: weights_bytes(llama, GPTQ.replace(quant_bits=b)) for b in (2, 3, 4, 8)}
    assert w[2] < w[3] < w[4] < w[8]
    assert weights_bytes(llama, GPTQ.replace(quant_group_size=32)) > w[4] > weights_bytes(
        llama, GPTQ.replace(quant_group_size=-1))
    # the head, embeddings and norms are the same bf16 bytes in all of them
    assert w[8] - w[4] == 32 * sum(gptq_linear_bytes(l.in_features, l.out_features, 8, 128, False)
                                   - gptq_linear_bytes(l.in_features, l.out_features, 4, 128, False)
                                   for l in llama.linears if l.role != "head")


# ----------------------------------------------------------------------------------------------
# the step


def test_gptq_keeps_a_16_bit_copy_of_every_weight_without_checkpointing(llama):
    bd = estimate(llama, GPTQ)
    quantized = sum(l.count * l.weight_params for l in llama.linears if l.role != "head")
    assert bd.component("dequantized_weights") == 2 * quantized
    # GPTQ activations stay bf16 (no k-bit upcast): the rest matches plain bf16 LoRA
    assert bd.component("activations") == estimate(llama, Setup(method="lora")).component("activations")
    ck = estimate(llama, GPTQ.replace(checkpointing=True))
    assert ck.component("dequantized_weights") == 0
    assert ck.tensor_peak_bytes < bd.tensor_peak_bytes - quantized  # one layer's copy, not 32


def test_awq_activations_are_the_kbit_prepared_ones(llama):
    bd = estimate(llama, AWQ)
    assert bd.component("dequantized_weights") == 0
    assert bd.component("activations") == estimate(llama, Setup(method="qlora")).component("activations")
    largest = max(l.weight_params for l in llama.linears if l.role != "head")
    assert bd.component("dequantization") == 2 * largest  # one fp16 weight in the GEMM backward


def test_three_bit_dequantization_peaks_higher(llama):
    four = estimate(llama, GPTQ.replace(checkpointing=True)).component("dequantization")
    three = estimate(llama, GPTQ.replace(checkpointing=True, quant_bits=3)).component("dequantization")
    assert three > four > 0


def test_cost_dequantizes_gptq_once_per_forward():
    assert cost.dequant_passes(GPTQ) == 1
    assert cost.dequant_passes(GPTQ.replace(checkpointing=True)) == 2
    assert cost.dequant_passes(AWQ) == 2 and cost.dequant_passes(AWQ.replace(seq=512)) == 1
    assert cost.dequant_passes(Setup(method="qlora")) == 2


# ----------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("kwargs, fragment", [
    ({"quant": "gptq"}, "cannot be fully fine-tuned"),
    ({"method": "qlora", "quant": "awq"}, "--method lora --quant awq"),
    ({"method": "lora", "quant": "gptq", "quant_bits": 5}, "quant_bits must be one of 2, 3, 4, 8"),
    ({"method": "lora", "quant": "awq", "quant_bits": 8}, "quant_bits must be one of 4 for awq"),
    ({"method": "lora", "quant": "awq", "quant_group_size": 256}, "quant_group_size must be one of"),
    ({"method": "lora", "quant": "nf4", "quant_bits": 8}, "apply to a GPTQ or AWQ base"),
    ({"method": "lora", "quant": "gptq", "precision": "fp32"}, "fp16 or bf16"),
    ({"method": "lora", "quant": "gptq", "precision": "bf16-mixed"}, "fp16 or bf16"),
    ({"method": "lora", "quant": "gptq", "zero_stage": 2, "gpus": 2}, "ZeRO or FSDP is not modelled"),
])
def test_setup_refuses(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        Setup(**kwargs)


@pytest.mark.parametrize("args, fragments", [
    (["--quant", "gptq"], ("GPTQ base cannot be fully fine-tuned",)),
    (["--method", "lora", "--quant", "gptq", "--quant-bits", "5"], ("--quant-bits must be one of",)),
    (["--method", "lora", "--quant", "awq", "--quant-group-size", "100"], ("--quant-group-size must be one of",)),
    (["--method", "lora", "--quant-bits", "8"], ("apply to a GPTQ or AWQ base",)),
])
def test_cli_one_line_errors(args, fragments):
    assert_user_error(CliRunner().invoke(main, ["estimate", LLAMA, *args]), *fragments)


def test_cli_estimate_names_the_base():
    result = CliRunner().invoke(main, ["estimate", LLAMA, "--method", "lora", "--quant", "gptq",
                                       "--quant-bits", "3", "--quant-group-size", "64"])
    assert result.exit_code == 0, result.output
    assert "gptq base (3-bit, group 64)" in result.output and "dequantized_weights" in result.output


# ----------------------------------------------------------------------------------------------
# plan, validate, emit


def test_plan_never_proposes_gptq_or_awq_unless_fixed():
    free = plan(LLAMA, "rtx-4090")
    seen = [free.setup] + [a.setup for a in free.alternatives] + [r.setup for r in free.rejected]
    assert not any(s.quant in ("gptq", "awq") for s in seen)
    fixed = plan(LLAMA, "rtx-4090", quant="awq")
    assert fixed.fits and fixed.setup.quant == "awq" and fixed.setup.method == "lora"
    assert all(a.setup.quant == "awq" for a in fixed.alternatives)
    assert fixed.setup.zero_stage == 0


def test_plan_cli_with_fixed_gptq_bits(tmp_path):
    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(main, ["plan", LLAMA, "--gpu", "rtx-4090", "--quant", "gptq", "--quant-bits", "8",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    loaded = load_plan(out)
    assert (loaded.setup.quant, loaded.setup.quant_bits, loaded.setup.quant_group_size) == ("gptq", 8, 128)


def test_validate_row_is_modelled_but_unverified():
    (row,) = unverified_rows(knobs=("gptq_awq",))
    assert row.knob == "gptq_awq" and not row.verified
    assert row.setup.quant == "gptq"
    assert row.why.startswith("modelled, estimate only") and "not modelled" not in row.why
    assert "gptqmodel" in row.why and "torch>=2.14.1" in row.why


@pytest.mark.slow  # the full tier
def test_emitted_train_py_requires_a_prequantized_checkpoint(tmp_path, llama):
    setup = GPTQ.replace(checkpointing=True)
    gpu = load_gpu("rtx-4090")
    p = Plan(model=llama.name, setup=setup, breakdown=estimate(llama, setup, gpu), gpu=gpu)
    save_plan(p, tmp_path / "plan.json")
    emit_to_dir(load_plan(tmp_path / "plan.json"), tmp_path / "run")
    script = (tmp_path / "run" / "train.py").read_text()
    assert "needs --model: a pre-quantized 4-bit GPTQ checkpoint" in script
    assert "'quant_bits': 4" in script and "'quant_group_size': 128" in script
    run = subprocess.run([sys.executable, "train.py", "--cpu", "--max-steps", "1"], cwd=tmp_path / "run",
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("error: this plan trains LoRA on a GPTQ base: pass --model"), run.stderr
    assert "Traceback" not in run.stderr


# ----------------------------------------------------------------------------------------------
# optional: gptqmodel's own modules (skipped where gptqmodel does not import)


def test_packing_against_gptqmodel_when_installed():
    torch = pytest.importorskip("torch")
    try:
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear
        from gptqmodel.utils.backend import BACKEND
    except (ImportError, RuntimeError) as exc:  # not installed, or incompatible with the pinned torch
        pytest.skip(f"gptqmodel not importable: {exc}")
    for bits, g in ((2, 64), (3, 128), (4, 128), (8, 32), (4, -1)):
        m = TorchLinear(bits=bits, group_size=g, desc_act=False, sym=True, in_features=1024, out_features=2816,
                        bias=True, pack_dtype=torch.int32, backend=BACKEND.GPTQ_TORCH, adapter=None,
                        register_buffers=True)
        got = sum(b.numel() * b.element_size() for b in m.buffers())
        assert got == gptq_linear_bytes(1024, 2816, bits, g, True), (bits, g)
