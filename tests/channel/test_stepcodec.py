"""StepCodec, the stateful binary step codec: every message decodes equal (same types) to what was
encoded, over random single messages and random stateful sequences (ids appearing, repeating,
released and re-used, hot buffers kept or changed, tables dropped, undelivered messages). Every
test runs on the pure-Python codec and on the C hot path (``hisparse_ray.channel._wire``); the C
path must also write the very bytes Python writes (``test_native_writes_pythons_bytes``)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.stepcodec import (
    _LAYOUT,
    NATIVE,
    TAG_COMMAND,
    TAG_FALLBACK,
    TAG_REPORT,
    TAG_REPORT_BIN,
    StepCodec,
    layout_matches,
)
from hisparse_ray.errors import ChannelError

# every test on both codecs; the C one is built by `pip install -e .` wherever a compiler is
# (CI has one: test_native_is_built says so)
pytestmark = pytest.mark.parametrize("native", [
    False, pytest.param(True, marks=pytest.mark.skipif(NATIVE is None, reason="_wire not built"))],
    ids=["python", "native"])

i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-1, 2**31 - 1)
any_id = st.text(max_size=10).map(T.RequestId)


def _same(a, b) -> bool:
    """Equal, with the same types all the way down (tuples stay tuples, enums stay enums)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def commands(ids=any_id, hot=st.lists(small, max_size=6).map(tuple), ints=small):
    rows = st.builds(T.BatchRow, ids, ints, ints, hot)
    diffs = st.builds(T.TableDiff, ids, ints, ints, ints)
    xfers = st.builds(T.PageTransfer, ints, st.sampled_from(T.TransferKind), ints, ints)
    backups = st.builds(T.Backup, ints, ids, ints, ints, ints)
    tup = lambda s, n: st.lists(s, max_size=n).map(tuple)  # noqa: E731
    return st.builds(T.StepCommand, ints, ints, tup(rows, 6), tup(diffs, 4), tup(xfers, 4),
                     tup(backups, 6), tup(ids, 3))


def reports(ids=any_id, ints=small):
    tup = lambda s, n: st.lists(s, max_size=n).map(tuple)  # noqa: E731
    return st.builds(T.StepReport, ints, ints, tup(ints, 5), tup(ints, 5),
                     tup(st.tuples(ids, ints), 5), ints, ints,
                     tup(st.tuples(ids, ints, ints), 5))


def test_layout_covers_every_wire_field(native):
    """The binary path is active for every message type (a field added to types.py lands here:
    teach stepcodec's layout the field; until then such messages ride the fallback)."""
    for cls in _LAYOUT:
        assert layout_matches(cls), f"{cls.__name__} fields changed: update stepcodec._LAYOUT"
    codec = StepCodec(native=native)
    assert codec.dumps(T.StepCommand(1, T.Rank(0), ()))[0] == TAG_COMMAND
    assert codec.dumps(T.StepReport(1, T.Rank(0)))[0] == (TAG_REPORT_BIN if native else TAG_REPORT)


@settings(max_examples=150, deadline=None)
@given(st.one_of(commands(ints=i64), reports(ints=i64)))
def test_single_message_round_trip(native, msg):
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    data = enc.dumps(msg)
    assert data[0] in (TAG_COMMAND, TAG_REPORT_BIN if native else TAG_REPORT)
    assert _same(dec.loads(data), msg)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_stateful_sequences(native, data):
    """A stream over a small id pool: ids repeat, get released and come back; hot buffers repeat
    (same tuple object or an equal copy) or change; some messages are encoded but never delivered
    (the channel then resets the encoder); a tiny id table is dropped now and then."""
    pool = [T.RequestId(s) for s in data.draw(st.lists(st.text(max_size=4), min_size=1,
                                                        max_size=6, unique=True))]
    hots = data.draw(st.lists(st.lists(small, max_size=4).map(tuple), min_size=1, max_size=3))
    ids = st.sampled_from(pool)
    hot = st.sampled_from(hots) | st.sampled_from(hots).map(lambda h: tuple(list(h)))
    max_ids = data.draw(st.sampled_from([1, 3, 8192]))
    # a TP group: each rank's channel gets the same stream (its own rank), so the encoders share
    # encodings through the memo; each may also lose a message on its own
    ranks = [(StepCodec(max_ids, native=native), StepCodec(native=native)) for _ in range(data.draw(st.integers(1, 3)))]
    for _ in range(data.draw(st.integers(1, 15))):
        msg = data.draw(commands(ids, hot) | reports(ids))
        for r, (enc, dec) in enumerate(ranks):
            mine = dataclasses.replace(msg, rank=T.Rank(r))
            payload = enc.dumps(mine)
            if data.draw(st.integers(0, 9)) == 0:
                enc.reset()  # encoded, not delivered
                continue
            assert payload[0] != TAG_FALLBACK
            assert _same(dec.loads(payload), mine)


