"""The model as the estimator sees it: ModelSpec, its Linears, MoE layout and family traits.

Built from a config.json by ``vramplan.model.architecture`` (the only place that reads raw config keys
for the estimator); re-exported from ``vramplan.specs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinearSpec:
    """One Linear-like module, repeated ``count`` times (once per layer for per-layer modules).

    ``name`` is the module's own name (``q_proj``) as peft matches it; ``path`` its path with
    ``*`` for the layer index (``model.layers.*.self_attn.q_proj``).
    """

    name: str
    path: str
    in_features: int
    out_features: int
    bias: bool
    count: int
    role: str  # attn | mlp | shared_expert | router | head | other

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        return (self.weight_params + (self.out_features if self.bias else 0)) * self.count


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_moe_layers: int
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    gated_shared_expert: bool = False  # qwen2_moe: sigmoid gate on the shared expert
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers (the others are dense)


@dataclass(frozen=True)
class MlaDims:
    """DeepSeek-V2 multi-head latent attention widths (config.json's names)."""

    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int  # 0: q is not compressed (a plain q_proj)


@dataclass(frozen=True)
class FamilyTraits:
    """What of a family's layer shape changes what autograd saves, read once from config.json by
    ``vramplan.model.traits.family_traits``; the estimator reads these, never the raw config. The
    defaults describe a plain pre-norm RMSNorm decoder with RoPE over whole heads."""

    norm: str = "rms"  # rms (llama), rms_fp32_mul (gemma, olmo2), layernorm, cohere
    norms_per_layer: int = 2
    shared_norm: bool = False  # attention and MLP read the same norm output (parallel blocks)
    fused_qkv: bool = False  # q, k, v are views of one projection's output
    rope: bool = True
    rope_bytes: int = 0  # dtype of the cos/sin tables (0: the residual stream's)
    rope_dim: int | None = None  # width of the cos/sin tables; None: the whole head (head_dim)
    qk_norm_rows: int = 0  # 0: none; per-head norms: heads + kv heads; OLMo2: 2
    dropout_masks_per_layer: int = 0  # hidden-state dropouts with p > 0 (bool masks, 1 B/element)
    embedding_dropout: bool = False
    sliding_window: int = 0  # config.json's sliding_window (0: none)
    sliding_layers: int = 0  # layers with sliding-window attention
    attn_softcapping: bool = False  # Gemma2's eager attention soft-caps its scores (keeps tanh's output)
    final_logit_softcapping: bool = False  # the logits are soft-capped (Gemma2)
    mla: MlaDims | None = None  # DeepSeek-V2's latent attention
    conv_layers: tuple[bool, ...] = ()  # per layer, a gated short-convolution block (LFM2); () none
    rope_layers: tuple[int, ...] = ()  # per layer, RoPE (1) or NoPE (0) where a family mixes them (Llama 4)
    qk_l2_norm: bool = False  # Llama 4's weightless L2 q/k norm on its RoPE layers (use_qk_norm)
    attn_temperature_tuning: bool = False  # Llama 4's NoPE layers scale q by a per-position temperature
    #: SDPA gets K and V repeated to every query head (transformers before 4.54: estimator/stack.py model_under)
    sdpa_repeat_kv: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """Everything the estimator needs about a model, derived from its config.json."""

    name: str
    model_type: str
    config: dict = field(repr=False, compare=False, hash=False)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    linears: tuple[LinearSpec, ...]
    #: Parameters that are not in a Linear: embeddings, norms, experts' 3-D weights, routers.
    other_params: tuple[tuple[str, int], ...]
    mlp_kind: str  # gated | plain
    activation: str  # silu | gelu_tanh | gelu | gelu_new | relu
    norm_kind: str  # rmsnorm | layernorm | layernorm_nobias
    default_attn: str  # sdpa | eager
    moe: MoeSpec | None = None
    family: str = ""  # the activation recipe used (llama, gemma2, gpt2, ...)
    fp32_params: int = 0  # parameters the modeling code keeps in fp32 whatever the load dtype
    source: str = ""  # profile name, path or hub id it was read from
    traits: FamilyTraits = FamilyTraits()

    @property
    def params_total(self) -> int:
        return sum(l.params for l in self.linears) + sum(n for _, n in self.other_params)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the cos/sin tables: the rotated part of a head."""
        return self.head_dim if self.traits.rope_dim is None else self.traits.rope_dim

    def linear(self, name: str) -> LinearSpec | None:
        for l in self.linears:
            if l.name == name:
                return l
        return None


def truncate_config(config: dict, num_layers: int) -> dict:
    """Copy of an HF config dict with ``num_layers`` decoder layers, per-layer lists cut to match (an
    image-text config's text tower: ``text_config``)."""
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = truncate_config(cfg["text_config"], num_layers)
        return cfg
    key = next((k for k in ("n_layer", "num_layers") if k in cfg and "num_hidden_layers" not in cfg),
               "num_hidden_layers")
    cfg[key] = num_layers
    if isinstance(cfg.get("layer_types"), list) and len(cfg["layer_types"]) != num_layers:
        cfg["layer_types"] = list(cfg["layer_types"][:num_layers])
    if isinstance(cfg.get("attention_layers"), list):  # GPT-Neo: global/local per layer, and its run-length form
        cfg["attention_layers"] = (cfg["attention_layers"] * num_layers)[:num_layers]
        cfg["attention_types"] = [[cfg["attention_layers"], 1]]
    if isinstance(cfg.get("mlp_only_layers"), list):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < num_layers]
    if cfg.get("model_type") == "llama4_text" or "intermediate_size_mlp" in cfg:  # Llama 4: a RoPE flag a layer
        if isinstance(cfg.get("no_rope_layers"), list):
            cfg["no_rope_layers"] = list(cfg["no_rope_layers"][:num_layers])
        if isinstance(cfg.get("moe_layers"), list):
            cfg["moe_layers"] = [i for i in cfg["moe_layers"] if i < num_layers]
    return cfg


def shrink_config(config: dict, *, layers: int = 2, hidden: int = 256, heads: int = 8, vocab: int = 4096,
                  experts: int = 4) -> dict:
    """A narrow copy of an HF config of the same family: ``layers`` layers, hidden ``hidden``,
    ``heads`` heads (the key/value heads keep their ratio), the MLP keeps its width ratio, MoE
    keeps ``experts`` experts (top-k capped at half of them). Narrow enough for a CPU step in a
    second, wide enough that every tensor a knob adds is a visible share of the peak. An image-text
    config: its text tower so, its vision tower to one narrow layer."""
    if isinstance(config.get("text_config"), dict):
        from .textconfig import text_config

        cfg = dict(config)
        text = {k: v for k, v in text_config(config).items() if k != "model_type"}
        text = shrink_config(dict(text, model_type="text"), layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                             experts=experts)
        text["model_type"] = (config["text_config"] or {}).get("model_type", text_config(config)["model_type"])
        cfg["text_config"] = text
        vision = dict(cfg.get("vision_config") or {})
        vision.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
        cfg["vision_config"] = vision
        return cfg
    cfg = truncate_config(config, layers)
    gpt2 = "n_embd" in cfg
    h_key, a_key = ("n_embd", "n_head") if gpt2 else ("hidden_size", "num_attention_heads")
    old_h, old_a = int(cfg[h_key]), int(cfg[a_key])
    old_kv = int(cfg.get("num_key_value_heads") or old_a)
    cfg[h_key], cfg[a_key] = hidden, heads
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = max(1, heads * old_kv // old_a)
    if cfg.get("head_dim"):
        cfg["head_dim"] = hidden // heads
    for key in ("intermediate_size", "n_inner"):
        if cfg.get(key):
            cfg[key] = max(64, round(int(cfg[key]) * hidden / old_h / 64) * 64)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.get(key):
            cfg[key] = max(64, round(int(cfg[key]) * hidden / old_h / 64) * 64)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            cfg[key] = experts
    if cfg.get("num_experts_per_tok"):
        cfg["num_experts_per_tok"] = min(int(cfg["num_experts_per_tok"]), experts // 2)
    cfg["vocab_size"] = vocab
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int) and cfg[key] >= vocab:
            cfg[key] = vocab - 1
        elif isinstance(cfg.get(key), list):
            cfg[key] = [min(t, vocab - 1) for t in cfg[key]]
    return cfg
