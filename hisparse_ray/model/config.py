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

from hisparse_ray.checks import (
    check_bool, check_choice, check_int, check_number, check_optional_number, check_type, is_int,
)
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
        check_choice("rope_type", self.rope_type, ("default", "yarn"))
        check_number("rope_theta", self.theta, lo=0, lo_open=True)
        check_optional_number("factor", self.factor, lo=0, lo_open=True)
        if self.original_max_position_embeddings is not None:
            check_int("original_max_position_embeddings", self.original_max_position_embeddings,
                      lo=1)
        check_number("beta_fast", self.beta_fast, lo=0, lo_open=True)
        check_number("beta_slow", self.beta_slow, lo=0, lo_open=True)
        check_optional_number("mscale", self.mscale)
        check_optional_number("mscale_all_dim", self.mscale_all_dim)
        check_optional_number("attention_factor", self.attention_factor, lo=0, lo_open=True)
        check_bool("truncate", self.truncate)


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
        check_choice("kind", self.kind, KINDS)
        for key in _POSITIVE_INTS:
            check_int(key, getattr(self, key), lo=1)
        check_int("n_shared_experts", self.n_shared_experts, lo=0)
        if self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim", self.qk_rope_head_dim,
                              "must be even (rope rotates pairs of values)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError("index_head_dim", self.index_head_dim,
                              f"must be >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise ConfigError("n_group", G, f"must divide n_routed_experts ({E})")
        check_int("topk_group", self.topk_group, lo=1, hi=G, why=f"groups kept of n_group={G}")
        check_int("num_experts_per_tok", self.num_experts_per_tok, lo=1,
                  hi=self.topk_group * (E // G),
                  why=f"experts of the topk_group={self.topk_group} kept groups of {E // G}")
        check_number("routed_scaling_factor", self.routed_scaling_factor, lo=0, lo_open=True)
        check_number("rms_norm_eps", self.rms_norm_eps, lo=0, lo_open=True)
        for key in ("norm_topk_prob", "attention_bias", "tie_word_embeddings"):
            check_bool(key, getattr(self, key))
        check_type("rope", self.rope, RopeConfig)
        L = self.num_hidden_layers
        for key, allowed in (("mlp_layer_types", ("dense", "sparse")),
                             ("indexer_types", ("full", "shared"))):
            v = getattr(self, key)
            if not isinstance(v, tuple) or len(v) != L or set(v) - set(allowed):
                raise ConfigError(key, v, f"must be a tuple of {L} entries of "
                                          f"{' / '.join(map(repr, allowed))}")
        if self.indexer_types[0] != "full":
            raise ConfigError("indexer_types", self.indexer_types, "layer 0 must be 'full'")

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


_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings",
)
_REQUIRED = object()

# transformers 5.23.0's defaults (DeepseekV32Config / GlmMoeDsaConfig fields) for the keys a
# config.json may leave out; the shape keys (vocab, hidden, heads, ranks, experts) stay required:
# HF's defaults there are the full-size model's, never what a smaller folder's weights hold.
_HF_SHARED_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                           first_k_dense_replace=3, attention_bias=False, tie_word_embeddings=False)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(_HF_SHARED_DEFAULTS, n_group=8, topk_group=4, rms_norm_eps=1e-6,
                         max_position_embeddings=163840),
    "glm_moe_dsa": dict(_HF_SHARED_DEFAULTS, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                        max_position_embeddings=202752),
}


def _hf(d: dict[str, Any], key: str, default: Any = _REQUIRED, *, kind: str = "int") -> Any:
    """HF key ``key`` of ``d`` as an int / float / bool (``kind``): ConfigError naming the key
    when it is missing (and has no default) or has the wrong type; ranges are DSAConfig's."""
    value = d.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(key, None, f"a required key of a {d.get('model_type')} config")
        return default
    if kind == "int":
        if is_int(value) or (isinstance(value, float) and value.is_integer()):
            return int(value)
        raise ConfigError(key, value, "must be an integer")
    if kind == "float":
        if is_int(value) or isinstance(value, float):
            return float(value)
        raise ConfigError(key, value, "must be a number")
    return check_bool(key, value)


