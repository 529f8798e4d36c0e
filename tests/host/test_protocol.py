"""Write/publish protocol across real processes (and a hypothesis model of the generation counter)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import HostPoolError
from hisparse_ray.host.pool import HostPool, list_segments
from tests.host import _hammer

PREFIX = f"hs-test-proto-{os.getpid()}"


def _run_pair(seed: int, gens: int, honest: tuple[bool, ...] = (True,)) -> list[dict]:
    """Rank 0 (this process) writes while one spawned reader per ``honest`` flag reads."""
    ctx = mp.get_context("spawn")
    with HostPool.create("r", _hammer.LAYOUT, _hammer.NUM_BLOCKS, register_cuda=False,
                         prefix=PREFIX) as pool:
        queue, ready = ctx.Queue(), [ctx.Event() for _ in honest]
        procs = [ctx.Process(target=_hammer.reader_process,
                             args=(pool.name, seed, gens, ev, queue, h))
                 for ev, h in zip(ready, honest)]
        for p in procs:
            p.start()
        for ev in ready:  # start writing only once every reader is attached
            assert ev.wait(timeout=60)
        _hammer.run_writer(pool, seed, gens)
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    assert list_segments(PREFIX) == []
    return results


def test_readers_after_wait_published_never_see_torn_or_stale_rows():
    """Two honest readers against a writer with random pauses; a third reader that skips
    ``wait_published`` shows the checks are not vacuous."""
    results = _run_pair(seed=7, gens=300, honest=(True, True, False))
    honest = [r for r in results if r.get("honest", True)]
    (cheat,) = [r for r in results if not r.get("honest", True)]
    for r in honest:
        assert "error" not in r, r
        assert r["reads"] >= 200 and r["final"] == 300 and r["rows"] > 0
        assert r["torn"] == 0 and r["stale"] == 0, r
    assert "error" not in cheat and cheat["stale"] + cheat["torn"] > 0, cheat


def test_wait_published_times_out_with_a_clear_error():
    with HostPool.create("r", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        with pytest.raises(HostPoolError, match="generation 1"):
            pool.wait_published(1, timeout_s=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["publish", "wait_now", "wait_ahead"]), max_size=30))
def test_generation_state_machine(ops):
    """Model: generation g. publish returns g + 1; waiting for any generation <= g returns at
    once, one beyond it times out; a peer sees the owner's generation."""
    with HostPool.create("m", _hammer.LAYOUT, 1, register_cuda=False, prefix=PREFIX) as pool:
        peer = HostPool.attach(pool.name, register_cuda=False)
        gen = 0
        try:
            for op in ops:
                if op == "publish":
                    gen += 1
                    assert pool.publish() == gen
                elif op == "wait_now":
                    peer.wait_published(gen, timeout_s=1)
                else:
                    with pytest.raises(HostPoolError):
                        peer.wait_published(gen + 1, timeout_s=0.001)
                assert pool.published() == peer.published() == gen
        finally:
            peer.close()
