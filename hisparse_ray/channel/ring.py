"""Shared-memory SPSC message ring for per-step control traffic (adapter ring, standard library).

The coordinator and each co-located TP rank exchange ``StepCommand`` / ``StepReport`` through a
pair of these (:mod:`hisparse_ray.channel.pair`) instead of Ray actor calls (~1 ms each): a
``/dev/shm`` segment holding a ring of length-prefixed encoded messages (``StepCodec`` by
default). Waiting spins, then yields, then blocks on a futex on the peer's position word (woken by
the peer's next publish; timed slices bound a lost wake-up and notice a dead peer); without futex
support it sleeps with backoff.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from hisparse_ray.channel.codec import Codec
from hisparse_ray.channel.futex import futex_available, futex_wait, futex_wake
from hisparse_ray.channel.stepcodec import NATIVE, StepCodec
from hisparse_ray.checks import check_bool, check_number
from hisparse_ray.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelPeerLostError,
    ChannelTimeoutError,
    MessageTooLargeError,
)
from hisparse_ray.host.segment import pid_alive as _pid_alive

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "hsr-ch-"
DEFAULT_CAPACITY = 1 << 20

_MAGIC = b"HSRCHAN1"
# Header layout (little-endian u64). Each side writes only its own fields; the positions sit on
# separate cache lines. write_pos / read_pos are monotonic byte counters (never wrapped).
_OFF_CAPACITY = 8
_OFF_WRITE = 64  # bytes of frames published by the sender
_OFF_READ = 128  # bytes of frames consumed by the receiver
_OFF_SENDER_PID, _OFF_RECEIVER_PID = 192, 200
_OFF_SENDER_CLOSED, _OFF_RECEIVER_CLOSED = 208, 216
_OFF_SENDER_WAITING, _OFF_RECEIVER_WAITING = 224, 232  # 1 while blocked on the futex
_DATA = 256
_FRAME = struct.Struct("<QQ")  # payload length, sequence number (0, 1, 2, ...)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

Role = Literal["sender", "receiver"]

@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """What the attaching side needs: the segment name and the role the creator took."""

    name: str
    capacity: int
    creator_role: Role


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How a blocked ``send``/``recv`` waits: busy-spin for ``spin_s``, then ``sched_yield()``s
    until ``yield_s``, then blocks on a futex (``futex=True`` and supported: the peer's publish
    wakes it, a wait lasts at most ``futex_slice_s``) or else sleeps doubling from
    ``min_sleep_s`` to ``max_sleep_s``. The peer's liveness is checked at most every
    ``liveness_s`` once blocked. Ranks with a core of their own can raise ``yield_s``."""

    spin_s: float = 50e-6
    yield_s: float = 1e-3
    min_sleep_s: float = 10e-6
    max_sleep_s: float = 100e-6  # bounds the latency a sleeping waiter adds
    liveness_s: float = 0.02
    futex: bool = True
    futex_slice_s: float = 2e-3  # bounds a lost wake-up (see ShmChannel) and the close check

    def __post_init__(self) -> None:  # ConfigError (a ValueError) naming the field
        check_number("yield_s", self.yield_s, lo=0, why="seconds")
        check_number("spin_s", self.spin_s, lo=0, hi=self.yield_s, why="seconds, <= yield_s")
        check_number("max_sleep_s", self.max_sleep_s, lo=0, lo_open=True, why="seconds")
        check_number("min_sleep_s", self.min_sleep_s, lo=0, lo_open=True, hi=self.max_sleep_s,
                     why="seconds, <= max_sleep_s")
        check_number("liveness_s", self.liveness_s, lo=0, lo_open=True, why="seconds")
        check_bool("futex", self.futex)
        check_number("futex_slice_s", self.futex_slice_s, lo=0, lo_open=True, why="seconds")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    return _pid_alive(pid, 0)


