"""LoRA under tensor parallelism, run on real gloo ranks (vramplan/truths/tp_lora.py: transformers 5.24's
DTensor TP load, peft 0.21's get_peft_model on it, one fp32 step against an unsharded LoRA step of
the same checkpoint).

- ``--tp 2`` with the column-parallel targets runs and is right (the gradients and the stepped
  adapters match the unsharded step): modelled and verified (``validate --knob tp``).
- ``--tp 2`` with the row-parallel targets (``all-linear``) fails in the first forward, and
  ``--tp 2`` beside FSDP2 (4 ranks) builds lora_B with FSDP's chunk of the TP shard and fails too:
  both refused. Those two tests pin the failure: when a release fixes it they fail, and the refusal
  (estimator/tensor_parallel.py check_tp, estimator/tp_fsdp2.py check_tp_fsdp2) is due for a truth.
"""

from __future__ import annotations

import pytest

from vramplan import Setup, estimate
from vramplan.specs import SpecError
from vramplan.truths.tiny import TINY_SEQ, tiny_config, tiny_model
from vramplan.truths.tp_lora import probe_tp_lora
from vramplan.truths.tp_truth import COLWISE_TARGETS

LORA = {"method": "lora", "seq": TINY_SEQ}
COLWISE = Setup(tp=2, gpus=2, lora_targets=COLWISE_TARGETS, **LORA)
ALL_LINEAR = Setup(tp=2, gpus=2, **LORA)
TP_FSDP2 = Setup(tp=2, gpus=4, fsdp="full_shard", fsdp_version=2, lora_targets=COLWISE_TARGETS, **LORA)
LAYER = "base_model.model.model.layers.0."


@pytest.fixture(scope="module")
def tp2():
    """One 2-rank launch: the column-parallel targets, then all-linear."""
    return probe_tp_lora(tiny_config(), [COLWISE, ALL_LINEAR], world=2)


def test_colwise_lora_under_tp_is_the_unsharded_step(tp2):
    """peft 0.21 shards a colwise Linear's lora_B (Shard(0) over the tp mesh, out/2 local rows) and
    keeps lora_A a plain replicated tensor; loss, every adapter's full gradient and its value after
    one AdamW step are the unsharded LoRA step's."""
    for got in tp2[0]:
        assert got["error"] is None and not got["malformed"], got
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6)
        assert got["grad_error"] < 1e-4 and got["step_error"] < 1e-3, got
        a, b = (got["placements"][f"{LAYER}mlp.gate_proj.lora_{x}.default.weight"] for x in "AB")
        assert a == {"dtensor": False, "shape": [16, 64], "local": [16, 64]}
        assert b == {"dtensor": True, "placements": ["S(0)"], "mesh": [2], "shape": [128, 16], "local": [64, 16]}


def test_rowwise_lora_under_tp_fails_in_the_first_forward(tp2):
    """o_proj/down_proj: peft builds lora_A with the shard's in_features (32 of 64) and transformers'
    RowwiseParallel takes that as the input's global width. Fails when a release fixes it: then
    check_tp's refusal is due for a truth."""
    for got in tp2[1]:
        assert got["error"] == "RuntimeError: shape '[64, 16]' is invalid for input of size 2048", got
        assert got["where"].startswith("transformers/distributed/tensor_parallel.py:tp_forward <- "
                                       "peft/tuners/lora/layer.py:forward")
        assert got["widths"][f"{LAYER}self_attn.o_proj.lora_A.default"] == [32, 16]  # in_features: the shard's
        assert got["placements"][f"{LAYER}self_attn.o_proj.lora_A.default.weight"]["placements"] == ["S(1)"]
    with pytest.raises(SpecError, match="_get_in_out_features builds lora_A with the shard's in_features"):
        estimate(tiny_model(), ALL_LINEAR)


@pytest.mark.slow  # the full tier
def test_lora_under_tp_with_fsdp2_builds_lora_b_from_the_fsdp_chunk():
    """TP 2 x FSDP2 2 (transformers 5.24 fully_shards at load, peft wraps after): lora_B is built
    with FSDP's chunk of the TP shard (64 / 4 = 16 rows) on a tp-mesh DTensor of global 64 (32 rows a
    rank expected), on every rank, and the first forward fails. Fails when a release fixes it."""
    runs = probe_tp_lora(tiny_config(), [TP_FSDP2], world=4)[0]
    for got in runs:
        assert got["error"] == "RuntimeError: shape '[1, 64, 32]' is invalid for input of size 1024", got
        assert got["where"].startswith("transformers/distributed/tensor_parallel.py:tp_forward")
        q = got["placements"][f"{LAYER}self_attn.q_proj.lora_B.default.weight"]
        assert q == {"dtensor": True, "placements": ["S(0)"], "mesh": [2], "shape": [64, 16], "local": [16, 16]}
        assert got["widths"][f"{LAYER}self_attn.q_proj.lora_B.default"] == [16, 16]
        assert len(got["malformed"]) == 10  # every lora_B of the 2 layers' 5 colwise Linears
    with pytest.raises(SpecError, match="_get_in_out_features then reads the \\(fsdp, tp\\) shard's width"):
        estimate(tiny_model(), TP_FSDP2)


def test_the_estimate_holds_the_adapters_peft_placed(tp2):
    """The estimate's per-rank adapters, their gradients and AdamW's two states are the local
    tensors peft 0.21 placed on the rank (fp32 adapters: 4 bytes an element)."""
    import math

    local = sum(math.prod(p["local"]) for p in tp2[0][0]["placements"].values()) * 4
    comps = {c.name: c.bytes for c in estimate(tiny_model(), COLWISE).components}
    assert (comps["adapters"], comps["gradients"], comps["optimizer_states"]) == (local, local, 2 * local)
    unsharded = {c.name: c.bytes for c in estimate(tiny_model(), COLWISE.replace(tp=1, gpus=1)).components}
    assert local < unsharded["adapters"]
