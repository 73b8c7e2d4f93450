"""Optimizer memory: states per trainable tensor and the transient of one ``step()``.

Each optimizer's rule is read off its source and checked by ``vramplan validate`` (the tracer for
torch's and transformers' optimizers, a real CPU run for bitsandbytes'):
- torch AdamW: ``exp_avg`` and ``exp_avg_sq`` as ``zeros_like(param)``; foreach (the CUDA default)
  allocates one state-sized list in ``_foreach_sqrt(exp_avg_sqs)``; ``fused=True`` none;
- torch SGD (momentum 0.9, foreach): ``momentum_buffer`` is a clone of the first gradient; every
  update is in place;
- transformers Adafactor (``scale_parameter=False, relative_step=False``, no first moment):
  factored fp32 second moments (rows + columns) for matrices, a full fp32 one for vectors; it
  updates one parameter at a time through fp32 copies (gradient, parameter, ``grad**2`` and the
  update: 16 B per element of a 16-bit parameter, 8 for an fp32 one), so the largest tensor sets
  the transient;
- bitsandbytes 8-bit AdamW (``Optimizer2State``): two uint8 states plus one fp32 absmax per
  256-element block; tensors under ``min_8bit_size`` (4096) elements keep two fp32 states; the
  CUDA kernels update in place. Paged: the uint8 states of tensors of at least 1e5 elements are
  ``cudaMallocManaged`` memory (``get_state_buffer``), outside torch's allocator. The HF Trainer
  registers every ``nn.Embedding`` weight with ``GlobalOptimManager.register_module_override(...,
  {"optim_bits": 32})`` when it builds a bitsandbytes 8-bit optimizer (transformers' trainer.py,
  ``create_optimizer``), so trained embeddings keep two fp32 states (8 B/param, paged when large);
- bitsandbytes Lion (32-bit, ``Optimizer1State``): one fp32 state whatever the parameter dtype
  (torch has no Lion), updated in place.
"""

from __future__ import annotations

import math

from ..specs import ModelSpec, Setup
from ..util.units import BNB_MIN_8BIT_SIZE
from .lora import adapted_linears, expert_lora_params

#: bitsandbytes pages the state of a parameter with at least this many elements.
BNB_PAGED_MIN_NUMEL = 100_000
BNB_BLOCK = 256

Shape = tuple[int, ...]


def trainable_tensors(model: ModelSpec, setup: Setup) -> list[tuple[Shape, int]]:
    """The shapes of the trainable parameters, each with how many there are. Non-Linear
    parameters are known by their totals (``ModelSpec.other_params``) and split by name: norms
    into hidden-size vectors, q/k norms into head-size ones, experts into their gate_up and down
    stacks, the router per layer, embeddings whole."""
    return [(shape, count) for shape, count, _ in _tensors(model, setup)]


