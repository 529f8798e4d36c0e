"""The DSA lightning indexer and its top-k (ring 2). Parameter names mirror HF's ``self_attn.indexer``.

Facts from transformers 5.23.0 (``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``):

* ``q = wq_b(q_resid)`` with ``q_resid = q_a_layernorm(q_a_proj(x))`` (shared with MLA), viewed
  ``[index_n_heads, index_head_dim]``; ``k = LayerNorm(wk(x))`` (one head, LayerNorm with bias, eps 1e-6).
  Rope is applied to the first ``qk_rope_head_dim`` dims of q and k (half-split for DeepSeek-V3.2,
  interleaved for GLM-MoE-DSA; see :mod:`hisparse_ray.model.rope`). The Hadamard rotation and fp8 of
  the original kernels are skipped (orthogonal / precision only).
* ``score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * index_head_dim**-0.5)`` in fp32, with
  ``w = weights_proj(x).float() * index_n_heads**-0.5`` (``weights_proj`` is kept in fp32).
* Top-k: ``topk(min(index_topk, T))`` over the scores of all cached keys after masking. In prefill the
  mask is causal (keys ``t <= s``); when fewer than ``index_topk`` keys are visible HF's result also
  contains masked positions, which attention ignores; we report them as -1. In decode (one query at
  position ``n-1`` after the new key is appended) the candidates are **all positions 0..n-1, including
  the current one**; with ``n <= index_topk`` every position is selected.
* Equal scores (common: ``relu`` zeroes a key for every head whose weight is positive, so scores tie at
  0.0) are ordered by ``torch.topk``; our batched decode pads keys to the longest row, so a tie at the
  k-th place may be broken differently from HF's per-request call (both are valid top-k sets).
* ``indexer_types == "shared"`` layers (GLM) have no indexer module at all and reuse the top-k of the
  most recent full layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hisparse_ray.model.config import DSAConfig
from hisparse_ray.model.rope import rotate_half_split, rotate_interleaved


def select_topk(scores: Tensor, k: int) -> Tensor:
    """``scores [..., N]`` fp32 with ``-inf`` at invalid keys -> ``[..., k]`` int64 positions, -1 where
    fewer than ``k`` keys are valid. Ties are broken by ``torch.topk``, as HF does."""
    kk = min(k, scores.shape[-1])
    vals, idx = scores.topk(kk, dim=-1)
    idx = idx.masked_fill(vals == float("-inf"), -1)
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx


class Indexer(nn.Module):
    """One layer's lightning indexer (replicated on every TP rank: selection is identical everywhere)."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, D, bias=False)
        self.k_norm = nn.LayerNorm(D, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, H, bias=False)
        self._rotate = rotate_half_split if cfg.kind == "deepseek_v32" else rotate_interleaved

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = self.cfg.qk_rope_head_dim
        return torch.cat([self._rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [N, hidden]``, ``cos/sin [N, rope/2]`` -> keys ``[N, index_head_dim]`` (cached per request)."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """-> ``(q [N, H_idx, D] fp32, w [N, H_idx] fp32)`` for ``x [N, hidden]``, ``q_resid [N, q_lora]``."""
        cfg = self.cfg
        q = self.wq_b(q_resid).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = self._rope(q, cos[:, None], sin[:, None])
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * cfg.index_n_heads**-0.5
        return q.float(), w

    def scores(self, q: Tensor, w: Tensor, keys: Tensor) -> Tensor:
        """``q [B, S, H, D]``, ``w [B, S, H]``, ``keys [B, N, D]`` -> ``[B, S, N]`` fp32 (unmasked)."""
        s = torch.matmul(q, keys.float().transpose(-1, -2)[:, None]) * self.cfg.index_head_dim**-0.5
        s = F.relu(s)  # [B, S, H, N]
        return torch.matmul(w[..., None, :], s).squeeze(-2)

    def prefill_topk(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """One request's prompt ``x [T, hidden]`` -> ``(topk [T, K] int64 causal, -1 padded; keys [T, D])``."""
        T = x.shape[0]
        keys = self.keys(x, cos, sin)
        q, w = self.queries(x, q_resid, cos, sin)
        s = self.scores(q[None], w[None], keys[None])[0]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        return select_topk(s, self.cfg.index_topk), keys

    def decode_topk(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, n: Tensor) -> Tensor:
        """Batch step: ``x [B, hidden]``, ``keys [B, N, D]`` (row b valid for ``t < n[b]``, the newest key
        already included) -> ``topk [B, K]`` int64 over positions ``[0, n[b])``, -1 padded."""
        q, w = self.queries(x, q_resid, cos, sin)
        s = self.scores(q[:, None], w[:, None], keys)[:, 0]  # [B, N]
        valid = torch.arange(keys.shape[1], device=x.device)[None, :] < n[:, None]
        s = s.masked_fill(~valid, float("-inf"))
        return select_topk(s, self.cfg.index_topk)
