"""Step time of the DPO and GRPO steps TRL 1.16 runs (estimator/objectives.py), torch-free and pure.

:func:`step_cost` is :func:`vramplan.cost.model.step_cost` for SFT; for an objective it prices the policy's
forward/backward/optimizer over the rows TRL trains on (``policy_setup``: DPO 2 x pairs, GRPO
prompts x generations rows of prompt + completion) with the SFT cost model, and adds:

- **reference** (DPO always but ``precomputed``; GRPO with a reference, ``beta != 0``): one no-grad
  forward over the same rows (``2N`` per token plus the causal attention forward) at the compute
  rate of the policy's micro-batch; with ``adapter`` TRL runs its "ref" copy of the adapter
  (estimator/objectives.py ``reference_adapter_bytes``), so the adapters' FLOPs and a third of the
  LoRA path's fitted traffic count. ORPO has no reference; KTO's KL-batch forward is not priced
  (its rows as DPO's otherwise). ``precomputed``
  (``precompute_ref_log_probs``) runs the same forward once per example before training: priced at
  one epoch, the same seconds per example, out of the step's memory.
- **generation** (GRPO): per optimizer step TRL generates the generation batch
  (``per_device_train_batch_size x steps_per_generation`` completions, ``steps_per_generation`` =
  grad accum). *Prefill*: ``2N`` per prompt token plus attention, compute-bound at the cost model's
  MFU. *Decode*: ``max_completion_length`` token steps (every completion at its maximum length: an
  upper bound, completions that stop at EOS end sooner); each step is memory-bound: the weights
  and the KV cache of the running sequences read once, against ``2N`` FLOPs per running sequence,
  whichever takes longer (a roofline), plus the engine's per-step overhead:

  * HF ``generate`` (eager, DynamicCache): kernel launches and Python per layer and step,
    :data:`HF_DECODE_LAYER_OVERHEAD_S`, and the cache's ``torch.cat`` growth (transformers 5.24
    ``cache_utils.py DynamicLayer.update``) re-reading and re-writing the cache every step. peft's
    adapters add their own launches (:data:`HF_LORA_LINEAR_OVERHEAD_S`); a bitsandbytes 4-bit base
    dequantizes each Linear every step (the SFT model's fitted dequantization cost).
  * vLLM colocated (paged attention, continuous batching, CUDA graphs): the weights and KV read at
    :data:`VLLM_BW_EFFICIENCY` of the card's bandwidth with no per-layer launch cost; when its KV
    cache holds fewer sequences than the batch (estimator/vllm_share.py) the batch runs in waves.
    TRL pushes the updated weights into vLLM once per step (a device copy: read and write).
  * vLLM server: generation on other GPUs, overlapped with nothing here (TRL waits for it): priced as
    vLLM at the same card's bandwidth.

Tokens/s counts TRL's ``num_tokens``: the prompt + completion tokens of the rows the policy trains on
per second (grpo_trainer.py ``num_input_tokens_seen``; DPO: chosen and rejected rows), every row at
its maximum length as the memory estimate assumes. The plan also states completions (GRPO) or pairs
(DPO) per second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..estimator.lora import adapted_linears
from ..estimator.objectives import lengths, policy_setup, reference
from ..estimator.vllm_share import kv_bytes_per_token, vllm_share, vllm_weights_bytes
from ..specs import GpuSpec, ModelSpec, Setup
from . import model as cost
from .counts import DEQUANT_BYTES_PER_PARAM

#: Eager decode overhead per layer and token step (launches and Python, not hidden by the GPU), derived
#: from PyTorch's "Accelerating Generative AI with PyTorch II: GPT, Fast" (Nov 2023, gpt-fast): Llama-2-7B
#: fp16 on one A100-80GB at batch 1, eager 25.5 tokens/s vs 107 tokens/s compiled with CUDA graphs:
#: (1/25.5 s - 13.5 GB / (2.039 TB/s x 0.7)) / 32 layers = 0.93 ms
HF_DECODE_LAYER_OVERHEAD_S = 9.3e-4
#: peft's LoRA path per adapted Linear and decode step (dropout, A, B, scale and add: ~4 launches of ~10 us)
HF_LORA_LINEAR_OVERHEAD_S = 4e-5
#: share of the bandwidth a CUDA-graph decode step reaches: gpt-fast's compiled 107 tokens/s for 13.5 GB
#: of weights per token on a 2.039 TB/s A100 is 0.71; vLLM's paged decode is taken to reach the same (stated)
VLLM_BW_EFFICIENCY = 0.7
#: share of the bandwidth eager HF decode kernels reach on the weights and cache (the same reading)
HF_BW_EFFICIENCY = 0.7
#: vLLM's per-step scheduler and sampler overhead (seconds per decode step, stated, not measured here)
VLLM_STEP_OVERHEAD_S = 1e-3


@dataclass(frozen=True)
class ObjectiveCost:
    """The objective's step split by phase (seconds per optimizer step) and what it produces."""

    generation_s: float
    prefill_s: float
    decode_s: float
    sync_s: float  # vLLM: the weights pushed into the engine
    reference_s: float
    policy_s: float  # forward/backward/optimizer of the policy (vramplan.cost.model)
    waves: int  # vLLM: the generation batch in this many waves (its KV cache holds fewer sequences)
    concurrent: int  # sequences decoded at once
    completions: int  # GRPO: completions per step; DPO: pairs per step
    tokens_per_step: int
    policy: cost.StepCost  # the policy's step by term

    @property
    def step_s(self) -> float:
        return self.generation_s + self.reference_s + self.policy_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def _rate(gpu: GpuSpec | None, setup: Setup, tokens: int, constants: Mapping[str, float]) -> float:
    """Executed matmul FLOP/s for ``tokens`` rows (the SFT model's MFU and batch efficiency)."""
    return cost.peak_flops(gpu, setup) * cost.mfu(gpu, constants) * cost.batch_efficiency(tokens)


