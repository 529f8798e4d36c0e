"""The host pool's step ring (``HostPool.publish(step=N)`` / ``wait_step(N)``): how a peer finds the
generation of rank 0's step-N writes by step number, before the coordinator has the report that
carries it (a command chained past step N), and which IPC event slot it waits on (step N's, never
one a landing's or a later step's publish re-recorded). Real shared memory, real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from hisparse_ray.errors import HostPoolError
from hisparse_ray.host.pool import HostPool, list_segments
from hisparse_ray.host.segment import STEP_SLOTS
from hisparse_ray.host.segment import MIN_EVENT_RING
from tests.host import _hammer, _step_hammer

PREFIX = f"hs-test-steps-{os.getpid()}"


def _run(seed: int, steps: int, honest: tuple[bool, ...]) -> list[dict]:
    """Rank 0 (this process) runs the plan; one spawned peer per ``honest`` flag follows it (rank
    0 paces itself on the slowest honest peer). The pool's event ring is an ``EventLog`` of
    ``MIN_EVENT_RING`` slots in shared memory (rank 0 publishes bursts of landings longer than
    that between steps)."""
    ctx = mp.get_context("spawn")
    with HostPool.create("s", _hammer.LAYOUT, _hammer.NUM_BLOCKS, register_cuda=False,
                         prefix=PREFIX) as pool:
        labels = ctx.Array("q", MIN_EVENT_RING)
        pool._ring = events = _step_hammer.EventLog(labels, owner=True)
        queue, ready = ctx.Queue(), [ctx.Event() for _ in honest]
        done = [ctx.Value("q", 0) for _ in honest]
        procs = [ctx.Process(target=_step_hammer.peer_process,
                             args=(pool.name, seed, steps, d, ev, queue, h, labels))
                 for d, ev, h in zip(done, ready, honest)]
        for p in procs:
            p.start()
        for ev in ready:  # start only once every peer is attached
            assert ev.wait(timeout=60)

        class Slowest:  # the pipeline's bound: rank 0 waits for the honest peers only
            @property
            def value(self) -> int:
                return min(d.value for d, h in zip(done, honest) if h)

        _step_hammer.run_rank0(pool, seed, steps, Slowest(), events=events)
        results = [queue.get(timeout=120) for _ in procs]
        results.append({"records": events.records})
        for p in procs:
            p.join(timeout=30)
    assert list_segments(PREFIX) == []
    return results


@pytest.mark.parametrize("seed", [3, 11])
def test_a_peer_waiting_by_step_number_never_reads_before_rank_0s_writes(seed):
    """Two honest peers wait for each step rank 0 wrote in by number, in random schedules (random
    pauses on both sides, rank 0 up to two steps ahead, bursts of 9-12 landing publishes between
    steps): every row of that step and the ones before is whole and current, the generation
    found is the step's, and every event wait caught that step's record in its slot (a ring of
    4). A peer that skips the wait reads stale rows: the check bites. Failed before events were
    indexed by step: ``wrong_event`` > 0 (the slot of the step's generation re-recorded by the
    landings after it, or by the next step)."""
    steps = 300
    *results, records = _run(seed, steps, honest=(True, True, False))
    honest = [r for r in results if r.get("honest", True)]
    (cheat,) = [r for r in results if not r.get("honest", True)]
    for r in honest:
        assert "error" not in r, r
        assert r["waits"] > 100 and r["rows"] > 300 and r["event_waits"] == r["waits"], r
        assert r["torn"] == 0 and r["stale"] == 0 and r["wrong_gen"] == 0, r
        assert r["wrong_event"] == 0, r
    assert "error" not in cheat and cheat["stale"] + cheat["torn"] > 0, cheat
    plan = _step_hammer.plan(seed, steps)  # one event record per step with writes, none else
    assert records["records"] == sum(1 for p in plan[1:] if p["rows"]), records


def test_wait_step_of_a_step_never_published_times_out_naming_it():
    with HostPool.create("t", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        peer = HostPool.attach(pool.name, register_cuda=False)
        try:
            pool.publish(step=4)
            pool.publish()  # a generation no step names
            with pytest.raises(HostPoolError, match="host writes of step 5"):
                peer.wait_step(5, timeout_s=0.05)
            assert peer.wait_step(4, timeout_s=0.05) == 1
        finally:
            peer.close()


def test_the_ring_names_each_steps_generation_and_refuses_an_overrun():
    with HostPool.create("o", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        peer = HostPool.attach(pool.name, register_cuda=False)
        try:
            assert peer.step_generation(1) is None
            gens = {n: pool.publish(step=n) for n in range(1, STEP_SLOTS + 1)}
            assert all(peer.step_generation(n) == g for n, g in gens.items())
            assert peer.step_generation(STEP_SLOTS + 1) is None
            pool.publish(step=STEP_SLOTS + 1)  # slot of step 1 reused
            with pytest.raises(HostPoolError, match="overrun.*step 1 holds step 33"):
                peer.wait_step(1, timeout_s=0.05)
        finally:
            peer.close()


def test_a_waiting_thread_proceeds_once_the_step_is_published():
    """In one process too (threads): the wait returns the step's generation only after the
    owner's publish of that step, not an earlier one."""
    with HostPool.create("w", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        got: list = []
        t = threading.Thread(target=lambda: got.append(pool.wait_step(2, timeout_s=30)))
        t.start()
        pool.publish(step=1)
        t.join(0.05)
        assert t.is_alive() and got == []
        pool.publish()
        pool.publish(step=2)
        t.join(30)
        assert got == [3]
