"""The one HiSparse error hierarchy (all rings).

Every exception keeps ``self.args`` equal to the positional arguments of its ``__init__``: that is
what pickle (and so Ray, when it re-raises an actor's exception on the caller) uses to rebuild it.
Subclasses with fields therefore pass exactly those fields to ``super().__init__`` and format the
message in ``__str__``.
"""

from __future__ import annotations

from typing import Any


class HiSparseError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(HiSparseError, ValueError):
    """A configuration value is invalid: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(key, value, allowed)
        self.key, self.value, self.allowed = key, value, allowed

    def __str__(self) -> str:
        return f"invalid config {self.key}={self.value!r}: {self.allowed}"


class StateError(HiSparseError):
    """A call that the coordinator's or a pool's current state does not allow (state unchanged)."""


class UnknownRequestError(StateError, KeyError):
    def __init__(self, request_id: Any) -> None:
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"unknown request id {self.request_id!r}"


class DuplicateRequestError(StateError):
    def __init__(self, request_id: Any) -> None:
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"request id {self.request_id!r} is already known"


class UnknownTransferError(StateError, KeyError):
    def __init__(self, transfer_id: Any) -> None:
        super().__init__(transfer_id)
        self.transfer_id = transfer_id

    def __str__(self) -> str:
        return f"unknown transfer id {self.transfer_id!r}"


class UnknownRankError(StateError, KeyError):
    def __init__(self, rank: Any, tp_size: int) -> None:
        super().__init__(rank, tp_size)
        self.rank, self.tp_size = rank, tp_size

    def __str__(self) -> str:
        return f"rank {self.rank!r} is not in 0..{self.tp_size - 1}"


class DoubleFreeError(StateError):
    def __init__(self, what: str, ident: Any) -> None:
        super().__init__(what, ident)
        self.what, self.ident = what, ident

    def __str__(self) -> str:
        return f"{self.what} {self.ident!r} freed twice (or never allocated)"


class CapacityError(HiSparseError):
    """A request can never fit: it needs more than the whole pool holds."""

    def __init__(self, what: str, needed: int, total: int) -> None:
        super().__init__(what, needed, total)
        self.what, self.needed, self.total = what, needed, total

    def __str__(self) -> str:
        return f"{self.what}: needs {self.needed}, the whole pool holds {self.total}"


class HostPoolError(HiSparseError):
    """The pinned host pool could not be created, mapped, registered or removed."""


class KernelPreconditionError(HiSparseError, ValueError):
    """A resolver input breaks the kernel contract (shape, dtype, device, distinct positions...)."""


class TransferError(HiSparseError):
    """A KV transfer (NIXL or local copy) failed; ``request_id`` is None for pool-level failures."""

    def __init__(self, message: str, request_id: Any = None) -> None:
        super().__init__(message, request_id)
        self.message, self.request_id = message, request_id

    def __str__(self) -> str:
        who = f" (request {self.request_id!r})" if self.request_id is not None else ""
        return f"{self.message}{who}"


class TransferTimeoutError(TransferError):
    """A transfer did not complete within its deadline (after retries)."""


class ChannelError(HiSparseError):
    """The shared-memory step channel failed (segment, framing or peer); ``channel`` names it."""

    def __init__(self, message: str, channel: str = "") -> None:
        super().__init__(message, channel)
        self.message, self.channel = message, channel

    def __str__(self) -> str:
        return f"channel {self.channel}: {self.message}" if self.channel else self.message


class ChannelTimeoutError(ChannelError):
    """No message (recv) or no room (send) within the deadline; the peer may be stuck."""


class ChannelClosedError(ChannelError):
    """The peer closed its end (after the receiver drained every message sent before that)."""


class ChannelPeerLostError(ChannelError):
    """The peer process died without closing its end."""


class MessageTooLargeError(ChannelError, ValueError):
    """A pickled message does not fit the ring at all (raise the channel capacity)."""

    def __init__(self, nbytes: int, max_bytes: int, channel: str = "") -> None:
        ChannelError.__init__(self, f"message of {nbytes} bytes exceeds the ring's "
                              f"{max_bytes}-byte maximum", channel)
        self.args = (nbytes, max_bytes, channel)
        self.nbytes, self.max_bytes = nbytes, max_bytes


class InvalidRequestError(HiSparseError, ValueError):
    """A request's own values are invalid (empty prompt, max_new_tokens < 1, non-integer tokens)."""

    def __init__(self, request_id: Any, reason: str) -> None:
        super().__init__(request_id, reason)
        self.request_id, self.reason = request_id, reason

    def __str__(self) -> str:
        return f"invalid request {self.request_id!r}: {self.reason}"


class CheckpointError(ConfigError):
    """A model folder is unusable: names the file, the key (tensor or config key) and the problem
    (missing shard, missing scale, wrong dtype or shape, a model type that is not DSA...)."""

    def __init__(self, file: str, key: str, problem: str) -> None:
        HiSparseError.__init__(self, file, key, problem)
        self.file, self.key, self.problem = file, key, problem
        self.value, self.allowed = file, problem  # ConfigError's fields: handlers that print them work

    def __str__(self) -> str:
        return f"checkpoint {self.file}: {self.key}: {self.problem}"
