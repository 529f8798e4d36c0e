"""The rings between real processes: spawned processes (one-to-one, one-to-three broadcast, two
way) and two Ray actors hammer them with thousands of random-size messages at random paces; a
dying peer gives a typed error."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ShmRing
from hisparse_ray.errors import ChannelPeerLostError, ChannelTimeoutError
from tests.channel import _peers

CTX = mp.get_context("spawn")

P = PickleCodec()  # these tests send any object; the step codec carries step messages only


def _run_child(target, *args):
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def test_process_one_way_hammer_with_backpressure():
    """4000 messages of 0..1500 bytes through a 4 KiB ring: the ring fills again and again."""
    n, seed, max_len = 4000, 11, 1500
    with ShmRing.create("writer", 4096, codec=P) as tx:
        child = _run_child(_peers.sink, tx.spec, n, seed, max_len)
        _peers.source(tx, n, seed, max_len)
        child.join(30)
        assert child.exitcode == 0


def test_process_broadcast_hammer_with_the_slowest_reader_holding_the_writer():
    """3000 messages of 0..1500 bytes broadcast through a 4 KiB ring to three reader processes,
    each pausing at its own random pace: every reader gets every message in order, once."""
    n, seed, max_len = 3000, 13, 1500
    with ShmRing.create("writer", 4096, readers=3, codec=P) as tx:
        children = [_run_child(_peers.sink, tx.spec_for(r), n, seed, max_len) for r in range(3)]
        _peers.source(tx, n, seed, max_len)
        for child in children:
            child.join(60)
            assert child.exitcode == 0


def test_process_two_way_hammer():
    n, seed = 3000, 5
    with ChannelPair.create(64 * 1024, codec=P) as pair:
        child = _run_child(_peers.echo_loop, pair.spec, n, seed)
        assert _peers.drive(pair, n, seed, max_len=3000) == n
        child.join(30)
        assert child.exitcode == 0


def test_peer_death_is_a_typed_error_not_a_hang():
    with ChannelPair.create(4096, codec=P) as pair:
        ready = CTX.Event()
        child = _run_child(_peers.attach_and_hang, pair.spec, ready)
        assert ready.wait(30)
        os.kill(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((ChannelPeerLostError, ChannelTimeoutError)) as ei:
            pair.recv(timeout=5)
        assert time.monotonic() - t0 < 6
        child.join(5)
        # the pid check catches the (zombie or reaped) peer well before the deadline
        assert isinstance(ei.value, ChannelPeerLostError)


class _ChannelActor:
    """A Ray actor holding one end of a ChannelPair."""

    def __init__(self):
        self.pair = None

    def create(self, capacity):
        self.pair = ChannelPair.create(capacity, codec=P)
        return self.pair.spec

    # Generous per-message deadlines: on a loaded 2-core CI machine a Ray worker can be descheduled
    # for many seconds; the test is about order and loss, not latency.
    def drive(self, n, seed, max_len):
        return _peers.drive(self.pair, n, seed, max_len, timeout=120.0)

    def echo(self, spec, n, seed):
        return _peers.echo_loop(spec, n, seed, timeout=120.0)

    def close(self):
        if self.pair is not None:
            self.pair.close()


@pytest.mark.ray
def test_ray_actors_hammer(ray_cluster):
    ray = ray_cluster
    Actor = ray.remote(num_cpus=0)(_ChannelActor)
    a, b = Actor.remote(), Actor.remote()
    try:
        spec = ray.get(a.create.remote(16 * 1024))
        n, seed = 3000, 23
        echoed = b.echo.remote(spec, n, seed)
        assert ray.get(a.drive.remote(n, seed, 2000), timeout=300) == n
        assert ray.get(echoed, timeout=300) == n
        ray.get(a.close.remote())
    finally:
        ray.kill(a)
        ray.kill(b)


def test_fanout_round_trips_under_the_actor_thread_mix():
    """The coordinator's step channel as the actor system drives it, hammered: one broadcast
    command ring and one report ring per rank (``RankChannels``), two rank processes answering
    from a step thread beside a busy thread, the coordinator's round trips from its own step
    thread while the main thread reads the step log and another thread keeps the interpreter
    busy; 1500 steps, random report sizes and pauses. Every round trip returns each rank's
    report for that step, in rank order."""
    import threading

    from hisparse_ray.channel.fanout import RankChannels
    from hisparse_ray.types import StepCommand

    n, steps = 2, 1500
    chans = RankChannels(n)
    ranks = [_run_child(_peers.rank_loop, spec, r, 11 + r) for r, spec in enumerate(chans.specs)]
    stop = threading.Event()
    threading.Thread(target=_peers.busy, args=(stop, 3), daemon=True).start()
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            for s in range(steps):
                reports = chans.round_trip(StepCommand(s), 30)
                assert [(r.step, r.rank) for r in reports] == [(s, r) for r in range(n)]
        except BaseException as err:  # noqa: BLE001 - reported below
            failure.append(err)

    driver = threading.Thread(target=drive)
    try:
        driver.start()
        while driver.is_alive():
            driver.join(0.005)
            list(chans.log)  # what stats calls do from Ray's method threads
        assert not failure, failure
        assert len(chans.log) == steps
        chans.commands.send(StepCommand(-1), 5)
        for proc in ranks:
            proc.join(30)
            assert proc.exitcode == 0
    finally:
        stop.set()
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
        chans.close()
