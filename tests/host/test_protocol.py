"""Write/publish protocol across real processes (and a hypothesis model of the seqlock counter)."""

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


def _run_pair(seed: int, gens: int, write_once: bool, honest: tuple[bool, ...] = (True,)) -> list[dict]:
    """Rank 0 (this process) writes while one spawned reader per ``honest`` flag reads."""
    ctx = mp.get_context("spawn")
    with HostPool.create("r", _hammer.LAYOUT, _hammer.NUM_BLOCKS, register_cuda=False,
                         prefix=PREFIX) as pool:
        queue, ready = ctx.Queue(), [ctx.Event() for _ in honest]
        procs = [ctx.Process(target=_hammer.reader_process,
                             args=(pool.name, seed, gens, write_once, ev, queue, h))
                 for ev, h in zip(ready, honest)]
        for p in procs:
            p.start()
        for ev in ready:  # start writing only once every reader is attached
            assert ev.wait(timeout=60)
        _hammer.run_writer(pool, seed, gens, write_once)
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    assert list_segments(PREFIX) == []
    return results


def test_seqlock_readers_never_see_torn_or_stale_pages():
    results = _run_pair(seed=1, gens=400, write_once=False, honest=(True, True))
    for r in results:
        assert "error" not in r, r
        assert r["reads"] >= 200 and r["final"] == 400
        assert r["torn"] == 0 and r["stale"] == 0, r


def test_publish_then_wait_orders_write_once_pages():
    """Pages written once (spills into fresh blocks) and read after wait_published, without the
    seqlock; a second reader that skips wait_published shows the checks are not vacuous."""
    r, cheat = sorted(_run_pair(seed=7, gens=40, write_once=True, honest=(True, False)),
                      key=lambda r: r.get("honest", True), reverse=True)
    assert "error" not in r and "error" not in cheat, (r, cheat)
    assert r["pages"] > 0 and r["torn"] == 0 and r["stale"] == 0, r
    assert cheat["stale"] + cheat["torn"] > 0, cheat


def test_wait_published_times_out_with_a_clear_error():
    with HostPool.create("r", _hammer.LAYOUT, 4, register_cuda=False, prefix=PREFIX) as pool:
        with pytest.raises(HostPoolError, match="generation 1"):
            pool.wait_published(1, timeout_s=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["begin", "publish", "read"]), max_size=30))
def test_counter_state_machine(ops):
    """Model: generation g, writing flag. begin while writing is refused; publish ends any write;
    a read token taken while idle stays valid until the next begin/publish."""
    with HostPool.create("m", _hammer.LAYOUT, 1, register_cuda=False, prefix=PREFIX) as pool:
        gen, writing, tokens = 0, False, []
        for op in ops:
            if op == "begin":
                if writing:
                    with pytest.raises(HostPoolError):
                        pool.begin_write()
                else:
                    pool.begin_write()
                    writing = True
                    tokens.clear()
            elif op == "publish":
                pub = pool.publish()
                gen, writing = gen + 1, False
                assert pub.seq == gen and pub.event_handle == b""
                tokens.clear()
            elif not writing:
                tokens.append(pool.read_begin(timeout_s=1))
            assert pool.published() == gen
            assert all(pool.read_valid(t) for t in tokens)
            if writing:
                with pytest.raises(HostPoolError):
                    pool.read_begin(timeout_s=0.001)