def cleanup_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink channel segments whose creator process is gone (names carry the creator's pid);
    returns the names removed. Segments are normally unlinked once both ends are mapped, so only
    a creator that died before its peer attached leaves one behind."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class ShmChannel:
    """One direction of a single-producer single-consumer message ring in ``/dev/shm``.

    Frames are ``[u64 length][u64 seq][payload, padded to 8 bytes]`` written circularly into
    ``capacity`` bytes; the sender publishes a frame by advancing ``write_pos`` after copying it,
    the receiver frees it by advancing ``read_pos``. Invariants: ``0 <= write_pos - read_pos <=
    capacity``; messages arrive in order, each once (the receiver checks ``seq``). Relies on the
    x86-64 store order (TSO) for publication. Wake-ups: a blocked side raises its ``*_WAITING``
    word and futex-waits on the low 32 bits of the peer's position; the peer, after publishing,
    wakes it if that word is up. Both sides put a full fence (a lock round trip) between their
    store and their load, so at least one sees the other (Dekker); the timed slice bounds the
    cost of anything missed anyway.

    Ring ops: ``send``'s frame write + publish + wake and ``recv``'s frame read + free + wake
    run in C (``hisparse_ray.channel._wire``, where built: the same frames and the same
    protocol, so a C end and a Python end interoperate); waiting stays in Python.

    Codecs: the channel uses ``codec.fresh()`` when the codec has one (a stateful codec keeps one
    state per direction), and calls ``codec.reset()`` when an encoded message is not delivered
    (too large, timeout, peer closed or lost).

    Lifecycle: ``create`` (either role) -> ``spec`` to the peer -> peer ``attach`` (which unlinks
    the name: from then on nothing leaks even if both crash) -> ``send``/``recv`` -> ``close``
    (unlinks if still linked). A full ring blocks ``send`` (backpressure) until ``timeout``.
    """

    def __init__(self, name: str, role: Role, fd: int, mm: mmap.mmap, capacity: int,
                 creator: bool, policy: WaitPolicy, codec: Codec | None) -> None:
        self.name, self.role, self.capacity = name, role, capacity
        self._fd, self._mm, self._creator, self._policy = fd, mm, creator, policy
        codec = codec if codec is not None else StepCodec()
        fresh = getattr(codec, "fresh", None)
        self._codec = fresh() if fresh is not None else codec
        self._seq = 0
        self._pos = self._load(_OFF_WRITE if role == "sender" else _OFF_READ)
        self._store(_OFF_SENDER_PID if role == "sender" else _OFF_RECEIVER_PID, os.getpid())
        self._closed = False
        self.ready_t = 0.0  # receiver: perf_counter() when the last message was found (tracing)
        self._fence_lock = threading.Lock()
        self._futex = policy.futex and futex_available()
        # the C ring ops (hisparse_ray.channel._wire: same frames, same publication and wake
        # protocol; one call instead of ~15 interpreted lines per message); None = the Python twin
        self._ring = NATIVE
        probe = ctypes.c_char.from_buffer(mm)  # the mapping's address (it never moves)
        self._base = ctypes.addressof(probe)
        del probe  # drop the buffer export so that close() can unmap

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(cls, role: Role, capacity: int = DEFAULT_CAPACITY, *,
               prefix: str = DEFAULT_PREFIX, policy: WaitPolicy | None = None,
               codec: Codec | None = None) -> ShmChannel:
        """Create a new segment and take ``role``; ``capacity`` bytes of ring (multiple of 8).
        ``codec`` (both ends must agree) defaults to ``StepCodec``: binary for StepCommand and
        StepReport, plain pickle for anything else."""
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be 'sender' or 'receiver', got {role!r}")
        if capacity < 64 or capacity % 8:
            raise ValueError(f"capacity must be a multiple of 8 and >= 64, got {capacity}")
        cleanup_stale_segments(prefix)
        name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _DATA + capacity)
            mm = mmap.mmap(fd, _DATA + capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mm[0:8] = _MAGIC
        _U64.pack_into(mm, _OFF_CAPACITY, capacity)
        return cls(name, role, fd, mm, capacity, True, policy or WaitPolicy(), codec)

    @classmethod
    def attach(cls, spec: ChannelSpec, *, policy: WaitPolicy | None = None,
               codec: Codec | None = None) -> ShmChannel:
        """Map the segment ``spec`` names, take the other role, and unlink the name."""
        path = os.path.join(SHM_DIR, spec.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ChannelError("segment not found (already attached, or creator gone)",
                               spec.name) from None
        mm = mmap.mmap(fd, _DATA + spec.capacity)
        if mm[0:8] != _MAGIC or _U64.unpack_from(mm, _OFF_CAPACITY)[0] != spec.capacity:
            mm.close()
            os.close(fd)
            raise ChannelError("segment header does not match its spec", spec.name)
        role: Role = "receiver" if spec.creator_role == "sender" else "sender"
        chan = cls(spec.name, role, fd, mm, spec.capacity, False, policy or WaitPolicy(), codec)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return chan

    @property
    def spec(self) -> ChannelSpec:
        return ChannelSpec(self.name, self.capacity, self.role)

    def close(self) -> None:
        """Mark this end closed (the peer sees ``ChannelClosedError``), unmap, unlink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._store(_OFF_SENDER_CLOSED if self.role == "sender" else _OFF_RECEIVER_CLOSED, 1)
        if self._futex:  # a blocked peer sees the close at once
            self._fence()
            futex_wake(self._base + _OFF_WRITE)
            futex_wake(self._base + _OFF_READ)
        self._mm.close()
        os.close(self._fd)
        if self._creator:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> ShmChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- messages --------------------------------------------------------------------------

    @property
    def max_message_bytes(self) -> int:
        """Largest encoded payload that fits the ring."""
        return self.capacity - _FRAME.size

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Encode ``obj`` and append it; blocks while the ring is full (up to ``timeout`` s, None =
        forever). Raises ``MessageTooLargeError``, ``ChannelTimeoutError``, ``ChannelClosedError``
        (receiver closed) or ``ChannelPeerLostError`` (receiver died)."""
        self._check_role("sender")
        if self._load(_OFF_RECEIVER_CLOSED):
            raise ChannelClosedError("the receiver closed its end", self.name)
        payload = self._codec.dumps(obj)
        ring = self._ring
        if ring is not None and len(payload) <= self.max_message_bytes:
            try:
                pos = ring.ring_send(self._mm, self.capacity, self._pos, self._seq, payload,
                                     self._futex)
            except BaseException:  # not delivered (the mapping is gone): restart the codec
                reset = getattr(self._codec, "reset", None)
                if reset is not None:
                    reset()
                raise
            if pos is not None:  # else the ring is full: wait below
                self._pos = pos
                self._seq += 1
                return
        try:
            if len(payload) > self.max_message_bytes:
                raise MessageTooLargeError(len(payload), self.max_message_bytes, self.name)
            frame = _FRAME.size + ((len(payload) + 7) & ~7)
            pos, cap = self._pos, self.capacity
            if cap - (pos - self._load(_OFF_READ)) < frame:
                self._wait(lambda: cap - (pos - self._load(_OFF_READ)) >= frame, timeout,
                           "no room in the ring", "sender")
        except BaseException:
            reset = getattr(self._codec, "reset", None)
            if reset is not None:  # the peer never sees this message: restart the codec state
                reset()
            raise
        self._put(pos, _FRAME.pack(len(payload), self._seq) + payload)  # one copy into the ring
        self._pos = pos + frame
        self._seq += 1
        _U64.pack_into(self._mm, _OFF_WRITE, self._pos)  # publish
        self._wake_peer(_OFF_RECEIVER_WAITING, _OFF_WRITE)

    def recv(self, timeout: float | None = None) -> Any:
        """Take the next message (in send order); blocks up to ``timeout`` s (None = forever).
        Raises ``ChannelTimeoutError``, ``ChannelClosedError`` (sender closed and ring drained)
        or ``ChannelPeerLostError`` (sender died with nothing left to read)."""
        self._check_role("receiver")
        pos = self._pos
        ring = self._ring
        if ring is not None:
            try:
                got = ring.ring_recv(self._mm, self.capacity, pos, self._seq, self._futex)
                if got is None:
                    self._wait(lambda: self._load(_OFF_WRITE) != pos, timeout, "no message",
                               "receiver")
                    got = ring.ring_recv(self._mm, self.capacity, pos, self._seq, self._futex)
            except ValueError as err:
                raise ChannelError(str(err), self.name) from None
            self.ready_t = time.perf_counter()
            payload, self._pos = got
            self._seq += 1
            return self._codec.loads(payload)
        if self._load(_OFF_WRITE) == pos:
            self._wait(lambda: self._load(_OFF_WRITE) != pos, timeout, "no message",
                       "receiver")
        self.ready_t = time.perf_counter()
        off = pos % self.capacity
        if off + _FRAME.size <= self.capacity:
            length, seq = _FRAME.unpack_from(self._mm, _DATA + off)
        else:  # the header wraps
            length, seq = _FRAME.unpack(self._get(pos, _FRAME.size))
        if seq != self._seq or length > self.max_message_bytes:
            raise ChannelError(f"corrupt frame: seq {seq} (expected {self._seq}), "
                               f"length {length}", self.name)
        payload = self._get(pos + _FRAME.size, length)
        self._pos = pos + _FRAME.size + ((length + 7) & ~7)
        self._seq += 1
        _U64.pack_into(self._mm, _OFF_READ, self._pos)  # free the frame before decoding
        self._wake_peer(_OFF_SENDER_WAITING, _OFF_READ)
        return self._codec.loads(payload)

    def pending(self) -> bool:
        """Receiver: whether a message is ready (``recv`` would not block)."""
        self._check_role("receiver")
        return self._load(_OFF_WRITE) != self._pos

    def wait_pending(self, timeout: float, others: tuple[ShmChannel, ...] = ()) -> bool:
        """Receiver: block until this channel or any of ``others`` (receivers in this process)
        has a message, up to ``timeout`` s; False on timeout. Waits like ``recv`` (spin, yield,
        then a futex on this channel only: a message on another is seen within
        ``futex_slice_s``); same ``ChannelClosedError`` / ``ChannelPeerLostError`` for this
        channel's peer."""
        self._check_role("receiver")
        pos, load = self._pos, self._load
        ready = (lambda: load(_OFF_WRITE) != pos or any(o.pending() for o in others))
        if ready():
            return True
        try:
            self._wait(ready, timeout, "no message", "receiver")
        except ChannelTimeoutError:
            return False
        return True

    # -- internals -------------------------------------------------------------------------

    def _check_role(self, role: Role) -> None:
        if self._closed:
            raise ChannelClosedError("this end is closed", self.name)
        if self.role != role:
            raise ChannelError(f"this end is the {self.role}; cannot act as {role}", self.name)

    def _load(self, off: int) -> int:
        return _U64.unpack_from(self._mm, off)[0]

    def _store(self, off: int, value: int) -> None:
        _U64.pack_into(self._mm, off, value)

    def _put(self, pos: int, data: bytes) -> None:
        off, n, mm = pos % self.capacity, len(data), self._mm
        first = min(n, self.capacity - off)
        mm[_DATA + off:_DATA + off + first] = memoryview(data)[:first]
        if first < n:
            mm[_DATA:_DATA + n - first] = memoryview(data)[first:]

    def _get(self, pos: int, n: int) -> bytes:
        off, mm = pos % self.capacity, self._mm
        first = min(n, self.capacity - off)
        if first == n:
            return mm[_DATA + off:_DATA + off + n]
        return mm[_DATA + off:_DATA + self.capacity] + mm[_DATA:_DATA + n - first]

    def _fence(self) -> None:
        """A full memory fence (the uncontended lock round trip executes a locked instruction)."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _wake_peer(self, peer_waiting_off: int, word_off: int) -> None:
        """After publishing ``word_off``: wake the peer if it is blocked on that word."""
        if self._futex:
            self._fence()
            if self._load(peer_waiting_off):
                futex_wake(self._base + word_off)

    def _wait(self, ready, timeout: float | None, what: str, me: Role) -> None:
        """Block until ``ready()``; the sender waits on the receiver's read position, the
        receiver on the sender's write position."""
        if me == "sender":
            pid_off, closed_off, word_off, my_flag = (
                _OFF_RECEIVER_PID, _OFF_RECEIVER_CLOSED, _OFF_READ, _OFF_SENDER_WAITING)
        else:
            pid_off, closed_off, word_off, my_flag = (
                _OFF_SENDER_PID, _OFF_SENDER_CLOSED, _OFF_WRITE, _OFF_RECEIVER_WAITING)
        policy = self._policy
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        sleep, next_check = policy.min_sleep_s, start
        flagged = False
        try:
            while True:
                if ready():
                    return
                now = time.monotonic()
                if self._load(closed_off):
                    if ready():
                        return
                    raise ChannelClosedError(f"{what}: the peer closed its end", self.name)
                if deadline is not None and now >= deadline:
                    raise ChannelTimeoutError(f"{what} after {timeout:.3g} s", self.name)
                elapsed = now - start
                if elapsed < policy.spin_s:
                    continue
                if elapsed < policy.yield_s:
                    os.sched_yield()
                    continue
                if now >= next_check:
                    next_check = now + policy.liveness_s
                    pid = self._load(pid_off)
                    if pid and not pid_alive(pid):
                        if ready():
                            return
                        raise ChannelPeerLostError(f"{what}: peer pid {pid} died", self.name)
                if self._futex:
                    if not flagged:
                        self._store(my_flag, 1)
                        flagged = True
                    self._fence()
                    word = _U32.unpack_from(self._mm, word_off)[0]
                    if ready():
                        return
                    left = policy.futex_slice_s if deadline is None else deadline - now
                    futex_wait(self._base + word_off, word,
                               max(1e-6, min(policy.futex_slice_s, left)))
                    continue
                time.sleep(sleep if deadline is None else max(0.0, min(sleep, deadline - now)))
                sleep = min(sleep * 2, policy.max_sleep_s)
        finally:
            if flagged and not self._closed:
                self._store(my_flag, 0)
