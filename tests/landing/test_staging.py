"""Landing orders -> NIXL segments, chunking, and the bounded FIFO staging pool (no Ray): literal
cases, a thread hammer, and hypothesis properties."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hisparse_ray.errors import StateError
from hisparse_ray.landing.plan import chunks, page_positions
from hisparse_ray.landing.segments import write_segments
from hisparse_ray.landing.staging import StagingPool
from hisparse_ray.transfer import MemKind, RegionDesc
from hisparse_ray.types import LandingDest


def _regions(n_layers: int, nbytes: int) -> tuple[RegionDesc, ...]:
    return tuple(RegionDesc("peer", f"host.{l}", 1000 * (l + 1), nbytes, 0, MemKind.HOST)
                 for l in range(n_layers))


def test_page_positions_clip_to_the_prompt():
    assert page_positions(0, 8, 20) == (0, 8)
    assert page_positions(2, 8, 20) == (16, 4)
    assert page_positions(3, 8, 20) == (24, 0)


def test_write_segments_map_pages_to_blocks_per_layer():
    row, page, T, stride = 4, 8, 20, 100 * 4
    dest = LandingDest(0, _regions(2, 64 * 8 * row), ((0, 5), (2, 1), (3, 7)), b"n")
    segs = write_segments(dest, "send", stride, row, page, T)
    got = [(s.remote.name, s.local_offset, s.nbytes, s.remote_offset) for s in segs]
    # page 3 holds no landed position (it is the first decode step's page): skipped
    assert got == [
        ("host.0", 0, 32, 5 * 8 * row), ("host.0", 16 * row, 16, 1 * 8 * row),
        ("host.1", stride, 32, 5 * 8 * row), ("host.1", stride + 16 * row, 16, 1 * 8 * row),
    ]


def test_chunks():
    assert chunks([1, 2, 3, 4, 5], 2) == [(1, 2), (3, 4), (5,)]
    assert chunks([], 3) == []
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_staging_refuses_more_than_capacity_and_unleased_release():
    pool = StagingPool(4)
    with pytest.raises(StateError):
        pool.acquire(5)
    got = pool.acquire(3)
    assert sorted(got) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(StateError):
        pool.release([3])
    pool.release(got)
    pool.check_invariants()
    everything = pool.acquire(4)
    with pytest.raises(TimeoutError):
        pool.acquire(1, timeout=0.01)
    pool.release(everything)
    pool.check_invariants()


def test_staging_is_fifo_a_big_request_is_not_starved():
    pool = StagingPool(4)
    held = pool.acquire(3)
    order: list[str] = []
    big = threading.Thread(target=lambda: (pool.acquire(4), order.append("big")))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=lambda: (pool.acquire(1), order.append("small")))
    small.start()
    time.sleep(0.05)
    assert order == []  # one block is free, but the small request queues behind the big one
    pool.release(held)
    big.join(2)
    assert order == ["big"]
    pool.release([0, 1, 2, 3])
    small.join(2)
    assert order == ["big", "small"]


# --- properties -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.data(), L=st.integers(1, 3), page=st.integers(1, 5), T=st.integers(0, 40),
       row=st.integers(1, 6))
def test_segments_land_exactly_the_prompt_rows_into_their_blocks(data, L, page, T, row):
    """Applying the segments to byte arrays puts row p of layer l at block(page(p)) * page +
    p % page of that layer's region, for every p < T, and writes nothing else."""
    num_pages = -(-(T + 1) // page)
    blocks = data.draw(st.permutations(range(num_pages + 3)))[:num_pages]
    pages = tuple(data.draw(st.sets(st.integers(0, num_pages - 1))))
    dest = LandingDest(0, _regions(L, (num_pages + 3) * page * row), tuple(
        (p, blocks[p]) for p in pages), b"")
    max_t = T + 5
    src = np.arange(L * max_t * row, dtype=np.int64).reshape(L, max_t, row)  # unique values
    dst = {r.name: np.full(r.nbytes, -1, dtype=np.int64) for r in dest.layers}
    for s in write_segments(dest, "send", max_t * row, row, page, T):
        flat = src.reshape(-1)
        dst[s.remote.name][s.remote_offset:s.remote_offset + s.nbytes] = \
            flat[s.local_offset:s.local_offset + s.nbytes]
    for l, region in enumerate(dest.layers):
        want = np.full(region.nbytes, -1, dtype=np.int64)
        for p in pages:
            lo, n = page_positions(p, page, T)
            for i in range(n):
                at = (blocks[p] * page + i) * row
                want[at:at + row] = src[l, lo + i]
        assert (dst[region.name] == want).all()


class StagingMachine(RuleBasedStateMachine):
    """Single-threaded model of the staging pool: acquire what is free (never blocking), release
    what is held; the pool's free count and invariants always match the model."""

    def __init__(self):
        super().__init__()
        self.pool = StagingPool(5)
        self.held: list[tuple[int, ...]] = []

    @rule(n=st.integers(1, 5))
    def acquire(self, n):
        free = 5 - sum(map(len, self.held))
        if n <= free:
            got = self.pool.acquire(n, timeout=0)
            assert len(got) == n and not set(got) & {b for h in self.held for b in h}
            self.held.append(got)
        else:
            with pytest.raises(TimeoutError):
                self.pool.acquire(n, timeout=0)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def release(self, i):
        self.pool.release(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held)
    @rule()
    def double_release_is_refused(self):
        blocks = self.held[0]
        self.pool.release(blocks)
        with pytest.raises(StateError):
            self.pool.release(blocks)
        self.held.pop(0)

    @invariant()
    def counts_match(self):
        assert self.pool.num_free == 5 - sum(map(len, self.held))
        self.pool.check_invariants()


TestStagingMachine = StagingMachine.TestCase
TestStagingMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
