"""Allocation order of the block pools (issue #7): blocks leased in one call are strictly ascending,
the first contiguous free run when one exists, else the lowest free blocks; literal cases, model
based hypothesis machines for both pools, and the coordinator's wire (admissions, spills, restores)
under random interleavings."""

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from hisparse_ray.core import CoordinatorConfig, DeviceBlockPool, HostBlockPool
from hisparse_ray.core.free_blocks import FreeBlocks
from hisparse_ray.core.request import TransferOp
from hisparse_ray.testing.random_driver import RandomDriver
from hisparse_ray.testing.reference_worker import ReferenceWorker
from hisparse_ray.types import NO_BLOCK, LandingTarget

FAST = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def ascending(blocks) -> bool:
    return all(a < b for a, b in zip(blocks, blocks[1:]))


def expected_choice(free: set[int], n: int) -> list[int]:
    """The allocator's contract: first run of ``n`` consecutive free ids, else the ``n`` lowest."""
    for s in sorted(free):
        if all(s + i in free for i in range(n)):
            return list(range(s, s + n))
    return sorted(free)[:n]


# -- literal values ------------------------------------------------------------------------------
def test_host_lease_4_4_free_first_lease_2_gives_0_1():
    pool = HostBlockPool(8)
    first, second = pool.allocate(4), pool.allocate(4)
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6, 7])
    for b in first:
        pool.release(b)
    assert pool.allocate(2) == [0, 1]  # a LIFO free list gave [3, 2]
    pool.check_invariants()


def test_device_lease_4_4_free_first_lease_2_gives_0_1():
    pool = DeviceBlockPool(8)
    first, second = pool.lease(4, "a"), pool.lease(4, "b")
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6, 7])
    for b in first:
        pool.release(b)
    assert pool.lease(2, "c") == [0, 1]
    pool.check_invariants()


def test_first_contiguous_run_beats_the_lowest_scattered_blocks():
    pool = HostBlockPool(8)
    singles = [pool.allocate(1)[0] for _ in range(8)]
    assert singles == list(range(8))
    for b in (0, 2, 3, 4, 6):
        pool.release(b)
    assert pool.allocate(3) == [2, 3, 4]  # not [0, 2, 3]
    assert pool.allocate(2) == [0, 6]  # no run of 2 left: the lowest two
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.check_invariants()


def test_eviction_takes_exactly_the_shortfall_in_lru_order_and_returns_ascending():
    pool = HostBlockPool(6)
    blocks = pool.allocate(6)
    for b in (5, 1, 3):  # published, then released in this order: LRU = 5, 1, 3
        pool.publish(b, bytes([b]))
        pool.release(b)
    pool.release(4)  # private: free
    got = pool.allocate(3)  # 1 free (4) + evict 5 then 1
    assert got == [1, 4, 5] and pool.evictions == 2
    assert pool.is_cached(3) and pool.index.lookup(bytes([3])) == 3
    assert pool.index.lookup(bytes([5])) is None and pool.index.lookup(bytes([1])) is None
    assert blocks == list(range(6))
    pool.check_invariants()


def test_device_pool_with_pins_stays_correct_and_ascending():
    pool = DeviceBlockPool(6)
    a = pool.lease(3, "a")
    b = pool.lease(3, "b")
    pool.pin(a[1])
    for x in (a[0], a[2]):
        pool.release(x)
    assert pool.lease(2, "c") == [0, 2]  # block 1 is leased (and pinned): skipped
    pool.unpin(a[1])
    pool.release(a[1])
    for x in b:
        pool.release(x)
    assert pool.lease(4, "d") == [1, 3, 4, 5]
    pool.check_invariants()


def test_free_blocks_large_pool_fragmented_then_coalesced():
    fb = FreeBlocks(100_000)
    assert fb.take(100_000) == list(range(100_000))
    for b in range(0, 100_000, 2):
        fb.add(b)
    assert fb.take(2) == [0, 2]  # no run of 2 anywhere: lowest, and the failed search is remembered
    fb.check_invariants()
    fb.add(99_999)
    assert fb.take(2) == [99_998, 99_999]
    fb.add(3)
    assert fb.take(3) == [3, 4, 6]
    fb.check_invariants()
    assert len(fb) == 50_000 - 5 and list(fb)[:2] == [8, 10]


