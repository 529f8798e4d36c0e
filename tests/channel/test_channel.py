"""The shared-memory rings in one process: framing, wrap-around, backpressure, errors, segment
lifecycle, the broadcast to several readers (each its own cursor, the writer held by the slowest),
and hypothesis models of the ring against a FIFO per reader."""

from __future__ import annotations

import os
import random
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.channel.codec import PickleCodec, StepCodec
from hisparse_ray.channel.fanout import RankChannels
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import SHM_DIR, ShmRing, WaitPolicy, cleanup_stale_segments
from hisparse_ray.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelTimeoutError,
    MessageTooLargeError,
    StateError,
)
from hisparse_ray.types import BatchRow, Rank, RequestHandle, RequestId, StepCommand, StepReport

FAST = WaitPolicy(spin_s=0, yield_s=0, min_sleep_s=1e-4, max_sleep_s=1e-3)

P = PickleCodec()  # these tests send any object; the step codec carries step messages only


@pytest.fixture
def chan():
    tx = ShmRing.create("writer", 1024, prefix="hsr-chtest-", policy=FAST, codec=P)
    rx = ShmRing.attach(tx.spec, policy=FAST, codec=P)
    yield tx, rx
    tx.close()
    rx.close()


def test_step_messages_round_trip():
    cmd = StepCommand(step=3, batch=(BatchRow(0, 4097, 11, ()),),
                      handles=(RequestHandle(0, RequestId("r1")),))
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
    tx = ShmRing.create("reader", 256, prefix="hsr-chtest-", codec=P)
    path = os.path.join(SHM_DIR, tx.name)
    assert os.path.exists(path)
    rx = ShmRing.attach(tx.spec, codec=P)
    assert not os.path.exists(path)
    with pytest.raises(ChannelError):
        ShmRing.attach(tx.spec, codec=P)  # a second attacher cannot find it
    rx.close()
    tx.close()
    lone = ShmRing.create("writer", 256, prefix="hsr-chtest-", codec=P)
    lone.close()
    assert not os.path.exists(os.path.join(SHM_DIR, lone.name))


def test_stale_segments_of_dead_creators_are_removed():
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    stale = os.path.join(SHM_DIR, f"hsr-chtest-{dead_pid}-deadbeef")
    live = ShmRing.create("writer", 256, prefix="hsr-chtest-", codec=P)
    open(stale, "wb").close()
    removed = cleanup_stale_segments("hsr-chtest-")
    assert os.path.basename(stale) in removed
    assert not os.path.exists(stale)
    assert os.path.exists(os.path.join(SHM_DIR, live.name))  # ours is alive: kept
    live.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ShmRing.create("writer", 100, codec=P)  # not a multiple of 8
    with pytest.raises(ValueError):
        ShmRing.create("both", 256, codec=P)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ShmRing.create("reader", 256, readers=2)  # a creating reader reads alone
    with pytest.raises(ValueError):
        ShmRing.create("writer", 256, readers=0)
    with pytest.raises(ValueError):
        WaitPolicy(spin_s=1.0, yield_s=0.1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 300), st.none()), max_size=80))
def test_ring_matches_a_fifo_model(ops):
    """Each op sends a message of that many bytes (None = receive one); the ring must behave like
    an unbounded FIFO that refuses (times out) exactly when the bytes in flight would exceed it."""
    tx = ShmRing.create("writer", 512, prefix="hsr-chtest-", policy=FAST, codec=P)
    rx = ShmRing.attach(tx.spec, policy=FAST, codec=P)
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
    return P.dumps(obj)


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
    a = ShmRing.create("writer", 1024, prefix="hsr-chtest-", policy=spin, codec=P)
    b = ShmRing.create("writer", 1024, prefix="hsr-chtest-", policy=spin, codec=P)
    ra, rb = ShmRing.attach(a.spec, policy=spin, codec=P), ShmRing.attach(b.spec, policy=spin, codec=P)
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


