"""Process bodies for the ring tests (importable by spawned children and Ray workers)."""

from __future__ import annotations

import collections
import random
import time
from typing import Iterator

from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ShmRing

P = PickleCodec()  # these tests send any object; the step codec carries step messages only


def messages(seed: int, n: int, max_len: int) -> Iterator[tuple[int, bytes]]:
    """The deterministic stream both ends agree on: (index, random bytes of random length)."""
    rng = random.Random(seed)
    for i in range(n):
        yield (i, rng.randbytes(rng.randint(0, max_len)))


def _maybe_pause(rng: random.Random, p: float = 0.02) -> None:
    if rng.random() < p:
        time.sleep(rng.random() * 2e-3)


def sink(spec, n: int, seed: int, max_len: int, timeout: float = 20.0) -> int:
    """Attach as a reader (``spec.reader`` of a broadcast), check ``n`` messages against ``messages(seed, ...)`` arriving in order,
    pausing at random (so the sender hits a full ring); returns n."""
    rng = random.Random(~seed ^ (spec.reader << 8))  # each reader of a broadcast its own pace
    chan = ShmRing.attach(spec, codec=P)
    try:
        for want in messages(seed, n, max_len):
            got = chan.recv(timeout)
            if got != want:
                raise AssertionError(f"message {want[0]}: got index {got[0]}, "
                                     f"{len(got[1])} bytes vs {len(want[1])}")
            _maybe_pause(rng, 0.05)
    finally:
        chan.close()
    return n


def source(chan: ShmRing, n: int, seed: int, max_len: int, timeout: float = 20.0) -> int:
    """Send ``messages(seed, ...)`` with random pauses; returns n."""
    rng = random.Random(seed ^ 0x5A5A)
    for msg in messages(seed, n, max_len):
        chan.send(msg, timeout)
        _maybe_pause(rng)
    return n


def echo_loop(spec, n: int, seed: int, timeout: float = 20.0) -> int:
    """Attach to a ChannelPair and echo ``n`` messages back, at a random pace; returns n."""
    rng = random.Random(seed)
    pair = ChannelPair.attach(spec, codec=P)
    try:
        for _ in range(n):
            msg = pair.recv(timeout)
            _maybe_pause(rng)
            pair.send(msg, timeout)
    finally:
        pair.close()
    return n


def drive(pair: ChannelPair, n: int, seed: int, max_len: int, timeout: float = 20.0,
          window: int = 8) -> int:
    """Against ``echo_loop``: send ``messages(seed, ...)`` and take their echoes, interleaved at
    random with at most ``window`` in flight; checks order, bytes, no loss, no duplicates."""
    rng = random.Random(seed ^ 0xA5A5)
    stream = messages(seed, n, max_len)
    in_flight: collections.deque = collections.deque()
    sent = got = 0
    while got < n:
        can_send = sent < n and len(in_flight) < window
        if can_send and (not in_flight or rng.random() < 0.6):
            msg = next(stream)
            pair.send(msg, timeout)
            in_flight.append(msg)
            sent += 1
        else:
            echo = pair.recv(timeout)
            want = in_flight.popleft()
            if echo != want:
                raise AssertionError(f"echo {got}: got index {echo[0]}, want {want[0]}")
            got += 1
    if pair.inbox.pending():
        raise AssertionError("an extra (duplicate) message arrived")
    return got


def attach_and_hang(spec, ready) -> None:
    """Attach, signal, then block (the test kills this process)."""
    pair = ChannelPair.attach(spec, codec=P)
    ready.set()
    time.sleep(3600)
    pair.close()


def busy(stop, seed: int) -> None:
    """Interpreter-heavy noise for another thread of the same process (GIL hand-offs at random
    points of the ring ops), with short sleeps."""
    rng = random.Random(seed)
    while not stop.is_set():
        sum(len(str(i)) for i in range(rng.randint(50, 500)))
        if rng.random() < 0.02:
            time.sleep(rng.random() * 5e-4)


def rank_loop(spec, rank: int, seed: int, noise: int = 1, timeout: float = 30.0) -> int:
    """A rank's step thread as ``DecodeWorker._loop`` runs it (its own thread, ``noise`` busy
    threads beside it): each StepCommand answered with a StepReport of random size (up to 40
    sampled tokens) at a random pace; a negative step ends it. Returns the steps answered."""
    import threading

    from hisparse_ray.types import RequestId, StepReport

    pair = ChannelPair.attach(spec)
    stop = threading.Event()
    for i in range(noise):
        threading.Thread(target=busy, args=(stop, seed * 31 + i), daemon=True).start()
    rng = random.Random(seed)
    done = [0]

    def loop() -> None:
        while True:
            cmd = pair.recv(timeout)
            if cmd.step < 0:
                return
            sampled = tuple((RequestId(f"r{i}"), rng.randrange(1 << 20))
                            for i in range(rng.randint(0, 40)))
            _maybe_pause(rng, 0.03)
            pair.send(StepReport(cmd.step, rank, sampled=sampled, hot_hits=rng.randrange(9999)),
                      timeout)
            done[0] += 1

    step = threading.Thread(target=loop, name=f"step-r{rank}")
    step.start()
    step.join()
    stop.set()
    pair.close()
    return done[0]
