"""A ring's shared words (positions, flags) are stored whole: a peer process reading one while
another rewrites it never sees a value that was not stored. ``struct.pack_into`` zero-fills its
destination before packing (CPython), so a reader could see 0 in between: the Python ring's
published write position read 0, a reader took it for a new frame and read zeros (the
corrupt-frame failures of 2026-12-01, seen only under a loaded full suite)."""

from __future__ import annotations

import multiprocessing as mp
import time

from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.ring import ShmRing

CTX = mp.get_context("spawn")
OFF = 64 + 24  # the writer line's "waiting" word: rewriting it has no effect on the protocol
DONE = 5_000_000


def _rewrite(spec, n: int) -> None:
    ring = ShmRing.attach(spec, codec=PickleCodec())
    for i in range(n):
        ring._store(OFF, 1_000_000 + i)  # large values: a torn or zero-filled store shows
    ring._store(OFF, DONE)


def test_a_peer_never_reads_a_word_that_was_not_stored():
    with ShmRing.create("reader", 4096, codec=PickleCodec()) as ring:
        ring._store(OFF, 999_999)
        child = CTX.Process(target=_rewrite, args=(ring.spec, 2_000_000), daemon=True)
        child.start()
        seen, bad = 0, []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            v = ring._load(OFF)
            if v == DONE:
                break  # the child's last store
            seen += 1
            if not 999_999 <= v < 3_000_000:
                bad.append(v)
        child.join(10)
        assert child.exitcode == 0
        assert seen > 10_000 and not bad, (seen, bad[:10])
