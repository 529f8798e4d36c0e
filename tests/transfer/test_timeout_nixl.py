"""Real NIXL WRITE timeouts: the receiving peer process is stopped with SIGSTOP (a real stall: UCX
cannot complete a WRITE into a stopped process), so ``write_with_retry`` times out on every attempt
deterministically; SIGCONT in a finally. The engine is a real ``NixlTransferEngine`` seen through a
counting wrapper (it only forwards and counts posts and releases)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable, Sequence

import pytest
import torch

from hisparse_ray.errors import TransferError, TransferTimeoutError
from hisparse_ray.transfer import NixlTransferEngine, WriteSegment, write_with_retry
from tests.transfer import _nixl_peers as P

pytestmark = pytest.mark.nixl

REGION = 1 << 20


class CountingEngine:
    """Forwards to a real engine; records every post and release (leak check)."""

    def __init__(self, engine: NixlTransferEngine,
                 before_post: Callable[[int], None] | None = None) -> None:
        self.engine, self.before_post = engine, before_post
        self.posted: list[int] = []
        self.released: list[int] = []

    def post_write(self, segments: Sequence[WriteSegment], notif: bytes = b"") -> int:
        if self.before_post is not None:
            self.before_post(len(self.posted))
        xfer = self.engine.post_write(segments, notif)
        self.posted.append(xfer)
        return xfer

    def release(self, xfer_id: int) -> None:
        self.engine.release(xfer_id)
        self.released.append(xfer_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def target(md_q, res_q, nbytes: int) -> None:
    """Spawned receiver: register a zeroed region, publish metadata and pid, then poll
    notifications; on each one starting with b"final" send back (notifications so far, region
    bytes). Runs until terminated (at most 10 minutes)."""
    peer = P.NixlPeer("stalled-target")
    md, (desc,) = peer.setup(nbytes, None)
    md_q.put((md, desc, os.getpid()))
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        new = peer.engine.take_notifications()
        got.extend(new)
        if any(m.startswith(b"final") for _, m in new):
            res_q.put((list(got), peer.tensor.numpy().tobytes()))
            got.clear()
        time.sleep(1e-3)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not stopped(pid):  # SIGSTOP is asynchronous: post nothing before it took effect
        assert time.monotonic() < deadline, "SIGSTOP did not take effect"
        time.sleep(1e-3)


@pytest.fixture(scope="module")
def stalled_peer():
    """(engine, remote region, target pid, results queue), shared by the module (a spawned
    process imports torch and NIXL: seconds); the target is resumed and reaped afterwards."""
    ctx = mp.get_context("spawn")
    md_q, res_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=target, args=(md_q, res_q, REGION), daemon=True)
    child.start()
    engine = NixlTransferEngine("stalling-source")
    try:
        engine.register("kv", P.pattern(REGION, 11))
        md, desc, pid = md_q.get(timeout=60)
        assert engine.add_peer(md) == "stalled-target"
        yield engine, desc, pid, res_q
    finally:
        engine.close()
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.terminate()
            child.join(30)


def test_stalled_peer_times_out_after_exactly_attempts_posts_then_engine_recovers(stalled_peer):
    engine, desc, pid, res_q = stalled_peer
    seg = [WriteSegment("kv", 0, REGION, desc, 0)]
    write_with_retry(engine, seg, b"warm", attempts=1, timeout_s=30)  # the path works
    counting = CountingEngine(engine)
    stop(pid)
    try:
        with pytest.raises(TransferTimeoutError) as err:
            write_with_retry(counting, seg, b"stalled", attempts=3, timeout_s=0.3,
                             request_id="req-stalled")
    finally:
        os.kill(pid, signal.SIGCONT)
    e = err.value
    assert e.request_id == "req-stalled" and e.args == (e.message, "req-stalled")
    assert e.message.startswith("after 3 attempt(s): ") and "not done after" in e.message
    assert len(counting.posted) == 3 and len(set(counting.posted)) == 3
    assert counting.released == counting.posted  # every handle released: none leaked
    with pytest.raises(TransferError, match="unknown transfer id"):
        engine.poll(counting.posted[-1])
    # the same engine still WRITEs normally; bytes land exactly
    write_with_retry(engine, seg, b"final-1", attempts=1, timeout_s=30)
    got, data = res_q.get(timeout=60)
    assert got[-1] == ("stalling-source", b"final-1")
    assert {m for _, m in got} <= {b"warm", b"stalled", b"final-1"}  # cancelled WRITEs may land
    assert data == P.pattern(REGION, 11).numpy().tobytes()


def test_a_retry_succeeds_once_the_peer_resumes(stalled_peer):
    """Attempt 1 times out against the stopped peer; the wrapper resumes the peer right before
    attempt 2 is posted (deterministic), and attempt 2 completes: no error, two posts, both
    released. (2 s per attempt: ample for a 4 KiB WRITE to a resumed process.)"""
    engine, desc, pid, res_q = stalled_peer

    def resume_before_second(n_posted: int) -> None:
        if n_posted == 1:
            os.kill(pid, signal.SIGCONT)

    counting = CountingEngine(engine, resume_before_second)
    stop(pid)
    try:
        write_with_retry(counting, [WriteSegment("kv", 0, 4096, desc, 0)], b"final-2", attempts=3,
                         timeout_s=2.0, request_id="req-retry")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(counting.posted) == 2 and counting.released == counting.posted
    got, data = res_q.get(timeout=60)
    assert got[-1] == ("stalling-source", b"final-2")
    assert data[:4096] == P.pattern(REGION, 11).numpy().tobytes()[:4096]
