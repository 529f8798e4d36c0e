"""The rings' C hot path (``hisparse_ray.channel._ring``) against their Python ops: a C end and a
Python end interoperate on one ring (same frames, positions and wake-ups) under random schedules
of sends and per-reader receives; the C reader refuses a corrupt frame; a closed reader stops a C
writer. The other ring tests run on whichever the default is (C where built)."""

from __future__ import annotations

import random
import struct

import pytest

from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.ring import NATIVE, ShmRing, WaitPolicy
from hisparse_ray.errors import ChannelClosedError, ChannelError, ChannelTimeoutError

P = PickleCodec()
FAST = WaitPolicy(spin_s=0, yield_s=0, min_sleep_s=1e-4, max_sleep_s=1e-3)
needs_native = pytest.mark.skipif(NATIVE is None, reason="hisparse_ray.channel._ring not built")


def test_native_is_built():
    """CI has a C compiler: the C ring must have built there (``pip install -e . -v`` says why
    not). Elsewhere the rings still work in Python."""
    assert NATIVE is not None, "hisparse_ray.channel._ring did not build: see `pip install -e . -v`"
    ring = ShmRing.create("writer", 256, codec=P)
    try:
        assert ring.native and not ShmRing.attach(ring.spec, codec=P, native=False).native
    finally:
        ring.close()


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_c_and_python_ends_interoperate_under_random_schedules(seed):
    """A writer (C or Python) and three readers (each C or Python) on a 1 KiB ring: random sizes
    (wrapping every few frames, headers split at the end), random send / receive order, full
    rings; every reader gets every message in order."""
    rng = random.Random(seed)
    tx = ShmRing.create("writer", 1024, readers=3, policy=FAST, codec=P, native=rng.random() < 0.5)
    rxs = [ShmRing.attach(tx.spec_for(i), policy=FAST, codec=P, native=rng.random() < 0.5)
           for i in range(3)]
    fifos: list[list] = [[], [], []]
    try:
        for i in range(1500):
            who = rng.randrange(-3, 3)
            if who < 0:
                msg = (i, rng.randbytes(rng.randint(0, 300)))
                try:
                    tx.send(msg, timeout=0)
                except ChannelTimeoutError:
                    continue  # the slowest reader holds the ring
                for f in fifos:
                    f.append(msg)
            elif fifos[who]:
                assert rxs[who].recv(timeout=0) == fifos[who].pop(0)
        for rx, f in zip(rxs, fifos):
            assert [rx.recv(timeout=0) for _ in list(f)] == f and not rx.pending()
    finally:
        for r in (tx, *rxs):
            r.close()


@needs_native
def test_the_c_reader_refuses_a_corrupt_frame_and_a_closed_reader_stops_the_c_writer():
    tx = ShmRing.create("writer", 512, codec=P, native=True)
    rx = ShmRing.attach(tx.spec, codec=P, native=True)
    try:
        tx.send("a", timeout=1)
        data = 128 + 64  # ring.py's data offset for one reader
        struct.pack_into("<Q", tx._mm, data + 8, 5)  # the first frame's sequence number
        with pytest.raises(ChannelError, match="corrupt frame") as err:
            rx.recv(timeout=1)
        # where it was met: the reader's and the writer's positions, the header read again
        assert "read at 0 (offset 0), writer at 32" in str(err.value)
        assert "header there now (length, seq) = (" in str(err.value)
        rx.close()
        with pytest.raises(ChannelClosedError):
            tx.send("b", timeout=1)
    finally:
        tx.close()
        rx.close()


def test_the_python_reader_names_where_a_corrupt_frame_lies():
    """A frame whose sequence number is wrong: the error says where the reader and the writer
    stand and at which offsets a header with the expected sequence number lies (diagnosis of a
    frame written elsewhere vs a publish seen before its frame)."""
    tx = ShmRing.create("writer", 512, codec=P, native=False)
    rx = ShmRing.attach(tx.spec, codec=P, native=False)
    try:
        tx.send("a", timeout=1)
        tx.send("b", timeout=1)
        data = 128 + 64
        struct.pack_into("<Q", tx._mm, data + 8, 7)  # frame 0 claims sequence 7
        with pytest.raises(ChannelError, match=r"seq 7 \(expected 0\)") as err:
            rx.recv(timeout=1)
        assert "writer at 64" in str(err.value) and "seq 0 found at offsets []" in str(err.value)
    finally:
        tx.close()
        rx.close()