def reference_s(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, k: cost.Counts,
                constants: Mapping[str, float] = cost.CONSTANTS) -> float:
    """One no-grad forward of the reference over the step's rows (0 without a reference)."""
    ref = reference(setup)
    if ref == "none" or setup.objective == "sft":
        return 0.0
    pol = policy_setup(setup)
    per_token = 2.0 * k.matmul_params + 2.0 * model.num_layers * pol.seq * model.q_dim
    tokens = pol.tokens * setup.grad_accum
    lora = 0.0
    # TRL's "ref" copy of a PeftModel's adapter runs in the forward (use_adapter("ref")), in the step or, with
    # precompute_ref_log_probs, in the pass before training (dpo_trainer.py: the same use_adapter context)
    if ref == "adapter" or (ref == "precomputed" and setup.adapters):
        per_token += 2.0 * k.adapter_params
        # the adapter path's traffic: the forward's third of the fitted forward + backward passes (assumed)
        lora = tokens * k.lora_width * 2.0 * constants["lora_passes"] / 3.0 / cost.bandwidth(gpu)
    seconds = tokens * per_token / _rate(gpu, pol, pol.tokens, constants) + lora
    if setup.quant in DEQUANT_BYTES_PER_PARAM:  # a bitsandbytes base (or its copy), dequantized once
        seconds += (setup.grad_accum * k.quantized_params * DEQUANT_BYTES_PER_PARAM[setup.quant]
                    * constants["dequant_inefficiency"] / cost.bandwidth(gpu))
    return seconds


def _decode_step_s(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, k: cost.Counts, rows: int, context: float,
                   weights: float, constants: Mapping[str, float]) -> float:
    """One decode step of ``rows`` sequences at mean ``context`` tokens: roofline plus the engine's overhead."""
    kv = rows * context * kv_bytes_per_token(model, setup)
    flops = rows * (2.0 * (k.matmul_params + k.adapter_params) + 4.0 * model.num_layers * context * model.q_dim)
    compute = flops / (cost.peak_flops(gpu, setup) * cost.mfu(gpu, constants))  # few rows: the memory side binds
    dequant = 0.0
    if setup.quant in DEQUANT_BYTES_PER_PARAM:  # bitsandbytes dequantizes each Linear per step (batch > 1), in
        # HF and in vLLM's bitsandbytes path alike: the SFT model's fitted dequantization cost
        dequant = (k.quantized_params * DEQUANT_BYTES_PER_PARAM[setup.quant] * constants["dequant_inefficiency"]
                   / cost.bandwidth(gpu))
    if setup.generation == "hf":
        traffic = weights + 3.0 * kv  # attention reads the cache; torch.cat re-reads and re-writes it
        memory = traffic / (cost.bandwidth(gpu) * HF_BW_EFFICIENCY) + dequant
        adapted = sum(l.count for l in adapted_linears(model, setup)) if setup.adapters else 0
        overhead = model.num_layers * HF_DECODE_LAYER_OVERHEAD_S + adapted * HF_LORA_LINEAR_OVERHEAD_S
        return max(memory, compute) + overhead
    memory = (weights + kv) / (cost.bandwidth(gpu) * VLLM_BW_EFFICIENCY) + dequant
    return max(memory, compute) + VLLM_STEP_OVERHEAD_S