def _tensors(model: ModelSpec, setup: Setup) -> list[tuple[Shape, int, bool]]:
    """:func:`trainable_tensors`, each marked True when it is an ``nn.Embedding`` weight."""
    return [(shape, count, False) for shape, count in linear_and_other_tensors(model, setup)] + [
        ((n // model.hidden_size, model.hidden_size), 1, True)
        for name, n in model.other_params if not setup.adapters and name.startswith("embed")]


def linear_and_other_tensors(model: ModelSpec, setup: Setup) -> list[tuple[Shape, int]]:
    """The trainable tensors' shapes with their counts, embeddings left out (:func:`_tensors`
    adds them, marked): under LoRA each adapted Linear's A and B (and the experts' ParamWrapper
    factors as one tensor); otherwise every Linear's weight and bias, then the non-Linear
    parameters split by name (see :func:`trainable_tensors`)."""
    h = model.hidden_size
    if setup.adapters:
        r = setup.lora_rank
        out: list[tuple[Shape, int]] = []
        for l in adapted_linears(model, setup):
            out += [((r, l.in_features), l.count), ((l.out_features, r), l.count)]
        extra = expert_lora_params(model, setup)
        if extra:
            out.append(((r, extra // r), 1))
        return out
    out = []
    for l in model.linears:
        out.append(((l.out_features, l.in_features), l.count))
        if l.bias:
            out.append(((l.out_features,), l.count))
    moe = model.moe
    for name, n in model.other_params:
        if name == "norms":
            out.append(((h,), n // h))
        elif name == "qk_norms":
            out.append(((model.head_dim,), max(1, n // model.head_dim)))
        elif name == "experts" and moe is not None:
            E, ei = moe.num_experts, moe.expert_intermediate_size
            out += [((E, 2 * ei, h), moe.num_moe_layers), ((E, h, ei), moe.num_moe_layers)]
        elif name == "router" and moe is not None:
            out.append(((moe.num_experts, h), moe.num_moe_layers))
        elif name.startswith("embed"):
            continue  # _tensors adds them, marked
        else:
            out.append(((n,), 1))
    return out


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _param_bytes(setup: Setup, weight_bytes: int) -> int:
    from .precision import adapter_param_bytes

    return adapter_param_bytes(setup) if setup.adapters else weight_bytes


def state_bytes(model: ModelSpec, setup: Setup, weight_bytes: int) -> int:
    """Optimizer states on the device (paged bitsandbytes states excluded: see paged_bytes)."""
    pb = _param_bytes(setup, weight_bytes)
    return sum(count * tensor_state_bytes(setup.optimizer, shape, pb, embedding)
               for shape, count, embedding in _tensors(model, setup))


def tensor_state_bytes(opt: str, shape: Shape, pb: int, embedding: bool = False) -> int:
    """Device bytes of optimizer ``opt``'s states for one tensor of ``shape`` whose parameter
    has ``pb`` bytes per element (``embedding``: an ``nn.Embedding`` weight; see the module
    docstring; paged states excluded)."""
    n = _numel(shape)
    if opt in ("adamw", "adamw-fused"):
        return 2 * n * pb
    if opt == "sgd":
        return n * pb
    if opt == "lion":
        return 4 * n
    if opt in ("adamw-8bit", "paged-adamw-8bit"):
        if embedding:  # the Trainer's 32-bit override: two fp32 states, paged when large
            return 0 if opt == "paged-adamw-8bit" and n >= BNB_PAGED_MIN_NUMEL else 8 * n
        if n < BNB_MIN_8BIT_SIZE:
            return 8 * n
        blocks = -(-n // BNB_BLOCK)
        paged = opt == "paged-adamw-8bit" and n >= BNB_PAGED_MIN_NUMEL
        return 2 * 4 * blocks + (0 if paged else 2 * n)
    # adafactor
    return 4 * (_numel(shape[:-1]) + _numel(shape[:-2] + shape[-1:])) if len(shape) >= 2 else 4 * n


def tensor_paged_bytes(opt: str, shape: Shape, embedding: bool = False) -> int:
    """bitsandbytes' paged (managed) state bytes of one tensor (0 unless paged AdamW 8-bit)."""
    n = _numel(shape)
    if opt != "paged-adamw-8bit" or n < BNB_PAGED_MIN_NUMEL:
        return 0
    return (8 if embedding else 2) * n


def tensor_step_bytes(opt: str, shape: Shape, pb: int) -> int:
    """What one tensor's ``step()`` allocates (AdamW foreach: a state-sized list; Adafactor: its
    fp32 copies; the others update in place)."""
    n = _numel(shape)
    if opt == "adamw":
        return n * pb
    if opt == "adafactor":
        return (16 if pb < 4 else 8) * n
    return 0


def paged_bytes(model: ModelSpec, setup: Setup) -> int:
    """bitsandbytes' paged states (managed memory): on the device, invisible to torch's counters."""
    return sum(c * tensor_paged_bytes(setup.optimizer, s, embedding) for s, c, embedding in _tensors(model, setup))


def step_transient_bytes(model: ModelSpec, setup: Setup, weight_bytes: int) -> int:
    """Bytes ``optimizer.step()`` allocates beyond the states (see the module docstring)."""
    pb = _param_bytes(setup, weight_bytes)
    tensors = trainable_tensors(model, setup)
    if setup.optimizer == "adamw":
        return sum(_numel(s) * c for s, c in tensors) * pb
    if setup.optimizer == "adafactor":
        largest = max((_numel(s) for s, _ in tensors), default=0)
        return (16 if pb < 4 else 8) * largest
    return 0