# -- one writer, several readers ---------------------------------------------------------------
def _broadcast(n: int, capacity: int = 1024):
    tx = ShmRing.create("writer", capacity, readers=n, prefix="hsr-chtest-", policy=FAST, codec=P)
    rxs = [ShmRing.attach(tx.spec_for(i), policy=FAST, codec=P) for i in range(n)]
    return tx, rxs


def test_every_reader_gets_every_message_and_the_name_goes_with_the_last_attach():
    tx = ShmRing.create("writer", 1024, readers=3, prefix="hsr-chtest-", policy=FAST, codec=P)
    path = os.path.join(SHM_DIR, tx.name)
    try:
        rxs = [ShmRing.attach(tx.spec_for(0), policy=FAST, codec=P),
               ShmRing.attach(tx.spec_for(1), policy=FAST, codec=P)]
        assert os.path.exists(path)  # reader 2 has not mapped it yet
        with pytest.raises(ChannelError, match="already attached"):
            ShmRing.attach(tx.spec_for(1), codec=P)
        rxs.append(ShmRing.attach(tx.spec_for(2), policy=FAST, codec=P))
        assert not os.path.exists(path)
        for i in range(50):
            tx.send((i, b"x" * (i * 7)), timeout=1)
            for rx in rxs:
                assert rx.recv(timeout=1) == (i, b"x" * (i * 7))
        assert not any(rx.pending() for rx in rxs)
    finally:
        for r in (tx, *rxs):
            r.close()


def test_the_slowest_reader_holds_the_writer_and_a_closed_reader_stops_it():
    tx, (fast, slow) = _broadcast(2, 512)
    try:
        sent = 0
        with pytest.raises(ChannelTimeoutError):
            while True:
                tx.send(sent, timeout=0.02)
                sent += 1
                assert fast.recv(timeout=1) == sent - 1  # the fast reader keeps up
        assert sent > 5 and not fast.pending()
        assert slow.recv(timeout=1) == 0  # one frame freed for the slow reader: room again
        tx.send(sent, timeout=0.05)
        assert fast.recv(timeout=1) == sent
        assert [slow.recv(timeout=1) for _ in range(sent)] == list(range(1, sent + 1))
        slow.close()
        with pytest.raises(ChannelClosedError):
            tx.send("x", timeout=1)
    finally:
        for r in (tx, fast, slow):
            r.close()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), ops=st.lists(st.tuples(st.integers(-1, 3), st.integers(0, 200)),
                                         max_size=120))
def test_broadcast_matches_a_fifo_per_reader(n, ops):
    """Random schedules of sends and per-reader receives: each reader behaves like its own FIFO
    of everything sent; a send fits exactly when the slowest reader's backlog leaves room."""
    tx, rxs = _broadcast(n, 512)
    fifos: list[list[bytes]] = [[] for _ in range(n)]
    try:
        for i, (who, size) in enumerate(ops):
            if who < 0 or who >= n:  # a send
                msg = bytes([i % 256]) * size
                frame = 16 + ((len(P.dumps(msg)) + 7) & ~7)
                used = max(sum(16 + ((len(P.dumps(m)) + 7) & ~7) for m in f) for f in fifos)
                if used + frame <= 512:
                    tx.send(msg, timeout=0)
                    for f in fifos:
                        f.append(msg)
                else:
                    with pytest.raises((ChannelTimeoutError, MessageTooLargeError)):
                        tx.send(msg, timeout=0)
            elif fifos[who]:
                assert rxs[who].recv(timeout=0) == fifos[who].pop(0)
            else:
                with pytest.raises(ChannelTimeoutError):
                    rxs[who].recv(timeout=0)
        for rx, f in zip(rxs, fifos):
            assert [rx.recv(timeout=0) for _ in f] == f and not rx.pending()
    finally:
        for r in (tx, *rxs):
            r.close()


