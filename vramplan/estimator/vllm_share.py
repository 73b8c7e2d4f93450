"""vLLM colocated with GRPO training: what its share of the card holds, from vLLM's documented arithmetic.

vLLM does not run here (no CUDA wheel, and it is not installed); these are its own formulas, stated
as such, for the vLLM versions TRL 1.16 accepts (``trl/import_utils.py is_vllm_available``: 0.22-0.31):

- ``vllm/v1/worker/gpu_worker.py`` ``Worker.init_device``: ``requested_memory = ceil(total x
  gpu_memory_utilization)``, refused when less is free at start-up; ``determine_available_memory``:
  ``available_kv_cache_memory = requested_memory - non_kv_cache_memory`` where ``non_kv_cache_memory
  = weights + the torch peak of the profile run + the non-torch increase`` (``vllm/utils/mem_utils.py``
  ``memory_profiling``), less the CUDA-graph estimate where vLLM counts it.
- the profile run (``gpu_model_runner.py`` ``profile_run``): one dummy forward over
  ``max_num_batched_tokens`` tokens (TRL 1.16 pins 4096: ``trl/generation/vllm_generation.py``) and a
  dummy sampler run over ``max_num_seqs`` rows of the vocabulary; TRL sets ``max_num_seqs`` to the
  generation batch (``per_device_train_batch_size x steps_per_generation``, grpo_trainer.py).
- KV cache pages (``vllm/v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``): ``2 x
  block_size x kv_heads x head_dim x dtype bytes`` per layer, blocks of 16 tokens; vLLM refuses to
  start when the cache cannot hold one ``max_model_len`` sequence (``kv_cache_utils.py``
  ``check_enough_kv_cache_memory``). The emitted script sets ``vllm_max_model_length`` to the row length.
- Fewer concurrent sequences than the generation batch is not an OOM: the scheduler runs the rest
  as slots free up (continuous batching), so generation takes more waves (vramplan/cost/objectives.py).

Weights: vLLM loads the checkpoint itself (``LLM(model=model.name_or_path)``) in the model's 16-bit
dtype; with a bitsandbytes 4-bit policy TRL passes ``quantization="bitsandbytes"`` (4-bit Linears, the
rest 16-bit). Two terms are not derived from a formula and are stated constants:
:data:`NON_TORCH_BYTES` and :data:`CUDA_GRAPH_BYTES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..specs import GpuSpec, ModelSpec, Setup
from ..util.units import bnb_4bit_tensor_bytes
from .objectives import lengths

#: ``max_num_batched_tokens`` TRL 1.16 passes to ``LLM`` (trl/generation/vllm_generation.py)
VLLM_BATCHED_TOKENS = 4096
#: vLLM's KV block size in tokens (CacheConfig.block_size default on CUDA)
VLLM_BLOCK_TOKENS = 16
#: the non-torch increase of the profile (cuBLAS/NCCL workspaces): a stated value; vLLM logs report
#: 0.13-0.55 GiB on H100 for 8B-70B models (llm-d-benchmark config_explorer/empirical-vllm-memory-results.md)
NON_TORCH_BYTES = int(0.5 * 2**30)
#: CUDA graphs of the decode batch sizes: a stated value, counted inside the share (vLLM 0.22+ estimates
#: them with VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS; the same logs report -0.45-0.39 GiB)
CUDA_GRAPH_BYTES = int(0.5 * 2**30)
#: fp32-equivalent copies of the logits the dummy sampler run holds: logits, probabilities, top-k/top-p's
#: sorted values and int64 indices (two fp32 widths)
SAMPLER_COPIES = 5


@dataclass(frozen=True)
class VllmShare:
    """One split of the card: vLLM's share and what it holds, in bytes and sequences."""

    fraction: float
    share_bytes: int
    weights_bytes: int
    activation_bytes: int  # the profile run's torch peak
    fixed_bytes: int  # non-torch increase and CUDA graphs
    kv_bytes: int  # what is left for the KV cache (may be negative: vLLM does not start)
    kv_per_seq_bytes: int  # one sequence of prompt + completion, in whole blocks
    seqs: int  # sequences the generation batch runs at once
    row_len: int

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.fixed_bytes

    @property
    def starts(self) -> bool:
        """vLLM starts: its KV cache holds at least one max_model_len (= row) sequence."""
        return self.kv_bytes >= self.kv_per_seq_bytes

    @property
    def concurrent(self) -> int:
        """Sequences decoded at once (the KV cache's capacity, at most the generation batch)."""
        return max(0, min(self.seqs, self.kv_bytes // self.kv_per_seq_bytes)) if self.kv_per_seq_bytes else 0

    @property
    def kv_needed_bytes(self) -> int:
        """KV for the whole generation batch at once."""
        return self.seqs * self.kv_per_seq_bytes


def vllm_weights_bytes(model: ModelSpec, setup: Setup) -> int:
    """The weights vLLM loads: 16-bit, or bitsandbytes 4-bit Linears (head excluded) with a 4-bit policy."""
    c = _dtype_bytes(setup)
    if setup.quant not in ("nf4", "fp4"):
        return model.params_total * c
    linears = [l for l in model.linears if l.role != "head"]
    quantized = sum(l.count * l.weight_params for l in linears)
    packed = sum(l.count * bnb_4bit_tensor_bytes(l.weight_params, setup.double_quant) for l in linears)
    return int(packed + (model.params_total - quantized) * c)


def kv_bytes_per_token(model: ModelSpec, setup: Setup) -> int:
    """Keys and values of every layer for one token in the model's 16-bit dtype (vLLM's kv_cache_dtype auto)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * _dtype_bytes(setup)


def _dtype_bytes(setup: Setup) -> int:
    """vLLM runs the checkpoint's 16-bit dtype (dtype auto), fp32 only for an fp32 policy."""
    return 4 if setup.precision == "fp32" else 2


def profile_peak_bytes(model: ModelSpec, setup: Setup, seqs: int) -> int:
    """The profile run's torch peak beyond the weights: one layer's no-grad transient over
    :data:`VLLM_BATCHED_TOKENS` tokens beside the residual stream, or the dummy sampler over
    ``seqs`` rows of the vocabulary, whichever is larger."""
    t, c, h, i = VLLM_BATCHED_TOKENS, _dtype_bytes(setup), model.hidden_size, model.intermediate_size
    width = 3 * i if model.mlp_kind == "gated" else 2 * i  # as estimator/objectives.py nograd_layer_bytes
    layer = c * t * (width + 2 * h) + 2 * c * t * h
    sampler = SAMPLER_COPIES * 4 * min(seqs, t) * model.vocab_size
    return int(max(layer, sampler))


def vllm_share(model: ModelSpec, setup: Setup, gpu: GpuSpec, fraction: float | None = None) -> VllmShare:
    """What ``fraction`` (default: the setup's ``vllm_memory_fraction``) of ``gpu`` holds for ``setup``'s
    generation batch (``batch x num_generations x grad_accum`` sequences of prompt + completion)."""
    frac = setup.vllm_memory_fraction if fraction is None else fraction
    lens = lengths(setup)
    share = math.ceil(frac * gpu.usable_memory_bytes)
    blocks = -(-lens.row_len // VLLM_BLOCK_TOKENS)
    per_seq = blocks * VLLM_BLOCK_TOKENS * kv_bytes_per_token(model, setup)
    w = vllm_weights_bytes(model, setup)
    act = profile_peak_bytes(model, setup, lens.gen_rows)
    fixed = NON_TORCH_BYTES + CUDA_GRAPH_BYTES
    return VllmShare(frac, share, w, act, fixed, share - w - act - fixed, per_seq, lens.gen_rows, lens.row_len)


def smallest_fraction(model: ModelSpec, setup: Setup, gpu: GpuSpec, whole_batch: bool = False) -> float:
    """The least share of the card vLLM starts with (``whole_batch``: holds the whole generation batch at once)."""
    s = vllm_share(model, setup, gpu, 0.0)
    need = s.non_kv_bytes + (s.kv_needed_bytes if whole_batch else s.kv_per_seq_bytes)
    return need / gpu.usable_memory_bytes


def share_notes(model: ModelSpec, setup: Setup, gpu: GpuSpec | None) -> list[str]:
    """The estimate's lines about vLLM's share (vLLM colocated only): what it holds, or why vLLM would not start."""
    if setup.objective != "grpo" or setup.generation != "vllm-colocate" or gpu is None:
        return []
    s = vllm_share(model, setup, gpu)
    gib = 2**30
    head = (f"vLLM share {s.fraction:.2f} of the card ({s.share_bytes / gib:.1f} GiB): weights "
            f"{s.weights_bytes / gib:.1f} + profile peak {s.activation_bytes / gib:.1f} + non-torch and CUDA graphs "
            f"{s.fixed_bytes / gib:.1f} GiB")
    if not s.starts:
        return [f"{head} leave {max(s.kv_bytes, 0) / gib:.2f} GiB for the KV cache, under one "
                f"{s.row_len}-token sequence ({s.kv_per_seq_bytes / gib:.2f} GiB): vLLM refuses to start; raise "
                f"--vllm-memory-fraction to {math.ceil(smallest_fraction(model, setup, gpu) * 100) / 100:.2f} or more "
                "(vLLM's documented arithmetic, not run here)"]
    return [f"{head}; KV cache {s.kv_bytes / gib:.1f} GiB holds {s.concurrent} of the {s.seqs} sequences of "
            f"{s.row_len} tokens at once ({s.kv_needed_bytes / gib:.2f} GiB for all) (vLLM's documented arithmetic, "
            "not run here)"]
