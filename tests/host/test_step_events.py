"""Which IPC event a peer's stream waits on (CPU: the pool's event ring replaced by an ``EventLog``
stand-in that keeps which publish recorded each slot last). Rank 0 records one event per step,
in slot ``N % event_ring``, and none for publishes without a step (landings: their bytes are in
host memory when they publish); a peer's wait for step N uses step N's slot. Before, slots were
chosen by generation: after rank 0 published step N, landings, then step N + 1, a peer's wait for
step N's generation used a slot a later publish had re-recorded; on a GPU, re-recorded by step
N + 1 it is a deadlock at TP > 1 (that event is behind rank 0's step N + 1 all-reduce, which
needs the peer's own step N + 1 forward, queued after the wait)."""

from __future__ import annotations

import os

import pytest

from hisparse_ray.errors import HostPoolError
from hisparse_ray.host.pool import HostPool
from hisparse_ray.host.segment import MAX_EVENT_RING, MIN_EVENT_RING
from hisparse_ray.host.sync import event_slot
from tests.host import _hammer
from tests.host._step_hammer import LANDING, EventLog

PREFIX = f"hs-test-events-{os.getpid()}"


class _Pair:
    """Rank 0's pool and a peer's, attached in this process, each with an ``EventLog`` ring of
    ``size`` slots on one shared label list."""

    def __init__(self, size: int = 8) -> None:
        self.pool = HostPool.create("e", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX)
        self.peer = HostPool.attach(self.pool.name, register_cuda=False)
        labels = [0] * size
        self.pool._ring = self.events = EventLog(labels, owner=True)
        self.peer._ring = self.waits = EventLog(labels, owner=False)

    def step(self, n: int) -> int:
        self.events.label = n
        return self.pool.publish(step=n)

    def landings(self, k: int) -> None:
        self.events.label = LANDING
        for _ in range(k):
            self.pool.publish()

    def close(self) -> None:
        self.peer.close()
        self.pool.destroy()


@pytest.fixture
def pair():
    p = _Pair()
    yield p
    p.close()


def test_the_event_slot_is_the_steps():
    assert [event_slot(n, 8) for n in (0, 1, 7, 8, 13)] == [0, 1, 7, 0, 5]
    with HostPool.create("s", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        assert pool.event_slot(3) is None  # a pool without events (CPU)
        pool._ring = EventLog([0] * 4, owner=True)
        assert pool.event_slot(3) == 3 and pool.event_slot(6) == 2


@pytest.mark.parametrize("landings", [7, 8, 9, 20])
def test_a_wait_for_step_n_uses_step_ns_slot_after_landings_and_the_next_step(pair, landings):
    """The defect's schedule: rank 0 publishes step N, then ``landings`` publishes without a step,
    then step N + 1; a peer reaching command N + 1 only now waits for step N: its stream waits on
    the slot step N recorded, which no later publish re-recorded. Failed before: the slot was
    generation g_N's, re-recorded by g_N + 8 (with 7 landings: step N + 1 itself, the deadlock;
    else a landing's)."""
    g = pair.step(5)
    pair.landings(landings)
    assert pair.step(6) == g + landings + 1
    assert pair.peer.wait_step(5, timeout_s=1) == g
    assert pair.waits.waits == [(5 % 8, 5)]
    assert pair.peer.wait_step(6, timeout_s=1) == g + landings + 1
    assert pair.waits.waits[-1] == (6 % 8, 6)


def test_publishes_without_a_step_record_no_event(pair):
    pair.landings(3 * 8 + 1)
    assert pair.events.records == 0 and pair.pool.published() == 25
    pair.step(1)
    pair.landings(9)
    pair.step(2)
    assert pair.events.records == 2 and pair.events.labels[:3] == [-2, 1, 2]  # -2: never recorded
    pair.peer.wait_published(36, timeout_s=1)  # the host side: the counter only
    assert pair.waits.waits == []


def test_a_stream_is_published_only_by_step(pair):
    with pytest.raises(HostPoolError, match="needs step="):
        pair.pool.publish(object())
    assert pair.pool.published() == 0 and pair.events.records == 0


def test_a_slot_re_recorded_before_the_peer_waited_is_an_error(pair):
    """Rank 0 ``event_ring`` steps past the step a peer waits for (the pipeline never lets it):
    the peer's wait may have caught the later record, and it says so instead of waiting on it."""
    pair.step(1)
    pair.step(9)  # slot 1 again
    with pytest.raises(HostPoolError, match="event slot 1 of step 1 may hold step 9's record"):
        pair.peer.wait_step(1, timeout_s=1)
    pair.step(10)
    assert pair.peer.wait_step(9, timeout_s=1) == 2  # 9 + 8 > 10: still its own record


@pytest.mark.parametrize("size", [1, 2, MIN_EVENT_RING - 1, MAX_EVENT_RING + 1])
def test_an_event_ring_too_small_to_index_by_step_is_refused(size):
    with pytest.raises(HostPoolError, match=f"event_ring {size} out of range: 0 .*or "
                                            f"{MIN_EVENT_RING}\\.\\.{MAX_EVENT_RING}"):
        HostPool.create("m", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX,
                        event_ring=size)
    for ok in (0, MIN_EVENT_RING, 8):
        HostPool.create("m", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX,
                        event_ring=ok).destroy()
