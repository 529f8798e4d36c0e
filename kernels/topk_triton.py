"""The fast step's top-k as ONE Triton kernel per layer (ring 2: triton, optional): radix select of
the threshold, then one compaction pass; no sort, no host sync, no allocation (capturable).

Contract (:func:`select_positions`): ``scores [B, N]`` fp32 (no NaN), optional ``lengths [B]`` (a
row's keys at and past its length are ignored, as if ``-inf``) -> ``out [B, k]`` int32 or int64:
row r holds **the set** :func:`~hisparse_ray.model.indexer.select_topk` selects (higher score
first, equal scores by lower position, ``-0.0 == 0.0``, ``-inf`` keys never), **in ascending
position order**, then ``-1`` up to ``k``. The order is the one deliberate difference from
``select_topk`` (which orders by score): a position-ordered set needs no sort, and both decode
modes read it in the same order, so HiSparse equals full-resident bit for bit all the same.

The kernel, one program per row, every pass reading the row from L2 after the first:

1. up to four histogram passes over the row's valid keys, 8 bits each, most significant first:
   each 32-bit key is the score's order-preserving pattern (``select_topk``'s high half, as
   unsigned); after pass p the threshold's top ``8 (p + 1)`` bits are known and ``rem`` says how
   many keys with that prefix are still to take. When that is the whole bucket, the cut ``T`` is
   the bucket's lowest key and every key equal to it is taken (no more passes); else after pass 4
   ``T`` is the k-th largest key and ``rem`` how many of the keys equal to it are taken (the
   lowest positions: the tie rule);
2. one pass writing every position with key ``> T``, and the first ``rem`` positions with key
   ``== T``, to consecutive output slots (a running count plus a block prefix sum), then ``-1``.

A row with at most k valid keys takes them all (no radix passes). ``tests/kernels/test_topk_triton.py``
runs the kernel in Triton's interpreter on CPU against ``select_topk``; ``benchmarks/bench_topk.py``
times it on CUDA.
"""

import inspect

import torch
from torch import Tensor

import triton
import triton.language as tl

BLOCK = 1024  # keys per loop iteration of a program
NUM_WARPS = 8


