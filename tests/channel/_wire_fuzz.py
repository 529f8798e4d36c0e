"""Run in a child process by ``test_native_wire`` (under an address-space limit, so a decoder
that tried to allocate for a corrupt count fails there instead of taking CI's memory): corrupted
step messages, crafted and random, must decode or raise ``ChannelError``, never crash, never
allocate out of proportion to the message, never fail for want of memory.

Only the binary layouts are corrupted here (commands and ``TAG_REPORT_BIN``): the marshal and
pickle fallbacks trust their bytes (``marshal.loads`` allocates a tuple as long as the message
says), which is sound for a channel between processes of one replica whose ring frames carry a
sequence check (``test_c_ring_refuses_a_corrupt_frame``)."""

from __future__ import annotations

import struct
import sys
import tracemalloc

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.stepcodec import NATIVE, TAG_COMMAND, TAG_REPORT_BIN, StepCodec
from hisparse_ray.errors import ChannelError

from .test_stepcodec import commands, reports

# A decode allocates a few Python objects per 8-byte value of its message: bound it generously.
_BYTES_PER_MESSAGE_BYTE = 64
_SLACK = 256 << 10
_CODECS = (True, False) if NATIVE is not None else (False,)


def _decode_within_bounds(raw: bytes, what: str) -> None:
    for native in _CODECS:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            StepCodec(native=native).loads(raw)
        except ChannelError as err:
            assert not isinstance(err.__cause__, MemoryError), (what, native, err)
        peak = tracemalloc.get_traced_memory()[1] - base
        limit = _BYTES_PER_MESSAGE_BYTE * len(raw) + _SLACK
        assert peak <= limit, f"{what} (native={native}): decode allocated {peak} B for {len(raw)}"


def _u32(raw: bytearray, off: int, value: int) -> bytes:
    struct.pack_into("<I", raw, off, value)
    return bytes(raw)


def _crafted() -> list[tuple[str, bytes]]:
    """Valid messages with one count, index or length set far past what their bytes carry."""
    huge = 0xFFFFFFFF
    cmd = T.StepCommand(1, T.Rank(0), (T.BatchRow(T.RequestId("ab"), 7, 1, (3, 4)),))
    good = bytearray(StepCodec(native=False).dumps(cmd))
    assert good[0] == TAG_COMMAND
    vals = 46 + 8 * 1 + 2  # header, one definition (index, length), the id's 2 bytes
    cases = [(f"definition index {i}", _u32(bytearray(good), 46, i))
             for i in (huge, huge - 1, 1 << 24, 2)]
    for name, off in (("batch rows", 18), ("diffs", 22), ("transfers", 26), ("backups", 30),
                      ("released", 34), ("definitions", 38), ("hot values", 42)):
        cases.append((f"{name} count", _u32(bytearray(good), off, huge)))
    for ln in (2**63 - 1, 2**62, 2**40):
        raw = bytearray(good)
        struct.pack_into("<q", raw, vals + 8 * 3, ln)  # the row's hot_blocks length
        cases.append((f"hot length {ln}", bytes(raw)))
    rep = T.StepReport(2, T.Rank(1), enqueued=(1,), completed=(2,), sampled=(("x", 5),),
                       hits_by_request=(("y", 1, 0),))
    good = bytearray(StepCodec(native=True).dumps(rep)) if NATIVE is not None else None
    if good is not None:
        assert good[0] == TAG_REPORT_BIN
        for name, off in (("enqueued", 33), ("completed", 37), ("sampled", 41), ("hits", 45)):
            cases.append((f"report {name} count", _u32(bytearray(good), off, huge)))
            cases.append((f"report {name} count 2**28", _u32(bytearray(good), off, 1 << 28)))
        cases.append(("report id length", _u32(bytearray(good), 1 + 32 + 16 + 16, huge)))
    return cases


ids = st.text(max_size=4).map(T.RequestId)
ints = st.integers(-1, 2**20)


@settings(max_examples=300, deadline=None, database=None)
@given(st.data())
def fuzz(data):
    """Flipped bytes, truncations and garbage after a valid command or binary report."""
    msg = data.draw(commands(ids, ints=ints) | reports(ids, ints=ints))
    raw = bytearray(StepCodec(native=data.draw(st.booleans())).dumps(msg))
    assume(raw[0] in (TAG_COMMAND, TAG_REPORT_BIN))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "word", "cut", "grow"]))
        if op == "flip" and len(raw) > 1:
            i = data.draw(st.integers(1, len(raw) - 1))  # keep the tag: the fallback is pickle
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "word" and len(raw) > 5:  # a whole count or index, not one byte of it
            _u32(raw, data.draw(st.integers(1, len(raw) - 4)),
                 data.draw(st.sampled_from([0xFFFFFFFF, 1 << 31, 1 << 24, 65536])))
        elif op == "cut" and len(raw) > 1:
            del raw[data.draw(st.integers(1, len(raw) - 1)):]
        else:
            raw += data.draw(st.binary(max_size=16))
    _decode_within_bounds(bytes(raw), "fuzzed")


def main() -> None:
    tracemalloc.start()
    cases = _crafted()
    for what, raw in cases:
        _decode_within_bounds(raw, what)
    fuzz()
    print(f"ok: {len(cases)} crafted cases, fuzz passed, codecs native={_CODECS}")


if __name__ == "__main__":
    sys.exit(main())