def test_rank_channels_broadcast_one_command_and_gather_every_report():
    """The coordinator's end: one command on the broadcast, one report per rank back, taken in
    arrival order; the specs name each rank's reader."""
    chans = RankChannels(3, FAST)
    ends = [ChannelPair.attach(spec, policy=FAST) for spec in chans.specs]
    chans.unlink()
    try:
        cmd = StepCommand(7, handles=(RequestHandle(0, RequestId("a")),), host_seq=2)
        import threading

        def answer(r: int, end: ChannelPair) -> None:
            got = end.recv(5)
            assert got == cmd
            time.sleep(0.01 * (2 - r))  # the last rank answers first
            end.send(StepReport(got.step, Rank(r), published=got.host_seq if r == 0 else 0), 5)

        threads = [threading.Thread(target=answer, args=(r, e)) for r, e in enumerate(ends)]
        for t in threads:
            t.start()
        reports = chans.round_trip(cmd, 5)
        for t in threads:
            t.join()
        assert [(r.step, r.rank, r.published) for r in reports] == [(7, 0, 2), (7, 1, 0), (7, 2, 0)]
        (step, t0, sent, found, loaded) = chans.trace[-1]
        assert step == 7 and t0 <= sent <= min(found) and found[2] <= found[0]
    finally:
        for e in ends:
            e.close()
        chans.close()


def test_rank_channels_pipelined_send_and_gather_in_step_order():
    """``ReplicaSpec.lookahead``: command N + 1 goes out before step N's reports are gathered;
    each rank answers in step order at its own pace; ``gather`` takes a step's reports only
    when it is the oldest sent, and a probe is refused while steps are in flight."""
    import threading

    chans = RankChannels(2, FAST)
    ends = [ChannelPair.attach(spec, policy=FAST) for spec in chans.specs]
    chans.unlink()
    rng = random.Random(3)
    delays = [[rng.uniform(0, 0.004) for _ in range(40)] for _ in ends]
    try:
        def answer(r: int, end: ChannelPair) -> None:
            for i in range(40):
                got = end.recv(5)
                time.sleep(delays[r][i])
                end.send(StepReport(got.step, Rank(r)), 5)

        threads = [threading.Thread(target=answer, args=(r, e)) for r, e in enumerate(ends)]
        for t in threads:
            t.start()
        chans.send(StepCommand(1), 5)
        for step in range(2, 41):
            chans.send(StepCommand(step), 5)
            with pytest.raises(StateError, match="in flight"):
                chans.probe(1, 1)
            with pytest.raises(StateError, match="gather of step"):
                chans.gather(step, 5)  # step - 1 is older
            assert [(r.step, r.rank) for r in chans.gather(step - 1, 5)] == [(step - 1, 0),
                                                                            (step - 1, 1)]
        assert [(r.step, r.rank) for r in chans.gather(40, 5)] == [(40, 0), (40, 1)]
        for t in threads:
            t.join()
        assert [s for s, _ in list(chans.log)[-40:]] == list(range(1, 41))
    finally:
        for e in ends:
            e.close()
        chans.close()


def test_the_step_codec_refuses_other_objects_and_reports_corrupt_bytes():
    with ChannelPair.create(1024) as coord:
        with ChannelPair.attach(coord.spec) as rank:
            with pytest.raises(TypeError):
                coord.send({"not": "a step message"})
            coord.outbox._codec = P  # a peer speaking another codec: refused, not misread
            coord.send(("junk", 1))
            with pytest.raises(ChannelError, match="unreadable"):
                rank.recv(timeout=1)
            coord.outbox._codec = StepCodec()
            coord.send(StepCommand(2))  # the stream goes on: the codec keeps no state
            assert rank.recv(timeout=1) == StepCommand(2)


def test_the_python_reader_names_where_a_corrupt_frame_lies():
    """A frame whose sequence number is wrong: the error says where the reader and the writer
    stand and at which offsets a header with the expected sequence number lies (diagnosis of a
    frame written elsewhere vs a publish seen before its frame)."""
    tx = ShmRing.create("writer", 512, codec=P)
    rx = ShmRing.attach(tx.spec, codec=P)
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
