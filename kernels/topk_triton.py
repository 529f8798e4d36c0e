"""The fast step's top-k in Triton (ring 2: triton, optional): radix select of the threshold,
then one compaction pass; no sort, no host sync, no data-dependent host control flow
(capturable in a CUDA graph).

Contract (:func:`select_positions`): ``scores [B, N]`` fp32 (no NaN), optional ``lengths [B]`` (a
row's keys at and past its length are ignored, as if ``-inf``) -> ``out [B, k]`` int32 or int64:
row r holds **the set** :func:`~hisparse_ray.model.indexer.select_topk` selects (higher score
first, equal scores by lower position, ``-0.0 == 0.0``, ``-inf`` keys never), **in ascending
position order**, then ``-1`` up to ``k``. The order is the one deliberate difference from
``select_topk`` (which orders by score): a position-ordered set needs no sort, and both decode
modes read it in the same order, so HiSparse equals full-resident bit for bit all the same.

The algorithm, per row:

1. up to four histogram passes over the row's valid keys, 8 bits each, most significant first:
   each 32-bit key is the score's order-preserving pattern (``select_topk``'s high half, as
   unsigned); after pass p the threshold's top ``8 (p + 1)`` bits are known and ``rem`` says how
   many keys with that prefix are still to take (:func:`_step`, the one copy of that decision).
   When that is the whole bucket, the cut ``T`` is the bucket's lowest key and every key equal to
   it is taken (no more passes); else after pass 4 ``T`` is the k-th largest key and ``rem`` how
   many of the keys equal to it are taken (the lowest positions: the tie rule);
2. one pass writing every position with key ``> T``, and the first ``rem`` positions with key
   ``== T``, to consecutive output slots (a running count plus a block prefix sum), then ``-1``.

A row with at most k valid keys takes them all (no radix passes). Two launch shapes, the same
output bit for bit:

* **one program per row** (``splits == 1``): one launch, no workspace;
* **split rows** (grid ``(B, S)``, :func:`_split_launch`): each row cut into S contiguous chunks;
  one launch per histogram pass (:func:`_topk_hist`), one counting each chunk's keys above and
  equal to the cut (:func:`_topk_count`), one writing (:func:`_topk_write`: a chunk's first
  slot is the keys above the cut in earlier chunks plus the ties taken there). The programs of a
  row meet in a small workspace, zeroed per call: per-pass histograms summed by integer atomics
  (schedule-independent), per-chunk counts, and the row's decision state after each pass: every
  program of a launch advances the state of the launch before by one :func:`_step` on the last
  pass's histogram (:func:`_advance`; chunk 0 stores it for the next launch), so a program runs
  at most one decision, not the whole chain.

Why split: at batch 1 one program per row runs on one SM of the H200's 132: 118 us a call at
32K keys (torch's top-k: ~136), 496 us at 128K, where the 61-layer batch-1 decode step took
50.1 ms against 39.2 ms with the torch top-k. Split rows: 20 us and 21 us (from a CUDA graph;
the step at 128K 23.0 ms; H200, 2026-12-01, BENCHMARKS.md). ``splits=None`` picks S by
:func:`auto_splits` (1 where the batch alone fills the GPU). ``tests/kernels/test_topk_triton.py``
runs both shapes in Triton's interpreter on CPU against ``select_topk``;
``benchmarks/bench_topk_splits.py`` times them from CUDA graphs, ``bench_topk.py`` eagerly.
"""

import functools
import inspect

import torch
from torch import Tensor

import triton
import triton.language as tl

BLOCK = 1024  # keys per loop iteration of a program
NUM_WARPS = 8
MIN_CHUNK = 1024  # auto splits: the fewest keys a split-row program gets (one loop iteration)
MAX_SPLITS = 64  # auto splits: the most chunks a row gets (the largest count the sweep timed)
PROGRAMS_PER_SM = 4  # auto splits: aim for this many programs per SM over the batch


@triton.jit
def _keys(s):
    """fp32 scores -> their order-preserving 32-bit patterns as int64 in [0, 2**32), -0.0 as 0.0."""
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 counts as 0.0
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648


