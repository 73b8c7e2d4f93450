"""A layer split over the GPUs of one process (``device_map="auto"|"balanced"|"sequential"``).

Where ``from_pretrained(device_map=...)`` puts each module: a torch-free port of transformers
5.24's placement (``integrations/accelerate.py``: ``_get_device_map``, ``get_balanced_memory``,
``infer_auto_device_map``, ``compute_module_sizes``; transformers keeps its own copies of
accelerate 1.15's ``accelerate/utils/modeling.py`` functions, with ``hf_quantizer.param_element_size``
for the sizes and the tied keys skipped). Over the model tree of a ``model.layers.*`` causal LM
(``model``: embed_tokens, layers.0..L-1 (the ``_no_split_modules`` decoder layers), norm,
rotary_emb; ``lm_head``), sizes as loaded: each tensor's numel x the load dtype's bytes, a
bitsandbytes 4-bit weight 0.5 and an 8-bit one 1 byte per element (``quantized_element_size``;
quantization state, biases and the head stay as they are). What the steps do:

- ``max_memory``: each GPU's free memory at load (``torch.cuda.mem_get_info``: the usable memory
  less the CUDA context), unless given;
- ``auto``/``balanced``: ``get_balanced_memory`` caps every GPU but the last at
  ``total // n + 1.25 x max(largest decoder layer, largest leaf module)`` (the leaf is usually the
  embedding); ``sequential`` fills each GPU in turn;
- a bitsandbytes quantizer's ``adjust_max_memory`` (4- and 8-bit) keeps 90 % of each cap;
- ``infer_auto_device_map``: modules in order, a module that does not fit is split into its
  children unless it is a decoder layer (then the next GPU); GPU 0 (a "main device") keeps room
  for the largest remaining layer; a tied head goes with the embedding; what fits on no GPU goes
  to the CPU (vramplan refuses that: accelerate's CPU offload is not modelled).

Torch-free; checked against the real functions on the meta-device model by
``vramplan/truths/layer_split_truth.py`` (``vramplan validate --knob device_map``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..specs import GpuSpec, ModelSpec, Setup, SpecError
from ..util.units import DTYPE_BYTES, PRECISION_WEIGHT_DTYPE

#: the bitsandbytes bases whose Linear weights transformers sizes by their packed element when placing
#: them (quantizers/quantizer_bnb_4bit.py and quantizer_bnb_8bit.py ``quantized_element_size``: 0.5 and
#: 1 byte, units.DTYPE_BYTES, no quantization state)
BNB_QUANTS = ("nf4", "fp4", "int8")
#: ``get_balanced_memory``'s margin over the per-GPU share, x the largest layer or leaf
BALANCED_BUFFER = 1.25
#: ``HfQuantizer.adjust_max_memory`` of bitsandbytes 4-bit and 8-bit (quantizer_bnb_4bit.py,
#: quantizer_bnb_8bit.py: "need more space for buffers that are created during quantization")
BNB_MAX_MEMORY = 0.90


@dataclass(frozen=True)
class Node:
    """One module of the placement tree: its size as placed, and its children in module order."""

    name: str
    size: float
    children: tuple[Node, ...] = ()
    no_split: bool = False  # a decoder layer (``_no_split_modules``)
    largest_leaf: float = 0.0  # the largest module holding tensors directly, inside it or itself

    @property
    def leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class LayerSplit:
    """Where the modules went: ``devices[name]`` is a GPU index for each placed module name."""

    strategy: str
    max_memory: tuple[int, ...]  # per GPU, as infer_auto_device_map got it
    placement: tuple[tuple[str, int], ...]  # (module name, GPU) in placement order
    placed_bytes: tuple[int, ...]  # per GPU, the load-time bytes placed there
    num_layers: int
    #: the modules accelerate would offload to the CPU, for want of GPU memory (kept on the last
    #: GPU here, whose numbers then show the shortfall; CPU offload is not modelled)
    spilled: tuple[str, ...] = ()

    @functools.cached_property
    def _devices(self) -> dict[str, int]:
        devices: dict[str, int] = {}
        for mod, dev in self.placement:
            devices.setdefault(mod, dev)  # a name placed twice: its first placement
        return devices

    def device_of(self, name: str) -> int:
        """The GPU of module ``name`` (or of the innermost placed module that contains it; ``""`` is
        the whole model)."""
        devices, prefix = self._devices, name
        while True:
            if prefix in devices:
                return devices[prefix]
            if not prefix:
                raise KeyError(name)
            prefix = prefix.rpartition(".")[0]

    @functools.cached_property
    def _layers_by_rank(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for i in range(self.num_layers):
            out.setdefault(self.device_of(f"model.layers.{i}"), []).append(i)
        return {r: tuple(v) for r, v in out.items()}

    def layers_on(self, rank: int) -> tuple[int, ...]:
        return self._layers_by_rank.get(rank, ())

    @property
    def gpus(self) -> int:
        return len(self.max_memory)

    @property
    def head_rank(self) -> int:
        return self.device_of("lm_head")

    @property
    def embed_rank(self) -> int:
        return self.device_of("model.embed_tokens")

    @property
    def norm_rank(self) -> int:
        return self.device_of("model.norm")

    @property
    def rotary_rank(self) -> int:
        return self.device_of("model.rotary_emb")

    def layer_devices(self) -> tuple[int, ...]:
        """The GPU of each decoder layer, in order (what the validate matrix compares)."""
        return tuple(self.device_of(f"model.layers.{i}") for i in range(self.num_layers))


# ----------------------------------------------------------------------------------------------
# the module tree


def load_bytes(setup: Setup) -> int:
    """Bytes per element of the weights ``from_pretrained`` loads (the emitted train.py's
    LOAD_DTYPE: bf16/fp16, fp32 under the ``-mixed`` precisions and fp32)."""
    return int(DTYPE_BYTES[PRECISION_WEIGHT_DTYPE[setup.precision]])


def _norm_params(model: ModelSpec) -> int:
    return model.hidden_size * (2 if model.norm_kind == "layernorm" else 1)


def check_supported(model: ModelSpec, setup: Setup) -> None:
    """Raise SpecError for a model or base the placement does not model."""
    if any(not l.path.startswith("model.layers.") for l in model.linears if l.role != "head"):
        raise SpecError(f"device_map is modelled for decoders laid out as model.layers.* (Llama, Qwen, Mistral, "
                        f"Gemma...); {model.name} ({model.model_type}) is not")
    if setup.quant in ("gptq", "awq"):
        raise SpecError("device_map with a GPTQ/AWQ base is not modelled (its packed buffers' placement sizes)")


def model_tree(model: ModelSpec, setup: Setup) -> Node:
    """The CausalLM as transformers' placement walks it, each module at its load-time size."""
    check_supported(model, setup)
    w, L = load_bytes(setup), max(model.num_layers, 1)
    q = DTYPE_BYTES[setup.quant] if setup.quant in BNB_QUANTS else w
    other = dict(model.other_params)
    final_norm = _norm_params(model)
    per_layer_other = (other.get("norms", 0) - final_norm + sum(n for k, n in other.items()
                                                                if k not in ("norms", "embed_tokens"))) / L
    layer_linears = [l for l in model.linears if l.role != "head"]
    layer = sum(l.count * (l.weight_params * q + (l.out_features * w if l.bias else 0)) for l in layer_linears) / L
    layer += per_layer_other * w
    largest_linear = max((l.weight_params * q + (l.out_features * w if l.bias else 0) for l in layer_linears),
                         default=0)
    layers = tuple(Node(f"model.layers.{i}", layer, no_split=True, largest_leaf=largest_linear) for i in range(L))
    embed = other.get("embed_tokens", model.vocab_size * model.hidden_size) * w
    # inv_freq and original_inv_freq: fp32 buffers of rope_dim / 2
    rope = 2 * (model.rope_dim // 2) * 4 if model.traits.rope else 0
    head = 0 if model.tie_word_embeddings else sum(l.params for l in model.linears if l.role == "head") * w
    inner = (Node("model.embed_tokens", embed, largest_leaf=embed),
             Node("model.layers", layer * L, layers, largest_leaf=largest_linear),
             Node("model.norm", final_norm * w, largest_leaf=final_norm * w),
             Node("model.rotary_emb", rope, largest_leaf=rope))
    root_children = (Node("model", sum(n.size for n in inner), inner, largest_leaf=max(embed, largest_linear)),
                     Node("lm_head", head, largest_leaf=head))
    return Node("", sum(n.size for n in root_children), root_children,
                largest_leaf=max(n.largest_leaf for n in root_children))


def _max_layer(nodes: list[Node]) -> tuple[float, list[str]]:
    """accelerate ``get_max_layer_size``: the largest leaf or no-split module among ``nodes``,
    and the names of those of that size."""
    best, names = 0.0, []
    todo = list(nodes)
    while todo:
        n = todo.pop(0)
        if n.leaf or n.no_split:
            if n.size > best:
                best, names = n.size, [n.name]
            elif n.size == best:
                names.append(n.name)
        else:
            todo = list(n.children) + todo
    return best, names


# ----------------------------------------------------------------------------------------------
# the placement


def free_memory_bytes(gpu: GpuSpec, cuda_context_bytes: int) -> int:
    """What ``torch.cuda.mem_get_info`` reports free before the model loads."""
    return int(gpu.usable_memory_bytes - cuda_context_bytes)


def balanced_max_memory(tree: Node, max_memory: list[float], low_zero: bool = False) -> list[float]:
    """transformers 5.24 ``get_balanced_memory`` over the GPUs of ``max_memory``."""
    n = len(max_memory)
    if n <= 1:
        return list(max_memory)
    per_gpu = tree.size // (n - 1 if low_zero else n)
    layers = [c for c in _walk(tree) if c.no_split]
    biggest_no_split = max((c.size for c in layers), default=0)
    per_gpu += int(BALANCED_BUFFER * max(biggest_no_split, tree.largest_leaf))
    out = list(max_memory)
    for i in range(n - 1):
        out[i] = min(per_gpu, out[i])
    return out


def _walk(node: Node):
    yield node
    for c in node.children:
        yield from _walk(c)


def infer_placement(tree: Node, max_memory: list[float], tied: bool) -> tuple[list[tuple[str, int]], list[float]]:
    """transformers 5.24 ``infer_auto_device_map`` over GPUs 0..n-1 then the CPU (index n)."""
    n = len(max_memory)
    limits = list(max_memory) + [float("inf")]  # the CPU: what does not fit (refused by the caller)
    used = [0.0] * (n + 1)
    todo = list(tree.children)
    placement: list[tuple[str, int]] = []
    dev = 0
    max_layer, max_names = _max_layer(todo)
    while todo:
        node = todo.pop(0)
        # the largest layer left is recomputed once the ones of that size are all treated
        max_names = [m for m in max_names if m != node.name and not m.startswith(node.name + ".")]
        if not max_names:
            max_layer, max_names = _max_layer(todo)
        reserved = max_layer if dev == 0 else 0.0  # GPU 0 is a "main device": room for one layer
        cap = limits[dev] - reserved
        head = next((t for t in todo if t.name == "lm_head"), None) if tied and _holds_embedding(node) else None
        size = node.size + (head.size if head is not None else 0.0)
        if dev == n or used[dev] + size <= cap:
            used[dev] += size
            placement.append((node.name, dev))
            if head is not None:  # the tied head goes where the embedding goes
                todo.remove(head)
                placement.append((head.name, dev))
            continue
        if not (node.leaf or node.no_split):  # split it into its children
            todo = list(node.children) + todo
            max_layer, max_names = _max_layer(todo)
            continue
        used[dev] += reserved
        dev += 1
        todo.insert(0, node)
    return placement, used


def _holds_embedding(node: Node) -> bool:
    return node.name in ("model", "model.embed_tokens")


def clean_device_map(device_map: dict[str, int], module_name: str = "") -> dict[str, int]:
    """accelerate 1.15 ``clean_device_map``: the submodules of a module all on one device fold
    into that module (in place, recursively)."""
    prefix = "" if module_name == "" else f"{module_name}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    children = [k for k in device_map if k.startswith(prefix) and len(k) > len(module_name)]
    idx = len(module_name.split(".")) + 1 if module_name else 1
    for child in {".".join(k.split(".")[:idx]) for k in children}:
        clean_device_map(device_map, child)
    return device_map


def spill_message(setup: Setup, spilled: tuple[str, ...]) -> str:
    """Why a capped split is refused: accelerate's map would put ``spilled`` off the GPUs."""
    from ..setup.max_memory import caps_text

    what = spilled[0] + (f" and {len(spilled) - 1} more modules" if len(spilled) > 1 else "")
    return (f"max_memory {caps_text(setup.max_memory)} leaves {what} on no GPU: device_map={setup.device_map} would "
            "offload them to disk (to the CPU with a cpu budget), which vramplan does not model; raise the caps or "
            "split over more --gpus")


def place(model: ModelSpec, setup: Setup, gpu: GpuSpec | None, cuda_context_bytes: int,
          max_memory: tuple[int, ...] | None = None) -> LayerSplit:
    """The layer split ``from_pretrained(device_map=setup.device_map)`` computes on ``setup.gpus``
    GPUs like ``gpu`` (or under ``max_memory`` per GPU; else ``setup.max_memory``, the user's caps,
    which accelerate takes as given: a layer that then fits on no GPU is refused)."""
    capped = max_memory is None and bool(setup.max_memory)
    if capped:
        max_memory = setup.max_memory
    if max_memory is None:
        if gpu is None:
            raise SpecError("device_map places the layers by each GPU's free memory: give --gpu")
        max_memory = (free_memory_bytes(gpu, cuda_context_bytes),) * setup.gpus
    tree = model_tree(model, setup)
    caps = [float(m) for m in max_memory]
    if setup.device_map in ("auto", "balanced"):
        caps = balanced_max_memory(tree, caps)
    if setup.quant in ("nf4", "fp4", "int8"):
        caps = [c * BNB_MAX_MEMORY for c in caps]
    placement, used = infer_placement(tree, caps, model.tie_word_embeddings)
    n = len(caps)
    spilled = tuple(name for name, dev in placement if dev == n)
    if spilled and capped:
        raise SpecError(spill_message(setup, spilled))
    if spilled:  # accelerate would offload these to the CPU (not modelled): they stay on the last GPU,
        # which then does not fit, and the estimate says why
        placement, used = infer_placement(tree, caps[:-1] + [float("inf")], model.tie_word_embeddings)
    sizes = {nd.name: nd.size for nd in _walk(tree)}
    placed = [0.0] * n
    for name, dev in placement:
        placed[dev] += sizes[name]
    return LayerSplit(strategy=setup.device_map, max_memory=tuple(int(c) for c in caps),
                      placement=tuple(clean_device_map(dict(placement)).items()),
                      placed_bytes=tuple(int(p) for p in placed),
                      num_layers=model.num_layers, spilled=spilled)
