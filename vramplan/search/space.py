"""The knobs the search varies: families (method x base quantization x LoRA rank), their saver
configurations (checkpointing, optimizer, placement, attention), and the fixed knobs' checks.
Pure: a :class:`Space` is a value; nothing here estimates memory."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..estimator import cache
from ..estimator.cache import memoized
from ..estimator.eval_step import eval_unmodelled
from ..estimator.hybrid_shard import check_hybrid
from ..estimator.knobs import IN_BACKWARD_OPTIMIZERS
from ..estimator.layer_split import check_supported as layer_split_supported
from ..estimator.liger import LIGER_FAMILIES
from ..estimator.selective import check_selective
from ..setup.checks import (
    TUPLE_ROUTERS,
    attention_targets,
    check,
    check_activation_offload,
    check_framework,
    check_fsdp2,
    tiled_mlp_applies,
)
from ..setup.compat import known_failures, runs
from ..setup.frameworks import framework
from ..specs import GpuSpec, ModelSpec, Setup, SpecError
from .geometry import BatchShape, Target
from .space_cp import cp_splits
from .space_parallel import hybrid_shards, tp_fsdp2_splits

#: The most GPUs one machine (and so one ``device_map`` process) holds: DGX-2 / HGX-2's 16.
MAX_LAYER_SPLIT_GPUS = 16

#: LoRA ranks a ``--lora-rank LO..HI`` range is searched at (with LO and HI themselves).
LORA_RANKS = (8, 16, 32, 64, 128, 256)
#: The LoRA rank when the user names none: the rank is a quality setting the user owns, never
#: raised by the search to use the card (16: peft's examples, torchtune's and axolotl's LoRA recipes
#: use 8-64).
DEFAULT_LORA_RANK = 16
#: vLLM colocated: the shares of the card (``vllm_gpu_memory_utilization``) a GRPO plan tries; TRL 1.16's
#: default is 0.3 (lowered from 0.9 after OOM reports, trl#2688)
VLLM_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
DEFAULT_VLLM_FRACTION = next(f.default for f in dataclasses.fields(Setup) if f.name == "vllm_memory_fraction")
#: Selective checkpointing tried between none and every layer (estimator/selective.py): every
#: layer, one in 2, one in 4 (about half and a quarter of the recompute)
CHECKPOINT_EVERY = (1, 2, 4)


def rank_choices(lo: int, hi: int) -> tuple[int, ...]:
    """The ranks a range ``lo..hi`` is searched at: its ends and the :data:`LORA_RANKS` between."""
    return tuple(sorted({lo, hi} | {r for r in LORA_RANKS if lo < r < hi}))

#: Setup fields a user may fix; everything else of Setup is fixed by the target or the batch.
FIXABLE = ("method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "quant", "double_quant",
           "quant_bits", "quant_group_size",
           "precision", "optimizer", "checkpointing", "checkpoint_every", "attn", "zero_stage", "offload_optimizer",
           "offload_params", "loss", "batch", "grad_accum", "fsdp", "fsdp_version", "dp_replicate", "liger",
           "activation_offload",
           # how the data is batched (a padding-free collator): the user's pipeline, fixed, never searched
           "padding_free",
           # torch.compile as the framework applies it (torchtune's compiled loss): searched as a saver for
           # torchtune (:meth:`Space._savers`), a fixed one kept
           "compile",
           # Unsloth's unsloth_tiled_mlp=True, axolotl's tiled_mlp (the MLP in sequence tiles): searched as a saver
           # for those two (:meth:`Space._savers`), a fixed one kept; axolotl's shard count only fixed
           "tiled_mlp", "tiled_mlp_shards",
           # LLaMA-Factory's use_unsloth_gc (its checkpointed layer inputs in host RAM): searched for llamafactory
           # (:meth:`Space.offload_choices`), a fixed one kept
           "unsloth_gc",
           # searched where legal (:meth:`Space.in_backward_choices`); a fixed one is kept
           "optimizer_in_backward",
           # quality choices of the adapters (estimator/knobs.py): fixed, never searched
           "dora", "modules_to_save",
           # the objective and its algorithm (estimator/objectives.py): fixed, never searched (the lengths and
           # GRPO's num_generations are the user's algorithm, not memory knobs); searched unless fixed: DPO's
           # reference, GRPO's generation engine and vLLM's share of the card (:meth:`Space.objective_knobs`)
           "objective", "max_prompt_length", "max_completion_length", "num_generations", "ref_model", "generation",
           "vllm_memory_fraction",
           # the run's eval step (estimator/eval_step.py): its own phase, judged for fit, never searched
           "eval_batch",
           # the framework that runs the step (setup/frameworks.py): the user's, fixed, never searched
           "framework")


@dataclass(frozen=True)
class Space:
    """The setups one search may visit: the model, the target, the batch shape, the fixed knobs,
    and the LoRA ranks (None: the fixed ``lora_rank``, else :data:`DEFAULT_LORA_RANK`)."""

    model: ModelSpec
    target: Target
    shape: BatchShape
    fixed: dict[str, Any]
    ranks: tuple[int, ...] | None = None

    def choices(self, name: str, default: Iterable[Any]) -> tuple[Any, ...]:
        """The values of knob ``name`` to try: the fixed one, or ``default``."""
        return (self.fixed[name],) if name in self.fixed else tuple(default)

    def families(self) -> list[Setup]:
        """One base Setup per (method, base quantization, rank); savers at their defaults."""
        f = self.fixed
        lora_knobs = any(k in f for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "dora",
                                          "modules_to_save"))
        # a fixed LoRA knob means adapters unless the method is fixed too
        methods = self.choices("method", ("lora", "qlora") if lora_knobs else ("full", "lora", "qlora"))
        # the bases searched per method; a fixed --quant picks the methods it is valid for. GPTQ/AWQ
        # need a pre-quantized checkpoint: searched only when the user fixes --quant gptq|awq
        bases = {"full": ("none",), "lora": ("none",), "qlora": ("nf4",)}
        if "quant" in f:
            q = f["quant"]
            bases = {"full": (q,) if q == "none" else (),
                     "lora": (q,) if q in ("none", "int8", "gptq", "awq") or f.get("method") == "lora" else (),
                     "qlora": (q,) if q in ("nf4", "fp4") else ()}
        combos = [(method, q) for method in methods for q in bases[method]]
        refused: list[str] = []
        gpu = self.target.gpu
        out = []
        for method, quant in combos:
            ranks = (16,) if method == "full" else self.ranks or self.choices("lora_rank", (DEFAULT_LORA_RANK,))
            if method == "full":
                precision = self.choices("precision", ("bf16",) if gpu.bf16 else ("fp16-mixed",))
            else:
                precision = self.choices("precision", ("bf16",) if gpu.bf16 else ("fp16",))
            for r in ranks:
                for p in precision:
                    values = {k: v for k, v in f.items() if k not in ("batch", "grad_accum")}
                    if "vllm_memory_fraction" in f:  # a share of the card fixed: vLLM colocated
                        values.setdefault("generation", "vllm-colocate")
                    values.update(method=method, quant=quant,
                                  lora_rank=r if method != "full" else f.get("lora_rank", 16),
                                  precision=p, seq=self.shape.seq, gpus=self.target.gpus)
                    if method != "full" and "lora_targets" not in f and self.model.family in TUPLE_ROUTERS:
                        # all-linear wraps a router that returns a tuple and fails in peft (setup/checks.py)
                        values["lora_targets"] = attention_targets(self.model)
                    try:
                        s = Setup(**values)
                        check(self.model, s)
                    except SpecError as exc:
                        refused.append(str(exc))
                        continue
                    if eval_unmodelled(s):  # --eval-batch: only where the eval step is modelled
                        continue
                    out.append(s)
        if not out:  # say why, where every family was refused by one check
            why = f" (the most frequent refusal: {Counter(refused).most_common(1)[0][0]})" if refused else ""
            raise SpecError(f"no setup satisfies the fixed options together{why}; relax one of them")
        # ascending rank within a method, so failures at a low rank answer the higher ranks
        return sorted(out, key=lambda s: (s.method, s.quant, s.lora_rank))

    def placements(self) -> list[tuple[int, str, str, str]]:
        """(ZeRO stage, optimizer offload, parameter offload, FSDP sharding) worth trying on this
        target. Several GPUs also try PyTorch FSDP (FULL_SHARD, SHARD_GRAD_OP, FULL_SHARD with
        CPU offload) beside ZeRO; one GPU only when FSDP is asked for.

        FSDP candidates are accelerate's FSDP1 (``fsdp_version`` is not searched): FSDP1 is modelled
        for everything this search varies (CPU offload, 8-bit AdamW, QLoRA, one GPU), FSDP2
        (estimator/fsdp2.py) for a subset, and where both are modelled their per-rank peaks differ
        by about one layer's all-gather buffer (FSDP2's held at the loss) or an untied embedding,
        not by a memory tier; the plan's emitted accelerate config (fsdp_version: 1) is what it
        estimated. ``--fsdp-version 2`` (with a fixed ``--fsdp``) fixes FSDP2: every candidate is then
        FSDP2 (the others fail Setup: fsdp_version 2 needs FSDP). A file's fsdp_version 2 is not
        kept: it shows as a change to 1 in ``plan --from``."""
        n, f = self.target.gpus, self.fixed
        offl = ("cpu", "nvme") if self.target.nvme else ("cpu",)
        fsdp = [(0, "none", "none", m) for m in ("full_shard", "shard_grad_op")] + [(0, "cpu", "cpu", "full_shard")]
        if any(k in f for k in ("zero_stage", "offload_optimizer", "offload_params", "fsdp")):
            allowed = [(z, o, p, "none") for z in (0, 1, 2, 3) for o in ("none", "cpu", "nvme")
                       for p in ("none", "cpu", "nvme")]
            if n > 1 or "fsdp" in f:
                allowed += [(0, o, o, m) for m in ("full_shard", "shard_grad_op", "no_shard") for o in ("none", "cpu")]
        elif n == 1:
            allowed = ([(0, "none", "none", "none")] + [(2, o, "none", "none") for o in offl]
                       + [(3, o, o, "none") for o in offl])
        else:
            allowed = [(z, "none", "none", "none") for z in (0, 1, 2, 3)]
            allowed += [(2, o, "none", "none") for o in offl] + [(3, o, "none", "none") for o in offl]
            allowed += [(3, o, o, "none") for o in offl] + fsdp
        if f.get("objective", "sft") != "sft":  # DPO/GRPO are modelled on one resident GPU (objectives.py)
            allowed = [(0, "none", "none", "none")]
        if f.get("framework", "hf") != "hf":  # a framework's own preparation: modelled without ZeRO/FSDP
            allowed = [(0, "none", "none", "none")]
        out = []
        for z, o, p, m in allowed:
            if (f.get("zero_stage", z) != z or f.get("offload_optimizer", o) != o or f.get("offload_params", p) != p
                    or f.get("fsdp", m) != m):
                continue
            if m == "none" and ((p != "none" and z != 3) or (o != "none" and z == 0)):
                continue
            out.append((z, o, p, m))
        return out

    def savers(self, family: Setup) -> list[Setup]:
        """Every saver configuration of a family (checkpointing, optimizer, placement, attention). The card
        enters them only through the attention implementations it allows (:meth:`attentions`): they are
        computed on the :func:`card_free` target and kept per value (a plan over many cards asks on each)."""
        if not cache.enabled():  # on this very target (the tests' reference)
            return self._savers(family, self.attentions())
        try:
            fixed = tuple(sorted((k, type(v), v) for k, v in self.fixed.items()))
            hash(fixed)
        except TypeError:  # an unhashable fixed value: not kept
            return self._savers(family, self.attentions())
        return list(_savers(family, self.model, card_free(self.target), self.shape, fixed, self.ranks,
                            self.attentions()))

    def attentions(self) -> tuple[str, ...]:
        """The attention implementations the savers try on this card."""
        cc = self.target.gpu.compute_capability
        if self.model.default_attn == "eager" and (cc is None or float(cc) >= 8.0):
            return ("auto", "flash")  # FlashAttention-2 keeps no s x s scores (needs Ampere+)
        return ("auto",)

    def _savers(self, family: Setup, attns: tuple[str, ...]) -> list[Setup]:
        # Liger's kernels where they are modelled (estimator/liger.py): a saver, not a quality change
        ligers = self.choices("liger", (False, True) if liger_applies(self.model, family) else (False,))
        # torchtune's compile: True: its compiled loss saves memory (estimator/torchtune.py), searched as a saver
        compiles = self.choices("compile", (False, True) if family.framework == "torchtune" else (False,))
        # Unsloth's unsloth_tiled_mlp=True, axolotl's tiled_mlp: the MLP's activations of one tile
        # (estimator/tiled_mlp.py), a saver
        tileds = self.choices("tiled_mlp", (False, True) if family.framework in ("unsloth", "axolotl")
                              and tiled_mlp_applies(self.model) else (False,))
        objective = self.objective_knobs(family)
        out = []
        for z, o, p, m in self.placements():
            # DeepSpeed's optimizer offload runs its own CPU Adam; FSDP's CPU offload steps any torch
            # optimizer on the host (its shards live there), so only ZeRO offload restricts the optimizer
            deepspeed_offload = o != "none" and m == "none"
            optimizers = ("adamw-fused",) if o != "none" else ("adamw-fused", "adamw-8bit")
            for opt in self.choices("optimizer", optimizers):
                if deepspeed_offload and opt not in ("adamw", "adamw-fused"):
                    continue
                for ck, every in self.checkpointing_choices(family, z, m):
                    for attn, liger, comp, tiled, obj in itertools.product(self.choices("attn", attns), ligers,
                                                                           compiles, tileds, objective):
                        try:  # a GPTQ/AWQ base refuses ZeRO placements
                            s = family.replace(zero_stage=z, offload_optimizer=o, offload_params=p, fsdp=m, tp=1,
                                               optimizer=opt, checkpointing=ck, checkpoint_every=every, attn=attn,
                                               liger=liger, compile=comp, tiled_mlp=tiled, **obj)
                            if every > 1:
                                check_selective(self.model, s)
                            check_fsdp2(self.model, s)  # a fixed --fsdp-version 2: only what FSDP2 models
                            check_hybrid(self.model, s)  # a fixed --dp-replicate: only what HSDP models
                            check_framework(s)  # what the framework runs (Unsloth: its own savers)
                        except SpecError:
                            continue
                        if not runs(s, self.model):
                            continue  # known not to run with the pinned libraries (vramplan.setup.compat)
                        if eval_unmodelled(s):  # --eval-batch: only where the eval step is modelled
                            continue
                        out += [c for o in self.offload_choices(s) for c in self.in_backward_choices(o)]
                        out += hybrid_shards(self, s)  # several nodes: HSDP beside FSDP (space_parallel.py)
        out += tp_fsdp2_splits(self, family) + cp_splits(self, family)  # one node: TP x FSDP2, CP (space_cp.py)
        return out + [s for s in self.layer_splits(family) + self.tensor_splits(family) if not eval_unmodelled(s)]

    def offload_choices(self, s: Setup) -> list[Setup]:
        """``s`` without and with activation offloading (TRL's OffloadActivations), where it is
        modelled (estimator/act_offload.py: full fine-tuning with checkpointing on one GPU), and with
        LLaMA-Factory's ``use_unsloth_gc`` (the checkpointed layer inputs in host RAM, estimator/unsloth.py)."""
        out = []
        gcs = (False, True) if s.framework == "llamafactory" and s.checkpointing else (False,)
        for off, gc in itertools.product(self.choices("activation_offload", (False, True)),
                                         self.choices("unsloth_gc", gcs)):
            try:
                c = s.replace(activation_offload=off, unsloth_gc=gc)
                check_activation_offload(self.model, c)
                if gc:  # (the rest of the framework's rules were checked on s)
                    check_framework(c)
            except SpecError:
                continue
            out.append(c)
        return out

    def in_backward_choices(self, s: Setup) -> list[Setup]:
        """``s`` without and with the optimizer in backward (estimator/knobs.py: each gradient freed once
        its parameter is stepped). Searched for full fine-tuning only, where it saves a whole model's
        gradients; with adapters it frees only the adapters' (a few per cent of a LoRA run), not worth a
        second kind of optimizer step (a fixed ``--optimizer-in-backward`` is kept there). Only where it is
        modelled and emitted: one GPU without ZeRO/FSDP/layer split/TP, grad accumulation 1 at every
        micro-batch the search may pick, torch's optimizers (:data:`IN_BACKWARD_OPTIMIZERS`), SFT without eval."""
        legal = (self.target.gpus == 1 and s.objective == "sft" and s.eval_batch == 0
                 and s.optimizer in IN_BACKWARD_OPTIMIZERS and s.zero_stage == 0 and s.fsdp == "none"
                 and all(self.shape.grad_accum(m) == 1 for m in self.shape.micro_batches))
        written = "optimizer_in_backward" not in framework(s.framework).unwritten  # what its config can say
        ons = self.choices("optimizer_in_backward", (False, True) if legal and written and s.method == "full"
                           else (False,))
        out = []
        for on in ons:
            if on and not legal:
                continue
            try:
                c = s.replace(optimizer_in_backward=on)
                if on:
                    check(self.model, c, self.target.gpu)  # e.g. activation offloading with it is not traced
            except SpecError:
                continue
            out.append(c)
        return out

    def checkpointing_choices(self, family: Setup, zero_stage: int, fsdp: str) -> list[tuple[bool, int]]:
        """(checkpointing, checkpoint_every) to try: none, every layer, and between them every
        :data:`CHECKPOINT_EVERY` -th layer (estimator/selective.py: fewer layers recomputed) where
        selective checkpointing is modelled (no ZeRO/FSDP placement)."""
        written = "checkpoint_every" not in framework(family.framework).unwritten  # what its config can say
        everies = (1,) if zero_stage or fsdp != "none" or not written else CHECKPOINT_EVERY
        out = []
        for ck in self.choices("checkpointing", (False, True)):
            out += [(ck, e) for e in (self.choices("checkpoint_every", everies) if ck else (1,))]
        return out

    def objective_knobs(self, family: Setup) -> list[dict[str, Any]]:
        """The objective's memory knobs to try (``[{}]`` for SFT): DPO's reference (adapters: peft's
        adapter-disabled base or precomputed log-probs, a frozen copy being the base's weights again for
        nothing; full: a copy or precomputed); GRPO's generation (HF generate, or vLLM colocated at each of
        :data:`VLLM_FRACTIONS`; vLLM on other GPUs only when fixed: it needs GPUs this plan does not have).
        GRPO's reference is the user's ``beta`` (``--ref-model``; none by default), never searched."""
        if family.objective == "dpo":
            refs = self.choices("ref_model", ("adapter" if family.adapters else "copy", "precomputed"))
            return [{"ref_model": r} for r in refs]
        if family.objective != "grpo":
            return [{}]
        gens = self.choices("generation", ("vllm-colocate",) if "vllm_memory_fraction" in self.fixed
                            else ("hf", "vllm-colocate"))
        out: list[dict[str, Any]] = []
        for g in gens:
            if g != "vllm-colocate":  # no share of the card: Setup's default fraction (read only by vLLM colocated)
                out.append({"generation": g, "vllm_memory_fraction": DEFAULT_VLLM_FRACTION})
                continue
            out += [{"generation": g, "vllm_memory_fraction": v} for v in self.choices("vllm_memory_fraction",
                                                                                       VLLM_FRACTIONS)]
        return out

    def layer_splits(self, family: Setup) -> list[Setup]:
        """Several GPUs of one machine: the layer split (``device_map="auto"``, one process; naive
        pipeline parallelism: memory of a model too large for one card, at one card's speed), with
        the optimizer and checkpointing savers. Not with a fixed ZeRO/FSDP/offload placement."""
        f = self.fixed
        # a global batch is per_gpu x gpus sequences; a split has one data-parallel rank: not searched then.
        # One process drives every GPU of the split, so they are one machine's: past MAX_LAYER_SPLIT_GPUS
        # (the largest single machines) a split is not proposed (`--device-map` still estimates one).
        if (self.target.gpus < 2 or self.target.gpus > MAX_LAYER_SPLIT_GPUS or self.target.nodes > 1
                or f.get("objective", "sft") != "sft"
                or self.shape.per_gpu is not None
                or any(k in f for k in ("zero_stage", "offload_optimizer", "offload_params", "fsdp"))):
            return []
        out = []
        for opt in self.choices("optimizer", ("adamw-fused", "adamw-8bit")):
            for ck in self.choices("checkpointing", (False, True)):
                try:
                    s = family.replace(device_map="auto", optimizer=opt, checkpointing=ck, zero_stage=0, fsdp="none",
                                       tp=1, offload_optimizer="none", offload_params="none")
                    layer_split_supported(self.model, s)
                except SpecError:
                    continue
                if runs(s, self.model):
                    out.append(s)
        return out

    def tensor_splits(self, family: Setup) -> list[Setup]:
        """Several GPUs of one machine: tensor parallelism over all of them (``tp == gpus``,
        transformers' ``tp_plan="auto"``: each GPU a 1/tp shard of every layer, four all-reduces per
        layer on the critical path, cost/model.py), where estimator/tensor_parallel.py models it (a 16-bit
        base, torch AdamW). The cost model ranks it below data parallelism whenever that fits."""
        from ..estimator.tensor_parallel import check_tp

        f = self.fixed
        if (self.target.gpus < 2 or self.target.nodes > 1 or self.shape.per_gpu is not None
                or any(k in f for k in ("zero_stage", "offload_optimizer", "offload_params", "fsdp"))
                or f.get("optimizer", "adamw") != "adamw"):
            return []
        out = []
        for ck in self.choices("checkpointing", (False, True)):
            try:
                s = family.replace(tp=self.target.gpus, optimizer="adamw", checkpointing=ck, zero_stage=0,
                                   fsdp="none", offload_optimizer="none", offload_params="none")
                check_tp(self.model, s)
            except SpecError:
                continue
            if runs(s, self.model):
                out.append(s)
        return out


def card_free(target: Target) -> Target:
    """``target`` as the saver configurations see it: its GPUs, nodes and NVMe, no card (the attention
    implementations the card allows are :meth:`Space.attentions`), host RAM or corrections."""
    return Target(GpuSpec(name="card", display_name="card", usable_memory_bytes=1), target.gpus, target.nodes, None,
                  target.nvme)


@memoized(typed=0, maxsize=256)
def _savers(family: Setup, model: ModelSpec, target: Target, shape: BatchShape, fixed: tuple,
            ranks: tuple[int, ...] | None, attns: tuple[str, ...]) -> tuple[Setup, ...]:
    """:meth:`Space.savers` of the space these values make (``fixed``: (name, type, value) triples)."""
    return tuple(Space(model, target, shape, {k: v for k, _, v in fixed}, ranks)._savers(family, attns))


def check_fixed(model: ModelSpec, fixed: dict[str, Any], gpus: int, seq: int) -> None:
    """Reject fixed knobs that contradict each other, with Setup's own messages."""
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise SpecError(f"unknown constraint {unknown[0]!r}; fixable knobs: {', '.join(FIXABLE)}")
    probe = dict(fixed)
    if "vllm_memory_fraction" in probe:  # a share of the card fixed: vLLM colocated
        probe.setdefault("generation", "vllm-colocate")
    if probe.get("quant", "none") != "none" and "method" not in probe:
        probe["method"] = "qlora" if probe["quant"] in ("nf4", "fp4") else "lora"
    if (probe.get("dora") or probe.get("modules_to_save")) and "method" not in probe:
        probe["method"] = "lora"  # adapter knobs: the search tries LoRA and QLoRA
    if probe.get("offload_params", "none") != "none" and probe.get("fsdp", "none") == "none":
        probe.setdefault("zero_stage", 3)
    if probe.get("offload_optimizer", "none") != "none" and probe.get("fsdp", "none") == "none":
        probe.setdefault("zero_stage", 2)
    if (probe.get("offload_optimizer", "none") != "none"
            and probe.get("optimizer", "adamw") not in ("adamw", "adamw-fused")):
        raise SpecError(f"--optimizer {probe['optimizer']} cannot be offloaded: DeepSpeed's offload runs its own "
                        "CPU Adam; use --optimizer adamw-fused or drop --offload-optimizer")
    if probe.get("method") == "qlora" and probe.get("quant") == "none":
        raise SpecError("qlora means a 4-bit base; drop --no-quant or use --method lora")
    setup = Setup(**probe, gpus=gpus, seq=seq)
    hits = known_failures(setup, model)
    if hits:
        raise SpecError(f"the fixed options do not run: {hits[0].message()}")
    if any(k in fixed for k in ("lora_rank", "lora_targets")) and fixed.get("method") != "full":
        check(model, setup.replace(method="lora") if setup.method == "full" else setup)


# ----------------------------------------------------------------------------------------------
# keys that group setups


def family_key(s: Setup) -> tuple:
    """The family a setup belongs to: method, base quantization, rank (adapters only), precision."""
    return (s.method, s.quant, s.lora_rank if s.adapters else 0, s.precision)


_RANK_FREE = tuple(f.name for f in dataclasses.fields(Setup) if f.name not in ("lora_rank", "lora_alpha"))
_rank_free = operator.attrgetter(*_RANK_FREE)


def rank_key(s: Setup) -> tuple:
    """Every field of a Setup but its rank (new Setup fields are included automatically)."""
    return _rank_free(s)


def placement_key(s: Setup) -> tuple:
    """Saver configurations that share a placement are ordered by memory (see :func:`saving`)."""
    # the objective's knobs (DPO's reference, GRPO's generation and vLLM's share) are not savers: each its own placement
    return (s.zero_stage, s.offload_optimizer, s.offload_params, s.fsdp, s.device_map, s.tp, s.precision, s.ref_model,
            s.generation, s.vllm_memory_fraction, s.dp_replicate, s.fsdp_version, s.cp)


def saving(s: Setup) -> tuple[int, ...]:
    """How many memory savers a configuration turns on, in an order within one placement
    (checkpointing every layer saves more than every k-th)."""
    return (int(s.checkpointing), -s.checkpoint_every, int(s.optimizer in ("adamw-8bit", "paged-adamw-8bit")),
            int(s.attn != "auto"), int(s.liger), int(s.activation_offload), int(s.optimizer_in_backward),
            int(s.compile), int(s.tiled_mlp), int(s.unsloth_gc))


def liger_applies(model: ModelSpec, family: Setup) -> bool:
    """Liger's kernels are a search choice where they are modelled: the families of
    estimator/liger.py, with transformers' loss on a 16/32-bit base (Liger's fused loss replaces it),
    or with TRL's head on a 16-bit, NF4/FP4 or LLM.int8 base (TRL keeps its head and applies the layer
    kernels; validate --knob liger), or under axolotl's and LLaMA-Factory's Liger plugins on any of those bases
    (their rows of validate --knob liger); not under Unsloth (its own kernels). The HF recipe's quantized
    bases take ``--liger`` when asked (verified too) but its search leaves it out: where the HF recipe
    needs it to stay in VRAM the default plan turns to TRL, and a bigger card then never plans slower."""
    if model.family not in LIGER_FAMILIES or family.objective != "sft":  # DPO/GRPO: TRL's fused head
        return False
    if family.loss == "trl":
        return family.quant in ("none", "nf4", "fp4", "int8") and family.framework != "unsloth"
    if family.framework in ("axolotl", "llamafactory"):  # named: no TRL plan to turn to; their Liger plugins on
        return family.quant in ("none", "nf4", "fp4", "int8") and family.loss == "hf"  # quantized bases: verified
    return family.quant == "none" and family.loss == "hf"