@triton.jit
def _hist(base, lo, hi, prefix, SHIFT: tl.constexpr, MASKED_HIST: tl.constexpr,
          BLOCK_: tl.constexpr):
    """The 8-bit digit at ``SHIFT`` of the valid keys in ``[lo, hi)`` whose higher bits equal
    ``prefix``: ``[256]`` int32 counts (``[512]`` without a masked histogram, the upper half
    holding the excluded keys: callers ignore bins >= 256)."""
    NB: tl.constexpr = 256 if MASKED_HIST else 512
    offs = tl.arange(0, BLOCK_)
    hist = tl.zeros((NB,), dtype=tl.int32)
    for start in range(lo, hi, BLOCK_):
        idx = start + offs
        s = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        key = _keys(s)
        ok = (idx < hi) & (s != float("-inf")) & ((key >> (SHIFT + 8)) == prefix)
        digit = ((key >> SHIFT) & 255).to(tl.int32)
        if MASKED_HIST:
            hist += tl.histogram(digit, NB, mask=ok)
        else:
            hist += tl.histogram(tl.where(ok, digit, 256), NB)
    return hist


@triton.jit
def _step(hist, p: tl.constexpr, prefix, rem, active, thresh, kk):
    """The radix decision after pass p from its histogram (bins >= 256 ignored): the new
    ``(prefix, rem, active, thresh)``. Pass 0's total is the row's valid keys: at most ``kk``
    takes them all (``thresh`` stays -1, ``rem`` = that count). Else the digit d whose bucket
    holds the ``rem``-th largest key extends ``prefix``; when the whole bucket is to be taken the
    cut is its lowest key with every tie taken (``active`` 0); after pass 3 ``thresh`` is the
    k-th largest key and ``rem`` how many of its ties to take."""
    SHIFT: tl.constexpr = 24 - 8 * p
    bins = tl.arange(0, hist.shape[0])
    hist = tl.where(bins < 256, hist, 0)
    total = tl.sum(hist, 0)
    if p == 0:
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
    return prefix, rem, active, thresh


@triton.jit
def _start():
    """The decision state before pass 0: ``(prefix, rem, active, thresh)``."""
    return (tl.full([], 0, dtype=tl.int64), tl.full([], 0, dtype=tl.int32),
            tl.full([], 1, dtype=tl.int32), tl.full([], -1, dtype=tl.int64))


@triton.jit
def _compact(base, out, lo, hi, thresh, rem, n_sel, n_tie, K, BLOCK_: tl.constexpr):
    """Write the positions in ``[lo, hi)`` with key ``> thresh``, and those ``== thresh`` while
    fewer than ``rem`` ties were taken, to slots ``n_sel, n_sel + 1, ...`` (never at or past
    ``K``); ``n_tie`` counts the ties before ``lo``. Returns the updated ``(n_sel, n_tie)``."""
    offs = tl.arange(0, BLOCK_)
    for start in range(lo, hi, BLOCK_):
        idx = start + offs
        s = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        key = _keys(s)
        valid = (idx < hi) & (s != float("-inf"))
        eq = (valid & (key == thresh)).to(tl.int32)
        tie_rank = n_tie + tl.cumsum(eq, 0) - eq
        sel = ((valid & (key > thresh)) | ((eq > 0) & (tie_rank < rem))).to(tl.int32)
        slot = n_sel + tl.cumsum(sel, 0) - sel
        # (slot < K: never past the row, whatever the scores; the passes make n_sel <= kk)
        tl.store(out + slot, idx.to(out.dtype.element_ty), mask=(sel > 0) & (slot < K))
        n_sel += tl.sum(sel, 0)
        n_tie += tl.sum(eq, 0)
    return n_sel, n_tie


@triton.jit
def _pad(out, n_sel, K, BLOCK_: tl.constexpr):
    """``-1`` in slots ``[n_sel, K)``."""
    offs = tl.arange(0, BLOCK_)
    for start in range(0, K, BLOCK_):
        j = start + offs
        tl.store(out + j, tl.full((BLOCK_,), -1, dtype=out.dtype.element_ty),
                 mask=(j < K) & (j >= n_sel))


@triton.jit
def _row_length(LEN, stride_l, row, N, HAS_LEN: tl.constexpr):
    """The row's length clamped to ``[0, N]`` (N without lengths)."""
    L = N
    if HAS_LEN:
        L = tl.maximum(tl.minimum(tl.load(LEN + row * stride_l).to(tl.int32), N), 0)
    return L


