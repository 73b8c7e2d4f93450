"""The knobs of today's runs on N ranks: peft's ``modules_to_save`` under DeepSpeed ZeRO 1/2, DDP and
FSDP1 full_shard (estimator/distributed.py, estimator/fsdp.py, estimator/knobs.py), checked against
the real engines on 2 CPU ranks
(vramplan.truths.distributed, vramplan.truths.fsdp); what stays refused, and why."""

from __future__ import annotations

import pytest

from vramplan import Setup, estimate, load_model
from vramplan.specs import SpecError
from vramplan.truths.tiny import TINY_SEQ, tiny_model

BOTH = "embed_tokens,lm_head"


@pytest.mark.parametrize("kwargs, words", [
    ({"zero_stage": 3, "gpus": 2}, "defragment asserts one dtype"),
    ({"fsdp": "shard_grad_op", "gpus": 2}, "FSDP1 full_shard"),  # its copies stay gathered to the backward
    ({"fsdp": "full_shard", "gpus": 2, "method": "qlora"}, "16/32-bit base"),
])
def test_refused_where_no_truth_runs_it(kwargs, words):
    with pytest.raises(SpecError, match=words):
        Setup(**{"method": "lora", **kwargs}, modules_to_save=BOTH)


@pytest.mark.parametrize("kwargs", [{"zero_stage": 2, "gpus": 2}, {"zero_stage": 1, "gpus": 4}, {"gpus": 2},
                                    {"fsdp": "full_shard", "gpus": 4}])
def test_accepted_under_zero_1_2_ddp_and_fsdp_full_shard(kwargs):
    Setup(**{"method": "lora", **kwargs}, modules_to_save=BOTH)


def test_dora_and_optimizer_in_backward_stay_refused_on_ranks():
    with pytest.raises(SpecError, match="dora"):
        Setup(method="lora", dora=True, zero_stage=2, gpus=2)
    with pytest.raises(SpecError, match="optimizer_in_backward"):
        Setup(optimizer_in_backward=True, gpus=2)


def test_zero2_copies_join_the_flat_groups():
    """On 2 ranks at stage 2 the copies (16-bit, like the model) add, at the optimizer step, their
    16-bit flat copy whole and, per rank, half of: the fp32 master (4 bytes), AdamW's two fp32
    moments (8) and, at the gradient norm before the step, the 16-bit gradient partition (2) beside
    the fp64 copy the norm takes of the head copy's gradient (``get_grad_norm_direct``: 8, the
    copy fills the partition) - more than the step's flattened copy and fp32 gradient (2 + 4)."""
    model = load_model("meta-llama/Llama-3.2-1B")
    s = Setup(method="lora", zero_stage=2, gpus=2, seq=512)
    plain, copies = estimate(model, s), estimate(model, s.replace(modules_to_save="lm_head"))
    n = model.vocab_size * model.hidden_size  # the tied head's copy
    assert copies.params_trainable - plain.params_trainable == n
    added = copies.phase_peaks_bytes["optimizer"] - plain.phase_peaks_bytes["optimizer"]
    assert added == pytest.approx(2 * n + (4 + 8 + 2 + 8) * n / 2, rel=0.01)


def test_ddp_buckets_copy_the_copies_gradients():
    model = load_model("meta-llama/Llama-3.2-1B")
    s = Setup(method="lora", gpus=2, seq=512)
    plain, copies = estimate(model, s), estimate(model, s.replace(modules_to_save="lm_head"))
    n = model.vocab_size * model.hidden_size
    assert copies.component("ddp_buckets") - plain.component("ddp_buckets") == pytest.approx(2 * n, rel=0.01)


@pytest.mark.slow
def test_against_two_real_ranks():
    """ZeRO-2 (DeepSpeed's CPU accelerator, gloo), FSDP1 full_shard and DDP on 2 processes of the
    tiny Llama: the worst rank's tensor peak and each phase's within 5 % (validate --knob modules_to_save; its
    first ZeRO and DDP setups here)."""
    pytest.importorskip("deepspeed")
    from vramplan.validate.accuracy import Row
    from vramplan.validate.knobs import distributed_knob_rows

    rows = distributed_knob_rows(True, Row)
    assert {r.truth for r in rows} == {"deepspeed-2", "fsdp-2", "ddp-2"}
    assert all(r.verified for r in rows), [r.why for r in rows if not r.verified]
    assert all(abs(r.error) <= 0.05 for r in rows), [(r.truth, r.quantity, r.error) for r in rows]
    # the copies are what the truth measures: without them the estimate is far off
    plain = estimate(tiny_model(), Setup(method="lora", zero_stage=2, gpus=2, seq=TINY_SEQ)).tensor_peak_bytes
    zero = next(r for r in rows if r.truth == "deepspeed-2" and r.quantity == "tensor_peak_bytes")
    assert zero.truth_bytes > 1.2 * plain
