"""The shared-memory step channel in one process: framing, wrap-around, backpressure, errors,
segment lifecycle, and a hypothesis model of the ring."""

from __future__ import annotations

import os
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import SHM_DIR, ShmChannel, WaitPolicy, cleanup_stale_segments
from hisparse_ray.channel.stepcodec import StepCodec
from hisparse_ray.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelTimeoutError,
    MessageTooLargeError,
)
from hisparse_ray.types import BatchRow, Rank, RequestId, StepCommand, StepReport

FAST = WaitPolicy(spin_s=0, yield_s=0, min_sleep_s=1e-4, max_sleep_s=1e-3)


@pytest.fixture
def chan():
    tx = ShmChannel.create("sender", 1024, prefix="hsr-chtest-", policy=FAST)
    rx = ShmChannel.attach(tx.spec, policy=FAST)
    yield tx, rx
    tx.close()
    rx.close()


def test_step_messages_round_trip():
    cmd = StepCommand(step=3, rank=Rank(1),
                      batch=(BatchRow(RequestId("r1"), 4097, 11, ()),))
    rep = StepReport(step=3, rank=Rank(1), sampled=((RequestId("r1"), 42),))
    with ChannelPair.create(4096) as coord:
        with ChannelPair.attach(coord.spec) as rank:
            coord.send(cmd)
            assert rank.recv(timeout=1) == cmd
            rank.send(rep)
            assert coord.recv(timeout=1) == rep


def test_random_sizes_wrap_around_in_order(chan):
    tx, rx = chan
    rng = random.Random(0)
    for i in range(2000):  # ~500 KiB through a 1 KiB ring: wraps every few messages
        msg = (i, rng.randbytes(rng.randint(0, tx.max_message_bytes - 64)))
        tx.send(msg, timeout=1)
        assert rx.recv(timeout=1) == msg
    assert not rx.pending()


def test_full_ring_blocks_then_drains(chan):
    tx, rx = chan
    sent = 0
    with pytest.raises(ChannelTimeoutError):
        while True:
            tx.send(sent, timeout=0.05)
            sent += 1
    assert sent > 10
    assert rx.recv(timeout=1) == 0  # frees one frame: the sender can go on
    tx.send(sent, timeout=0.05)
    assert [rx.recv(timeout=1) for _ in range(sent)] == list(range(1, sent + 1))


def test_message_larger_than_ring(chan):
    tx, rx = chan
    with pytest.raises(MessageTooLargeError) as ei:
        tx.send(b"x" * 2000)
    assert ei.value.max_bytes == tx.max_message_bytes
    tx.send(b"y", timeout=1)  # the channel is still usable
    assert rx.recv(timeout=1) == b"y"


def test_recv_times_out_when_nothing_comes(chan):
    _, rx = chan
    with pytest.raises(ChannelTimeoutError):
        rx.recv(timeout=0.02)


def test_close_is_seen_after_draining(chan):
    tx, rx = chan
    tx.send("last", timeout=1)
    tx.close()
    assert rx.recv(timeout=1) == "last"
    with pytest.raises(ChannelClosedError):
        rx.recv(timeout=1)


def test_sender_sees_receiver_closed(chan):
    tx, rx = chan
    rx.close()
    with pytest.raises(ChannelClosedError):
        tx.send("x", timeout=1)


def test_roles_are_enforced(chan):
    tx, rx = chan
    with pytest.raises(ChannelError):
        tx.recv(timeout=0)
    with pytest.raises(ChannelError):
        rx.send("x")


def test_segment_unlinked_once_attached_and_on_close():
    tx = ShmChannel.create("receiver", 256, prefix="hsr-chtest-")
    path = os.path.join(SHM_DIR, tx.name)
    assert os.path.exists(path)
    rx = ShmChannel.attach(tx.spec)
    assert not os.path.exists(path)
    with pytest.raises(ChannelError):
        ShmChannel.attach(tx.spec)  # a second attacher cannot find it
    rx.close()
    tx.close()
    lone = ShmChannel.create("sender", 256, prefix="hsr-chtest-")
    lone.close()
    assert not os.path.exists(os.path.join(SHM_DIR, lone.name))


