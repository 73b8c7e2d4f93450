"""What every family builder (model/architecture.py, model/families.py) shares: the registry of builders by
``model_type``, reading a config's required sizes and activation, and collecting a family's Linears and other
parameters into a ModelSpec."""

from __future__ import annotations

from collections.abc import Callable

from ..specs import SpecError
from .modelspec import LinearSpec, ModelSpec

Builder = Callable[[dict, str, str], ModelSpec]
FAMILIES: dict[str, Builder] = {}


def family(*names: str):
    def deco(fn: Builder) -> Builder:
        for n in names:
            FAMILIES[n] = fn
        return fn

    return deco


def req(cfg: dict, *keys: str) -> int:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise SpecError(f"config.json: {k} must be a positive integer; got {v!r}")
            return int(v)
    raise SpecError(f"config.json is missing {keys[0]!r} (model_type {cfg.get('model_type')!r})")


def act(cfg: dict, key: str = "hidden_act", default: str = "silu") -> str:
    act = str(cfg.get(key) or default)
    if act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_fast"):
        return "gelu_tanh"
    return act


class Layers:
    """Collects Linear specs and other parameter counts while a family describes its layers."""

    def __init__(self, prefix: str, num_layers: int) -> None:
        self.prefix = prefix
        self.L = num_layers
        self.linears: list[LinearSpec] = []
        self.other: dict[str, int] = {}

    def linear(self, path: str, d_in: int, d_out: int, bias: bool, role: str, count: int | None = None,
               top: bool = False) -> None:
        full = path if top else f"{self.prefix}.*.{path}"
        self.linears.append(LinearSpec(path.rsplit(".", 1)[-1], full, d_in, d_out, bool(bias),
                                       self.L if count is None else count, role))

    def add(self, name: str, n: int) -> None:
        if n:
            self.other[name] = self.other.get(name, 0) + n


def spec(cfg: dict, name: str, source: str, lay: Layers, **kw) -> ModelSpec:
    return ModelSpec(
        name=name,
        model_type=cfg["model_type"],
        config=cfg,
        linears=tuple(lay.linears),
        other_params=tuple(lay.other.items()),
        source=source,
        **kw,
    )


def head(cfg: dict, lay: Layers, V: int, h: int, tie_default: bool, bias: bool = False) -> bool:
    tie = bool(cfg.get("tie_word_embeddings", tie_default))
    if not tie:
        lay.linear("lm_head", h, V, bias, "head", count=1, top=True)
    elif bias:  # a tied head keeps its own bias (Phi, GPT-J)
        lay.add("lm_head_bias", V)
    return tie


def attention(lay: Layers, h: int, a: int, kvh: int, hd: int, qkv_bias: bool, o_bias: bool) -> None:
    """``self_attn.q_proj/k_proj/v_proj/o_proj`` of a grouped-query attention."""
    lay.linear("self_attn.q_proj", h, a * hd, qkv_bias, "attn")
    lay.linear("self_attn.k_proj", h, kvh * hd, qkv_bias, "attn")
    lay.linear("self_attn.v_proj", h, kvh * hd, qkv_bias, "attn")
    lay.linear("self_attn.o_proj", a * hd, h, o_bias, "attn")


def gated_mlp(lay: Layers, prefix: str, h: int, i: int, bias: bool, role: str, count: int | None = None) -> None:
    """``{prefix}.gate_proj/up_proj/down_proj`` (SwiGLU/GeGLU), in ``count`` layers (all by default)."""
    lay.linear(f"{prefix}.gate_proj", h, i, bias, role, count)
    lay.linear(f"{prefix}.up_proj", h, i, bias, role, count)
    lay.linear(f"{prefix}.down_proj", i, h, bias, role, count)


def learned_positions(cfg: dict, lay: Layers, V: int, h: int, P: int) -> bool:
    """What GPT-2-shaped decoders (GPT-2, GPT-BigCode, GPT-Neo) have besides their blocks: two LayerNorms (with
    bias) a layer and a final one, token and position embeddings, a head tied by default; returns the tying."""
    lay.add("norms", (2 * lay.L + 1) * 2 * h)
    lay.add("embed_tokens", V * h)
    lay.add("embed_positions", P * h)
    return head(cfg, lay, V, h, True)


def mha_and_mlp(lay: Layers, attn: str, out: str, mlp: tuple[str, str], h: int, i: int, qkv_bias: bool,
                out_bias: bool, mlp_bias: bool) -> None:
    """A multi-head attention's ``{attn}.q_proj/k_proj/v_proj`` and ``{attn}.{out}``, and a two-Linear MLP
    ``mlp = (up, down)`` (GPT-J, GPT-Neo, OPT)."""
    for p in ("q_proj", "k_proj", "v_proj"):
        lay.linear(f"{attn}.{p}", h, h, qkv_bias, "attn")
    lay.linear(f"{attn}.{out}", h, h, out_bias, "attn")
    lay.linear(mlp[0], h, i, mlp_bias, "mlp")
    lay.linear(mlp[1], i, h, mlp_bias, "mlp")
