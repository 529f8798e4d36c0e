"""Chunk sizes of one prefill under a byte budget (ring 2): what keeps a 128K-token prompt in memory.

The prefill's working set per chunk is linear in the chunk and in ``T`` (the indexer scores a chunk
of queries against every earlier key), never ``T * T``: :class:`PrefillPlan` picks the chunk sizes
so that each stage's temporaries stay within ``budget_bytes`` (at least one row or query per chunk).
Outside the chunks the prefill holds ``O(T)`` tensors: the hidden state and its norm, the attention
output, ``q_resid``, the latent rows and keys of every layer, and one layer's top-k ``[T, K]`` int64.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_ray.errors import ConfigError
from hisparse_ray.model.config import DSAConfig

DEFAULT_PREFILL_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """``rows``: token rows per projection / MLP chunk; ``index_queries``: queries per indexer chunk;
    ``attn_queries``: queries per sparse-attention chunk. All >= 1."""

    rows: int
    index_queries: int
    attn_queries: int

    def __post_init__(self) -> None:
        for key in ("rows", "index_queries", "attn_queries"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(key, v, "must be an integer >= 1")

    @staticmethod
    def item_bytes(cfg: DSAConfig, heads: int, T: int, elem: int) -> tuple[int, int, int]:
        """Bytes one token row / indexer query / attention query allocates at once (upper bounds),
        for a ``T``-token prompt on a rank with ``heads`` attention heads, activations of ``elem`` bytes:

        * row: an RMSNorm's fp32 temporaries, the projections' outputs and the MLP's (or a
          routed/shared expert's) intermediates;
        * indexer query: fp32 per-head scores against ``T`` keys, the head-weighted scores and their
          int64 selection keys and mask, the query's heads;
        * attention query: the absorbed query, its gathered top-k rows, scores and probabilities (fp32
          and ``elem``), context and output.
        """
        T = max(T, 1)
        R, K = cfg.kv_lora_rank, cfg.index_topk
        inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1))
        norms = 12 * max(cfg.hidden_size, cfg.q_lora_rank + cfg.kv_lora_rank)  # RMSNorm's fp32 copies
        row = norms + elem * (2 * cfg.hidden_size + cfg.q_lora_rank + 2 * cfg.row_dim + 4 * inter
                              + cfg.index_head_dim) + 4 * cfg.index_n_heads
        index = (4 * cfg.index_n_heads + 4 + 3 * 8 + 1) * T + 8 * cfg.index_n_heads * cfg.index_head_dim
        attn = (elem * (heads * (cfg.qk_head_dim + 2 * (R + cfg.qk_rope_head_dim)) + K * cfg.row_dim
                        + 2 * heads * K + heads * (R + cfg.v_head_dim) + cfg.hidden_size)
                + 4 * heads * K + 8 * K)
        return row, index, attn

    @classmethod
    def of(cls, cfg: DSAConfig, heads: int, T: int, budget_bytes: int, elem: int) -> "PrefillPlan":
        """The largest chunks whose :meth:`item_bytes` fit ``budget_bytes`` (at least 1, at most T)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError("prefill_chunk_bytes", budget_bytes, "must be an integer >= 1")
        sizes = [max(1, min(max(T, 1), budget_bytes // b)) for b in cls.item_bytes(cfg, heads, T, elem)]
        return cls(*sizes)
