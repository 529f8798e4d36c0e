"""Both directions between the coordinator and one TP rank (adapter ring, standard library): two
:class:`~hisparse_ray.channel.ring.ShmChannel` rings, commands out and reports in.
"""

from __future__ import annotations

from typing import Any

from hisparse_ray.channel.codec import Codec
from hisparse_ray.channel.ring import (
    DEFAULT_CAPACITY, DEFAULT_PREFIX, ChannelSpec, ShmChannel, WaitPolicy,
)


class ChannelPair:
    """Both directions between the coordinator and one rank: ``send`` goes out, ``recv`` comes in.

    The coordinator ``create``s (it sends commands, receives reports) and hands ``spec`` to the
    rank, which ``attach``es (it receives commands, sends reports).
    """

    def __init__(self, outbox: ShmChannel, inbox: ShmChannel) -> None:
        assert outbox.role == "sender" and inbox.role == "receiver"
        self.outbox, self.inbox = outbox, inbox

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, *, prefix: str = DEFAULT_PREFIX,
               policy: WaitPolicy | None = None, codec: Codec | None = None) -> ChannelPair:
        out = ShmChannel.create("sender", capacity, prefix=prefix, policy=policy, codec=codec)
        try:
            inb = ShmChannel.create("receiver", capacity, prefix=prefix, policy=policy,
                                    codec=codec)
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
        inb = ShmChannel.attach(their_out, policy=policy, codec=codec)
        try:
            out = ShmChannel.attach(their_in, policy=policy, codec=codec)
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