def _topk_rows(S, stride_s, LEN, stride_l, OUT, stride_o, N, kk, K,
          HAS_LEN: tl.constexpr, MASKED_HIST: tl.constexpr, BLOCK_: tl.constexpr):
    """One program per row: the four passes on its own registers, then the compaction."""
    row = tl.program_id(0).to(tl.int64)
    base = S + row * stride_s
    out = OUT + row * stride_o
    L = _row_length(LEN, stride_l, row, N, HAS_LEN)
    prefix, rem, active, thresh = _start()
    for p in tl.static_range(4):
        if active > 0:  # (pass 0 always runs)
            hist = _hist(base, 0, L, prefix, 24 - 8 * p, MASKED_HIST, BLOCK_)
            prefix, rem, active, thresh = _step(hist, p, prefix, rem, active, thresh, kk)
    zero = tl.full([], 0, dtype=tl.int32)
    n_sel, n_tie = _compact(base, out, 0, L, thresh, rem, zero, zero, K, BLOCK_)
    _pad(out, n_sel, K, BLOCK_)


def _masked_hist() -> bool:
    """Whether this triton's ``tl.histogram`` takes ``mask`` (else excluded keys go to extra
    bins of a 512-bin histogram)."""
    return "mask" in inspect.signature(tl.histogram).parameters


_kernel = triton.jit(_topk_rows)  # interpreted (on CPU tensors) when TRITON_INTERPRET=1 at import


@triton.jit
def _advance(HIST, STATE, row, B, kk, P: tl.constexpr):
    """A split row's decision state ``(prefix, rem, active, thresh)`` after passes ``0 .. P-1``:
    the state after ``P-2`` (``STATE [4, B, 4]`` int64, stored by the launch before; the start
    for P == 1) advanced by :func:`_step` on pass ``P-1``'s summed histogram (``HIST [4, B, 256]``;
    not read once the cut is found), and stored for the launch after by the row's chunk 0."""
    prefix, rem, active, thresh = _start()
    if P > 0:
        if P > 1:
            st = STATE + ((P - 2) * B + row) * 4
            prefix, rem = tl.load(st), tl.load(st + 1).to(tl.int32)
            active, thresh = tl.load(st + 2).to(tl.int32), tl.load(st + 3)
        if active > 0:
            hist = tl.load(HIST + ((P - 1) * B + row) * 256 + tl.arange(0, 256))
            prefix, rem, active, thresh = _step(hist, P - 1, prefix, rem, active, thresh, kk)
        if tl.program_id(1) == 0:
            st = STATE + ((P - 1) * B + row) * 4
            tl.store(st, prefix)
            tl.store(st + 1, rem.to(tl.int64))
            tl.store(st + 2, active.to(tl.int64))
            tl.store(st + 3, thresh)
    return prefix, rem, active, thresh


