"""The step codec (``msgspec``, typed, stateless): every message decodes equal, with the same
types, to what was encoded, alone and in any order; anything else is refused; corrupt bytes are a
``ChannelError`` that never crashes or allocates out of proportion (``_wire_fuzz`` in a child
under an address-space limit)."""

from __future__ import annotations

import pathlib
import pickle
import resource
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.codec import PickleCodec, StepCodec
from hisparse_ray.errors import ChannelError

i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-1, 2**31 - 1)
any_id = st.text(max_size=10).map(T.RequestId)


def _same(a, b) -> bool:
    """Equal, with the same types all the way down (tuples stay tuples, enums stay enums)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, msgspec.Struct):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def commands(ids=any_id, ints=small):
    tup = lambda s, n: st.lists(s, max_size=n).map(tuple)  # noqa: E731
    hot = st.none() | tup(ints, 6)
    rows = st.builds(T.BatchRow, ints, ints, ints, hot, ints)  # prev_row too
    diffs = st.builds(T.TableDiff, ints, ints, ints, ints)
    xfers = st.builds(T.PageTransfer, ints, st.sampled_from(T.TransferKind), ints, ints)
    backups = st.builds(T.Backup, ints, ints, ints, ints, ints)
    handles = st.builds(T.RequestHandle, ints, ids)
    return st.builds(T.StepCommand, ints, tup(rows, 6), tup(diffs, 4), tup(xfers, 4),
                     tup(backups, 6), tup(ints, 3), tup(handles, 4), ints)


def reports(ids=any_id, ints=small):
    tup = lambda s, n: st.lists(s, max_size=n).map(tuple)  # noqa: E731
    return st.builds(T.StepReport, ints, ints, tup(ints, 5), tup(ints, 5),
                     tup(st.tuples(ids, ints), 5), ints, ints,
                     tup(st.tuples(ids, ints, ints), 5), ints)


@settings(max_examples=200, deadline=None)
@given(commands(ints=i64) | reports(ints=i64))
def test_every_message_round_trips_exactly(msg):
    codec = StepCodec()
    assert _same(codec.loads(codec.dumps(msg)), msg)


@settings(max_examples=50, deadline=None)
@given(st.lists(commands() | reports(), min_size=1, max_size=8), st.randoms())
def test_stateless_any_message_decodes_alone_in_any_order(msgs, rng):
    """What a reader decoded before changes nothing: a broadcast's readers, a reader that
    missed messages, and two codecs decode the same bytes to the same messages."""
    blobs = [StepCodec().dumps(m) for m in msgs]
    order = list(range(len(msgs)))
    rng.shuffle(order)
    reader = StepCodec()
    for i in order:
        assert _same(reader.loads(blobs[i]), msgs[i])


def test_the_wire_fields_are_what_the_core_sends():
    """A guard against a field slipping out of the messages (every field is on the wire, in
    declaration order: ``array_like``)."""
    assert T.StepCommand.__struct_fields__ == (
        "step", "batch", "table_diffs", "transfers", "backups", "released", "handles", "host_seq")
    assert T.BatchRow.__struct_fields__ == ("handle", "seq_len", "input_token", "hot_blocks",
                                            "prev_row")
    assert T.StepReport.__struct_fields__ == (
        "step", "rank", "enqueued", "completed", "sampled", "hot_hits", "hot_misses",
        "hits_by_request", "published")


@pytest.mark.parametrize("obj", [{"a": 1}, (1, 2), "x", T.BatchRow(0, 1, 2)])
def test_anything_but_a_command_or_report_is_refused(obj):
    with pytest.raises(TypeError):
        StepCodec().dumps(obj)


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgspec.msgpack.encode([3, 1]),  # unknown tag
    msgspec.msgpack.encode([1, "one"]),  # a string where the step goes
    msgspec.msgpack.encode([1, 2, [[0, 1, 2, None, 9, 4]]]),  # a row with an extra field
    msgspec.msgpack.encode([2, 1, True]),  # a bool is not a rank
    msgspec.msgpack.encode([1, 2, [], [], [[1, "burn", 0, 0]]]),  # no such transfer kind
])
def test_malformed_messages_are_channel_errors(raw):
    with pytest.raises(ChannelError, match="unreadable step message"):
        StepCodec().loads(raw)


def test_pickle_codec_round_trips_any_object():
    obj = {"a": (1, 2.5, "x"), "b": [None, b"\x00"]}
    assert PickleCodec().loads(PickleCodec().dumps(obj)) == obj
    msg = T.StepCommand(1, handles=(T.RequestHandle(0, "a"),))
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_corrupted_messages_never_crash_or_balloon_the_decoder():
    """``_wire_fuzz`` in a child process with a 2 GiB address-space limit: crafted and random
    corruptions of commands and reports decode or raise ChannelError, allocate at most a few
    dozen bytes per message byte, and never hit a MemoryError. (In a child so that a regression
    fails this test, not the CI machine: a corrupt count once made the old C decoder grow a table
    towards 2**32 entries and the kernel killed pytest.)"""
    root = pathlib.Path(__file__).resolve().parents[2]

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-m", "tests.channel._wire_fuzz"], cwd=root,
                          preexec_fn=limit, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"
    assert "ok:" in proc.stdout
