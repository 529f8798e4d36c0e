"""A rank's end of the step channel, or any two-way link (adapter ring, standard library): two
:class:`~hisparse_ray.channel.ring.ShmRing`\\ s, messages out and messages in.
"""

from __future__ import annotations

from typing import Any

from hisparse_ray.channel.codec import Codec
from hisparse_ray.channel.ring import (
    DEFAULT_CAPACITY, DEFAULT_PREFIX, ChannelSpec, ShmRing, WaitPolicy,
)


class ChannelPair:
    """Both directions of one link: ``send`` goes out on ``outbox`` (this end writes it),
    ``recv`` comes in on ``inbox`` (this end reads it, possibly as one reader of a broadcast).

    ``create`` makes both rings (one reader each) and hands ``spec`` to the peer, which
    ``attach``es with the roles swapped. A TP rank attaches to its coordinator's
    :class:`~hisparse_ray.channel.fanout.RankChannels` the same way: its inbox is then its reader
    of the command broadcast.
    """

    def __init__(self, outbox: ShmRing, inbox: ShmRing) -> None:
        assert outbox.role == "writer" and inbox.role == "reader"
        self.outbox, self.inbox = outbox, inbox

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, *, prefix: str = DEFAULT_PREFIX,
               policy: WaitPolicy | None = None, codec: Codec | None = None) -> ChannelPair:
        out = ShmRing.create("writer", capacity, prefix=prefix, policy=policy, codec=codec)
        try:
            inb = ShmRing.create("reader", capacity, prefix=prefix, policy=policy, codec=codec)
        except BaseException:
            out.close()
            raise
        return cls(out, inb)

    @property
    def spec(self) -> tuple[ChannelSpec, ChannelSpec]:
        """(creator's outbox, creator's inbox): pass to ``attach`` in the peer process."""
        return (self.outbox.spec, self.inbox.spec)

    @classmethod
    def attach(cls, spec: tuple[ChannelSpec, ChannelSpec], *,
               policy: WaitPolicy | None = None, codec: Codec | None = None) -> ChannelPair:
        their_out, their_in = spec
        inb = ShmRing.attach(their_out, policy=policy, codec=codec)
        try:
            out = ShmRing.attach(their_in, policy=policy, codec=codec)
        except BaseException:
            inb.close()
            raise
        return cls(out, inb)

    def send(self, obj: Any, timeout: float | None = None) -> None:
        self.outbox.send(obj, timeout)

    def recv(self, timeout: float | None = None) -> Any:
        return self.inbox.recv(timeout)

    @property
    def ready_t(self) -> float:
        """``perf_counter()`` when the last received message was found, before decoding."""
        return self.inbox.ready_t

    def close(self) -> None:
        self.outbox.close()
        self.inbox.close()

    def __enter__(self) -> ChannelPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
