"""The channel's codec basics: plain pickle carries any object, and the slot-setting constructors
StepCodec rebuilds wire dataclasses with give objects equal to the dataclasses' own."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.codec import PickleCodec, slot_constructor

ids = st.integers(0, 2**31 - 1)
req = st.text(min_size=1, max_size=12).map(T.RequestId)
rows = st.builds(T.BatchRow, req, ids, ids, st.tuples(ids, ids).map(
    lambda t: tuple(map(T.DeviceBlockId, t))))
diffs = st.builds(T.TableDiff, req, ids, st.integers(-1, 9), st.integers(-1, 9))
xfers = st.builds(T.PageTransfer, ids.map(T.TransferId), st.sampled_from(T.TransferKind),
                  ids.map(T.DeviceBlockId), ids.map(T.HostBlockId))
backups = st.builds(T.Backup, ids.map(T.TransferId), req, ids, ids.map(T.HostBlockId), ids)


@settings(max_examples=60, deadline=None)
@given(st.one_of(rows, diffs, xfers, backups))
def test_slot_constructor_builds_what_the_dataclass_builds(obj):
    cls = type(obj)
    names = [f.name for f in dataclasses.fields(cls)]
    make = slot_constructor(cls, names)
    assert make is not cls  # slots, no __post_init__: the fast path
    back = make(*(getattr(obj, n) for n in names))
    assert type(back) is cls and back == obj
    assert hash(back) == hash(obj)


def test_slot_constructor_keeps_a_class_that_validates():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("n")

    assert slot_constructor(Checked, ["n"]) is Checked


def test_pickle_codec_round_trips_any_object():
    codec = PickleCodec()
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    for obj in [None, (1, b"x"), {"a": [1, 2]}, T.TableDiff(T.RequestId("r"), 1, 2, -1),
                T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("r"), 5, 9),))]:
        assert codec.loads(codec.dumps(obj)) == obj
    assert np.array_equal(codec.loads(codec.dumps(arr)), arr)
