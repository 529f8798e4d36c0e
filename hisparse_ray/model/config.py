"""Frozen config of the DSA model (ring 2), parsed from a HF config.json / config dict, plus tiny defaults.

Facts from transformers 5.23.0 (``deepseek_v32`` and ``glm_moe_dsa``) that this config encodes:

* Every layer is DSA (``layer_types == "indexed_attention"``). MLP layers: the first
  ``first_k_dense_replace`` are dense, the rest MoE, unless ``mlp_layer_types`` says otherwise.
* GLM-5 index sharing is ``indexer_types`` (``"full"`` runs the indexer, ``"shared"`` reuses the top-k
  of the most recent full layer). When absent, HF derives it from ``index_topk_pattern`` (a string of
  ``F``/``S`` or a list) or from ``index_topk_freq`` / ``index_skip_topk_offset`` (defaults 1 / 2):
  layer ``i`` is full iff ``max(i - offset + 1, 0) % freq == 0``. We apply the same rule; DeepSeek-V3.2
  has no sharing (every layer full).
* Rope parameters live in ``rope_parameters`` (5.x) or legacy ``rope_theta`` + ``rope_scaling``;
  ``rope_type`` is ``"default"`` or ``"yarn"`` (``original_max_position_embeddings`` defaults to
  ``max_position_embeddings``, ``truncate`` to True).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hisparse_ray.errors import ConfigError

KINDS = ("deepseek_v32", "glm_moe_dsa")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rope frequencies for the ``qk_rope_head_dim`` slice (``rope_type`` default or yarn)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError("rope_type", self.rope_type, "one of 'default', 'yarn'")


@dataclass(frozen=True, slots=True)
class DSAConfig:
    """Shapes of a DeepSeek-V3.2 / GLM-5 style model. ``kind`` picks the indexer rope layout.

    Invariants: ``index_head_dim >= qk_rope_head_dim``; ``n_routed_experts % n_group == 0``;
    ``len(mlp_layer_types) == len(indexer_types) == num_hidden_layers``; layer 0 is a full indexer layer.
    """

    kind: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("kind", self.kind, f"one of {KINDS}")
        L = self.num_hidden_layers
        if len(self.mlp_layer_types) != L or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError("mlp_layer_types", self.mlp_layer_types, f"{L} entries of 'dense'/'sparse'")
        if len(self.indexer_types) != L or set(self.indexer_types) - {"full", "shared"}:
            raise ConfigError("indexer_types", self.indexer_types, f"{L} entries of 'full'/'shared'")
        if L and self.indexer_types[0] != "full":
            raise ConfigError("indexer_types", self.indexer_types, "layer 0 must be 'full'")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError("index_head_dim", self.index_head_dim, f">= qk_rope_head_dim {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError("n_group", self.n_group, f"must divide n_routed_experts {self.n_routed_experts}")
        if self.index_topk < 1:
            raise ConfigError("index_topk", self.index_topk, ">= 1")

    @property
    def row_dim(self) -> int:
        """Width of one latent KV row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def anchor_of(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` uses (itself for full layers)."""
        while self.indexer_types[layer] != "full":
            layer -= 1
        return layer

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def with_(self, **changes: Any) -> "DSAConfig":
        return replace(self, **changes)


def indexer_types_from_hf(d: dict[str, Any], L: int) -> tuple[str, ...]:
    """GLM index sharing from HF config keys: ``indexer_types``, else ``index_topk_pattern``, else the
    ``index_topk_freq`` / ``index_skip_topk_offset`` rule (all ``"full"`` when none is given)."""
    if d.get("indexer_types") is not None:
        return tuple(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(d.get("index_topk_freq", 1)), 1)
    offset = int(d.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L))


def _rope(d: dict[str, Any]) -> RopeConfig:
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig("default", float(theta))
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=rp.get("factor"),
        original_max_position_embeddings=rp.get(
            "original_max_position_embeddings", d.get("max_position_embeddings")
        ),
        beta_fast=float(rp.get("beta_fast") or 32),
        beta_slow=float(rp.get("beta_slow") or 1),
        mscale=rp.get("mscale"),
        mscale_all_dim=rp.get("mscale_all_dim"),
        attention_factor=rp.get("attention_factor"),
        truncate=bool(rp.get("truncate", True)),
    )


def config_from_hf(d: dict[str, Any]) -> DSAConfig:
    """Parse a HF ``config.json`` dict (or ``PreTrainedConfig.to_dict()``) of either model type."""
    kind = d.get("model_type")
    if kind not in KINDS:
        raise ConfigError("model_type", kind, f"one of {KINDS}")
    L = int(d["num_hidden_layers"])
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        n_dense = min(int(d.get("first_k_dense_replace", 3)), L)
        mlp = ["dense"] * n_dense + ["sparse"] * (L - n_dense)
    return DSAConfig(
        kind=kind,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        num_hidden_layers=L,
        num_attention_heads=int(d["num_attention_heads"]),
        q_lora_rank=int(d["q_lora_rank"]),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        index_n_heads=int(d["index_n_heads"]),
        index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]),
        n_routed_experts=int(d.get("n_routed_experts") or d.get("num_local_experts")),
        n_shared_experts=int(d.get("n_shared_experts", 1)),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        n_group=int(d.get("n_group", 1)),
        topk_group=int(d.get("topk_group", 1)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        mlp_layer_types=tuple(mlp),
        indexer_types=indexer_types_from_hf(d, L),
        rope=_rope(d),
        attention_bias=bool(d.get("attention_bias", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def tiny_config(kind: str = "deepseek_v32", *, yarn: bool = True) -> DSAConfig:
    """A tiny config of ``kind`` (CPU tests: < 1 M parameters). top-k 8, 4 heads (TP=2 divisible),
    MoE with 2 groups of 4 experts; GLM kind shares indices as F S F S. ``yarn`` turns on yarn rope
    with mscale so the attention-scale correction is exercised."""
    if kind not in KINDS:
        raise ConfigError("kind", kind, f"one of {KINDS}")
    L = 4
    rope = (
        RopeConfig("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707)
        if yarn
        else RopeConfig("default", 10000.0)
    )
    return DSAConfig(
        kind=kind, vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=L, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=16, index_head_dim=32,
        index_topk=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=256, mlp_layer_types=("dense",) + ("sparse",) * (L - 1),
        indexer_types=("full",) * L if kind == "deepseek_v32" else ("full", "shared", "full", "shared"),
        rope=rope,
    )


def landing_config(kind: str = "deepseek_v32", num_layers: int = 61) -> DSAConfig:
    """DeepSeek-V3.2's KV geometry around a tiny network, for landing and capacity benchmarks:
    ``num_layers`` layers (61 in DeepSeek-V3.2) of 576-value MLA rows (``kv_lora_rank`` 512 +
    ``qk_rope_head_dim`` 64: 1152 B per token and layer in bf16) and 128-dim indexer keys, so a
    prompt's KV is as many bytes as on the real model (~70 KB per token); hidden size, heads and
    experts stay tiny (2 heads: TP 2 divisible) and top-k is 8 (same as :func:`tiny_config`)."""
    tiny = tiny_config(kind, yarn=False)
    L = num_layers
    if L < 1:
        raise ConfigError("num_layers", L, "must be >= 1")
    return replace(
        tiny, hidden_size=64, num_hidden_layers=L, num_attention_heads=2, kv_lora_rank=512,
        qk_rope_head_dim=64, index_n_heads=2, index_head_dim=128, max_position_embeddings=1 << 17,
        mlp_layer_types=("dense",) + ("sparse",) * (L - 1),
        indexer_types=("full",) * L if kind == "deepseek_v32"
        else tuple("full" if i % 2 == 0 else "shared" for i in range(L)),
    )


def hf_config_dict(cfg: DSAConfig) -> dict[str, Any]:
    """The HF config kwargs equivalent to ``cfg`` (to build the reference model in tests or to write
    a config.json next to exported weights)."""
    r = cfg.rope
    rope_parameters: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        rope_parameters.update(
            factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
            beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim,
            truncate=r.truncate,
        )
        if r.attention_factor is not None:
            rope_parameters["attention_factor"] = r.attention_factor
    d: dict[str, Any] = dict(
        model_type=cfg.kind, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, mlp_layer_types=list(cfg.mlp_layer_types),
        rope_parameters=rope_parameters, attention_bias=cfg.attention_bias,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.kind == "glm_moe_dsa":
        d["indexer_types"] = list(cfg.indexer_types)
    return d
