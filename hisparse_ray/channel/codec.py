"""The step channel's codecs (adapter ring): the ``Codec`` protocol, :class:`StepCodec` (the one
codec of the per-step wire: ``StepCommand`` and ``StepReport`` as MessagePack through one
``msgspec`` encoder and one typed decoder) and plain pickle (any object; tests and baselines).

``StepCodec`` holds no state: a command names requests by the integer handles it defines and
carries hot-buffer changes as diffs (:mod:`hisparse_ray.types`), so any message decodes alone,
every reader of a broadcast decodes the same bytes, and a lost or corrupt message cannot put a
later one out of step. Corrupt bytes raise ``ChannelError`` (msgspec validates every field's type
while decoding, and checks every length against the bytes left before allocating: the fuzz test
in ``tests/channel`` runs it under an address-space limit).
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import msgspec

from hisparse_ray.errors import ChannelError
from hisparse_ray.types import StepCommand, StepReport

_PROTO = pickle.HIGHEST_PROTOCOL


class Codec(Protocol):
    """Turns one message into bytes and back; ``loads(dumps(x)) == x``."""

    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class StepCodec:
    """``StepCommand`` / ``StepReport`` <-> MessagePack (each a tagged array of its fields).

    ``dumps`` refuses anything else (``TypeError``); ``loads`` returns exactly one of the two
    types with every field checked against its annotation, or raises ``ChannelError``. Stateless:
    one instance may serve any number of channels and threads."""

    __slots__ = ("_enc", "_dec")

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(StepCommand | StepReport)

    def dumps(self, obj: Any) -> bytes:
        cls = type(obj)
        if cls is not StepCommand and cls is not StepReport:
            raise TypeError(f"the step codec carries StepCommand and StepReport, not {cls.__name__}")
        return self._enc.encode(obj)

    def loads(self, data: bytes) -> StepCommand | StepReport:
        try:
            return self._dec.decode(data)
        except (msgspec.DecodeError, ValueError, RecursionError) as err:
            # DecodeError (ValidationError is one), a string that is not UTF-8 (ValueError)
            raise ChannelError(f"unreadable step message: {err!r}") from None


class PickleCodec:
    """Plain pickle (highest protocol): any picklable object. Trusts its bytes (tests, tools)."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=_PROTO)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)