# -- hypothesis: both pools against a model ------------------------------------------------------
class HostOrderMachine(RuleBasedStateMachine):
    """Model: leases (one per allocate call), refs, pins and LRU order of cached blocks."""

    N = 24

    def __init__(self):
        super().__init__()
        self.pool = HostBlockPool(self.N)
        self.leases: list[list[int]] = []
        self.refs: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.lru: list[int] = []  # cached (published, unreferenced, unpinned), oldest first
        self.keys = 0

    def model_free(self) -> set[int]:
        return {b for b in range(self.N)
                if not self.refs.get(b) and not self.pins.get(b) and b not in self.lru}

    def _settle(self, b: int) -> None:
        if not self.refs.get(b) and not self.pins.get(b) and self.pool.is_published(b):
            self.lru.append(b)

    @rule(n=st.integers(1, 8))
    def allocate(self, n):
        free = self.model_free()
        got = self.pool.allocate(n)
        if n > len(free) + len(self.lru):
            assert got is None
            return
        if n <= len(free):
            assert got == expected_choice(free, n)
        else:
            victims, self.lru = self.lru[:n - len(free)], self.lru[n - len(free):]
            assert got == sorted(free | set(victims))
        for b in got:
            self.refs[b] = 1
        self.leases.append(got)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 20))
    def release_lease(self, i):
        lease = self.leases.pop(i % len(self.leases))
        for b in lease:
            self.pool.release(b)
            self.refs[b] -= 1
            self._settle(b)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 20), j=st.integers(0, 7))
    def publish(self, i, j):
        lease = self.leases[i % len(self.leases)]
        b = lease[j % len(lease)]
        if not self.pool.is_published(b):
            self.keys += 1
            assert self.pool.publish(b, self.keys.to_bytes(4, "little"))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 20), j=st.integers(0, 7))
    def pin_and_release(self, i, j):
        """A transfer pins a block, its lease ends, the ack unpins it later (see unpin_one)."""
        lease = self.leases.pop(i % len(self.leases))
        b = lease[j % len(lease)]
        self.pool.pin(b)
        self.pins[b] = self.pins.get(b, 0) + 1
        for x in lease:
            self.pool.release(x)
            self.refs[x] -= 1
            self._settle(x)

    @precondition(lambda self: any(self.pins.values()))
    @rule(i=st.integers(0, 20))
    def unpin_one(self, i):
        pinned = sorted(b for b, p in self.pins.items() if p)
        b = pinned[i % len(pinned)]
        self.pool.unpin(b)
        self.pins[b] -= 1
        self._settle(b)

    @precondition(lambda self: self.lru)
    @rule(i=st.integers(0, 20))
    def reuse_cached(self, i):
        b = self.lru.pop(i % len(self.lru))
        self.pool.acquire(b)
        self.refs[b] = 1
        self.leases.append([b])

    @invariant()
    def holds(self):
        self.pool.check_invariants()
        for lease in self.leases:
            assert ascending(lease), lease
        free = self.model_free()
        used = {b for b in range(self.N) if self.refs.get(b) or self.pins.get(b)}
        assert len(free) + len(used) + len(self.lru) == self.N  # a partition
        assert (self.pool.num_free, self.pool.num_cached, self.pool.num_used) == (
            len(free), len(self.lru), len(used))
        assert all(self.pool.is_cached(b) for b in self.lru)


def test_host_pool_allocation_order_machine():
    run_state_machine_as_test(HostOrderMachine,
                              settings=settings(max_examples=300, stateful_step_count=25, **FAST))


