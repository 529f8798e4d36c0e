"""The rings' futex wake-ups and the step codec between real processes. Waits here block on
the futex with 60 s slices, so a lost wake-up shows up as a timeout (deadlines are generous: the
tests are about delivery and order, never speed)."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

import pytest

from hisparse_ray import types as T
from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ShmRing, WaitPolicy, futex_available
from hisparse_ray.errors import ChannelClosedError, ChannelTimeoutError

pytestmark = pytest.mark.skipif(not futex_available(), reason="no futex on this platform")

CTX = mp.get_context("spawn")
BLOCK = WaitPolicy(spin_s=0, yield_s=0, futex_slice_s=60.0)  # straight to the futex, no polling
DEADLINE = 60.0

P = PickleCodec()  # these tests send any object; the step codec carries step messages only


def step_stream(seed: int, n: int):
    """A deterministic stream of StepCommands as the core makes them: requests get the smallest
    free handle when they first appear (defined in that command, with their hot buffer), keep or
    change hot buffers (sent only when changed), and leave through ``released``; their handles
    come back for new requests."""
    rng = random.Random(seed)
    live: dict[int, str] = {}
    next_req = 0
    for step in range(n):
        released = tuple(h for h in sorted(live) if rng.random() < 0.1)
        for h in released:
            del live[h]
        defined = []
        while len(live) < rng.randint(1, 12):
            h = min(set(range(len(live) + len(released) + 1)) - set(live) - set(released))
            live[h] = f"req-{next_req}"
            next_req += 1
            defined.append(T.RequestHandle(h, T.RequestId(live[h])))
        new = {d.handle for d in defined}
        rows = tuple(T.BatchRow(h, step + 1, rng.randrange(50_000),
                                tuple(rng.randrange(1000) for _ in range(rng.randint(0, 5)))
                                if h in new or rng.random() < 0.2 else None)
                     for h in sorted(live))
        backups = tuple(T.Backup(T.TransferId(step * 64 + i), h, step, i, i % 8)
                        for i, h in enumerate(sorted(live)) if rng.random() < 0.5)
        xfers = tuple(T.PageTransfer(T.TransferId(10**6 + step), rng.choice(list(T.TransferKind)),
                                     T.DeviceBlockId(step), T.HostBlockId(step + 1))
                      for _ in range(rng.randint(0, 2)))
        yield T.StepCommand(step, rows, (), xfers, backups, released, tuple(defined), step // 3)


def report_for(cmd: T.StepCommand, rank: int) -> T.StepReport:
    names = {d.handle: d.request_id for d in cmd.handles}
    return T.StepReport(cmd.step, T.Rank(rank), tuple(b.transfer_id for b in cmd.backups), (),
                        tuple((names.get(r.handle, "?"), r.input_token) for r in cmd.batch), 1, 2,
                        tuple((names.get(r.handle, "?"), r.seq_len, 0) for r in cmd.batch),
                        cmd.host_seq if rank == 0 else 0)


def rank_loop(spec, rank: int, seed: int, n: int) -> None:
    """One rank: check every broadcast command against the stream, answer with its report,
    pausing at random so that the coordinator blocks on the futex (and the ring fills)."""
    rng = random.Random(~seed + rank)
    with ChannelPair.attach(spec, policy=BLOCK) as pair:
        for want in step_stream(seed, n):
            got = pair.recv(DEADLINE)
            if got != want or type(got.batch) is not tuple:
                raise AssertionError(f"rank {rank} step {want.step}: got {got!r}")
            if rng.random() < 0.05:
                time.sleep(rng.random() * 2e-3)
            pair.send(report_for(want, rank), DEADLINE)


def test_step_stream_broadcast_to_two_rank_processes_with_futex_waits():
    """2000 steps through the step codec, broadcast to two rank processes (one ring, a cursor
    each) that answer on their own rings; windows of up to 4 commands in flight through a 16 KiB
    ring (backpressure from the slower rank), every wait a futex wait."""
    n, seed, tp = 2000, 3, 2
    cmds = ShmRing.create("writer", 16 * 1024, readers=tp, policy=BLOCK)
    reports = [ShmRing.create("reader", 16 * 1024, policy=BLOCK) for _ in range(tp)]
    try:
        children = [CTX.Process(target=rank_loop,
                                args=((cmds.spec_for(r), reports[r].spec), r, seed, n),
                                daemon=True) for r in range(tp)]
        for c in children:
            c.start()
        rng = random.Random(seed)
        sent: list[T.StepCommand] = []
        stream = step_stream(seed, n)
        done = 0
        while done < n:
            if len(sent) - done < 4 and len(sent) < n and rng.random() < 0.6:
                cmd = next(stream)
                cmds.send(cmd, DEADLINE)
                sent.append(cmd)
            elif done < len(sent):
                for r in rng.sample(range(tp), tp):
                    assert reports[r].recv(DEADLINE) == report_for(sent[done], r)
                done += 1
        for c in children:
            c.join(DEADLINE)
            assert c.exitcode == 0
    finally:
        cmds.close()
        for ring in reports:
            ring.close()


def _send_later(chan: ShmRing, msg, delay: float) -> None:
    time.sleep(delay)
    chan.send(msg, DEADLINE)


def test_blocked_receiver_is_woken_by_a_send():
    with ShmRing.create("writer", 4096, policy=BLOCK, codec=P) as tx:
        with ShmRing.attach(tx.spec, policy=BLOCK, codec=P) as rx:
            for delay in (0.0, 0.01, 0.05):
                t = threading.Thread(target=_send_later, args=(tx, ("m", delay), delay))
                t.start()
                assert rx.recv(DEADLINE) == ("m", delay)
                t.join()


def test_blocked_sender_is_woken_when_room_frees():
    with ShmRing.create("writer", 256, policy=BLOCK, codec=P) as tx:
        with ShmRing.attach(tx.spec, policy=BLOCK, codec=P) as rx:
            msgs = [bytes([i]) * 150 for i in range(20)]  # one message fills the ring
            got: list = []
            t = threading.Thread(target=lambda: [got.append(rx.recv(DEADLINE)) or time.sleep(0.002)
                                                 for _ in msgs])
            t.start()
            for m in msgs:
                tx.send(m, DEADLINE)
            t.join()
            assert got == msgs


def test_close_wakes_a_blocked_peer():
    with ShmRing.create("writer", 4096, policy=BLOCK, codec=P) as tx:
        rx = ShmRing.attach(tx.spec, policy=BLOCK, codec=P)
        t = threading.Timer(0.05, tx.close)
        t.start()
        with pytest.raises(ChannelClosedError):
            rx.recv(DEADLINE)
        t.join()
        rx.close()


def test_undelivered_messages_leave_the_stream_exact():
    """A send that times out on a full ring is simply not delivered: the codec keeps no state,
    so every later command decodes exactly (the old stateful codec had to reset itself here)."""
    policy = WaitPolicy(spin_s=0, yield_s=0, min_sleep_s=1e-4, max_sleep_s=1e-3)
    with ShmRing.create("writer", 2048, policy=policy) as tx:
        with ShmRing.attach(tx.spec, policy=policy) as rx:
            dropped = delivered = 0
            pending: list = []
            for cmd in step_stream(9, 300):
                try:
                    tx.send(cmd, timeout=0)
                    pending.append(cmd)
                except ChannelTimeoutError:
                    dropped += 1
                    while pending:
                        assert rx.recv(timeout=1) == pending.pop(0)
                        delivered += 1
            while pending:
                assert rx.recv(timeout=1) == pending.pop(0)
                delivered += 1
            assert dropped > 0 and delivered + dropped == 300