def indexer_types_from_hf(d: dict[str, Any], L: int) -> tuple[str, ...]:
    """GLM index sharing from HF config keys: ``indexer_types``, else ``index_topk_pattern``, else the
    ``index_topk_freq`` / ``index_skip_topk_offset`` rule (all ``"full"`` when none is given).
    A list longer than ``L`` gives its first ``L`` entries, as transformers reads layer ``i``'s
    entry (a released config whose ``num_hidden_layers`` a user lowered); a shorter one, or
    letters other than F / S, raise ConfigError naming ``index_topk_pattern``."""
    if d.get("indexer_types") is not None:
        types = d["indexer_types"]
        # DSAConfig says why anything else is refused (a shorter list among it)
        return tuple(types[:L]) if isinstance(types, (list, tuple)) else types
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and len(pattern) >= L and set(pattern) <= set(letters):
            return tuple(letters[c] for c in pattern[:L])
        if isinstance(pattern, (list, tuple)) and len(pattern) >= L and \
                set(pattern) <= {"full", "shared"}:
            return tuple(pattern[:L])
        raise ConfigError("index_topk_pattern", pattern,
                          f"must give each of the {L} layers 'F' (full) or 'S' (shared): a string "
                          f"like 'FSFS' or a list of 'full' / 'shared'")
    freq = _hf(d, "index_topk_freq", 1)
    if freq < 1:
        raise ConfigError("index_topk_freq", freq, "must be an integer >= 1")
    offset = _hf(d, "index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L))


def _rope(d: dict[str, Any]) -> RopeConfig:
    # HF reads a (legacy) ``rope_scaling`` in preference to ``rope_parameters`` when both are given
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    rp = d.get(key) or {}
    if not isinstance(rp, dict):
        raise ConfigError(key, rp, "must be a dict (or absent)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = _hf(rp, "rope_theta", None, kind="float")
    theta = _hf(d, "rope_theta", 10000.0, kind="float") if theta is None else theta
    if rope_type == "default":
        return RopeConfig("default", theta)
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=_hf(rp, "factor", None, kind="float"),
        original_max_position_embeddings=_hf(
            rp, "original_max_position_embeddings", _hf(d, "max_position_embeddings", None)),
        beta_fast=_hf(rp, "beta_fast", 32.0, kind="float") or 32.0,
        beta_slow=_hf(rp, "beta_slow", 1.0, kind="float") or 1.0,
        mscale=_hf(rp, "mscale", None, kind="float"),
        mscale_all_dim=_hf(rp, "mscale_all_dim", None, kind="float"),
        attention_factor=_hf(rp, "attention_factor", None, kind="float"),
        truncate=_hf(rp, "truncate", True, kind="bool"),
    )


def config_from_hf(d: dict[str, Any]) -> DSAConfig:
    """Parse a HF ``config.json`` dict (or ``PreTrainedConfig.to_dict()``) of either model type.
    A missing key, a value of the wrong type and every value :class:`DSAConfig` refuses raise
    ConfigError naming the key."""
    if not isinstance(d, dict):
        raise ConfigError("config", d, "must be a dict (a parsed config.json)")
    kind = d.get("model_type")
    check_choice("model_type", kind, KINDS)
    L = check_int("num_hidden_layers", _hf(d, "num_hidden_layers"), lo=1)
    dflt = HF_DEFAULTS[kind]
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        n_dense = _hf(d, "first_k_dense_replace", dflt["first_k_dense_replace"])
        if n_dense < 0:
            raise ConfigError("first_k_dense_replace", n_dense, "must be an integer >= 0")
        n_dense = min(n_dense, L)
        mlp = ["dense"] * n_dense + ["sparse"] * (L - n_dense)
    # HF: a ``num_experts`` kwarg overrides n_routed_experts; ``num_local_experts`` is its alias
    experts = next((k for k in ("num_experts", "n_routed_experts") if d.get(k) is not None),
                   "num_local_experts")
    ints = {k: _hf(d, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
        "num_experts_per_tok")}
    return DSAConfig(
        kind=kind,
        num_hidden_layers=L,
        **ints,
        n_routed_experts=_hf(d, experts),
        n_shared_experts=_hf(d, "n_shared_experts", dflt["n_shared_experts"]),
        n_group=_hf(d, "n_group", dflt["n_group"]),
        topk_group=_hf(d, "topk_group", dflt["topk_group"]),
        routed_scaling_factor=_hf(d, "routed_scaling_factor", dflt["routed_scaling_factor"], kind="float"),
        norm_topk_prob=_hf(d, "norm_topk_prob", dflt["norm_topk_prob"], kind="bool"),
        rms_norm_eps=_hf(d, "rms_norm_eps", dflt["rms_norm_eps"], kind="float"),
        max_position_embeddings=_hf(d, "max_position_embeddings", dflt["max_position_embeddings"]),
        mlp_layer_types=tuple(mlp) if isinstance(mlp, (list, tuple)) else mlp,
        # transformers' DeepSeek-V3.2 runs every layer's indexer whatever sharing keys a config carries
        indexer_types=indexer_types_from_hf(d, L) if kind == "glm_moe_dsa" else ("full",) * L,
        rope=_rope(d),
        attention_bias=_hf(d, "attention_bias", dflt["attention_bias"], kind="bool"),
        tie_word_embeddings=_hf(d, "tie_word_embeddings", dflt["tie_word_embeddings"], kind="bool"),
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
