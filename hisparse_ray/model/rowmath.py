"""How the prefill multiplies per-token rows by weights: batched, or one token row at a time (ring 2).

A matmul's result for one row depends on how many rows went in with it: measured with torch 2.13's
CPU BLAS, ``F.linear`` of one row differs in the last bits from the same row inside a batch of 2 or
more, a batch of 2 from a batch of 160, and a MoE expert's tokens form a batch whose size depends
on the prompt. A prompt's KV would then depend on its length, its chunking and its other tokens.

:class:`RowMath` with ``batch_invariant=True`` computes every row-mixing matmul of the prefill the
way a batch-of-one decode step computes it for that token: ``F.linear`` on one row (a Python loop
of cheap calls), head-wise products as batches of single rows, the indexer's head-weighted sum over
exactly the keys the decode step sees. Transcendental elementwise ops (``sigmoid``, ``silu``) also
go per row: torch's CPU kernels run whole SIMD vectors and finish a tensor's tail with a scalar
routine that rounds differently (measured: ``sigmoid`` of a ``[1, 8]`` row differs from the same
row inside ``[1000, 8]``). Norms, softmax and exact arithmetic work per row already. So
the KV row, indexer key and logits of position ``p`` are a function of ``tokens[0..p]`` alone, bit
for bit: whatever the prompt length and query chunking, and equal to what decoding the prompt one
token at a time writes (tested). ``batch_invariant=False`` is plain batched math (throughput; rows
round differently in the last bits, well within fp32/bf16 tolerance).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class RowMath:
    """The prefill's row-mixing matmuls, batched (``batch_invariant=False``) or per row."""

    def __init__(self, batch_invariant: bool) -> None:
        self.batch_invariant = bool(batch_invariant)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x [N, in], weight [out, in], bias) -> [N, out]``. A weight kept fp8 by
        :class:`~hisparse_ray.model.fp8.Fp8Linear` (tagged ``fp8_linear``) goes through its GEMM."""
        fp8 = getattr(weight, "fp8_linear", None)
        lin = F.linear if fp8 is None else (lambda r, _w, b: fp8.forward_no_bias(r) if b is None
                                            else fp8.forward_no_bias(r) + b)
        if not self.batch_invariant or x.shape[0] <= 1:
            return lin(x, weight, bias)
        return torch.cat([lin(x[i : i + 1], weight, bias) for i in range(x.shape[0])])

    def each(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """``fn(x [N, ...])`` for a row-local ``fn``, applied to one row at a time when batch-invariant."""
        if not self.batch_invariant or x.shape[0] <= 1:
            return fn(x)
        return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])

    def heads_in(self, x: Tensor, w: Tensor) -> Tensor:
        """``einsum("nhd,hdr->nhr", x [N, h, d], w [h, d, r])`` (MLA's query absorption)."""
        if not self.batch_invariant or x.shape[0] == 1:
            return torch.einsum("nhd,hdr->nhr", x, w)
        return torch.matmul(x[:, :, None, :], w[None]).squeeze(-2)

    def heads_out(self, x: Tensor, w: Tensor) -> Tensor:
        """``einsum("nhr,hvr->nhv", x [N, h, r], w [h, v, r])`` (MLA's value up-projection). Per row,
        as the decode step's einsum of one row computes it: ``h`` single-row products against
        ``w[h]`` transposed."""
        if not self.batch_invariant:
            return torch.einsum("nhr,hvr->nhv", x, w)
        if x.shape[0] == 1:  # the decode step's own call
            return torch.einsum("bqhr,hvr->bqhv", x[None], w)[0]
        N, h, r = x.shape
        v = w.shape[1]
        wt = w.expand(N, h, v, r).reshape(N * h, v, r).transpose(-1, -2)
        return torch.bmm(x.reshape(N * h, 1, r), wt).view(N, h, v)

    def index_scores(self, q: Tensor, keys: Tensor, scale: float) -> Tensor:
        """``relu(q [Q, H, D] . keys [N, D] * scale)`` -> ``[Q, H, N]`` fp32 (the indexer's per-head
        scores, before the head weights), written in place where possible."""
        Q, H, D = q.shape
        if self.batch_invariant:
            s = torch.bmm(q, keys.t().expand(Q, D, keys.shape[0]))
        else:
            s = torch.matmul(q.reshape(Q * H, D), keys.t()).view(Q, H, -1)
        return s.mul_(scale).relu_()

    def head_sum(self, w: Tensor, s: Tensor, first: int) -> Tensor:
        """``sum_h w[q, h] * s[q, h, t]`` -> ``[Q, N]``, for query ``q`` at position ``first + q``;
        entries of keys after the query are left to the caller's causal mask. Per row, the sum
        covers exactly keys ``0..first+q``, as the decode step of that position does."""
        if not self.batch_invariant:
            return torch.bmm(w[:, None, :], s)[:, 0]
        out = torch.empty(s.shape[0], s.shape[2], dtype=s.dtype, device=s.device)
        for i in range(s.shape[0]):
            n = min(first + i + 1, s.shape[2])
            out[i, :n] = torch.bmm(w[i : i + 1, None, :], s[i : i + 1, :, :n].contiguous())[0, 0]
        return out