@triton.jit
def _chunk(S, stride_s, LEN, stride_l, N, C, HAS_LEN: tl.constexpr):
    """This program's row, the row's base pointer, and its chunk's ``[lo, hi)`` (empty when the
    chunk lies past the row's length)."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * C
    hi = tl.minimum(lo + C, _row_length(LEN, stride_l, row, N, HAS_LEN))
    return row, S + row * stride_s, lo, hi


@triton.jit
def _topk_hist(S, stride_s, LEN, stride_l, HIST, STATE, B, N, C, kk, P: tl.constexpr,
               HAS_LEN: tl.constexpr, MASKED_HIST: tl.constexpr, BLOCK_: tl.constexpr):
    """Pass P of a split row: the chunk's histogram added into ``HIST[P, row]``, unless the passes
    before already found the cut."""
    row, base, lo, hi = _chunk(S, stride_s, LEN, stride_l, N, C, HAS_LEN)
    prefix, rem, active, thresh = _advance(HIST, STATE, row, B, kk, P)
    if active > 0:
        hist = _hist(base, lo, hi, prefix, 24 - 8 * P, MASKED_HIST, BLOCK_)
        bins = tl.arange(0, hist.shape[0])
        tl.atomic_add(HIST + (P * B + row) * 256 + bins, hist, mask=(bins < 256) & (hist > 0),
                      sem="relaxed")


@triton.jit
def _topk_count(S, stride_s, LEN, stride_l, HIST, STATE, CNT, B, N, C, kk,
                HAS_LEN: tl.constexpr, BLOCK_: tl.constexpr):
    """``CNT[row, chunk] = (keys > cut, keys == cut)`` among the chunk's valid keys."""
    row, base, lo, hi = _chunk(S, stride_s, LEN, stride_l, N, C, HAS_LEN)
    prefix, rem, active, thresh = _advance(HIST, STATE, row, B, kk, 4)
    offs = tl.arange(0, BLOCK_)
    gt = tl.zeros((BLOCK_,), dtype=tl.int32)
    eq = tl.zeros((BLOCK_,), dtype=tl.int32)
    for start in range(lo, hi, BLOCK_):
        idx = start + offs
        s = tl.load(base + idx, mask=idx < hi, other=float("-inf"))
        key = _keys(s)
        valid = (idx < hi) & (s != float("-inf"))
        gt += (valid & (key > thresh)).to(tl.int32)
        eq += (valid & (key == thresh)).to(tl.int32)
    cnt = CNT + (row * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(cnt, tl.sum(gt, 0))
    tl.store(cnt + 1, tl.sum(eq, 0))


@triton.jit
def _topk_write(S, stride_s, LEN, stride_l, STATE, CNT, OUT, stride_o, B, N, C, K,
                HAS_LEN: tl.constexpr, SP: tl.constexpr, BLOCK_: tl.constexpr):
    """The chunk's selected positions from slot ``gt_before + min(eq_before, rem)`` (keys above
    the cut in earlier chunks, plus the ties taken there), its ties ranked from ``eq_before``;
    chunk 0 also writes the ``-1`` tail. ``SP``: the chunk count padded to a power of two."""
    row, base, lo, hi = _chunk(S, stride_s, LEN, stride_l, N, C, HAS_LEN)
    st = STATE + (3 * B + row) * 4  # (the state after pass 3, stored by the count launch)
    rem, thresh = tl.load(st + 1).to(tl.int32), tl.load(st + 3)
    chunk = tl.program_id(1)
    j = tl.arange(0, SP)
    cnt = CNT + row * tl.num_programs(1) * 2 + j * 2
    gt = tl.load(cnt, mask=j < tl.num_programs(1), other=0)
    eq = tl.load(cnt + 1, mask=j < tl.num_programs(1), other=0)
    gt_before = tl.sum(tl.where(j < chunk, gt, 0), 0)
    eq_before = tl.sum(tl.where(j < chunk, eq, 0), 0)
    out = OUT + row * stride_o
    _compact(base, out, lo, hi, thresh, rem, gt_before + tl.minimum(eq_before, rem), eq_before,
             K, BLOCK_)
    if chunk == 0:
        _pad(out, tl.sum(gt, 0) + tl.minimum(tl.sum(eq, 0), rem), K, BLOCK_)


def _split_launch(scores: Tensor, lens: tuple, out: Tensor, kk: int, K: int, chunk: int,
                  has_len: bool, masked: bool) -> None:
    """The split-row launches (see the module docstring), grid ``(B, cdiv(N, chunk))``, meeting
    in one workspace zeroed by one fill (no host sync): ``HIST [4, B, 256]`` int32, ``CNT
    [B, S, 2]`` int32, ``STATE [4, B, 4]`` int64."""
    B, N = scores.shape
    S = triton.cdiv(N, chunk)
    n_hist, n_cnt = 4 * B * 256, B * S * 2  # both even: STATE starts 8-byte aligned
    ws = torch.zeros(n_hist + n_cnt + 4 * B * 4 * 2, dtype=torch.int32, device=scores.device)
    hist, cnt = ws[:n_hist], ws[n_hist:n_hist + n_cnt]
    state = ws[n_hist + n_cnt:].view(torch.int64)
    rows = (scores, scores.stride(0), *lens)
    for p in range(4):
        _topk_hist[(B, S)](*rows, hist, state, B, N, chunk, kk, P=p, HAS_LEN=has_len,
                           MASKED_HIST=masked, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    _topk_count[(B, S)](*rows, hist, state, cnt, B, N, chunk, kk, HAS_LEN=has_len,
                        BLOCK_=BLOCK, num_warps=NUM_WARPS)
    _topk_write[(B, S)](*rows, state, cnt, out, out.stride(0), B, N, chunk, K,
                        HAS_LEN=has_len, SP=triton.next_power_of_2(S), BLOCK_=BLOCK,
                        num_warps=NUM_WARPS)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # (the H200's; the interpreter on CPU)


def auto_splits(B: int, N: int, device: torch.device) -> int:
    """Chunks per row when ``splits=None``:
    ``min(cdiv(N, MIN_CHUNK), MAX_SPLITS, max(1, cdiv(4 * SMs, B)))``.
    One program per row leaves most of the GPU idle at small batch (batch 1 at 128K keys: one SM
    of the H200's 132 scanning the row 5 times); splitting until the batch has ~4 programs per
    SM (8 warps each: half an SM's warp slots) fills it, and no chunk below ``MIN_CHUNK`` keys
    keeps each program's fixed cost (the decision it advances; the split shape's six launches
    cost ~the same whatever the grid) small beside its scan. From batch ``4 * SMs`` up, or at
    most ``MIN_CHUNK`` keys, this is 1: one launch, no workspace. On an H200 (132 SMs): batch 1
    and 8 -> ``N / 1024`` chunks up to 64 (32 at 32K, 64 at 64K and 128K), batch 64 -> 9. The
    sweep behind these constants (``benchmarks/bench_topk_splits.py``, BENCHMARKS.md; H200, from
    CUDA graphs): at 32K batch 1 / 8, 32 splits took 16.1 / 19.5 us against 20.8 / 21.6 us for
    16 (MIN_CHUNK 2048); at 128K batch 1, 64 splits 21.2 us; more than 64 were never timed."""
    target = PROGRAMS_PER_SM * _sm_count(device)
    return max(1, min(triton.cdiv(N, MIN_CHUNK), MAX_SPLITS, triton.cdiv(target, max(B, 1))))


def chunk_size(N: int, splits: int) -> int:
    """Keys per chunk for ``splits`` chunks of an N-key row: ``cdiv(N, splits)`` rounded up to a
    multiple of ``BLOCK`` (16 when below one ``BLOCK``: aligned loads), so the chunks actually
    used, ``cdiv(N, chunk_size)``, can be fewer than ``splits``."""
    c = triton.cdiv(max(N, 1), splits)
    step = BLOCK if c >= BLOCK else 16
    return triton.cdiv(c, step) * step


def select_positions(scores: Tensor, k: int, *, lengths: 'Tensor | None' = None,
                     out: 'Tensor | None' = None, masked_hist: 'bool | None' = None,
                     splits: 'int | None' = None) -> Tensor:
    """See the module docstring. ``scores [B, N]`` fp32 (rows may be strided, keys contiguous),
    ``lengths [B]`` int32/int64 (any stride) or None, ``out [B, k]`` int32/int64 (written in
    place) or None (a new int64 tensor). CUDA tensors, or any device under Triton's interpreter
    (``TRITON_INTERPRET=1`` before triton is first imported). ``splits``: chunks per row, an int
    >= 1 (an upper bound: see :func:`chunk_size`; 1 = one program per row) or None
    (:func:`auto_splits`). ``masked_hist``: force one histogram variant (tests); default: this
    triton's."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be [B, N] fp32 with contiguous rows, got "
                         f"{tuple(scores.shape)} {scores.dtype} stride {scores.stride()}")
    B, N = scores.shape
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if N >= 1 << 31:
        raise ValueError(f"select_positions: {N} keys exceed int32 positions")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or splits < 1):
        raise ValueError(f"splits must be an int >= 1 or None, got {splits!r}")
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
    lens = (lengths, lengths.stride(0)) if has_len else (scores, 0)
    chunk = chunk_size(N, auto_splits(B, N, scores.device) if splits is None else splits)
    if triton.cdiv(N, chunk) <= 1:
        _kernel[(B,)](scores, scores.stride(0), *lens, out, out.stride(0), N, min(k, N), k,
                      HAS_LEN=has_len, MASKED_HIST=masked, BLOCK_=BLOCK, num_warps=NUM_WARPS)
        return out
    _split_launch(scores, lens, out, min(k, N), k, chunk, has_len, masked)
    return out
