"""The step channel's C hot path (``hisparse_ray.channel._wire``) against its pure-Python twin:
the C encoder writes byte for byte what the Python encoder writes over random stateful streams (ids
defined, reused, released, tables dropped, messages lost), reports cross between the two codecs
in both directions, and rings written by one side's ring code are read by the other's, with
wrap-around and backpressure, from two threads on random schedules."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import resource
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel import stepcodec
from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.ring import ShmChannel
from hisparse_ray.channel.stepcodec import NATIVE, TAG_REPORT, TAG_REPORT_BIN, StepCodec
from hisparse_ray.config import env_flag

from .test_stepcodec import _same, commands, reports

needs_native = pytest.mark.skipif(NATIVE is None, reason="hisparse_ray.channel._wire not built")


def test_native_is_built():
    """`pip install -e .` builds the C module wherever a C compiler is (CI has gcc); without it
    the package silently runs the Python twin, so say so here instead."""
    if not env_flag("HISPARSE_NATIVE_WIRE", True):
        pytest.skip("HISPARSE_NATIVE_WIRE=0")
    assert NATIVE is not None, \
        "hisparse_ray.channel._wire did not build: see `pip install -e . -v`"
    assert StepCodec().native and StepCodec().fresh().native
    assert not StepCodec(native=False).native


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_native_writes_pythons_bytes(data):
    """Two encoders fed one stream (commands and reports, some lost, tiny id tables dropped):
    every command encodes to the same bytes; every message decodes equal on both decoders."""
    pool = [T.RequestId(s) for s in data.draw(st.lists(st.text(max_size=4), min_size=1,
                                                        max_size=6, unique=True))]
    hots = data.draw(st.lists(st.lists(st.integers(-1, 2**40), max_size=4).map(tuple),
                              min_size=1, max_size=3))
    ids = st.sampled_from(pool)
    hot = st.sampled_from(hots) | st.sampled_from(hots).map(lambda h: tuple(list(h)))
    max_ids = data.draw(st.sampled_from([1, 3, 8192]))
    py, c = StepCodec(max_ids, native=False), StepCodec(max_ids, native=True)
    py_dec, c_dec = StepCodec(native=False), StepCodec(native=True)
    for _ in range(data.draw(st.integers(1, 15))):
        msg = data.draw(commands(ids, hot) | reports(ids))
        stepcodec._MEMO.clear()  # else the second encoder replays the first one's encoding
        a = py.dumps(msg)
        stepcodec._MEMO.clear()
        b = c.dumps(msg)
        if type(msg) is T.StepCommand:
            assert a == b
        else:
            assert a[0] == TAG_REPORT and b[0] == TAG_REPORT_BIN
        if data.draw(st.integers(0, 9)) == 0:  # encoded, not delivered: both restart
            py.reset()
            c.reset()
            continue
        got_py, got_c = py_dec.loads(b), c_dec.loads(b)
        assert _same(got_py, msg) and _same(got_c, msg)
        if type(msg) is T.StepReport:  # and marshal's report into the C decoder
            assert _same(c_dec.loads(a), msg)


@needs_native
@pytest.mark.parametrize("rep", [
    T.StepReport(3, T.Rank(1)),
    T.StepReport(2**63 - 1, T.Rank(0), enqueued=(1, -2), completed=(2**62,),
                 sampled=(("r\u00e9", 5), ("", -1)), hot_hits=4, hot_misses=0,
                 hits_by_request=(("r\u00e9", 3, 1), ("x" * 300, 0, 0))),
])
def test_binary_reports_read_the_same_in_c_and_python(rep):
    data = StepCodec(native=True).dumps(rep)
    assert data[0] == TAG_REPORT_BIN
    assert _same(StepCodec(native=False).loads(data), rep)
    assert _same(StepCodec(native=True).loads(data), rep)
    for cut in (1, 8, len(data) - 1):  # truncated: refused, never misread
        with pytest.raises(Exception):
            StepCodec(native=True).loads(data[:-cut])
        with pytest.raises(Exception):
            StepCodec(native=False).loads(data[:-cut])


@needs_native
@pytest.mark.parametrize("rep", [
    T.StepReport(1, T.Rank(0), sampled=(("r", True),)),  # bool: marshal keeps it a bool
    T.StepReport(1, T.Rank(0), sampled=(("\udc80", 1),)),  # lone surrogate id
    T.StepReport(1, T.Rank(0), hits_by_request=(("r", 2**64, 1),)),  # beyond int64
    T.StepReport(1, T.Rank(0), sampled=(("r", 1, 2),)),  # another arity
])
def test_reports_the_binary_layout_cannot_carry_take_marshal(rep):
    data = StepCodec(native=True).dumps(rep)
    assert data[0] == TAG_REPORT
    assert _same(StepCodec(native=True).loads(data), rep)


def _ring_pair(capacity: int, send_native: bool, recv_native: bool):
    out = ShmChannel.create("sender", capacity, codec=PickleCodec())
    inn = ShmChannel.attach(out.spec, codec=PickleCodec())
    out._ring = NATIVE if send_native else None
    inn._ring = NATIVE if recv_native else None
    return out, inn


@needs_native
@pytest.mark.parametrize("send_native,recv_native", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("seed", range(3))
def test_rings_interoperate_under_random_schedules(send_native, recv_native, seed):
    """A sender and a receiver thread, one on the C ring ops and the other on Python's (or both
    on C), a 256-byte ring so frames wrap and the sender hits a full ring; random sizes and
    random pauses on both sides: every message arrives once, in order, intact."""
    rng = random.Random(seed)
    out, inn = _ring_pair(256, send_native, recv_native)
    msgs = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 150))) for _ in range(400)]
    pauses = [rng.random() < 0.1 for _ in msgs]
    got: list[bytes] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            for p in pauses:
                got.append(inn.recv(timeout=30))
                if p:
                    threading.Event().wait(1e-4)
        except BaseException as err:  # surfaced below
            errors.append(err)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        for m, p in zip(msgs, reversed(pauses)):
            out.send(m, timeout=30)
            if p:
                threading.Event().wait(1e-4)
        t.join(60)
    finally:
        out.close()
        inn.close()
    assert not t.is_alive() and not errors, errors
    assert got == msgs


@needs_native
def test_c_ring_refuses_a_corrupt_frame():
    out, inn = _ring_pair(256, True, True)
    try:
        out.send(b"x")
        inn._seq = 5  # what a receiver that lost its place would expect
        with pytest.raises(Exception, match="corrupt frame"):
            inn.recv(timeout=1)
    finally:
        out.close()
        inn.close()


@needs_native
def test_step_messages_round_trip_through_the_c_ring():
    out = ShmChannel.create("sender", 4096)
    inn = ShmChannel.attach(out.spec)
    try:
        assert out._ring is NATIVE and out._codec.native and inn._codec.native
        rows = tuple(T.BatchRow(T.RequestId(f"r{i}"), 10 + i, i, (i, i + 1)) for i in range(4))
        for step in range(50):  # > ring capacity in total: wraps
            cmd = T.StepCommand(step, T.Rank(0), rows, backups=(
                T.Backup(step, T.RequestId("r1"), 10, 3, 2),))
            out.send(cmd)
            assert _same(inn.recv(timeout=1), cmd)
            rows = tuple(dataclasses.replace(r, seq_len=r.seq_len + 1) for r in rows)
    finally:
        out.close()
        inn.close()


@needs_native
def test_corrupted_messages_never_crash_or_balloon_the_decoders():
    """``_wire_fuzz`` in a child process with a 2 GiB address-space limit: crafted and random
    corruptions of commands and binary reports decode or raise ChannelError in both decoders,
    allocate at most a few dozen bytes per message byte, and never hit a MemoryError. (In a
    child so that a regression fails this test, not the CI machine: a corrupt id index once made
    the C decoder grow its id table towards 2**32 entries and the kernel killed pytest.)"""
    root = pathlib.Path(__file__).resolve().parents[2]

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-m", "tests.channel._wire_fuzz"], cwd=root,
                          preexec_fn=limit, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"
    assert "ok:" in proc.stdout