class DeviceOrderMachine(RuleBasedStateMachine):
    N = 20

    def __init__(self):
        super().__init__()
        self.pool = DeviceBlockPool(self.N)
        self.leases: list[list[int]] = []
        self.pinned: dict[int, int] = {}

    @rule(n=st.integers(1, 7))
    def lease(self, n):
        free = set(range(self.N)) - {b for lease in self.leases for b in lease}
        got = self.pool.lease(n, "r")
        assert got == (expected_choice(free, n) if n <= len(free) else None)
        if got is not None:
            self.leases.append(got)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 20), j=st.integers(0, 7))
    def pin(self, i, j):
        lease = self.leases[i % len(self.leases)]
        b = lease[j % len(lease)]
        self.pool.pin(b)
        self.pinned[b] = self.pinned.get(b, 0) + 1

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 20))
    def release(self, i):
        lease = self.leases[i % len(self.leases)]
        for b in lease:  # a pinned block waits for its ack: unpin first, like the coordinator
            while self.pinned.get(b):
                self.pool.unpin(b)
                self.pinned[b] -= 1
            self.pool.release(b)
        self.leases.remove(lease)

    @invariant()
    def holds(self):
        self.pool.check_invariants()
        for lease in self.leases:
            assert ascending(lease), lease
        assert self.pool.num_used + self.pool.num_free == self.N
        assert self.pool.num_used == sum(map(len, self.leases))


def test_device_pool_allocation_order_machine():
    run_state_machine_as_test(DeviceOrderMachine,
                              settings=settings(max_examples=200, stateful_step_count=25, **FAST))


# -- the coordinator's wire ----------------------------------------------------------------------
class OrderCheckingWorker(ReferenceWorker):
    """The reference worker, plus: blocks the coordinator leased in one call reach the wire in
    ascending page order (admission host pages and hot buffer, resident landing pages, every
    request's spill destinations and restore targets within a step command)."""

    def __init__(self, config, rng, vocab, coord):
        super().__init__(config, rng, vocab)
        self.coord = coord
        self.order_violations: list[str] = []
        self.seen = {"admit_host": 0, "admit_resident": 0, "spill": 0, "restore": 0}

    def land(self, adm):
        fresh = [p.host_block for p in adm.pages if not p.reused and p.host_block != NO_BLOCK]
        dev = [p.device_block for p in adm.pages]
        if adm.target is LandingTarget.HOST:
            checks = [("host pages", fresh), ("hot buffer", list(adm.hot_blocks))]
            self.seen["admit_host"] += len(fresh) > 1
        else:
            checks = [("resident pages", dev)]
            self.seen["admit_resident"] += len(dev) > 1
        for what, blocks in checks:
            if not ascending(blocks):
                self.order_violations.append(f"{adm.request_id} {what} {blocks}")
        super().land(adm)

    def execute(self, cmd):
        groups: dict[tuple[str, TransferOp], list[tuple[int, int]]] = {}
        for t in cmd.transfers if cmd is not None else ():
            p = self.coord.book.pending[t.transfer_id]
            block = p.host_block if p.kind is TransferOp.SPILL else p.device_block
            groups.setdefault((p.rid, p.kind), []).append((p.page, block))
        for (rid, kind), pages in groups.items():
            blocks = [b for _, b in sorted(pages)]
            self.seen[kind.name.lower()] += len(blocks) > 1
            if not ascending(blocks):
                self.order_violations.append(f"{rid} {kind.name} {blocks}")
        super().execute(cmd)


def order_driver(cfg: CoordinatorConfig, seed: int) -> tuple[RandomDriver, OrderCheckingWorker]:
    d = RandomDriver(cfg, seed)
    d.worker = OrderCheckingWorker(cfg, random.Random(seed + 1), 3, d.coord)
    return d, d.worker


def test_coordinator_leases_reach_the_wire_ascending():
    seen = {"admit_host": 0, "admit_resident": 0, "spill": 0, "restore": 0}
    for seed in range(6):
        cfg = CoordinatorConfig(num_device_blocks=10 + seed, num_host_blocks=16 + 2 * seed,
                                page_size=1 + seed % 3, device_buffer_size=2 + seed % 3,
                                tp_size=1 + seed % 2, max_batch=3)
        d, w = order_driver(cfg, seed)
        for _ in range(1500):
            d.random_op()
            assert d.check() == []
            assert w.order_violations == []
        for k, v in w.seen.items():
            seen[k] += v
    assert all(v > 0 for v in seen.values()), seen  # every kind of multi-block lease was seen
