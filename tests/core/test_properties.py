"""Hypothesis state machines: random interleavings of admit, schedule, per-rank out-of-order
reports, finish, free, restore, landing failures, bad input and pool pressure; every invariant and
the reference worker's content checks run after every step.

Budget: 10^4 generated sequences per run in total (3000 + 4000 + 3000, see the settings below);
long sequences are covered by ``test_long_random_runs`` here and by benchmarks/soak_coordinator.py."""

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from hisparse_ray.core import CoordinatorConfig, DeviceBlockPool, HostBlockPool
from hisparse_ray.errors import DoubleFreeError, StateError
from hisparse_ray.testing.random_driver import RandomDriver
from hisparse_ray.testing.reference_worker import ReferenceWorker

FAST = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


class CoordinatorMachine(RuleBasedStateMachine):
    driver: RandomDriver | None = None

    @initialize(dev=st.integers(2, 10), host=st.integers(2, 16), ps=st.integers(1, 4),
                H=st.integers(1, 6), tp=st.integers(1, 3), max_batch=st.integers(1, 4),
                seed=st.integers(0, 2**16), index=st.none() | st.integers(1, 12))
    def setup(self, dev, host, ps, H, tp, max_batch, seed, index):
        hot = -(-(H + 1) // ps)
        cfg = CoordinatorConfig(num_device_blocks=max(dev, hot), num_host_blocks=host,
                                page_size=ps, device_buffer_size=H, tp_size=tp,
                                max_batch=max_batch, page_bytes=64, row_bytes=8,
                                index_pages=index, index_page_tokens=4)  # a capped key pool
        self.driver = RandomDriver(cfg, seed)

    @rule(prefix=st.integers(0, 2), extra=st.integers(0, 6), max_new=st.integers(1, 6),
          chain=st.booleans())
    def admit(self, prefix, extra, max_new, chain):
        self.driver.op_admit(prefix, extra, max_new, chain)

    @rule(pick=st.integers(0, 7), fail=st.booleans())
    def landed(self, pick, fail):
        self.driver.op_landed(pick, fail=fail and pick == 0)

    @rule()
    def take(self):
        self.driver.op_take()

    @rule(rank=st.integers(0, 2), flush=st.booleans())
    def report(self, rank, flush):
        self.driver.op_report(rank, flush)

    @rule(rank=st.integers(0, 2))
    def report_again(self, rank):
        self.driver.op_report(rank)

    @rule(pick=st.integers(0, 7))
    def finish(self, pick):
        self.driver.op_finish(pick)

    @rule(pick=st.integers(0, 7))
    def free(self, pick):
        self.driver.op_free(pick)

    @rule(pick=st.integers(0, 7))
    def restore(self, pick):
        self.driver.op_restore(pick)

    @rule(kind=st.integers(0, 5))
    def bad_input(self, kind):
        self.driver.op_bad(kind)

    @invariant()
    def holds(self):
        if self.driver is not None:
            assert self.driver.check() == []

    def teardown(self):
        """Liveness after any interleaving: with no more arrivals every open request finishes
        on its own (no admission deadlocks, whatever the pools' pressure)."""
        if self.driver is not None:
            assert self.driver.settle() == []


def test_coordinator_state_machine():
    """Every invariant and the reference worker's checks after every step (its rule for host
    reads at TP > 1 included: a chained row reads the previous step's backups through the step
    ring). Whether the random runs reach chained host-tier rows at TP > 1 depends on the draw;
    ``test_long_random_runs`` asserts that its seeded runs do."""
    run_state_machine_as_test(CoordinatorMachine,
                              settings=settings(max_examples=3000, stateful_step_count=10, **FAST))


class HostPoolMachine(RuleBasedStateMachine):
    """Model: refs per owned block, pins per block, published keys."""

    def __init__(self):
        super().__init__()
        self.pool = HostBlockPool(6)
        self.refs: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.keys = 0

    @rule(n=st.integers(1, 3))
    def allocate(self, n):
        avail = self.pool.available()
        got = self.pool.allocate(n)
        assert (got is None) == (n > avail)
        for b in got or ():
            assert self.refs.get(b, 0) == 0 and self.pins.get(b, 0) == 0
            self.refs[b] = 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(i=st.integers(0, 5))
    def release(self, i):
        owned = sorted(b for b, r in self.refs.items() if r)
        b = owned[i % len(owned)]
        self.pool.release(b)
        self.refs[b] -= 1

    @rule(b=st.integers(0, 5))
    def release_unowned(self, b):
        if self.refs.get(b, 0) == 0:
            try:
                self.pool.release(b)
            except DoubleFreeError:
                return
            raise AssertionError("released an unowned host block")

    @precondition(lambda self: any(self.refs.values()))
    @rule(i=st.integers(0, 5), unpin=st.booleans())
    def pin(self, i, unpin):
        owned = sorted(b for b, r in self.refs.items() if r)
        b = owned[i % len(owned)]
        if unpin and self.pins.get(b):
            self.pool.unpin(b)
            self.pins[b] -= 1
        else:
            self.pool.pin(b)
            self.pins[b] = self.pins.get(b, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(i=st.integers(0, 5))
    def unpin_any(self, i):
        pinned = sorted(b for b, p in self.pins.items() if p)
        b = pinned[i % len(pinned)]
        self.pool.unpin(b)
        self.pins[b] -= 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(i=st.integers(0, 5), shared=st.booleans())
    def publish_or_acquire(self, i, shared):
        owned = sorted(b for b, r in self.refs.items() if r)
        b = owned[i % len(owned)]
        if shared and self.pool.is_published(b):
            self.pool.acquire(b)
            self.refs[b] += 1
        else:
            self.keys += 1
            self.pool.publish(b, self.keys.to_bytes(4, "little"))

    @rule(b=st.integers(0, 5))
    def acquire_cached(self, b):
        if self.pool.is_cached(b):
            self.pool.acquire(b)
            self.refs[b] = 1
        elif not self.pool.is_published(b):
            try:
                self.pool.acquire(b)
            except StateError:
                return
            raise AssertionError("acquired an unpublished host block")

    @invariant()
    def holds(self):
        self.pool.check_invariants()
        used = sum(1 for b in range(6) if self.refs.get(b, 0) or self.pins.get(b, 0))
        assert self.pool.num_used == used
        for b in range(6):
            assert self.pool.refs(b) == self.refs.get(b, 0) and self.pool.pins(b) == self.pins.get(b, 0)


def test_host_pool_state_machine():
    run_state_machine_as_test(HostPoolMachine,
                              settings=settings(max_examples=4000, stateful_step_count=6, **FAST))


class DevicePoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = DeviceBlockPool(5)
        self.leased: dict[int, str] = {}
        self.pinned: dict[int, int] = {}

    @rule(n=st.integers(1, 3), owner=st.sampled_from("abc"))
    def lease(self, n, owner):
        free = 5 - len(self.leased)
        got = self.pool.lease(n, owner)
        assert (got is None) == (n > free)
        for b in got or ():
            assert b not in self.leased
            self.leased[b] = owner

    @rule(b=st.integers(0, 4))
    def release(self, b):
        if b not in self.leased:
            try:
                self.pool.release(b)
            except DoubleFreeError:
                return
            raise AssertionError("double free accepted")
        if self.pinned.get(b):
            try:
                self.pool.release(b)
            except StateError:
                return
            raise AssertionError("released a pinned device block")
        self.pool.release(b)
        del self.leased[b]

    @rule(b=st.integers(0, 4), unpin=st.booleans())
    def pin(self, b, unpin):
        if b not in self.leased:
            return
        if unpin and self.pinned.get(b):
            self.pool.unpin(b)
            self.pinned[b] -= 1
        else:
            self.pool.pin(b)
            self.pinned[b] = self.pinned.get(b, 0) + 1

    @invariant()
    def holds(self):
        self.pool.check_invariants()
        assert self.pool.num_used == len(self.leased)
        assert all(self.pool.owner(b) == o for b, o in self.leased.items())


def test_device_pool_state_machine():
    run_state_machine_as_test(DevicePoolMachine,
                              settings=settings(max_examples=3000, stateful_step_count=6, **FAST))


def test_long_random_runs():
    """Deep states (repeated spills, restores, evictions, chained host-tier rows at TP > 1) that
    short sequences rarely reach."""
    totals = {"spills": 0, "restores": 0, "evictions": 0, "prefix_hit_pages": 0,
              "chained_rows": 0, "dropped_rows": 0, "tp_chained_host_rows": 0}
    for seed in range(6):
        cfg = CoordinatorConfig(num_device_blocks=6 + seed % 3, num_host_blocks=9 + seed,
                                page_size=2 + seed % 2, device_buffer_size=2 + seed % 3,
                                tp_size=1 + seed % 3, max_batch=3)
        d = RandomDriver(cfg, seed)
        for _ in range(1500):
            d.random_op()
            assert d.check() == []
        for name in totals:
            if name != "tp_chained_host_rows":
                totals[name] += getattr(d.coord.counters, name)
        if cfg.tp_size > 1:  # host-tier rows chained past a step whose backups a peer reads
            totals["tp_chained_host_rows"] += d.worker.chained_host_rows
        if seed % 2:
            assert d.settle() == []  # every open request finishes on its own
        d.drain()
        assert d.check() == []
        c = d.coord.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.waiting, c.running) == (0, 0, 0, 0)
        assert c.host_blocks_cached == len(d.coord.host.index)  # only published pages remain
    assert all(v > 0 for v in totals.values()), totals


def test_random_runs_chain_rows_and_drop_them_after_eos():
    """The driver takes commands ahead of reports at random and about half its requests chain,
    so the property tests reach chained rows. Without aborts, every dropped row is the chained
    row of a step that sampled eos; the reference worker checks every chained input."""
    cfg = CoordinatorConfig(num_device_blocks=16, num_host_blocks=24, page_size=2,
                            device_buffer_size=2, tp_size=2, max_batch=4)
    d = RandomDriver(cfg, seed=0)
    rng = random.Random(0)
    for _ in range(3000):  # random_op without finish (abort), restore and bad input
        r, g = rng.random(), rng.randrange(1 << 30)
        if r < 0.12:
            d.op_admit(g, g % 5, 1 + g % 6, chain=bool(g >> 7 & 1))
        elif r < 0.25:
            d.op_landed(g)
        elif r < 0.55:
            d.op_take()
        elif r < 0.95:
            d.op_report(g, flush=g % 9 == 0)
        else:
            d.op_free(g)
        assert d.check() == []
    assert d.settle() == []
    c = d.coord.counters
    assert c.chained_rows > 50 and c.dropped_rows > 0, c
    assert d.worker.chained_host_rows > 10, d.worker.chained_host_rows  # TP 2, backups in flight


def test_random_runs_catch_a_peer_that_skips_the_step_wait(monkeypatch):
    """The random runs' host-read check is not vacuous: with the peers' wait for rank 0's
    previous writing step turned off (``ReferenceWorker.peer_waits_by_step``), the TP 2 runs
    above read host rows rank 0 wrote in a step the peers never waited for."""
    monkeypatch.setattr(ReferenceWorker, "peer_waits_by_step", False)
    cfg = CoordinatorConfig(num_device_blocks=16, num_host_blocks=24, page_size=2,
                            device_buffer_size=2, tp_size=2, max_batch=4)
    d = RandomDriver(cfg, seed=0)
    caught: list[str] = []
    for _ in range(3000):
        d.random_op()
        caught += [v for v in d.check() if "read with the peers waited only for step" in v]
        if caught:
            break
    assert caught


def test_long_random_runs_without_a_host_tier():
    """The full-resident baseline under a device budget (``host_tier=False``): requests lease
    their whole life at admission, wait while it does not fit, are never spilled; every invariant
    holds after every operation and everything drains."""
    admitted = 0
    for seed in range(4):
        cfg = CoordinatorConfig(num_device_blocks=8 + seed, num_host_blocks=9, page_size=2 + seed % 2,
                                device_buffer_size=2, tp_size=1 + seed % 2, max_batch=3,
                                host_tier=False)
        d = RandomDriver(cfg, seed)
        for _ in range(1000):
            d.random_op()
            assert d.check() == []
            for rid in d.coord.request_ids():
                v = d.coord.view(rid)
                assert v.tier.value == "resident", (rid, v.tier)
        c = d.coord.counters
        assert c.spills == 0 and c.conversions_to_host == 0 and c.backups == 0
        admitted += c.admitted
        d.drain()
        assert d.check() == []
        assert (d.coord.counters.device_blocks_used, d.coord.counters.host_blocks_used) == (0, 0)
    assert admitted > 20