def test_stale_segments_of_dead_creators_are_removed():
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = os.path.join(SHM_DIR, f"hsr-chtest-{dead_pid}-deadbeef")
    live = ShmChannel.create("sender", 256, prefix="hsr-chtest-")
    open(stale, "wb").close()
    removed = cleanup_stale_segments("hsr-chtest-")
    assert os.path.basename(stale) in removed
    assert not os.path.exists(stale)
    assert os.path.exists(os.path.join(SHM_DIR, live.name))  # ours is alive: kept
    live.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ShmChannel.create("sender", 100)  # not a multiple of 8
    with pytest.raises(ValueError):
        ShmChannel.create("both", 256)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WaitPolicy(spin_s=1.0, yield_s=0.1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 300), st.none()), max_size=80))
def test_ring_matches_a_fifo_model(ops):
    """Each op sends a message of that many bytes (None = receive one); the ring must behave like
    an unbounded FIFO that refuses (times out) exactly when the bytes in flight would exceed it."""
    tx = ShmChannel.create("sender", 512, prefix="hsr-chtest-", policy=FAST)
    rx = ShmChannel.attach(tx.spec, policy=FAST)
    model: list[bytes] = []
    try:
        for i, op in enumerate(ops):
            if op is None:
                if model:
                    assert rx.recv(timeout=0) == model.pop(0)
                else:
                    with pytest.raises(ChannelTimeoutError):
                        rx.recv(timeout=0)
                continue
            msg = bytes([i % 256]) * op
            frame = 16 + ((len(_pickled(msg)) + 7) & ~7)
            used = sum(16 + ((len(_pickled(m)) + 7) & ~7) for m in model)
            if used + frame <= 512:
                tx.send(msg, timeout=0)
                model.append(msg)
            else:
                with pytest.raises((ChannelTimeoutError, MessageTooLargeError)):
                    tx.send(msg, timeout=0)
        assert [rx.recv(timeout=0) for _ in model] == model
        assert not rx.pending()
    finally:
        tx.close()
        rx.close()


def _pickled(obj) -> bytes:
    return StepCodec().dumps(obj)  # the channel's default codec


@pytest.mark.parametrize("err", [
    ChannelError("corrupt frame", "hsr-ch-1-ab"),
    ChannelTimeoutError("no message after 1 s", "c"),
    ChannelClosedError("peer closed", "c"),
    MessageTooLargeError(5000, 1008, "c"),
], ids=lambda e: type(e).__name__)
def test_channel_errors_pickle(err):
    import pickle

    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and back.args == err.args and str(back) == str(err)


def test_wait_pending_wakes_for_any_channel_and_times_out():
    """The coordinator's report wait: blocked on one rank's channel, it wakes when another rank's
    report arrives first (sent from a thread after a random pause), and returns False when none
    does; the messages stay in their rings for recv."""
    import threading

    spin = WaitPolicy(spin_s=0, yield_s=2e-3, futex_slice_s=1e-3)
    a = ShmChannel.create("sender", 1024, prefix="hsr-chtest-", policy=spin)
    b = ShmChannel.create("sender", 1024, prefix="hsr-chtest-", policy=spin)
    ra, rb = ShmChannel.attach(a.spec, policy=spin), ShmChannel.attach(b.spec, policy=spin)
    try:
        assert not ra.wait_pending(0.01, (rb,))
        rng = random.Random(11)
        for i in range(30):
            th = threading.Timer(rng.choice([0, 1e-4, 3e-3]), b.send, args=(i,))
            th.start()
            assert ra.wait_pending(10.0, (rb,))
            th.join()
            assert not ra.pending() and rb.recv(1.0) == i
        a.send("x")
        assert ra.wait_pending(0.0) and ra.recv(0) == "x"
    finally:
        for c in (a, b, ra, rb):
            c.close()
