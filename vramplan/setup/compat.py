"""Combinations that do not run (or have not been shown to run) with the pinned libraries: one table.

Each :class:`Incompatibility` names a combination of method x quantization x optimizer x engine x
offload x precision, what goes wrong, and its evidence: a run in this repository's tests
(``tests/...``) that reproduces the failure, or a library issue/PR. ``status`` is ``fails`` (the
failure is reproduced or reported at these versions) or ``unverified`` (reported failures and no
passing N-process run here yet: refused until one passes). :func:`known_failures` is the one
question code asks: ``vramplan plan`` never proposes a setup that hits an entry and ``vramplan
emit`` refuses to write one.

Not here: the planner searches optimizer offload with AdamW only (``search.space.check_fixed``)
because its memory and cost models price DeepSpeed's CPU Adam; that is a modelling choice, not a
failure (``emit`` writes other offloaded optimizers with ``zero_force_ds_cpu_optimizer: false``).

Some entries are also refused where a Setup is built (``Setup.__post_init__`` raises with the same
reason: a setup that cannot run is not a value); they are listed here too so the table is complete.

Versions modelled: torch 2.13, transformers 5.24, peft 0.21, accelerate 1.15, bitsandbytes 0.50,
deepspeed 0.19. Pure data and predicates; no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..specs import ModelSpec, Setup

#: The library versions the table was checked against.
VERSIONS = "torch 2.13, transformers 5.24, peft 0.21, accelerate 1.15, bitsandbytes 0.50, deepspeed 0.19"

EIGHT_BIT_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit")


@dataclass(frozen=True)
class Incompatibility:
    """One combination known not to run. ``applies(setup, model)`` says whether a setup is it."""

    key: str
    summary: str
    evidence: str
    status: Literal["fails", "unverified"]
    applies: Callable[[Setup, ModelSpec | None], bool]
    versions: str = VERSIONS
    #: True where ``Setup.__post_init__`` already refuses it (such a Setup cannot be built)
    refused_by_setup: bool = False

    def message(self) -> str:
        """One line for an error: what fails, and the evidence."""
        return f"{self.summary} ({self.status} at {self.versions}; evidence: {self.evidence})"


def _fsdp(s: Setup) -> bool:
    return s.fsdp != "none"


def _tied(m: ModelSpec | None) -> bool:
    return bool(m is not None and m.tie_word_embeddings)


TABLE: tuple[Incompatibility, ...] = (
    Incompatibility(
        "bnb-8bit-optimizer-fsdp",
        "bitsandbytes 8-bit/paged optimizers under FSDP: the optimizer state's gather for a checkpoint is a long "
        "record of failures",
        "bitsandbytes#89, bitsandbytes#1403, LLaMA-Factory#5619 (state-dict fix: bitsandbytes#1840); no "
        "N-process run of the emitted train.py with a checkpoint save passes here yet",
        "unverified",
        lambda s, m: _fsdp(s) and s.optimizer in EIGHT_BIT_OPTIMIZERS),
    Incompatibility(
        "fsdp-lora-tied-unsharded",
        "FSDP NO_SHARD (or any FSDP on one rank) with LoRA on tied embeddings: FSDP1 with use_orig_params asserts "
        "in FlatParamHandle._use_unsharded_views",
        "reproduced with plain torch FSDP (vramplan.setup.checks.fsdp_lora_crashes)",
        "fails",
        lambda s, m: s.adapters and _fsdp(s) and (s.fsdp == "no_shard" or s.gpus == 1) and _tied(m)),
    Incompatibility(
        "int8-fsdp",
        "FSDP cannot shard LLM.int8 weights (\"Cannot flatten integer dtype tensors\")",
        "tests/test_fsdp.py::test_invalid_fsdp_setups_say_why (seen in vramplan.truths.fsdp)",
        "fails",
        lambda s, m: _fsdp(s) and s.quant == "int8", refused_by_setup=True),
    Incompatibility(
        "qlora-fsdp-mixed",
        "QLoRA under FSDP with a -mixed precision: the 4-bit weights packed in fp32 are cast element by element",
        "tests/test_fsdp.py::test_invalid_fsdp_setups_say_why (seen in vramplan.truths.fsdp)",
        "fails",
        lambda s, m: _fsdp(s) and s.quant in ("nf4", "fp4") and s.precision.endswith("-mixed"),
        refused_by_setup=True),
    Incompatibility(
        "qlora-fsdp-shard-grad-op",
        "QLoRA under FSDP SHARD_GRAD_OP (\"FSDP does not support changing the parameters between forward and "
        "backward\")",
        "tests/test_fsdp.py::test_invalid_fsdp_setups_say_why (seen in vramplan.truths.fsdp)",
        "fails",
        lambda s, m: s.fsdp == "shard_grad_op" and s.quant in ("nf4", "fp4"), refused_by_setup=True),
    Incompatibility(
        "prequantized-sharded",
        "a GPTQ/AWQ base under DeepSpeed ZeRO or FSDP: its packed weights are buffers they neither shard nor cast",
        "not run here (Setup refuses it as not modelled)",
        "unverified",
        lambda s, m: s.quant in ("gptq", "awq") and (s.zero_stage > 0 or _fsdp(s)), refused_by_setup=True),
    Incompatibility(
        "eager-only-alibi",
        "BLOOM and MPT with --attn sdpa or flash: their model classes declare no SDPA or FlashAttention path, and "
        "from_pretrained raises (\"does not support an attention implementation through "
        "torch.nn.functional.scaled_dot_product_attention yet\")",
        "tests/test_catalogue_models.py::test_bloom_and_mpt_refuse_sdpa_and_flash (transformers' own classes)",
        "fails",
        lambda s, m: m is not None and m.model_type in ("bloom", "mpt") and s.attn in ("sdpa", "flash")),
)

BY_KEY = {i.key: i for i in TABLE}


def known_failures(setup: Setup, model: ModelSpec | None = None) -> tuple[Incompatibility, ...]:
    """The table's entries ``setup`` (of ``model``, when the entry depends on it) hits."""
    return tuple(i for i in TABLE if i.applies(setup, model))


def runs(setup: Setup, model: ModelSpec | None = None) -> bool:
    """No known failure applies (cheap: a few comparisons per entry)."""
    return not any(i.applies(setup, model) for i in TABLE)
