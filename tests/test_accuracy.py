"""Bar: the analytic tensor peak is within 5 % of the fake-tensor trace of the real code.

Truncated copies (4 layers) of each family's shipped model trace at full depth in well under a
second each; the full-depth models are covered by tests/test_trace.py's extrapolation proof and
by benchmarks/accuracy.py.
"""

import pytest

from vramplan.specs import Setup
from vramplan.validate.accuracy import FAMILY_MODELS, compare

pytest.importorskip("torch")
pytest.importorskip("peft")

SHAPES = [(1, 512), (4, 4096)]
CASES = [
    (family, model, method, ckpt, b, s)
    for family, model in FAMILY_MODELS.items()
    for method in ("full", "lora")
    for ckpt in (False, True)
    for b, s in SHAPES
]


@pytest.mark.sample(4)  # the fast tier: every 4th case (each family and method across the sample)
@pytest.mark.parametrize("family, model, method, ckpt, b, s", CASES,
                         ids=[f"{c[0]}-{c[2]}-ck{int(c[3])}-{c[4]}x{c[5]}" for c in CASES])
def test_estimate_within_5_percent_of_trace(family, model, method, ckpt, b, s):
    setup = Setup(method=method, checkpointing=ckpt, batch=b, seq=s)
    row = compare(model, setup, layers=4)
    assert abs(row.error) <= 0.05, (f"{model} {setup}: estimate {row.estimated_bytes:,} vs trace "
                                    f"{row.traced_bytes:,} ({row.error:+.2%})")


@pytest.mark.sample(2)
@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"])
def test_canonical_step_within_2_percent_full_depth(model):
    for setup in (Setup(), Setup(method="lora"), Setup(checkpointing=True, batch=2),
                  Setup(method="lora", checkpointing=True)):
        row = compare(model, setup, layers=None)
        assert abs(row.error) <= 0.02, (setup, row.error)
