"""The library versions vramplan records beside its numbers, read from package metadata: a
version is never read by importing the library (reading torch's must not import torch).

One list, :data:`LIBRARIES`: a measurement's provenance (:mod:`vramplan.calibration.measure`) records all of
them; a ``vramplan check`` baseline (:mod:`vramplan.budget`) records :data:`BASELINE_LIBRARIES`,
the ones its traced tier runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Libraries whose versions change what a training step allocates.
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed", "nvidia-ml-py")

#: The part of :data:`LIBRARIES` a check baseline's ``recorded_with`` holds.
BASELINE_LIBRARIES = ("torch", "transformers", "peft")


def library_versions(names: Iterable[str] = LIBRARIES) -> dict[str, str | None]:
    """``{name: installed version}`` in the order given; None for a library not installed."""
    from importlib import metadata  # here, not at import: it costs every command ~12 ms (vramplan models)

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


#: The exact versions the estimates are read off and the truths run on; the first block of the
#: repository's constraints.txt pins the same (tests/test_doctor.py holds the two together), and
#: ``vramplan doctor`` prints the installed ones against them.
MODELLED: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "accelerate": "1.15.0",
    "bitsandbytes": "0.50.2",
    "deepspeed": "0.19.8",
    "trl": "1.16.0",
}


def version_tuple(text: str) -> tuple[int, ...]:
    """'4.48.1' -> (4, 48, 1), '2.13.0+cpu' -> (2, 13, 0), '5' -> (5,); () for no leading number."""
    out = []
    for part in text.strip().split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


@dataclass(frozen=True)
class Boundary:
    """A version boundary of one library that changes what a step allocates: below ``below`` the
    library behaves as ``before`` says, from ``below`` on as ``after`` says; ``modelled`` is the
    side the default estimate takes, ``source`` where it was read."""

    #: the name code asks for it by (estimator/stack.py ``Stack``'s predicates)
    key: str
    library: str
    below: tuple[int, ...]
    before: str
    after: str
    source: str
    #: the first version where the boundary's "before" holds (None: every earlier version)
    since: tuple[int, ...] | None = None

    def side(self, version: str) -> str | None:
        """"before" / "after" for an installed version, None when it lies outside the boundary's range."""
        v = version_tuple(version)
        if not v:
            return None
        if self.since is not None and v < self.since:
            return None
        return "before" if v < self.below else "after"


#: The boundaries vramplan knows, each one a predicate of ``vramplan.estimator.stack.Stack`` where
#: the estimate follows it (``--stack`` / a record's versions choose the other side).
BOUNDARIES: tuple[Boundary, ...] = (
    Boundary("moe_experts_linear", "transformers", (5,),
             "MoE experts are per-expert nn.Linear modules: bitsandbytes quantizes them and LoRA can target each",
             "MoE experts are fused 3-D parameters: bitsandbytes does not quantize them (a QLoRA MoE base keeps "
             "its experts in 16 bits) and LoRA targets them through peft's MoE conversion",
             "transformers 4.48.1 modeling_mixtral.py MixtralBlockSparseTop2MLP; 5.x fused experts "
             "skipped by replace_with_bnb_linear (4.x modelled: vramplan/estimator/moe_4x.py)"),
    Boundary("reentrant_checkpointing", "transformers", (5,),
             "gradient_checkpointing=True checkpoints reentrantly (use_reentrant=True): under FSDP1 no backward "
             "prefetch, frozen layer units keep their inputs to the end of the backward",
             "non-reentrant checkpointing (use_reentrant=False)",
             "transformers 4.48.1 modeling_utils.py gradient_checkpointing_enable; 5.24 "
             "_activation_checkpointing_enable"),
    Boundary("sdpa_repeat_kv", "transformers", (4, 54),
             "SDPA gets K and V repeated to every query head (repeat_kv before the call): a GQA layer keeps "
             "the repeated copies for its backward",
             "SDPA gets K and V at their own head count (enable_gqa=True) when no mask is passed",
             "transformers 4.48.1 and 4.53.0 integrations/sdpa_attention.py (repeat_kv always); 4.54.0 "
             "use_gqa_in_sdpa (torch >= 2.5, no attention mask)"),
    Boundary("loss_shift_copy", "transformers", (4, 49),
             "the causal-LM loss keeps a second, shifted fp32 copy of the logits while cross_entropy runs",
             "the labels are shifted instead (no second fp32 logits copy)",
             "transformers 4.46.0-4.48.1 loss/loss_utils.py ForCausalLMLoss; 4.49.0 pads the labels",
             since=(4, 46)),
)


def boundary(key: str) -> Boundary:
    """The boundary named ``key`` (one of :data:`BOUNDARIES`)."""
    return next(b for b in BOUNDARIES if b.key == key)


def drift(installed: Mapping[str, str | None], modelled: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{library: why}`` for every modelled library whose installed version differs from the
    modelled one (missing libraries are not drift: the estimate path needs none of them)."""
    modelled = MODELLED if modelled is None else modelled
    out = {}
    for name, want in modelled.items():
        have = installed.get(name)
        if have is not None and version_tuple(have) != version_tuple(want):
            out[name] = f"{name} {have} installed, estimates model {want}"
    return out


def boundaries_crossed(installed: Mapping[str, str | None],
                       modelled: Mapping[str, str] | None = None) -> list[tuple[Boundary, str]]:
    """The boundaries an installed version lies on the other side of from the modelled one, with
    the installed version: what changes memory between this machine's stack and the estimate."""
    modelled = MODELLED if modelled is None else modelled
    out = []
    for b in BOUNDARIES:
        have, want = installed.get(b.library), modelled.get(b.library)
        if have is None or want is None:
            continue
        side = b.side(have)
        if side is not None and side != b.side(want):
            out.append((b, have))
    return out
