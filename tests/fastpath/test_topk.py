"""``select_topk_fast`` returns exactly ``select_topk``'s positions (the one top-k rule: higher
score first, equal scores by lower position, -0.0 == 0.0, -1 past the valid keys) on tie-heavy
inputs: scores from a handful of values (zeros of both signs, +-inf, repeated finite values),
rows shorter than k, all-masked rows, any leading shape; on CPU and (``gpu``) on CUDA, where a
128K-position batch with a wall of tied zeros at the k-th place is checked too."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.fastpath.topk import select_topk_fast
from hisparse_ray.model.indexer import select_topk

INF = float("inf")
VALUES = [-INF, -2.0, -1.0, -0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 3.0, INF]


def tie_heavy(shape, seed, device="cpu", continuous=0.0):
    """Scores drawn from ``VALUES`` (a fraction ``continuous`` replaced by normal values)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.tensor(VALUES)[torch.randint(0, len(VALUES), shape, generator=g)]
    if continuous:
        mix = torch.rand(shape, generator=g) < continuous
        v = torch.where(mix, torch.randn(shape, generator=g), v)
    return v.to(device)


def check(scores, k):
    want = select_topk(scores, k)
    got = select_topk_fast(scores, k)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (scores, got, want)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), k=st.integers(1, 64),
       seed=st.integers(0, 2**31 - 1), continuous=st.sampled_from([0.0, 0.3, 1.0]))
def test_same_as_select_topk_on_tie_heavy_rows(rows, n, k, seed, continuous):
    check(tie_heavy((rows, n), seed, continuous=continuous), k)


@pytest.mark.parametrize("n,k", [(5, 8), (8, 8), (9, 8), (1, 1), (200, 1)])
def test_edges(n, k):
    for seed in range(20):
        check(tie_heavy((3, n), seed), k)
    check(torch.full((2, n), -INF), k)  # every key masked: all -1
    check(torch.zeros(2, n), k)  # one big tie: the lowest positions in order
    check(-torch.zeros(2, n), k)  # -0.0 counts as 0.0
    check(torch.full((2, n), INF), k)


def test_any_leading_shape_and_a_masked_tail():
    check(tie_heavy((300,), 1), 16)
    check(tie_heavy((2, 3, 97), 2), 16)
    s = tie_heavy((4, 256), 3, continuous=0.5)
    s[:, 100:] = -INF  # a row's length, as the fast step masks it
    check(s, 128)


def test_the_decode_step_shape_relu_zeros():
    """What the indexer produces: head-weighted relu sums, zero for keys every head rejects."""
    g = torch.Generator().manual_seed(5)
    s = torch.relu(torch.randn(8, 2048, generator=g) - 1.5)  # ~7 % positive, the rest tied at 0
    lengths = torch.tensor([1, 7, 64, 65, 300, 1024, 2047, 2048])
    s = s.masked_fill(torch.arange(2048)[None] >= lengths[:, None], -INF)
    check(s, 256)


@pytest.mark.gpu
def test_same_as_select_topk_on_cuda():
    for seed in range(10):
        check(tie_heavy((4, 5000), seed, "cuda", continuous=0.3), 2048)
        check(tie_heavy((4, 3000), seed, "cuda"), 2048)
    # batch 8 at 128K positions: ~1 % positive scores, the rest a wall of 0.0 / -0.0 ties, rows
    # of different lengths (the k-th place falls inside the tie for every row)
    g = torch.Generator(device="cuda").manual_seed(0)
    N = 1 << 17
    s = torch.relu(torch.randn(8, N, generator=g, device="cuda") - 2.3)
    s = torch.where(torch.rand(8, N, generator=g, device="cuda") < 0.5, s, -s)  # -0.0 among them
    lengths = torch.tensor([1, 2048, 2049, 4096, 65536, 100000, N - 1, N], device="cuda")
    s = s.masked_fill(torch.arange(N, device="cuda")[None] >= lengths[:, None], -INF)
    check(s, 2048)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), k=st.integers(1, 64),
       seed=st.integers(0, 2**31 - 1), continuous=st.sampled_from([0.0, 0.3, 1.0]),
       with_lengths=st.booleans(), out_dtype=st.sampled_from([None, torch.int32, torch.int64]))
def test_positions_are_the_same_set_in_position_order(rows, n, k, seed, continuous, with_lengths,
                                                      out_dtype):
    """``select_topk_positions`` (the fast step's call): ``select_topk``'s set of the row masked
    at its length, ascending, ``-1`` last; into ``out`` when given."""
    from hisparse_ray.fastpath.topk import in_position_order, select_topk_positions

    s = tie_heavy((rows, n), seed, continuous=continuous)
    lengths = torch.randint(0, n + 2, (rows,), generator=torch.Generator().manual_seed(seed)) \
        if with_lengths else None
    masked = s if lengths is None else s.masked_fill(torch.arange(n)[None] >= lengths[:, None], -INF)
    want = select_topk(masked, k)
    out = None if out_dtype is None else torch.full((rows, k), 7, dtype=out_dtype)
    got = select_topk_positions(s, k, lengths=lengths, out=out)
    assert out is None or got is out
    assert torch.equal(got.long(), in_position_order(want))
    for r in range(rows):  # the same set as select_topk, ascending, -1 only at the end
        sel = got[r][got[r] >= 0].tolist()
        assert sel == sorted(want[r][want[r] >= 0].tolist())
        assert (got[r][len(sel):] == -1).all()
