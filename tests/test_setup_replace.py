"""Setup.replace is dataclasses.replace, made without ``__init__`` (the plan search builds thousands
of Setups: benchmarks/plan_speed.py): the same Setup, the same normalisation, the same errors."""

from __future__ import annotations

import dataclasses

import pytest

from vramplan import Setup
from vramplan.specs import SpecError

BASES = [Setup(), Setup(method="qlora", checkpointing=True), Setup(fsdp="full_shard", gpus=2),
         Setup(zero_stage=3, offload_params="cpu", offload_optimizer="cpu", gpus=4),
         Setup(objective="grpo", method="lora", num_generations=4, max_completion_length=256, seq=1024)]
CHANGES = [{"batch": 4}, {"method": "qlora"}, {"method": "full"}, {"quant": "int8"},
           {"fsdp": "full_shard", "offload_params": "cpu"},  # normalised: the optimizer goes to the CPU too
           {"fsdp": "full_shard", "gpus": 2, "zero_stage": 0, "offload_optimizer": "none", "offload_params": "none"},
           {"offload_params": "nvme"}, {"lora_rank": 0}, {"zero_stage": 5}, {"num_generations": 16},
           {"tp": 2, "gpus": 2}, {"cp": 2, "gpus": 2}, {"max_memory": (1 << 30, 1 << 30)}, {}]


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SpecError as exc:
        return ("SpecError", str(exc))


@pytest.mark.parametrize("base", BASES, ids=range(len(BASES)))
def test_replace_is_dataclasses_replace(base):
    for change in CHANGES:
        fast, slow = _outcome(base.replace, **change), _outcome(dataclasses.replace, base, **change)
        assert fast == slow, change
        if isinstance(fast, Setup):
            assert fast.to_dict() == slow.to_dict() and hash(fast) == hash(slow) and fast is not base, change


def test_replace_normalises_as_a_built_setup_does():
    s = Setup().replace(method="qlora")
    assert s.quant == "nf4" and s == Setup(method="qlora")
    assert Setup(fsdp="full_shard", gpus=2).replace(offload_params="cpu").offload_optimizer == "cpu"


def test_replace_refuses_an_unknown_field_and_leaves_the_original():
    base = Setup()
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_knob'"):
        base.replace(no_such_knob=1)
    with pytest.raises(SpecError):
        base.replace(batch=0)
    assert base == Setup() and base.batch == 1