def generation_terms(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, k: cost.Counts,
                     constants: Mapping[str, float] = cost.CONSTANTS) -> tuple[float, float, float, int, int]:
    """GRPO: (prefill, decode, weight sync seconds, waves, sequences at once) of one generation batch."""
    lens = lengths(setup)
    B, P, C = lens.gen_rows, lens.prompt, lens.completion
    concurrent, sync = B, 0.0
    if setup.generation == "hf":
        weights = float(k.weight_bytes)
    else:
        weights = float(vllm_weights_bytes(model, setup))
        # TRL pushes the updated weights into vLLM every step (peft: merged first): a device copy
        sync = 2.0 * weights / (cost.bandwidth(gpu) * VLLM_BW_EFFICIENCY)
        if setup.generation == "vllm-colocate" and gpu is not None:
            concurrent = max(vllm_share(model, setup, gpu).concurrent, 1)
    waves = math.ceil(B / concurrent)
    prompt_tokens = B * P
    pre_flops = prompt_tokens * (2.0 * (k.matmul_params + k.adapter_params) + 2.0 * model.num_layers * P * model.q_dim)
    # vLLM prefills in chunks of max_num_batched_tokens (4096, as TRL pins it); HF the whole batch at once
    chunk = min(prompt_tokens, 4096) if setup.generation != "hf" else prompt_tokens
    prefill = pre_flops / _rate(gpu, setup, chunk, constants) if prompt_tokens > 0 else 0.0
    decode = 0.0
    for w in range(waves):
        rows = min(concurrent, B - w * concurrent)
        decode += C * _decode_step_s(model, setup, gpu, k, rows, P + C / 2.0, weights, constants)
    return prefill, decode, sync, waves, concurrent


def objective_cost(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
                   k: cost.Counts | None = None, constants: Mapping[str, float] = cost.CONSTANTS) -> ObjectiveCost:
    """The phases of one optimizer step of ``setup``'s objective (DPO or GRPO)."""
    k = k or cost.counts(model, setup)
    pol = policy_setup(setup)
    policy = cost.step_cost(model, pol, gpu, nodes, k, constants=constants)
    ref = reference_s(model, setup, gpu, k, constants)
    pre = dec = sync = 0.0
    waves, concurrent = 1, 0
    if setup.objective == "grpo":
        pre, dec, sync, waves, concurrent = generation_terms(model, setup, gpu, k, constants)
    lens = lengths(setup)
    completions = (lens.gen_rows if setup.objective == "grpo" else setup.batch * setup.grad_accum) * setup.gpus
    return ObjectiveCost(generation_s=pre + dec + sync, prefill_s=pre, decode_s=dec, sync_s=sync, reference_s=ref,
                         policy_s=policy.step_s, waves=waves, concurrent=concurrent, completions=completions,
                         tokens_per_step=policy.tokens_per_step, policy=policy)


def step_cost(model: ModelSpec, setup: Setup, gpu: GpuSpec | None = None, nodes: int = 1,
              k: cost.Counts | None = None, constants: Mapping[str, float] = cost.CONSTANTS) -> cost.StepCost:
    """:func:`vramplan.cost.model.step_cost` with the objective's phases: SFT unchanged; DPO/GRPO the policy's
    step over its rows plus the ``reference_s`` and ``generation_s`` terms (:func:`objective_cost`)."""
    if setup.objective == "sft":
        return cost.step_cost(model, setup, gpu, nodes, k, constants=constants)
    k = k or cost.counts(model, setup)
    oc = objective_cost(model, setup, gpu, nodes, k, constants)
    return replace(oc.policy, generation_s=oc.generation_s, reference_s=oc.reference_s)
