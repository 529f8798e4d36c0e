"""The sampler: greedy is argmax, top-k / top-p cut the distribution as documented, a seed gives
the same tokens every time, a row's draw does not depend on its batch mates, the draws follow
the distribution, the counter-based hash never overflows int64 (so CPU and CUDA compute the same
uniforms), bad parameters are refused naming the key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import ConfigError
from hisparse_ray.rank.sampler import (
    Sampler, _hash32, kept, probabilities, sample, sample_rows, uniforms,
)
from hisparse_ray.types import SamplingParams


def _logits(seed: int, v: int = 50) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_ignores_top_k_and_top_p():
    x = _logits(0)
    assert Sampler()(x) == int(x.argmax())
    assert Sampler(SamplingParams(top_k=3, top_p=0.1, seed=9))(x) == int(x.argmax())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), temp=st.floats(0.05, 4.0), top_k=st.integers(0, 60),
       top_p=st.floats(0.01, 1.0))
def test_the_distribution_keeps_what_top_k_and_top_p_allow(seed, temp, top_k, top_p):
    x = _logits(seed)
    p = probabilities(x, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
    assert torch.isclose(p.sum(), torch.tensor(1.0), atol=1e-5)
    kept = set(torch.nonzero(p).flatten().tolist())
    assert int(x.argmax()) in kept  # the most likely token always stays
    if 0 < top_k < x.numel():
        assert kept <= set(torch.topk(x, top_k).indices.tolist())
    full = torch.softmax(x / temp, dim=-1)
    if top_k == 0 or top_k >= x.numel():
        # nucleus: the kept tokens are the most likely ones, and dropping the least likely kept
        # token would leave less than top_p
        ranked = sorted(kept, key=lambda t: -full[t])
        assert all(full[t] >= full[u] for t in kept for u in set(range(x.numel())) - kept)
        assert float(full[ranked[:-1]].sum()) < top_p + 1e-6


def test_seeded_sampling_repeats_and_seeds_differ():
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=1234)
    rows = [_logits(s) for s in range(40)]
    a = [Sampler(params)(r) for r in [rows[0]]]  # fresh samplers, one draw
    assert a == [Sampler(params)(rows[0])]
    one, two = Sampler(params), Sampler(params)
    seq1 = [one(r) for r in rows]
    assert seq1 == [two(r) for r in rows]
    other = Sampler(SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=1235))
    assert seq1 != [other(r) for r in rows]
    assert len(set(seq1)) > 5, "temperature 1 over 40 rows picked almost one token"


def test_top_k_1_is_greedy_at_any_temperature():
    for s in range(10):
        x = _logits(s)
        assert Sampler(SamplingParams(temperature=3.0, top_k=1, seed=s))(x) == int(x.argmax())


@pytest.mark.parametrize("kw, key", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "0.7"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"),
    ({"seed": True}, "seed"),
])
def test_bad_parameters_are_refused_naming_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        SamplingParams(**kw)


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
    """``sample_rows`` over a batch equals each row alone (the executors batch; the oracle runs
    requests alone), greedy and sampled rows mixed."""
    rows = torch.stack([_logits(s, 97) for s in range(12)])
    params = [None if i % 3 == 0 else SamplingParams(temperature=0.3 + 0.2 * i, top_k=i * 5,
                                                     top_p=1.0 - 0.05 * i, seed=100 + i)
              for i in range(12)]
    counters = [7 * i + 3 for i in range(12)]
    batch = sample_rows(rows, params, counters).tolist()
    alone = [int(sample_rows(rows[i:i + 1], [params[i]], [counters[i]])[0]) for i in range(12)]
    assert batch == alone
    assert [batch[i] for i in range(0, 12, 3)] == [int(rows[i].argmax()) for i in range(0, 12, 3)]
    assert Sampler(params[1])(rows[1], counters[1]) == batch[1]
    into = torch.full((12,), -5, dtype=torch.int64)  # the fast step's tokens: greedy rows' argmax
    assert sample_rows(rows, params, counters, into=into) is into
    assert into.tolist() == [-5 if p is None else t for p, t in zip(params, batch)]


def test_the_draws_follow_the_distribution():
    """Over 20000 counters one row's draws match ``probabilities`` (top-k and top-p applied):
    every frequency within 0.012 of its probability (a fixed seed: the same draws every run),
    and no token outside the kept set is ever drawn."""
    x = torch.tensor([2.0, 1.5, 1.5, 0.3, 0.0, -1.0, -3.0, 1.0])
    for params in (SamplingParams(temperature=1.0, seed=3),
                   SamplingParams(temperature=0.7, top_k=4, seed=4),
                   SamplingParams(temperature=1.3, top_p=0.8, seed=5)):
        p = probabilities(x, params)
        n = 20000
        toks = sample(x.expand(n, -1), torch.full((n,), params.temperature),
                      torch.full((n,), params.top_k), torch.full((n,), params.top_p),
                      torch.full((n,), params.seed), torch.arange(n))
        freq = torch.bincount(toks, minlength=x.numel()).float() / n
        assert (freq - p).abs().max() < 0.012, (params, freq, p)
        assert (freq[p == 0] == 0).all()


def test_the_hash_stays_in_32_bits_for_any_seed_and_counter():
    """The mix multiplies in 16-bit halves: never an int64 overflow (whose wrap-around would be
    undefined, and could differ between devices); the uniforms lie in (0, 1)."""
    x = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789], dtype=torch.int64)
    h = _hash32(x)
    assert ((h >= 0) & (h < 2**32)).all() and len(set(h.tolist())) == 5
    for seed in (0, 1, 2**63 - 1, 2**40 + 7):
        u = uniforms(torch.tensor([seed, seed]), torch.tensor([0, 2**31 - 1]), 1000)
        assert ((u > 0) & (u < 1)).all()
        assert not torch.equal(u[0], u[1])  # the counter matters
        assert abs(float(u.mean()) - 0.5) < 0.03


def test_top_k_keeps_ties_with_the_kth_score():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.5]])
    keep = kept(x, torch.tensor([2]), torch.tensor([1.0]))[0].tolist()
    assert keep == [True, False, True, True, False]  # both 2.0s: the cut is by value


@pytest.mark.gpu
def test_cuda_draws_equal_the_cpus():
    """The uniforms are integer-derived: bit-identical on CUDA; the tokens too where no two
    scores are within float rounding of each other (random logits: none)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, v = 64, 4096
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(n, v, generator=g)
    args = (torch.full((n,), 0.9), torch.full((n,), 50), torch.full((n,), 0.95),
            torch.arange(n) * 977, torch.arange(n) + 11)
    assert torch.equal(uniforms(args[3], args[4], v), uniforms(args[3].cuda(), args[4].cuda(), v).cpu())
    cpu = sample(logits, *args)
    gpu = sample(logits.cuda(), *(a.cuda() for a in args)).cpu()
    assert (cpu == gpu).float().mean() > 0.98
