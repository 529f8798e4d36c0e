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
  0.0) are broken by position, lower first (:func:`select_topk`): the selection of a row is then the
  same whatever its padded length or batch, so a prefix reused from another request's prefill is the
  KV a fresh prefill would write. HF's ``torch.topk`` breaks such ties arbitrarily; both are valid
  top-k sets, so HF comparisons use models whose scores do not tie at the k-th place.
* ``indexer_types == "shared"`` layers (GLM) have no indexer module at all and reuse the top-k of the
  most recent full layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hisparse_ray.model.config import DSAConfig
from hisparse_ray.model.rope import rotate_half_split, rotate_interleaved
from hisparse_ray.model.rowmath import RowMath


def select_topk(scores: Tensor, k: int) -> Tensor:
    """``scores [..., N]`` fp32 with ``-inf`` at invalid keys -> ``[..., k]`` int64 positions, -1 where
    fewer than ``k`` keys are valid.

    The one selection rule of the project (reference, CUDA path and fast path): higher score first,
    **equal scores by lower position**, so the selected set and its order depend only on the scores
    of the valid keys, never on ``N`` (a row's padded length), the batch, or the device. ``-0.0``
    counts as ``0.0``. ``torch.topk`` alone breaks ties by its internal algorithm, which differs with
    the row length: a prefix reused from a longer prompt's prefill then selected other rows than a
    fresh prefill (issue #15). Each score becomes one distinct int64 key: its order-preserving
    32-bit pattern in the high half, ``2**32 - 1 - position`` in the low half; top-k of distinct
    keys is unique, on every device and in CUDA graphs.
    """
    N = scores.shape[-1]
    kk = min(k, N)
    if N >= 1 << 32:
        raise ValueError(f"select_topk: {N} keys exceed the 2**32 positions a key can encode")
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: one bit pattern per value
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # monotone in s
    pos = torch.arange(N, device=scores.device, dtype=torch.int64)
    key = ordered * (1 << 32) + ((1 << 32) - 1 - pos)
    top = key.topk(kk, dim=-1).values
    idx = (1 << 32) - 1 - (top & 0xFFFFFFFF)
    idx = idx.masked_fill(top < NEG_INF_KEY_BOUND, -1)
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx


# keys of -inf scores (masked keys) are below this bound; every finite score is above it
NEG_INF_KEY_BOUND = (int(torch.tensor(float("-inf")).view(torch.int32)) ^ 0x7FFFFFFF) * (1 << 32) + (1 << 32)


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

    # -- prefill: one request's prompt, queries in chunks (never [T, H, T]) ------------------------
    def prefill_topk(
        self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, *, query_chunk: int | None = None,
        row_chunk: int | None = None, rm: RowMath | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One request's prompt ``x [T, hidden]``, ``q_resid [T, q_lora]`` -> ``(topk [T, K] int64
        causal, -1 padded; keys [T, D] in x's dtype)``.

        Keys are made ``row_chunk`` rows at a time, queries go in chunks of ``query_chunk`` (both
        default all ``T``); a chunk of queries ``[lo, hi)`` is scored against keys ``[0, hi)`` only
        and masked causally, so memory is ``O(query_chunk * index_n_heads * T)`` fp32 and the
        selection of every query is the one :meth:`decode_topk` makes at that position (the tie
        rule makes it independent of the key count). ``rm`` (default batched) computes the
        row-mixing matmuls (:mod:`.rowmath`).
        """
        cfg = self.cfg
        rm = rm or RowMath(False)
        T, H, D = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        chunk = T if query_chunk is None else max(1, int(query_chunk))
        rows = T if row_chunk is None else max(1, int(row_chunk))
        keys = torch.empty(T, D, dtype=x.dtype, device=x.device)
        for lo in range(0, T, rows):
            hi = min(T, lo + rows)
            k = self.k_norm(rm.linear(x[lo:hi], self.wk.weight, self.wk.bias))
            keys[lo:hi] = self._rope(k, cos[lo:hi], sin[lo:hi])
        kf = keys.float()
        topk = torch.empty(T, cfg.index_topk, dtype=torch.int64, device=x.device)
        for lo in range(0, T, chunk):
            hi = min(T, lo + chunk)
            w = rm.linear(x[lo:hi].to(self.weights_proj.weight.dtype), self.weights_proj.weight).float() * H**-0.5
            q = rm.linear(q_resid[lo:hi], self.wq_b.weight).view(hi - lo, H, D)
            q = self._rope(q, cos[lo:hi, None], sin[lo:hi, None]).float()
            s = rm.head_sum(w, rm.index_scores(q, kf[:hi], D**-0.5), lo)  # [Q, hi]
            future = torch.arange(hi, device=x.device)[None, :] > torch.arange(lo, hi, device=x.device)[:, None]
            topk[lo:hi] = select_topk(s.masked_fill_(future, float("-inf")), cfg.index_topk)
        return topk, keys

    def decode_topk(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, n: Tensor) -> Tensor:
        """Batch step: ``x [B, hidden]``, ``keys [B, N, D]`` (row b valid for ``t < n[b]``, the newest key
        already included) -> ``topk [B, K]`` int64 over positions ``[0, n[b])``, -1 padded."""
        q, w = self.queries(x, q_resid, cos, sin)
        s = self.scores(q[:, None], w[:, None], keys)[:, 0]  # [B, N]
        valid = torch.arange(keys.shape[1], device=x.device)[None, :] < n[:, None]
        s = s.masked_fill(~valid, float("-inf"))
        return select_topk(s, self.cfg.index_topk)
