"""The step channel's codecs: the fast wire codec rebuilds exactly the objects pickle would."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.codec import PickleCodec, WireCodec

ids = st.integers(0, 2**31 - 1)
req = st.text(min_size=1, max_size=12).map(T.RequestId)
rows = st.builds(T.BatchRow, req, ids, ids, st.tuples(ids, ids).map(
    lambda t: tuple(map(T.DeviceBlockId, t))))
diffs = st.builds(T.TableDiff, req, ids, st.integers(-1, 9), st.integers(-1, 9))
xfers = st.builds(T.PageTransfer, ids.map(T.TransferId), st.sampled_from(T.TransferKind),
                  ids.map(T.DeviceBlockId), ids.map(T.HostBlockId))
backups = st.builds(T.Backup, ids.map(T.TransferId), req, ids, ids.map(T.HostBlockId), ids)
commands = st.builds(T.StepCommand, ids, ids.map(T.Rank), st.tuples(rows, rows),
                     st.lists(diffs, max_size=4).map(tuple), st.lists(xfers, max_size=4).map(tuple),
                     st.lists(backups, max_size=4).map(tuple), st.lists(req, max_size=3).map(tuple))
reports = st.builds(T.StepReport, ids, ids.map(T.Rank),
                    st.lists(ids.map(T.TransferId), max_size=5).map(tuple),
                    st.lists(ids.map(T.TransferId), max_size=5).map(tuple),
                    st.lists(st.tuples(req, ids), max_size=3).map(tuple), ids, ids)


@settings(max_examples=60, deadline=None)
@given(st.one_of(commands, reports))
def test_wire_codec_round_trips_like_pickle(msg):
    codec = WireCodec()
    back = codec.loads(codec.dumps(msg))
    assert type(back) is type(msg)
    assert back == msg == pickle.loads(pickle.dumps(msg))
    kinds = [t.kind for t in getattr(back, "transfers", ())]
    assert all(isinstance(k, T.TransferKind) for k in kinds)


def test_other_objects_fall_back_to_pickle():
    codec = WireCodec()
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    for obj in [None, (1, b"x"), {"a": [1, 2]}, T.TableDiff(T.RequestId("r"), 1, 2, -1)]:
        assert codec.loads(codec.dumps(obj)) == obj
    assert np.array_equal(codec.loads(codec.dumps(arr)), arr)
    assert PickleCodec().loads(PickleCodec().dumps(arr)).tolist() == arr.tolist()


def test_wire_codec_follows_every_field():
    """Each wire message's flattened form has one entry per dataclass field (new fields ride
    along without touching the codec)."""
    import dataclasses

    codec = WireCodec()
    cmd = T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("r"), 5, 9),))
    tag, body = pickle.loads(codec.dumps(cmd))
    assert len(body) == len(dataclasses.fields(T.StepCommand))
