"""Rank 0's sampler: greedy is argmax, top-k / top-p cut the distribution as documented, a seed
gives the same tokens every time, bad parameters are refused naming the key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import ConfigError
from hisparse_ray.rank.sampler import Sampler, probabilities
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
