"""Hypothesis property tests of the torch reference (CPU) plus the dispatch's signature contract:
over random consistent states, lru stays a permutation, slot_pos stays distinct, every selected
position's out row holds that position's bytes, and misses land in LRU order."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import kernels
from hisparse_ray.kernels import cuda, reference
from tests.kernels.builders import make_case, next_step


def test_backends_have_identical_signatures():
    for name in ("resolve", "replay", "backup"):
        ref, gpu = inspect.signature(getattr(reference, name)), inspect.signature(getattr(cuda, name))
        assert ref == gpu, name
        disp = inspect.signature(getattr(kernels, name))
        assert list(disp.parameters)[:-1] == list(ref.parameters), name
        assert list(disp.parameters)[-1] == "backend"


def test_auto_backend_on_cpu_is_reference():
    assert kernels.backend_for(torch.zeros(1, 1, dtype=torch.uint8)) is reference
    assert kernels.backend_for(torch.zeros(1, 1, dtype=torch.uint8), "torch") is reference


def test_unknown_or_unavailable_backend_raises():
    from hisparse_ray.errors import KernelPreconditionError

    with pytest.raises(KernelPreconditionError, match="backend"):
        kernels.backend_for(torch.zeros(1, 1, dtype=torch.uint8), "triton")
    if cuda.available():
        assert kernels.backend_for(torch.zeros(1, 1, dtype=torch.uint8), "cuda") is cuda
    else:
        with pytest.raises(KernelPreconditionError, match="cupy"):
            kernels.backend_for(torch.zeros(1, 1, dtype=torch.uint8), "cuda")


def check_invariants(case, before_pos, before_lru, out, plan):
    h = case.slot_pos.shape[1]
    for b, n in enumerate(case.seq_lens.tolist()):
        positions = case.top_k[b].tolist()
        if n == 0:
            assert out[b].eq(-1).all() and plan[b].eq(-1).all()
            continue
        s = int(case.state_idx[b])
        lru = case.lru[s].tolist()
        assert sorted(lru) == list(range(h))
        sp = [q for q in case.slot_pos[s].tolist() if q >= 0]
        assert len(sp) == len(set(sp))
        for j, p in enumerate(positions):
            r = int(out[b, j])
            if p < 0:
                assert r == -1
                continue
            assert torch.equal(case.device_kv[r], case.host_kv[case.host_row(b, p)]), (b, j, p)
        misses = [j for j in range(len(positions)) if plan[b, j, 0] >= 0]
        if n <= h:
            assert not misses and lru == before_lru[s].tolist()
            assert case.slot_pos[s, :n].tolist() == list(range(n))
            continue
        # hits keep their slot; misses take slots from the old LRU's oldest end (non-hits only)
        where = {q: i for i, q in enumerate(before_pos[s].tolist()) if q >= 0}
        rows = case.slot_rows[b].tolist()
        victims = [rows.index(int(plan[b, j, 1])) for j in misses]
        res = case.resident_table[b].tolist()
        pending = [p for p in positions if p >= 0 and res[p // case.page_size] < 0 and p != n - 1]
        hits = [where[p] for p in pending if p in where]
        evictable = [x for x in before_lru[s].tolist() if x not in set(hits)]
        assert victims == evictable[: len(victims)]
        assert lru[h - len(hits):] == hits and lru[h - len(hits) - len(victims): h - len(hits)] == victims


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    h=st.integers(1, 24),
    k_frac=st.floats(0.05, 1.0),
    page_size=st.sampled_from([1, 2, 4, 8]),
    batch=st.integers(1, 3),
    hit_frac=st.floats(0.0, 1.0),
    steps=st.integers(1, 3),
)
def test_resolve_invariants(seed, h, k_frac, page_size, batch, hit_frac, steps):
    rng = random.Random(seed)
    k = max(1, int(k_frac * h))
    lens = [rng.choice([0, rng.randrange(1, h + 1), rng.randrange(h + 1, 3 * h + k + 4)]) for _ in range(batch)]
    if not any(lens):
        lens[0] = h + k + 2
    case = make_case(rng, batch=batch, k=k, h=h, seq_lens=lens, page_size=page_size, row_bytes=3,
                     hit_frac=hit_frac, resident_frac=rng.choice([0.0, 0.2]), max_len=max(lens) + 8,
                     lens_dtype=rng.choice([torch.int32, torch.int64]))
    for _ in range(steps):
        before_pos, before_lru = case.slot_pos.clone(), case.lru.clone()
        out = torch.empty(case.top_k.shape, dtype=torch.int32)
        plan = torch.empty((*case.top_k.shape, 2), dtype=torch.int32)
        kernels.resolve(*case.args(out, plan), page_size=page_size, backend="torch")
        check_invariants(case, before_pos, before_lru, out, plan)
        next_step(rng, case)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), h=st.integers(2, 16), batch=st.integers(1, 3))
def test_replay_matches_resolve_on_a_skip_layer(seed, h, batch):
    rng = random.Random(seed)
    lens = [rng.randrange(h + 2, 4 * h + 4) for _ in range(batch)]
    case = make_case(rng, batch=batch, k=h // 2 + 1, h=h, seq_lens=lens, page_size=2, row_bytes=5,
                     max_len=max(lens) + 4)
    skip = case.clone_state()
    skip.host_kv = torch.randint(0, 256, case.host_kv.shape, dtype=torch.uint8)
    full = skip.clone_state()
    out = torch.empty(case.top_k.shape, dtype=torch.int32)
    plan = torch.empty((*case.top_k.shape, 2), dtype=torch.int32)
    kernels.resolve(*case.args(out, plan), page_size=2, backend="torch")
    kernels.replay(plan, skip.host_kv, skip.device_kv, backend="torch")
    out_full = torch.empty_like(out)
    kernels.resolve(*full.args(out_full), page_size=2, backend="torch")
    assert torch.equal(out, out_full)
    assert torch.equal(skip.device_kv, full.device_kv)
    assert torch.equal(case.slot_pos, full.slot_pos) and torch.equal(case.lru, full.lru)