def test_unchanged_hot_buffers_are_not_resent(native):
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    hot = tuple(range(1000, 1033))
    rows = lambda step: tuple(T.BatchRow(T.RequestId(f"r{i}"), step, 7, tuple(hot))  # noqa: E731
                              for i in range(32))
    first = enc.dumps(T.StepCommand(0, T.Rank(0), rows(10)))
    second = enc.dumps(T.StepCommand(1, T.Rank(0), rows(11)))
    assert len(second) < len(first) - 32 * 33 * 8  # no hot values, no id strings
    a, b = dec.loads(first), dec.loads(second)
    assert _same(b, T.StepCommand(1, T.Rank(0), rows(11)))
    assert b.batch[5].hot_blocks is a.batch[5].hot_blocks  # the decoder hands back its tuple


def test_tp_group_encodes_a_step_once(native):
    """Equal commands (rank aside) from equal encoder states: one encoding, rank re-packed."""
    group = [StepCodec(native=native) for _ in range(3)]
    rows = tuple(T.BatchRow(T.RequestId(f"r{i}"), 9, 1, (i, i + 1)) for i in range(8))
    for step in range(3):
        payloads = [e.dumps(T.StepCommand(step, T.Rank(r), rows)) for r, e in enumerate(group)]
        assert len({p[:10] + p[18:] for p in payloads}) == 1  # only the rank field differs
        assert len({e._token for e in group}) == 1 and group[0]._token != 0
    group[1].reset()  # rank 1 lost a message: it encodes on its own from now on
    cmd = T.StepCommand(3, T.Rank(1), rows)
    assert _same(StepCodec(native=native).loads(group[1].dumps(cmd)), cmd)


def test_released_ids_are_forgotten_and_indices_reused(native):
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    r = lambda s: T.BatchRow(T.RequestId(s), 1, 2, (3,))  # noqa: E731
    msgs = [T.StepCommand(0, T.Rank(0), (r("a"), r("b"))),
            T.StepCommand(1, T.Rank(0), (r("b"),), released=(T.RequestId("a"),)),
            T.StepCommand(2, T.Rank(0), (r("c"), r("a"), r("b")))]
    for m in msgs:
        assert _same(dec.loads(enc.dumps(m)), m)
    assert sorted(enc._ids.values()) == [0, 1, 2] and len(enc._ids) == 3


class Tok(int):
    """An int subclass: equal to its value, but the binary layout would decode a plain int."""

    def __eq__(self, other):
        return type(other) is Tok and int(self) == int(other)

    __hash__ = int.__hash__


@pytest.mark.parametrize("msg", [
    T.StepCommand(1, T.Rank(0), [T.BatchRow(T.RequestId("r"), 1, 2)]),  # a list, not a tuple
    T.StepCommand(1, T.Rank(0), (T.BatchRow(5, 1, 2),)),  # non-str request id
    T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("r"), 2**64, 2),)),  # beyond int64
    T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("r"), 1, 2, [4, 5]),)),  # list hot
    T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("r"), 1.5, 2),)),  # float
    T.StepReport(1, T.Rank(0), sampled=((T.RequestId("r"), Tok(1)),)),  # an int subclass
    T.StepReport(1, T.Rank(0), enqueued=(T.TransferKind.SPILL,)),  # not a builtin
    T.TableDiff(T.RequestId("r"), 1, 2, -1),  # not a top-level message
    {"any": ("picklable", b"object")},
])
def test_values_the_layout_cannot_carry_ride_the_fallback(native, msg):
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    ok = T.StepCommand(0, T.Rank(0), (T.BatchRow(T.RequestId("r"), 1, 2, (9,)),))
    assert _same(dec.loads(enc.dumps(ok)), ok)
    data = enc.dumps(msg)
    assert data[0] == TAG_FALLBACK
    back = dec.loads(data)
    assert type(back) is type(msg) and back == msg
    # the stream goes on exactly after a fallback (the encoder restarted its tables)
    nxt = T.StepCommand(2, T.Rank(0), (T.BatchRow(T.RequestId("r"), 3, 4, (9,)),))
    assert _same(dec.loads(enc.dumps(nxt)), nxt)


def test_reports_of_any_shape_are_exact(native):
    """Reports are marshalled: odd shapes (lists, wrong arity, bools) come back exactly."""
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    for rep in [T.StepReport(1, T.Rank(0), sampled=(("r", 1, 2),)),
                T.StepReport(1, T.Rank(0), enqueued=[1, 2], hot_hits=True),
                T.StepReport(1, T.Rank(0), hits_by_request=(("r", 2**70, -1),))]:
        data = enc.dumps(rep)
        assert data[0] == TAG_REPORT
        assert _same(dec.loads(data), rep)


def test_failed_decode_refuses_later_messages(native):
    enc, dec = StepCodec(native=native), StepCodec(native=native)
    good = enc.dumps(T.StepCommand(0, T.Rank(0), (T.BatchRow(T.RequestId("r"), 1, 2),)))
    with pytest.raises(ChannelError):
        dec.loads(good[:-4])  # truncated
    with pytest.raises(ChannelError):
        dec.loads(good)
    assert pickle.loads(pickle.dumps(ChannelError("x", "c"))).channel == "c"


def test_fresh_codecs_share_no_state(native):
    a = StepCodec(max_ids=16, native=native)
    b = a.fresh()
    assert b.max_ids == 16 and b is not a
    a.dumps(T.StepCommand(0, T.Rank(0), (T.BatchRow(T.RequestId("r"), 1, 2),)))
    assert a._ids and not b._ids
    with pytest.raises(ValueError):
        StepCodec(max_ids=0, native=native)
