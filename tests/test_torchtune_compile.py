"""torchtune's ``compile: True`` (``Setup.compile``, estimator/torchtune.py ``loss_bytes``): its compiled
cross-entropy keeps the bf16 logit chunks and two fp32 numbers per token, no fp32 log-probs; checked against
what torch's inductor really saves and allocates on the CPU (the slow tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vramplan import Setup, estimate, load_gpu, load_model
from vramplan.cli import main
from vramplan.estimator import torchtune as tt
from vramplan.util.errors import SpecError

DATA = Path(__file__).parent / "data/configs/torchtune"
TT = Setup(framework="torchtune", precision="bf16", optimizer="adamw-fused", seq=2048, batch=2, method="qlora",
           lora_rank=8, lora_alpha=16, checkpointing=True)


def _c(bd, name):
    return next((c.bytes for c in bd.components if c.name == name), 0)


def test_the_compiled_loss_keeps_no_fp32_log_probs():
    m = load_model("llama-3.1-8b")
    eager, compiled = estimate(m, TT), estimate(m, TT.replace(compile=True))
    N, V, C = 4096, m.vocab_size, 2 * 256
    assert tt.loss_bytes(m, compiled.setup) == (2 * N * V + 8 * N, 2 * N * V + 8 * N + 2 * C * V)
    assert _c(compiled, "logits_loss") == 2 * N * V + 8 * N + 2 * C * V
    assert _c(eager, "logits_loss") - _c(compiled, "logits_loss") >= 4 * N * V  # the fp32 log-probs
    # everything else is the eager step's (the layers are modelled eager: an upper bound)
    for name in ("weights", "adapters", "optimizer_states", "checkpointed_inputs", "recompute"):
        assert _c(eager, name) == _c(compiled, name)
    assert compiled.tensor_peak_bytes < eager.tensor_peak_bytes
    assert "compiled cross-entropy" in next(c.note for c in compiled.components if c.name == "logits_loss")


@pytest.mark.parametrize("framework", ["hf", "trl", "axolotl", "unsloth"])
def test_compile_elsewhere_is_refused_in_one_line(framework):
    with pytest.raises(SpecError, match="--compile is modelled for torchtune"):
        estimate(load_model("llama-3.2-1b"), Setup(framework=framework, method="lora", compile=True,
                                                   loss="unsloth" if framework == "unsloth" else "hf"))
    r = CliRunner().invoke(main, ["estimate", "llama-3.2-1b", "--method", "lora", "--framework", framework,
                                  "--compile"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and r.output.startswith("error: --compile")


def test_the_reader_the_plan_and_the_writer_keep_compile(tmp_path):
    text = (DATA / "llama3_2_1B_qlora_single_device.yaml").read_text()
    assert "\ncompile: False" in text
    cfg = tmp_path / "tt.yaml"
    cfg.write_text(text.replace("\ncompile: False", "\ncompile: True"))
    from vramplan.readers import read_config

    mapped = read_config(cfg)
    assert mapped.setup.framework == "torchtune" and mapped.setup.compile
    assert not any("torch.compile is not modelled" in w.why for w in mapped.warnings)
    eager = read_config(DATA / "llama3_2_1B_qlora_single_device.yaml").setup
    assert not eager.compile
    # plan --from keeps it (never searched) and the torchtune writer writes it
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["plan", "--from", str(cfg), "--gpu", "rtx-4060", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("{"):])["setup"]["compile"] is True
    r = CliRunner().invoke(main, ["plan", "--from", str(cfg), "--gpu", "rtx-4060", "--emit", str(out)])
    assert r.exit_code == 0, r.output
    written = yaml.safe_load((out / "tt.yaml").read_text())
    assert written["compile"] is True


# ----------------------------------------------------------------------------------------------
# the truth: torch's inductor on the CPU

#: torchtune 0.6.1 ``CEWithChunkedOutputLoss.compute_cross_entropy`` (modules/loss/ce_chunked_output_loss.py),
#: the function ``training.compile_loss`` compiles; the torchtune venv's test runs the library's own
_PATTERN = """
import torch, torch.nn.functional as F
def compute_cross_entropy(logits, labels, ignore_index=-100):
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
"""

_PROBE = """
import json, torch
N, V, CHUNKS = {n}, {v}, 8
torch.manual_seed(0)
{loss}
chunks = [torch.randn(N // CHUNKS, V, dtype=torch.bfloat16, requires_grad=True) for _ in range(CHUNKS)]
labels = torch.randint(0, V, (N,))
saved = {{}}
def pack(t):
    saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), str(t.dtype), tuple(t.shape))
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = total(chunks, labels)
inputs = {{c.untyped_storage().data_ptr() for c in chunks}}
loss.backward()
print(json.dumps({{"saved_input_bytes": sum(b for p, (b, _, _) in saved.items() if p in inputs),
                   "saved_other": [v for p, v in saved.items() if p not in inputs],
                   "grad_dtypes": sorted({{str(c.grad.dtype) for c in chunks}})}}))
