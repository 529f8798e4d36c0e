"""The channel's futex wake-ups and its stateful codec between real processes. Waits here block on
the futex with 60 s slices, so a lost wake-up shows up as a timeout (deadlines are generous: the
tests are about delivery and order, never speed)."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

import pytest

from hisparse_ray import types as T
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ShmChannel, WaitPolicy, futex_available
from hisparse_ray.errors import ChannelClosedError, ChannelTimeoutError

pytestmark = pytest.mark.skipif(not futex_available(), reason="no futex on this platform")

CTX = mp.get_context("spawn")
BLOCK = WaitPolicy(spin_s=0, yield_s=0, futex_slice_s=60.0)  # straight to the futex, no polling
DEADLINE = 60.0


def step_stream(seed: int, n: int):
    """A deterministic stream of StepCommands over a rotating id pool: requests join, keep or
    change hot buffers, leave through ``released`` and come back under the same id."""
    rng = random.Random(seed)
    live: dict[str, tuple] = {}
    for step in range(n):
        released = tuple(rid for rid in list(live) if rng.random() < 0.1)
        for rid in released:
            del live[rid]
        while len(live) < rng.randint(1, 12):
            live[f"req-{rng.randint(0, 40)}"] = tuple(rng.randrange(1000) for _ in range(4))
        for rid in live:
            if rng.random() < 0.2:
                live[rid] = tuple(rng.randrange(1000) for _ in range(rng.randint(0, 5)))
        rows = tuple(T.BatchRow(T.RequestId(r), step + 1, rng.randrange(50_000), h)
                     for r, h in live.items())
        backups = tuple(T.Backup(T.TransferId(step * 64 + i), T.RequestId(r), step, i, i % 8)
                        for i, r in enumerate(live) if rng.random() < 0.5)
        xfers = tuple(T.PageTransfer(T.TransferId(10**6 + step), rng.choice(list(T.TransferKind)),
                                     T.DeviceBlockId(step), T.HostBlockId(step + 1))
                      for _ in range(rng.randint(0, 2)))
        yield T.StepCommand(step, T.Rank(0), rows, (), xfers, backups, released)


def report_for(cmd: T.StepCommand) -> T.StepReport:
    return T.StepReport(cmd.step, cmd.rank, tuple(b.transfer_id for b in cmd.backups), (),
                        tuple((r.request_id, r.input_token) for r in cmd.batch), 1, 2,
                        tuple((r.request_id, r.seq_len, 0) for r in cmd.batch))


def rank_loop(spec, seed: int, n: int) -> None:
    """The rank side: check every command against the stream, answer with its report, pausing at
    random so that the coordinator blocks on the futex (and the ring fills)."""
    rng = random.Random(~seed)
    with ChannelPair.attach(spec, policy=BLOCK) as pair:
        for want in step_stream(seed, n):
            got = pair.recv(DEADLINE)
            if got != want or type(got.batch) is not tuple:
                raise AssertionError(f"step {want.step}: got {got!r}")
            if rng.random() < 0.05:
                time.sleep(rng.random() * 2e-3)
            pair.send(report_for(want), DEADLINE)


def test_step_stream_between_processes_with_futex_waits():
    """2000 stateful-codec steps, coordinator and rank in two processes, windows of up to 4
    commands in flight through a 16 KiB ring (backpressure), every wait a futex wait."""
    n, seed = 2000, 3
    with ChannelPair.create(16 * 1024, policy=BLOCK) as pair:
        child = CTX.Process(target=rank_loop, args=(pair.spec, seed, n), daemon=True)
        child.start()
        rng = random.Random(seed)
        sent: list[T.StepCommand] = []
        stream = step_stream(seed, n)
        done = 0
        while done < n:
            if len(sent) - done < 4 and len(sent) < n and rng.random() < 0.6:
                cmd = next(stream)
                pair.send(cmd, DEADLINE)
                sent.append(cmd)
            elif done < len(sent):
                assert pair.recv(DEADLINE) == report_for(sent[done])
                done += 1
        child.join(DEADLINE)
        assert child.exitcode == 0


def _send_later(chan: ShmChannel, msg, delay: float) -> None:
    time.sleep(delay)
    chan.send(msg, DEADLINE)


def test_blocked_receiver_is_woken_by_a_send():
    with ShmChannel.create("sender", 4096, policy=BLOCK) as tx:
        with ShmChannel.attach(tx.spec, policy=BLOCK) as rx:
            for delay in (0.0, 0.01, 0.05):
                t = threading.Thread(target=_send_later, args=(tx, ("m", delay), delay))
                t.start()
                assert rx.recv(DEADLINE) == ("m", delay)
                t.join()


def test_blocked_sender_is_woken_when_room_frees():
    with ShmChannel.create("sender", 256, policy=BLOCK) as tx:
        with ShmChannel.attach(tx.spec, policy=BLOCK) as rx:
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
    with ShmChannel.create("sender", 4096, policy=BLOCK) as tx:
        rx = ShmChannel.attach(tx.spec, policy=BLOCK)
        t = threading.Timer(0.05, tx.close)
        t.start()
        with pytest.raises(ChannelClosedError):
            rx.recv(DEADLINE)
        t.join()
        rx.close()


def test_undelivered_message_resets_the_codec():
    """A send that times out on a full ring leaves the receiver's codec state behind the
    sender's: the channel resets the sender's codec and the stream stays exact."""
    policy = WaitPolicy(spin_s=0, yield_s=0, min_sleep_s=1e-4, max_sleep_s=1e-3)
    with ShmChannel.create("sender", 2048, policy=policy) as tx:
        with ShmChannel.attach(tx.spec, policy=policy) as rx:
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
