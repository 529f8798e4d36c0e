"""DenseKVCache / IndexerKeyCache contracts, and decode == prefill through the cache interface."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import CapacityError, StateError
from hisparse_ray.model import AttentionKVCache, DenseKVCache, IndexerKeyCache, build_tiny_model
from hisparse_ray.model.plan import PrefillPlan


def test_dense_cache_is_an_attention_kv_cache():
    assert isinstance(DenseKVCache(2, 4, 1, 8), AttentionKVCache)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_dense_cache_matches_a_list_model(data):
    """Random prompts and append steps over 3 slots: gather returns exactly the rows written."""
    L, R, S, cap = 2, 3, 3, 12
    cache = DenseKVCache(L, R, S, cap)
    truth: list[list[torch.Tensor]] = [[] for _ in range(S)]  # per slot: [L, R] rows by position
    counter = iter(range(10_000))

    def fresh(n: int) -> torch.Tensor:
        return torch.tensor([float(next(counter)) for _ in range(n * L * R)]).view(L, n, R)

    for s in range(S):
        n = data.draw(st.integers(1, 6))
        rows = fresh(n)
        cache.load(s, rows)
        truth[s] = [rows[:, i] for i in range(n)]
    for _ in range(data.draw(st.integers(1, 5))):
        slots = data.draw(st.lists(st.integers(0, S - 1), min_size=1, max_size=S, unique=True))
        if any(len(truth[s]) >= cap for s in slots):
            break
        pos = torch.tensor([len(truth[s]) for s in slots])
        cache.begin_step(torch.tensor(slots), pos)
        new = fresh(len(slots))  # [L, B, R]
        for layer in range(L):
            cache.write_newest(layer, new[layer])
        for b, s in enumerate(slots):
            truth[s].append(new[:, b])
        K = 4
        topk = torch.stack([
            torch.tensor(data.draw(st.lists(st.integers(-1, int(p)), min_size=K, max_size=K))) for p in pos
        ])
        for layer in range(L):
            got = cache.gather(layer, topk)
            for b, s in enumerate(slots):
                for k, p in enumerate(topk[b].tolist()):
                    if p >= 0:
                        assert torch.equal(got[b, k], truth[s][p][layer])


def test_dense_cache_refuses_gaps_and_overflow():
    cache = DenseKVCache(1, 2, 2, 4)
    cache.load(0, torch.zeros(1, 3, 2))
    with pytest.raises(StateError):
        cache.begin_step(torch.tensor([0]), torch.tensor([5]))
    cache.begin_step(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(CapacityError):
        cache.begin_step(torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(CapacityError):
        cache.load(1, torch.zeros(1, 5, 2))


def test_indexer_cache_appends_in_order():
    c = IndexerKeyCache.from_prefill(torch.ones(2, 3, 4), capacity=4)
    with pytest.raises(StateError):
        c.write(0, 4, torch.zeros(4))
    c.write(0, 3, torch.full((4,), 2.0))
    c.advance()
    assert c.length == 4 and c.view(0, 4)[3].tolist() == [2.0] * 4
    with pytest.raises(CapacityError):
        c.write(0, 4, torch.zeros(4))


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_decode_continues_prefill_exactly(kind):
    """Prefill T-3 tokens, decode 3 (batched with another request): logits equal prefill of all T."""
    model = build_tiny_model(seed=6, kind=kind)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in (30, 21)]
    full = [model.prefill(s, all_logits=True)[0] for s in seqs]
    cache = DenseKVCache(model.cfg.num_hidden_layers, model.cfg.row_dim, 2, 40)
    icaches = []
    for b, s in enumerate(seqs):
        _, rows, keys = model.prefill(s[:-3])
        cache.load(b, rows)
        icaches.append(IndexerKeyCache.from_prefill(keys, 40))
    for j in (3, 2, 1):
        pos = torch.tensor([len(s) - j for s in seqs])
        cache.begin_step(torch.arange(2), pos)
        logits = model.decode(torch.stack([s[-j] for s in seqs]), pos, cache, icaches)
        for b in range(2):
            torch.testing.assert_close(logits[b], full[b][-j], atol=1e-5, rtol=0)


def test_prefill_query_chunking_changes_nothing():
    """Chunks of 5 and more queries and rows (not dividing 37), and of 1: bitwise equal on the
    batch-invariant path, within fp32 rounding on the batched one (matmul blocking rounds differently)."""
    model = build_tiny_model(seed=6, kind="glm_moe_dsa")
    T = 37
    toks = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(2))
    five = 5 * max(PrefillPlan.item_bytes(model.cfg, model.cfg.num_attention_heads, T, 4))
    plan = PrefillPlan.of(model.cfg, model.cfg.num_attention_heads, T, five, 4)
    assert all(5 <= c < T and T % c for c in (plan.rows, plan.index_queries, plan.attn_queries)), plan
    for exact in (True, False):
        model.prefill_chunk_bytes = 1 << 30
        whole = model.prefill(toks, all_logits=True, batch_invariant=exact)
        for budget in (five, 1):
            model.prefill_chunk_bytes = budget
            chunked = model.prefill(toks, all_logits=True, batch_invariant=exact)
            for a, b in zip(whole, chunked):
                if exact:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