def _body(S, stride_s, LEN, stride_l, OUT, stride_o, N, kk, K,
          HAS_LEN: tl.constexpr, MASKED_HIST: tl.constexpr, BLOCK_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = S + row * stride_s
    out = OUT + row * stride_o
    L = N
    if HAS_LEN:
        L = tl.maximum(tl.minimum(tl.load(LEN + row * stride_l).to(tl.int32), N), 0)
    offs = tl.arange(0, BLOCK_)
    NB: tl.constexpr = 256 if MASKED_HIST else 512  # unmasked: the extra bins hold excluded keys
    bins = tl.arange(0, NB)
    prefix = tl.full([], 0, dtype=tl.int64)
    rem = tl.full([], 0, dtype=tl.int32)  # keys still to take among those with the prefix
    active = tl.full([], 1, dtype=tl.int32)  # a cut is still being searched (pass 0 always runs)
    thresh = tl.full([], -1, dtype=tl.int64)  # -1: every valid key is taken (no cut)
    for p in tl.static_range(4):
        SHIFT = 24 - 8 * p  # (a compile-time value: p is unrolled)
        if active > 0:
            hist = tl.zeros((NB,), dtype=tl.int32)
            for start in range(0, L, BLOCK_):
                idx = start + offs
                s = tl.load(base + idx, mask=idx < L, other=float("-inf"))
                bits = s.to(tl.int32, bitcast=True)
                bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 counts as 0.0
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
                ok = (idx < L) & (s != float("-inf")) & ((key >> (SHIFT + 8)) == prefix)
                digit = ((key >> SHIFT) & 255).to(tl.int32)
                if MASKED_HIST:
                    hist += tl.histogram(digit, NB, mask=ok)
                else:
                    hist += tl.histogram(tl.where(ok, digit, 256), NB)
            hist = tl.where(bins < 256, hist, 0)
            total = tl.sum(hist, 0)
            if p == 0:  # at most kk valid keys: take them all (thresh stays -1)
                rem = tl.minimum(total, kk)
                active = (total > kk).to(tl.int32)
            if active > 0:
                ge = total - tl.cumsum(hist, 0) + hist  # keys with digit >= d, per d
                d = tl.sum(((ge >= rem) & (bins < 256)).to(tl.int32), 0) - 1
                above = tl.sum(tl.where((bins > d) & (bins < 256), hist, 0), 0)
                in_bucket = tl.sum(tl.where(bins == d, hist, 0), 0)
                rem = rem - above
                prefix = prefix * 256 + d.to(tl.int64)
                if rem == in_bucket:  # the whole bucket is taken: cut at its lowest key, no
                    thresh = prefix << SHIFT  # more passes, every key equal to it taken
                    rem = 2147483647
                    active = active * 0
                if p == 3:  # (still active) the k-th largest key; take rem of its ties
                    thresh = tl.where(active > 0, prefix, thresh)
    # compaction: keys above the threshold, then the first `rem` equal to it, in position order
    n_sel = tl.full([], 0, dtype=tl.int32)
    n_tie = tl.full([], 0, dtype=tl.int32)
    for start in range(0, L, BLOCK_):
        idx = start + offs
        s = tl.load(base + idx, mask=idx < L, other=float("-inf"))
        bits = s.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
        valid = (idx < L) & (s != float("-inf"))
        eq = (valid & (key == thresh)).to(tl.int32)
        tie_rank = n_tie + tl.cumsum(eq, 0) - eq
        sel = ((valid & (key > thresh)) | ((eq > 0) & (tie_rank < rem))).to(tl.int32)
        slot = n_sel + tl.cumsum(sel, 0) - sel
        # (slot < K: never past the row, whatever the scores; the passes make n_sel <= kk)
        tl.store(out + slot, idx.to(OUT.dtype.element_ty), mask=(sel > 0) & (slot < K))
        n_sel += tl.sum(sel, 0)
        n_tie += tl.sum(eq, 0)
    for start in range(0, K, BLOCK_):
        j = start + offs
        tl.store(out + j, tl.full((BLOCK_,), -1, dtype=OUT.dtype.element_ty),
                 mask=(j < K) & (j >= n_sel))


def _masked_hist() -> bool:
    """Whether this triton's ``tl.histogram`` takes ``mask`` (else excluded keys go to extra
    bins of a 512-bin histogram)."""
    return "mask" in inspect.signature(tl.histogram).parameters


_kernel = triton.jit(_body)  # interpreted (on CPU tensors) when TRITON_INTERPRET=1 at import


def select_positions(scores: Tensor, k: int, *, lengths: 'Tensor | None' = None,
                     out: 'Tensor | None' = None, masked_hist: 'bool | None' = None) -> Tensor:
    """See the module docstring. ``scores [B, N]`` fp32 (rows may be strided, keys contiguous),
    ``lengths [B]`` int32/int64 (any stride) or None, ``out [B, k]`` int32/int64 (written in place) or None
    (a new int64 tensor). CUDA tensors, or any device under Triton's interpreter
    (``TRITON_INTERPRET=1`` before triton is first imported). ``masked_hist``: force one histogram variant (tests); default: this triton's."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be [B, N] fp32 with contiguous rows, got "
                         f"{tuple(scores.shape)} {scores.dtype} stride {scores.stride()}")
    B, N = scores.shape
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if N >= 1 << 31:
        raise ValueError(f"select_positions: {N} keys exceed int32 positions")
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=scores.device)
    if out.shape != (B, k) or out.dtype not in (torch.int32, torch.int64) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{B}, {k}] int32/int64 with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if lengths is not None and lengths.shape != (B,):
        raise ValueError(f"lengths must be [{B}], got {tuple(lengths.shape)}")
    if B == 0:
        return out
    masked = _masked_hist() if masked_hist is None else masked_hist
    has_len = lengths is not None
    args = (scores, scores.stride(0), lengths if has_len else scores,
            lengths.stride(0) if has_len else 0, out, out.stride(0), N, min(k, N), k)
    _kernel[(B,)](*args, HAS_LEN=has_len, MASKED_HIST=masked, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    return out
