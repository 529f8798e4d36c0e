"""Few-descriptor landing (no Ray): page runs -> one WRITE segment per layer, the staged chunk's
staging -> host copies (memcpy runs and the gather/scatter path), and the staging pool's
contiguous first-fit runs (literal cases, a thread hammer, hypothesis properties)."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hisparse_ray.errors import StateError
from hisparse_ray.landing.plan import (
    chunks, group_notif, layer_group, page_positions, page_runs, unstage_runs,
)
from hisparse_ray.landing.segments import split_by_memory_kind, write_groups, write_segments
from hisparse_ray.landing.staging import StagingPool, lease_run
from hisparse_ray.rank.landing import copy_runs
from hisparse_ray.transfer import MemKind, RegionDesc, coalesce
from hisparse_ray.types import LandingDest


def _regions(n_layers: int, nbytes: int) -> tuple[RegionDesc, ...]:
    return tuple(RegionDesc("peer", f"stage.{l}", 1000 * (l + 1), nbytes, 0, MemKind.DEVICE)
                 for l in range(n_layers))


def test_consecutive_pages_into_a_block_run_are_one_segment_per_layer():
    row, page, T, stride, L = 4, 8, 8 * 60 + 3, 1000 * 4, 3
    dest = LandingDest(0, _regions(L, 64 * 8 * row), tuple((p, 2 + p) for p in range(61)), b"n")
    segs = write_segments(dest, "send", stride, row, page, T)
    assert [(s.remote.name, s.local_offset, s.nbytes, s.remote_offset) for s in segs] == [
        (f"stage.{l}", l * stride, T * row, 2 * page * row) for l in range(L)]
    assert coalesce(segs) == segs


def test_key_rows_are_one_segment_per_layer_after_the_kv_segments():
    row, page, T, stride, L, key_row, key_stride = 4, 8, 37, 4000, 3, 6, 600
    hosts = tuple(RegionDesc("peer", f"host.{l}", 10_000 * (l + 1), 4096, 0, MemKind.HOST)
                  for l in range(L))
    keys = _regions(L, 64 * key_row)  # device key staging rows, one region per layer
    # pages 2, 3 -> host blocks 7, 8; keys of positions 16..36 into key staging rows 40..60
    dest = LandingDest(0, hosts, ((2, 7), (3, 8)), b"n", keys, (16, 40, 21))
    segs = write_segments(dest, "send", stride, row, page, T, key_local="send.keys",
                          key_layer_stride=key_stride, key_row_bytes=key_row)
    assert [(s.local, s.remote.name, s.local_offset, s.nbytes, s.remote_offset) for s in segs] == (
        [("send", f"host.{l}", l * stride + 16 * row, 16 * row, 56 * row) for l in range(L)]
        + [("send.keys", f"stage.{l}", l * key_stride + 16 * key_row, 21 * key_row,
            40 * key_row) for l in range(L)])
    # a WRITE of keys only (pages reused): no KV regions needed
    only_keys = LandingDest(1, (), (), b"k", keys, (0, 0, 5))
    assert len(write_segments(only_keys, "send", stride, row, page, T, key_local="send.keys",
                              key_layer_stride=key_stride, key_row_bytes=key_row)) == L
    with pytest.raises(StateError):  # key rows without key regions
        write_segments(LandingDest(0, hosts, (), b"x", (), (0, 0, 5)), "send", stride, row,
                       page, T, key_local="send.keys", key_layer_stride=key_stride,
                       key_row_bytes=key_row)
    # NIXL moves one memory kind per side per WRITE: host rows and device keys are two groups
    groups = split_by_memory_kind(segs, lambda name: MemKind.DEVICE)
    assert [[s.remote.name for s in g] for g in groups] == [
        [f"host.{l}" for l in range(L)], [f"stage.{l}" for l in range(L)]]
    assert split_by_memory_kind(segs[L:], lambda name: MemKind.DEVICE) == [segs[L:]]


def test_layer_groups_split_kv_by_layer_and_keep_keys_with_the_last_group():
    row, page, T, stride, L, key_row, key_stride = 4, 8, 37, 4000, 4, 6, 600
    keys = tuple(RegionDesc("peer", f"keys.{l}", 90_000 * (l + 1), 4096, 0, MemKind.DEVICE)
                 for l in range(L))
    pages = ((2, 7), (3, 8))
    one = LandingDest(0, _regions(L, 64 * 8 * row), pages, b"n", keys, (16, 40, 21))
    kw = dict(key_local="send.keys", key_layer_stride=key_stride, key_row_bytes=key_row)
    three = LandingDest(0, one.layers, pages, b"n", keys, (16, 40, 21), layer_groups=3)
    groups = write_groups(three, "send", stride, row, page, T, **kw)
    assert [[s.remote.name for s in g] for g in groups] == [
        ["stage.0", "stage.1"], ["stage.2"], ["stage.3"] + [f"keys.{l}" for l in range(L)]]
    # the same segments as one WRITE, in the same order
    assert [s for g in groups for s in g] == write_segments(one, "send", stride, row, page, T, **kw)
    assert write_groups(one, "send", stride, row, page, T, **kw) == [
        write_segments(one, "send", stride, row, page, T, **kw)]
    assert [layer_group(l, 61, 4) for l in (0, 15, 16, 30, 31, 45, 46, 60)] == [
        0, 0, 1, 1, 2, 2, 3, 3]
    assert group_notif(b"land:a:0:1", 2, 3) == b"land:a:0:1#2"
    assert group_notif(b"land:a:0:1", 0, 1) == b"land:a:0:1"


def test_page_runs_break_on_gaps_and_after_a_partial_page():
    # pages 0,1 -> blocks 4,5 (one run); page 3 -> block 6 (page gap); page 4 -> 9 (block gap)
    assert page_runs(((0, 4), (1, 5), (3, 6), (4, 9)), 8, 40) == [
        (0, 32, 16), (24, 48, 8), (32, 72, 8)]
    assert page_runs(((0, 0), (1, 1)), 8, 5) == [(0, 0, 5)]  # page 1 holds no position
    assert page_runs((), 8, 5) == []


def test_unstage_runs_merge_consecutive_host_blocks():
    # staging run starts at block 3; host blocks 10, 11 | 20, 21: a page gap does not matter
    # (the staging side is dense), a host-block gap does; page 5 holds 2 positions
    runs = unstage_runs(3, [10, 11, 20, 21], [0, 1, 2, 5], 4, 4 * 5 + 2)
    assert runs == [(12, 40, 8), (20, 80, 6)]
    assert unstage_runs(0, [5, 4], [0, 1], 4, 8) == [(0, 20, 4), (4, 16, 4)]
    with pytest.raises(ValueError):
        unstage_runs(0, [1, 2], [0], 4, 8)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), L=st.integers(1, 3), page=st.integers(1, 6), T=st.integers(0, 60),
       row=st.integers(1, 5), first=st.integers(0, 4), memcpys=st.sampled_from([0, 4, 1000]))
def test_unstaging_a_chunk_puts_every_row_in_its_host_block(data, L, page, T, row, first,
                                                            memcpys):
    """Rows of page pages[i] sit in staging block first + i; after copy_runs(unstage_runs(..))
    host block host_blocks[i] holds them (clipped to T) and nothing else changed, on both the
    per-run memcpy and the gather/scatter path."""
    num_pages = -(-(T + 1) // page)
    pages = sorted(data.draw(st.sets(st.integers(0, num_pages - 1), max_size=num_pages)))
    pages = [p for p in pages if page_positions(p, page, T)[1] > 0]
    n_host = num_pages + 3
    host_blocks = data.draw(st.permutations(range(n_host)))[:len(pages)]
    stage_rows = (first + len(pages) + 1) * page
    staging = [torch.randint(0, 255, (stage_rows, row), dtype=torch.uint8) for _ in range(L)]
    host = [torch.full((n_host * page, row), 7, dtype=torch.uint8) for _ in range(L)]
    want = [h.clone() for h in host]
    for l in range(L):
        for i, (p, hb) in enumerate(zip(pages, host_blocks)):
            n = page_positions(p, page, T)[1]
            want[l][hb * page:hb * page + n] = staging[l][(first + i) * page:(first + i) * page + n]
    runs = unstage_runs(first, host_blocks, pages, page, T)
    copy_runs(staging, host, runs, max_memcpys=memcpys)
    for l in range(L):
        assert torch.equal(host[l], want[l])


# --- contiguous staging runs ----------------------------------------------------------------------


def test_acquire_run_is_contiguous_first_fit():
    pool = StagingPool(8)
    a, b, c = pool.acquire_run(3), pool.acquire_run(2), pool.acquire_run(3)
    assert (a, b, c) == ((0, 1, 2), (3, 4), (5, 6, 7))
    pool.release(a)
    pool.release(c)
    assert pool.acquire_run(3) == (0, 1, 2)  # lowest fitting start
    with pytest.raises(TimeoutError):
        pool.acquire_run(4, timeout=0.01)  # 3 blocks free (5, 6, 7) but no run of 4
    with pytest.raises(StateError):
        pool.acquire_run(9)
    pool.check_invariants()


def test_acquire_run_waits_for_a_run_then_serves_fifo():
    pool = StagingPool(4)
    held = [pool.acquire_run(1) for _ in range(4)]
    pool.release(held[0])
    pool.release(held[2])  # blocks 0 and 2 free: 2 blocks, no run of 2
    order: list[tuple] = []
    big = threading.Thread(target=lambda: order.append(("big", pool.acquire_run(2, timeout=5))))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=lambda: order.append(("small", pool.acquire(1, timeout=5))))
    small.start()
    time.sleep(0.05)
    assert order == []  # a block is free, but the small request queues behind the run
    pool.release(held[1])
    big.join(5)
    small.join(5)
    assert order == [("big", (0, 1)), ("small", (2,))]
    pool.release((0, 1))
    pool.release((2,))
    pool.release(held[3])
    assert pool.num_free == 4
    pool.check_invariants()


def test_run_hammer_random_threads_never_overlap_and_never_deadlock():
    """8 threads lease runs and single blocks (acquire_run / acquire, 1-7 blocks) at random and
    hold them for random times: no block is ever held twice (so never more than the capacity),
    no thread is left waiting, and the pool ends whole."""
    pool = StagingPool(7)
    lock = threading.Lock()
    owned: set[int] = set()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(50):
                n = rng.randint(1, 7)
                got = pool.acquire_run(n, timeout=20) if rng.random() < 0.7 else \
                    pool.acquire(n, timeout=20)
                with lock:
                    assert not owned & set(got), "a staging block leased twice"
                    owned.update(got)
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 1e-3)
                with lock:
                    owned.difference_update(got)
                pool.release(got)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert not owned and pool.num_free == 7
    pool.check_invariants()


class RunMachine(RuleBasedStateMachine):
    """Single-threaded model: acquire_run(n, timeout=0) succeeds iff the model's free set holds a
    run of n, and returns the lowest such run; releases in any order."""

    CAP = 6

    def __init__(self):
        super().__init__()
        self.pool = StagingPool(self.CAP)
        self.held: list[tuple[int, ...]] = []

    def _lowest_run(self, n: int):
        free = set(range(self.CAP)) - {b for h in self.held for b in h}
        for s in range(self.CAP - n + 1):
            if all(b in free for b in range(s, s + n)):
                return tuple(range(s, s + n))
        return None

    @rule(n=st.integers(1, CAP))
    def acquire_run(self, n):
        want = self._lowest_run(n)
        if want is None:
            with pytest.raises(TimeoutError):
                self.pool.acquire_run(n, timeout=0)
        else:
            assert self.pool.acquire_run(n, timeout=0) == want
            self.held.append(want)

    @rule(n=st.integers(1, CAP), spare=st.integers(0, CAP))
    def try_acquire_run(self, n, spare):
        """The lander's "auto" push-with-prefill lease: the lowest run, only if a run of
        ``spare`` blocks stays free after it; never blocks."""
        want = self._lowest_run(n)
        if want is not None and spare:
            self.held.append(want)  # what would be left
            if self._lowest_run(spare) is None:
                want = None
            self.held.pop()
        got = self.pool.try_acquire_run(n, spare)
        assert got == want
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def release(self, i):
        self.pool.release(self.held.pop(i % len(self.held)))

    @invariant()
    def counts_match(self):
        assert self.pool.num_free == self.CAP - sum(map(len, self.held))
        self.pool.check_invariants()


TestRunMachine = RunMachine.TestCase
TestRunMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("seed", range(4))
def test_pipelined_landers_sharing_a_small_pool_never_deadlock_or_double_lease(seed):
    """Random schedules of the lander's chunk loop (``chunks`` + ``lease_run`` + up to two
    chunks in flight, finished after a random delay) by several threads on one small pool:
    every landing completes, no block is held by two chunks at once, nothing is lost."""
    rng = random.Random(seed)
    capacity, landers, landings = rng.choice([2, 3, 4, 6]), rng.randint(2, 4), 12
    pool = StagingPool(capacity)
    held: set[int] = set()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def finish(item) -> None:
        blocks, delay = item
        time.sleep(delay)
        with lock:
            assert set(blocks) <= held
            held.difference_update(blocks)
        pool.release(blocks)

    def lander(index: int) -> None:
        local = random.Random(seed * 100 + index)
        try:
            for _ in range(landings):
                pages = list(range(local.randint(1, 3 * capacity)))
                size = capacity if len(pages) <= capacity else max(1, capacity // 2)
                inflight: collections.deque = collections.deque()
                if len(pages) <= capacity and local.random() < 0.5:
                    # push with prefill ("auto"): a one-chunk run held through a prefill, taken
                    # only while another landing of its size still fits; else the usual path
                    blocks = pool.try_acquire_run(len(pages), spare=len(pages))
                    if blocks is not None:
                        with lock:
                            assert not held & set(blocks), "a block leased to two chunks"
                            held.update(blocks)
                        finish((blocks, local.random() * 4e-3))
                        continue
                for part in chunks(pages, size):
                    blocks = lease_run(pool, len(part), inflight, finish)
                    assert list(blocks) == list(range(blocks[0], blocks[0] + len(part)))
                    with lock:
                        assert not held & set(blocks), "a block leased to two chunks"
                        held.update(blocks)
                    inflight.append((blocks, local.random() * 2e-3))
                    while len(inflight) >= 2:
                        finish(inflight.popleft())
                while inflight:
                    finish(inflight.popleft())
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=lander, args=(i,), daemon=True) for i in range(landers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "landers deadlocked on the staging pool"
    assert not errors, errors
    assert not held and pool.num_free == capacity
    pool.check_invariants()
