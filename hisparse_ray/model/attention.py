"""MLA sparse attention over latent KV rows, with absorbed weights and TP head sharding (ring 2).

Facts from transformers 5.23.0 (``DeepseekV32Attention``):

* ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` viewed ``[H, nope + rope]`` (nope first); the latent
  ``[c, k_rope] = kv_a_proj_with_mqa(x)``, ``c = kv_a_layernorm(c)``; q's and k's rope parts get the
  interleaved rotation. ``kv_b_proj(c)`` viewed ``[H, nope + v]`` gives per-head ``k_nope`` and ``v``.
* HF expands K/V for every cached token and adds ``finfo.min`` to the scores of keys not in the
  indexer's top-k (scattered as a mask over the causal mask); softmax in fp32, cast back.
* Softmax scale: see :func:`hisparse_ray.model.rope.softmax_scale`.

We never expand: with ``kv_b_proj.weight`` viewed ``[H, nope + v, R]`` (``W_uk = [:, :nope]``,
``W_uv = [:, nope:]``), ``q_lat[h] = W_uk[h]^T q_nope[h]`` and the score is
``[q_lat[h], q_rope[h]] . row(t)``; the output is ``W_uv[h] (sum_t p[h, t] c(t))``, then ``o_proj``.
Prefill runs the same per-query computation over each query's own top-k rows, in query chunks
(:meth:`MLAAttention.prefill`; chunk sizes from :class:`~hisparse_ray.model.plan.PrefillPlan`).

Tensor parallel: a rank holds heads ``[rank*H/tp, (rank+1)*H/tp)`` of ``q_b_proj``/``kv_b_proj`` (rows)
and ``o_proj`` (columns); latent KV rows and the indexer are replicated. The partial ``o_proj`` output
is summed with one ``all_reduce`` per layer; ``o_proj``'s bias (if any) is added after it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hisparse_ray.model.cache import AttentionKVCache
from hisparse_ray.model.config import DSAConfig
from hisparse_ray.model.fp8 import linear_no_bias
from hisparse_ray.model.indexer import Indexer
from hisparse_ray.model.layers import RMSNorm
from hisparse_ray.model.plan import PrefillPlan
from hisparse_ray.model.rope import rotate_interleaved, softmax_scale
from hisparse_ray.model.rowmath import RowMath


class MLAAttention(nn.Module):
    """One layer's MLA with its indexer (``None`` on GLM "shared" layers). ``heads`` is the local head
    count (``num_attention_heads / tp_size`` after :meth:`shard_heads`)."""

    def __init__(self, cfg: DSAConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.heads = cfg.num_attention_heads
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.row_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * cfg.v_head_dim, cfg.hidden_size, bias=bias)
        self.indexer = Indexer(cfg) if cfg.indexer_types[layer] == "full" else None
        self.scale = softmax_scale(cfg)
        self.tp_group: dist.ProcessGroup | None = None
        self.tp_size = 1

    # -- tensor parallel -------------------------------------------------------------------------
    @torch.no_grad()
    def shard_heads(self, rank: int, tp_size: int, group: dist.ProcessGroup | None) -> None:
        """Keep only this rank's heads (in place). ``num_attention_heads % tp_size == 0``."""
        cfg = self.cfg
        assert self.heads == cfg.num_attention_heads and cfg.num_attention_heads % tp_size == 0
        h = cfg.num_attention_heads // tp_size
        lo, hi = rank * h, (rank + 1) * h

        def rows(w: Tensor, per_head: int) -> Tensor:
            return w.view(cfg.num_attention_heads, per_head, -1)[lo:hi].reshape(h * per_head, -1).clone()

        self.q_b_proj.weight = nn.Parameter(rows(self.q_b_proj.weight, cfg.qk_head_dim))
        self.kv_b_proj.weight = nn.Parameter(rows(self.kv_b_proj.weight, cfg.qk_nope_head_dim + cfg.v_head_dim))
        o = self.o_proj.weight.view(cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim)
        self.o_proj.weight = nn.Parameter(o[:, lo:hi].reshape(cfg.hidden_size, h * cfg.v_head_dim).clone())
        self.heads, self.tp_size, self.tp_group = h, tp_size, group

    # -- shared pieces ---------------------------------------------------------------------------
    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [N, hidden]`` -> ``(q_full [N, heads, R + rope], q_resid [N, q_lora], row [N, row_dim])``.
        ``q_full`` is the absorbed query; ``row`` the latent KV row (post-norm, post-rope). The
        three pieces below, in this order (the fast step runs ``absorbed_query`` beside the
        resolver: it needs only ``q_resid``)."""
        q_resid = self.q_lora(x)
        q_full = self.absorbed_query(q_resid, cos, sin)
        return q_full, q_resid, self.latent_row(x, cos, sin)

    def q_lora(self, x: Tensor) -> Tensor:
        """``x [N, hidden]`` -> ``q_resid [N, q_lora]`` (``q_a_proj`` + its norm; the indexer's
        query input too)."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def absorbed_query(self, q_resid: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``q_resid [N, q_lora]`` -> ``q_full [N, heads, R + rope]``: ``q_b_proj``, rope on the
        rope part, the nope part absorbed into the latent space by ``W_uk``."""
        cfg = self.cfg
        N = q_resid.shape[0]
        q = self.q_b_proj(q_resid).view(N, self.heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = rotate_interleaved(q_rope, cos[:, None], sin[:, None])
        w = self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w[:, : cfg.qk_nope_head_dim])
        return torch.cat([q_lat, q_rope], dim=-1)

    def latent_row(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [N, hidden]`` -> the latent KV row ``[N, kv_lora + rope]`` (post-norm, post-rope)."""
        cfg = self.cfg
        c, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), rotate_interleaved(k_rope, cos, sin)], dim=-1)

    def attend(self, q_full: Tensor, rows: Tensor, allowed: Tensor) -> Tensor:
        """``q_full [B, Q, heads, R + rope]``, ``rows [B, S, row_dim]``, ``allowed [B, Q, S]`` bool (each
        query has >= 1 allowed row) -> ``[B, Q, hidden]`` after ``o_proj`` and the TP all-reduce."""
        cfg = self.cfg
        B, Q = q_full.shape[:2]
        rows = rows.to(q_full.dtype)
        s = torch.matmul(q_full, rows[:, None].transpose(-1, -2)) * self.scale  # [B, Q, heads, S]
        s = s.masked_fill(~allowed[:, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q_full.dtype)
        ctx = torch.matmul(p, rows[:, None, :, : cfg.kv_lora_rank])  # [B, Q, heads, R]
        w = self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        o = torch.einsum("bqhr,hvr->bqhv", ctx, w[:, cfg.qk_nope_head_dim :])
        out = linear_no_bias(self.o_proj, o.reshape(B, Q, self.heads * cfg.v_head_dim))
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        return out

    # -- one request's prompt: chunked, sparse (prefill side) -----------------------------------
    def prefill(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        prev_topk: Tensor | None,
        topk_hook: Callable[[int, Tensor], Tensor | None] | None,
        plan: PrefillPlan,
        rm: RowMath,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``x [T, hidden]`` -> ``(out [T, hidden], topk [T, K], row [T, row_dim], index_keys [T, d] | None)``.

        Latent rows and indexer keys of all ``T`` positions first (``plan.rows`` at a time), then the
        indexer's top-k in chunks of ``plan.index_queries`` queries, then sparse attention in chunks of
        ``plan.attn_queries``: each query attends over its own top-k rows only (gathered, absorbed MLA as
        in :meth:`decode`), so nothing of size ``T * T`` or ``T * heads * (R + rope)`` is ever built."""
        cfg = self.cfg
        T = x.shape[0]
        q_resid = torch.empty(T, cfg.q_lora_rank, dtype=x.dtype, device=x.device)
        row = torch.empty(T, cfg.row_dim, dtype=x.dtype, device=x.device)
        for lo in range(0, T, plan.rows):
            hi = min(T, lo + plan.rows)
            q_resid[lo:hi] = self.q_a_layernorm(rm.linear(x[lo:hi], self.q_a_proj.weight, self.q_a_proj.bias))
            kv = rm.linear(x[lo:hi], self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
            c, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            row[lo:hi] = torch.cat([self.kv_a_layernorm(c), rotate_interleaved(k_rope, cos[lo:hi], sin[lo:hi])], dim=-1)
        keys = None
        if self.indexer is not None:
            topk, keys = self.indexer.prefill_topk(x, q_resid, cos, sin, query_chunk=plan.index_queries,
                                                   row_chunk=plan.rows, rm=rm)
            if topk_hook is not None:
                topk = _replace(topk, topk_hook(self.layer, topk))
        else:
            assert prev_topk is not None, "shared layer without an anchor"
            topk = prev_topk
        out = torch.empty(T, cfg.hidden_size, dtype=x.dtype, device=x.device)
        for lo in range(0, T, plan.attn_queries):
            hi = min(T, lo + plan.attn_queries)
            out[lo:hi] = self._prefill_attend(q_resid[lo:hi], cos[lo:hi], sin[lo:hi], row, topk[lo:hi], rm)
        return out, topk, row, keys

    def _prefill_attend(self, q_resid: Tensor, cos: Tensor, sin: Tensor, row: Tensor, topk: Tensor,
                        rm: RowMath) -> Tensor:
        """A chunk of ``Q`` queries: ``q_resid [Q, q_lora]``, all rows ``row [T, row_dim]``, their
        ``topk [Q, K]`` (-1 padded) -> ``[Q, hidden]``. The same operations as :meth:`project` and
        :meth:`attend` for one decode row, with ``rm``'s row-mixing matmuls."""
        cfg = self.cfg
        Q, R, nope = q_resid.shape[0], cfg.kv_lora_rank, cfg.qk_nope_head_dim
        q = rm.linear(q_resid, self.q_b_proj.weight).view(Q, self.heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([nope, cfg.qk_rope_head_dim], dim=-1)
        q_rope = rotate_interleaved(q_rope, cos[:, None], sin[:, None])
        w = self.kv_b_proj.weight.view(self.heads, nope + cfg.v_head_dim, R)
        q_full = torch.cat([rm.heads_in(q_nope, w[:, :nope]), q_rope], dim=-1)[:, None]  # [Q, 1, heads, R + rope]
        rows = row[topk.clamp(min=0)].to(q_full.dtype)  # [Q, K, row_dim]
        s = torch.matmul(q_full, rows[:, None].transpose(-1, -2)).mul_(self.scale)  # [Q, 1, heads, K]
        s.masked_fill_(topk[:, None, None, :] < 0, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q_full.dtype)
        ctx = torch.matmul(p, rows[:, None, :, :R])[:, 0]  # [Q, heads, R]
        o = rm.heads_out(ctx, w[:, nope:])  # [Q, heads, v]
        out = rm.linear(o.reshape(Q, self.heads * cfg.v_head_dim), self.o_proj.weight)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        return out

    # -- one batched decode step -----------------------------------------------------------------
    def decode(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Tensor,
        kv_cache: AttentionKVCache,
        index_keys: Callable[[int, Tensor], Tensor],
        prev_topk: Tensor | None,
        topk_hook: Callable[[int, Tensor], Tensor | None] | None,
    ) -> tuple[Tensor, Tensor]:
        """``x [B, hidden]`` at ``positions [B]`` -> ``(out [B, hidden], topk [B, K])``. ``index_keys(layer,
        new_keys [B, d])`` stores the new keys and returns the padded key batch ``[B, N, d]``."""
        q_full, q_resid, row = self.project(x, cos, sin)
        kv_cache.write_newest(self.layer, row)
        if self.indexer is not None:
            keys = index_keys(self.layer, self.indexer.keys(x, cos, sin))
            topk = self.indexer.decode_topk(x, q_resid, cos, sin, keys, positions + 1)
            if topk_hook is not None:
                topk = _replace(topk, topk_hook(self.layer, topk))
        else:
            assert prev_topk is not None, "shared layer without an anchor"
            topk = prev_topk
        rows = kv_cache.gather(self.layer, topk)
        out = self.attend(q_full[:, None], rows, (topk >= 0)[:, None, :])
        return out[:, 0], topk


def _replace(topk: Tensor, new: Tensor | None) -> Tensor:
    if new is None:
        return topk
    assert new.shape == topk.shape, f"topk_hook returned {tuple(new.shape)}, expected {tuple(topk.shape)}"
    return new.to(device=topk.device, dtype=torch.int64)

