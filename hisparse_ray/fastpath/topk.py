"""The project's top-k rule at a lower cost per key (ring 2: torch): same contract and the same
output as :func:`~hisparse_ray.model.indexer.select_topk`, bit for bit, for any scores without
NaN.

The rule: higher score first, equal scores by lower position, ``-0.0 == 0.0``, ``-1`` where fewer
than ``k`` keys are valid (score ``-inf``). ``select_topk`` makes one int64 key per score (order
bits in the high half, the inverted position in the low half) and takes an int64 top-k over all N
keys of a row: at 128K positions and batch 64 that is 8M int64 keys written, then read by every
radix pass (twice the passes of a 32-bit top-k, each twice the bytes) per layer.

Here (:func:`select_topk_fast`) only the k candidates get int64 keys:

1. a float top-k of the scores gives the k-th largest value ``v`` (a value, so how ``torch.topk``
   breaks ties does not matter) and ``c`` = how many of its k results are ``> v``: every score
   above ``v`` is among them (fewer than k scores are), so those c positions are selected;
2. the remaining ``m = k - c`` selected positions are the lowest positions whose score equals
   ``v`` (the tie rule): one compare and one int32 running count over the row, then the j-th
   equal position for j = 1..m by a binary search of that count (``searchsorted``, O(k log N));
3. the k candidates are ordered exactly as ``select_topk`` orders them (its int64 key, k of them).

Per key of a row that is a 32-bit top-k, one compare and one int32 scan instead of building and
ranking int64 keys; everything is static-shaped and sync-free (capturable in a CUDA graph).
``benchmarks/bench_topk.py`` measures both; ``tests/fastpath/test_topk.py`` proves the outputs
identical on tie-heavy inputs.

The fast decode step calls :func:`select_topk_positions`: the same selected set **in ascending
position order** (``-1`` padded at the end), by one Triton kernel on CUDA
(:mod:`hisparse_ray.kernels.topk_triton`: radix select, then one compaction pass, rows split
over several programs at small batch; no sort) and
by ``select_topk_fast`` + a sort of the k positions elsewhere, so the step's output never depends
on which ran. Both decode modes read the rows in that same order: HiSparse still equals
full-resident bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hisparse_ray.kernels import triton_module
from hisparse_ray.model.indexer import NEG_INF_KEY_BOUND


def order_keys(scores: Tensor, positions: Tensor) -> Tensor:
    """``select_topk``'s int64 key of each (score, position): larger key = selected earlier.
    ``scores`` fp32 (``-0.0`` normalized by the caller), ``positions`` int64 in ``[0, 2**32)``."""
    bits = scores.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - positions)


def select_topk_fast(scores: Tensor, k: int) -> Tensor:
    """``scores [..., N]`` fp32, ``-inf`` at invalid keys, no NaN -> ``[..., k]`` int64 positions,
    ``-1`` where fewer than ``k`` keys are valid: exactly ``select_topk(scores, k)``."""
    N = scores.shape[-1]
    kk = min(k, N)
    if N >= 1 << 31:
        raise ValueError(f"select_topk_fast: {N} keys exceed the int32 running count")
    lead = scores.shape[:-1]
    if kk == 0:
        return torch.full((*lead, k), -1, dtype=torch.int64, device=scores.device)
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: one bit pattern per value (for the keys)
    vals, idx = s.topk(kk, dim=-1, sorted=False)
    v = vals.amin(-1, keepdim=True)  # the k-th largest value
    tie = vals == v  # [..., kk]: the m = kk - c slots whose positions the tie rule picks
    # the j-th (1-based) position of the row whose score equals v, j = 1..kk
    count = (s == v).to(torch.int32).cumsum(-1, dtype=torch.int32)  # [..., N], non-decreasing
    want = torch.arange(1, kk + 1, dtype=torch.int32, device=s.device).expand(*lead, kk)
    first = torch.searchsorted(count.contiguous(), want.contiguous()).clamp_max(N - 1)
    j = tie.to(torch.int64).cumsum(-1) - 1  # tie slot -> 0..m-1
    cand = torch.where(tie, first.gather(-1, j.clamp_min(0)), idx)
    top = order_keys(s.gather(-1, cand), cand).topk(kk, dim=-1).values
    out = (1 << 32) - 1 - (top & 0xFFFFFFFF)
    out = out.masked_fill(top < NEG_INF_KEY_BOUND, -1)
    if kk < k:
        out = F.pad(out, (0, k - kk), value=-1)
    return out


def in_position_order(top: Tensor) -> Tensor:
    """``[..., k]`` positions with ``-1`` padding (any order) -> ascending positions, ``-1`` last."""
    big = torch.iinfo(top.dtype).max
    pos = torch.where(top < 0, big, top).sort(-1).values
    return torch.where(pos == big, -1, pos)


def select_topk_positions(scores: Tensor, k: int, *, lengths: Tensor | None = None,
                          out: Tensor | None = None) -> Tensor:
    """The fast step's top-k: ``scores [B, N]`` fp32 (no NaN), ``lengths [B]`` or None (keys at
    and past a row's length are ignored) -> ``[B, k]`` (``out``, int32/int64, written in place;
    else new int64): ``select_topk``'s selected positions in ascending order, then ``-1``. The
    Triton kernel on CUDA where triton imports (``HISPARSE_TRITON_TOPK=0`` switches it off),
    else ``select_topk_fast`` and a sort; the two agree exactly."""
    kern = (triton_module("topk_triton", "HISPARSE_TRITON_TOPK")
            if scores.is_cuda and scores.dim() == 2 else None)
    if kern is not None:
        s = scores.float()  # the kernel reads fp32 rows with contiguous keys (no copy if so)
        return kern.select_positions(s if s.stride(-1) == 1 else s.contiguous(), k,
                                     lengths=lengths, out=out)
    if lengths is not None:
        pos = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(pos[None, :] >= lengths[:, None], float("-inf"))
    got = in_position_order(select_topk_fast(scores, k))
    if out is None:
        return got
    out.copy_(got)
    return out