"""


def _probe(python: str, loss_code: str, n: int, v: int) -> dict:
    code = _PROBE.format(n=n, v=v, loss=textwrap.dedent(loss_code))
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _check(result: dict, n: int, v: int) -> None:
    # the compiled function keeps each bf16 chunk it was given (c N V in all) ...
    assert result["saved_input_bytes"] == 2 * n * v
    # ... the labels and two fp32 numbers per token (the row max and log-sum-exp): no N x V fp32 tensor
    other = result["saved_other"]
    assert all(b < 4 * v for b, dtype, _ in other if dtype != "torch.int64"), other  # (the labels: int64)
    fp32 = sum(b for b, dtype, _ in other if dtype == "torch.float32")
    assert fp32 == 8 * n
    assert result["grad_dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
def test_inductor_saves_what_the_estimate_counts():
    loss = _PATTERN + """
compiled = torch.compile(compute_cross_entropy, backend="inductor")
def total(chunks, labels):
    return sum(compiled(c, l) for c, l in zip(chunks, labels.chunk(8)))
"""
    _check(_probe(sys.executable, loss, 2048, 4096), 2048, 4096)


@pytest.mark.slow
def test_torchtunes_own_compiled_loss_saves_what_the_estimate_counts():
    from vramplan.truths import torchtune_truth as truth

    python = truth.torchtune_python()
    if python is None:
        pytest.skip("torchtune 0.6.1 is not importable here (a venv sharing this torch: VRAMPLAN_TORCHTUNE_PYTHON)")
    loss = """
from torchtune import training
from torchtune.modules.loss import CEWithChunkedOutputLoss
fn = training.compile_loss(CEWithChunkedOutputLoss(num_output_chunks=8), verbose=False)
def total(chunks, labels):
    return fn(chunks, labels.view(1, -1))
"""
    _check(_probe(python, loss, 2048, 4096), 2048, 4096)


def test_plan_fixes_compile_either_way_for_torchtune_and_refuses_it_elsewhere():
    def plan(*extra):
        r = CliRunner().invoke(main, ["plan", "llama-3.2-3b", "--gpu", "rtx-4060", "--seq", "4096", "--json", *extra])
        return r.exit_code, r.output

    code, out = plan("--framework", "torchtune", "--compile")
    assert code == 0, out
    compiled = json.loads(out[out.index("{"):])
    code, out = plan("--framework", "torchtune", "--no-compile")
    eager = json.loads(out[out.index("{"):])
    assert compiled["setup"]["compile"] is True and "compile" not in eager["setup"]  # (omitted at its default)

    def loss(p):
        return next(c["bytes"] for c in p["breakdown"]["components"] if c["name"] == "logits_loss")

    assert loss(compiled) * eager["setup"]["batch"] < loss(eager) * compiled["setup"]["batch"]
    code, out = plan("--compile")
    assert code == 2 and out.startswith("error: ") and "--compile is modelled for torchtune" in out


def test_torchtunes_plan_takes_compile_only_where_eager_does_not_fit():
    def plan(model, gpu):
        r = CliRunner().invoke(main, ["plan", model, "--gpu", gpu, "--framework", "torchtune", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output[r.output.index("{"):])

    small = plan("llama-3.1-8b", "rtx-4060")  # eager QLoRA: 8.9 GiB of 7.9
    assert small["fits"] and small["setup"]["compile"] is True and small["setup"]["method"] == "qlora"
    eager = estimate(load_model("llama-3.1-8b"), Setup.from_dict({**small["setup"], "compile": False}),
                     load_gpu("rtx-4060"))
    assert eager.device_total_bytes > small["gpu"]["usable_memory_bytes"]
    big = plan("llama-3.1-8b", "rtx-4090")  # a plain plan fits: no compile (an extra: minutes of compilation)
    assert "compile" not in big["setup"]
