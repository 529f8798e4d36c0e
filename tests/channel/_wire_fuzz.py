"""Run in a child process by ``test_codec`` (under an address-space limit, so a decoder that tried
to allocate for a corrupt count fails there instead of taking CI's memory): corrupted step
messages, crafted and random, must decode or raise ``ChannelError``, never crash, never allocate
out of proportion to the message, never fail for want of memory."""

from __future__ import annotations

import struct
import sys
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray import types as T
from hisparse_ray.channel.codec import StepCodec
from hisparse_ray.errors import ChannelError

from .test_codec import commands, reports

# A decode allocates a few Python objects per byte of its message: bound it generously.
_BYTES_PER_MESSAGE_BYTE = 64
_SLACK = 256 << 10
_CODEC = StepCodec()


def _decode_within_bounds(raw: bytes, what: str) -> None:
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        _CODEC.loads(raw)
    except ChannelError as err:
        assert not isinstance(err.__cause__, MemoryError), (what, err)
        assert "MemoryError" not in str(err), (what, err)
    peak = tracemalloc.get_traced_memory()[1] - base
    limit = _BYTES_PER_MESSAGE_BYTE * len(raw) + _SLACK
    assert peak <= limit, f"{what}: decode allocated {peak} B for {len(raw)}"


def _crafted() -> list[tuple[str, bytes]]:
    """Valid messages with one array, string or binary length set far past what their bytes
    carry: every MessagePack length header (0xdc/0xdd array 16/32, 0xda/0xdb str 16/32)."""
    cmd = T.StepCommand(1, (T.BatchRow(0, 7, 1, (3, 4)),), handles=(T.RequestHandle(0, "ab"),))
    rep = T.StepReport(2, T.Rank(1), enqueued=(1,), completed=(2,), sampled=(("x", 5),),
                       hits_by_request=(("y", 1, 0),))
    cases = []
    for name, msg in (("command", cmd), ("report", rep)):
        good = _CODEC.dumps(msg)
        for i, b in enumerate(good):
            if 0x90 <= b <= 0x9F:  # a fixarray header: make it a 32-bit array of 2**32 - 1
                cases.append((f"{name} array at {i}", good[:i] + b"\xdd\xff\xff\xff\xff"
                              + good[i + 1:]))
                cases.append((f"{name} array16 at {i}", good[:i] + b"\xdc\xff\xff" + good[i + 1:]))
            if 0xA0 <= b <= 0xBF:  # a fixstr header: a 32-bit string of 2**31
                cases.append((f"{name} str at {i}", good[:i] + b"\xdb\x80\x00\x00\x00"
                              + good[i + 1:]))
        cases.append((f"{name} bin 2**31", b"\xc6\x80\x00\x00\x00" + good))
        cases.append((f"{name} ext 2**31", b"\xc9\x80\x00\x00\x00\x01" + good))
    nested = b"\x91" * 100_000  # arrays nested past any stack
    cases.append(("deep nesting", nested))
    return cases


ids = st.text(max_size=4).map(T.RequestId)
ints = st.integers(-1, 2**20)


@settings(max_examples=200, deadline=None, database=None)
@given(st.data())
def fuzz(data):
    """Flipped bytes, 32-bit words, truncations and garbage after a valid command or report."""
    msg = data.draw(commands(ids, ints=ints) | reports(ids, ints=ints))
    raw = bytearray(_CODEC.dumps(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "word", "cut", "grow"]))
        if op == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif op == "word" and len(raw) > 4:
            struct.pack_into(">I", raw, data.draw(st.integers(0, len(raw) - 4)),
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
    print(f"ok: {len(cases)} crafted cases, fuzz passed")


if __name__ == "__main__":
    sys.exit(main())
