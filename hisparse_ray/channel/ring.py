"""Shared-memory message ring with one writer and N readers (adapter ring, standard library).

The coordinator broadcasts each step's ``StepCommand`` to its co-located TP ranks through ONE of
these (N = TP readers, every reader sees every message), and each rank answers its ``StepReport``
through its own (N = 1); :mod:`hisparse_ray.channel.pair` and :mod:`~hisparse_ray.channel.fanout`
put them together. A ``/dev/shm`` segment holds a ring of length-prefixed encoded messages
(:class:`~hisparse_ray.channel.codec.StepCodec` by default). Waiting spins, then yields, then
blocks on a futex (woken by the other side's next publish or read; timed slices bound a lost
wake-up and notice a dead peer); without futex support it sleeps with backoff.

The ring ops are Python. C ring ops (a frame's write + publish + wake and read + free + wake in
one call each) were measured and removed (issue #16 B3): on the H200 the Python ring already
meets the control-plane target at TP 2 (real-step overhead 78.3 us median / 101.6 us p90 against
<= 100 / <= 150 us; the C ops gave 55.5 / 92.5). Their removal waited on the Python ring's
corrupt frames, found on 2026-12-01: ``struct.pack_into`` zero-fills before it packs (``_store``).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import struct
import threading
import time
import uuid
from typing import Any

from hisparse_ray.channel.codec import Codec, StepCodec
from hisparse_ray.channel.futex import futex_available, futex_wait, futex_wake
from hisparse_ray.channel.spec import (  # noqa: F401  (re-exported: the rings' public surface)
    DEFAULT_PREFIX, SHM_DIR, ChannelSpec, Role, WaitPolicy, cleanup_stale_segments, pid_alive,
)
from hisparse_ray.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelPeerLostError,
    ChannelTimeoutError,
    MessageTooLargeError,
)

DEFAULT_CAPACITY = 1 << 20
MAX_READERS = 64

_MAGIC = b"HSRRING2"
# Header (little-endian u64 words). Each side writes only its own line; lines are 64 bytes apart.
_OFF_CAPACITY, _OFF_READERS = 8, 16
_WRITER = 64  # the writer's line: write_pos, pid, closed, waiting
_READER = 128  # reader i's line at _READER + 64 * i: read_pos, pid, closed, waiting
_POS, _PID, _CLOSED, _WAITING = 0, 8, 16, 24
_FRAME = struct.Struct("<QQ")  # payload length, sequence number (0, 1, 2, ...)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_LINE3 = struct.Struct("<QQQ")  # a line's position, pid and closed flag


def _data_offset(readers: int) -> int:
    return _READER + 64 * readers


class ShmRing:
    """One end of a one-writer, ``readers``-reader message ring in ``/dev/shm``.

    Frames are ``[u64 length][u64 seq][payload, padded to 8 bytes]`` written circularly into
    ``capacity`` bytes. The writer publishes a frame by advancing ``write_pos`` after copying it;
    reader i consumes it by advancing its own ``read_pos[i]``; the writer reuses bytes only once
    the slowest reader is past them. Invariants: ``0 <= write_pos - read_pos[i] <= capacity``
    for every i; every reader sees every message, in order, once (it checks ``seq``). Relies on
    the x86-64 store order (TSO) for publication, and on every shared word (positions, flags,
    pids) being read and written whole: one 8-byte load or store through a u64 memoryview
    (``_load`` / ``_store``; ``struct.pack_into`` zero-fills first, a peer could read 0).
    Wake-ups: a blocked side raises its ``waiting`` word and futex-waits on the low 32 bits of
    the position it waits for (a reader: ``write_pos``; the writer: the slowest reader's
    ``read_pos``); the other side, after moving that position, wakes it if the word is up. Both
    put a full fence (a lock round trip) between their store and their load, so at least one sees
    the other (Dekker); the timed slice bounds the cost of anything missed anyway.

    Lifecycle: ``create`` (either role; a creating reader is reader 0 of a one-reader ring) ->
    ``spec_for`` each peer -> peers ``attach`` (the last one to map unlinks the name: from then
    on nothing leaks even if every end crashes; ``unlink`` does it at once) -> ``send`` /
    ``recv`` -> ``close`` (unlinks if still linked). A ring full for the slowest reader blocks
    ``send`` (backpressure) until ``timeout``; a reader that closed makes ``send`` raise.
    """

    def __init__(self, name: str, role: Role, index: int, fd: int, mm: mmap.mmap, capacity: int,
                 readers: int, creator: bool, policy: WaitPolicy, codec: Codec | None) -> None:
        self.name, self.role, self.index = name, role, index
        self.capacity, self.readers = capacity, readers
        self._fd, self._mm, self._creator, self._policy = fd, mm, creator, policy
        self._codec = codec if codec is not None else StepCodec()
        self._data = _data_offset(readers)
        self._line = _WRITER if role == "writer" else _READER + 64 * index
        self._reader_lines = tuple(_READER + 64 * i for i in range(readers))
        self._seq = 0
        # every shared word through this u64 view: one 8-byte store each (see _store)
        self._words = memoryview(mm).cast("Q")
        self._pos = self._load(self._line + _POS)
        self._store(self._line + _PID, os.getpid())
        self._closed = False
        self.ready_t = 0.0  # reader: perf_counter() when the last message was found (tracing)
        self._seen: collections.deque = collections.deque(maxlen=8)  # (pos, writer pos) per recv
        self._fence_lock = threading.Lock()
        self._futex = policy.futex and futex_available()
        probe = ctypes.c_char.from_buffer(mm)  # the mapping's address (it never moves)
        self._base = ctypes.addressof(probe)
        del probe  # drop the buffer export so that close() can unmap

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(cls, role: Role, capacity: int = DEFAULT_CAPACITY, *, readers: int = 1,
               prefix: str = DEFAULT_PREFIX, policy: WaitPolicy | None = None,
               codec: Codec | None = None) -> ShmRing:
        """Create a new segment and take ``role`` (a creating reader is reader 0 and needs
        ``readers == 1``); ``capacity`` bytes of ring (multiple of 8). ``codec`` (every end must
        agree) defaults to ``StepCodec``: ``StepCommand`` and ``StepReport`` only."""
        if role not in ("writer", "reader"):
            raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
        if capacity < 64 or capacity % 8:
            raise ValueError(f"capacity must be a multiple of 8 and >= 64, got {capacity}")
        if not 1 <= readers <= MAX_READERS or (role == "reader" and readers != 1):
            raise ValueError(f"readers must be in 1..{MAX_READERS} (1 when the creator reads), "
                             f"got {readers}")
        cleanup_stale_segments(prefix)
        name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
        path = os.path.join(SHM_DIR, name)
        size = _data_offset(readers) + capacity
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mm[0:8] = _MAGIC
        _U64.pack_into(mm, _OFF_CAPACITY, capacity)
        _U64.pack_into(mm, _OFF_READERS, readers)
        return cls(name, role, 0, fd, mm, capacity, readers, True, policy or WaitPolicy(), codec)

    @classmethod
    def attach(cls, spec: ChannelSpec, *, policy: WaitPolicy | None = None,
               codec: Codec | None = None) -> ShmRing:
        """Map the segment ``spec`` names and take the other role (as reader ``spec.reader``
        when the creator writes); the last end to map unlinks the name."""
        path = os.path.join(SHM_DIR, spec.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ChannelError("segment not found (already attached, or creator gone)",
                               spec.name) from None
        size = _data_offset(spec.readers) + spec.capacity
        mm = mmap.mmap(fd, size)
        if (mm[0:8] != _MAGIC or _U64.unpack_from(mm, _OFF_CAPACITY)[0] != spec.capacity
                or _U64.unpack_from(mm, _OFF_READERS)[0] != spec.readers
                or not 0 <= spec.reader < spec.readers):
            mm.close()
            os.close(fd)
            raise ChannelError("segment header does not match its spec", spec.name)
        role: Role = "reader" if spec.creator_role == "writer" else "writer"
        index = spec.reader if role == "reader" else 0
        if _U64.unpack_from(mm, (_WRITER if role == "writer" else _READER + 64 * index) + _PID)[0]:
            mm.close()
            os.close(fd)
            raise ChannelError(f"{role} {index} of this ring is already attached", spec.name)
        ring = cls(spec.name, role, index, fd, mm, spec.capacity, spec.readers, False,
                   policy or WaitPolicy(), codec)
        ring._fence()
        if ring._load(_WRITER + _PID) and all(ring._load(o + _PID) for o in ring._reader_lines):
            ring.unlink()  # every end is mapped
        return ring

    def spec_for(self, reader: int = 0) -> ChannelSpec:
        """The spec a peer attaches with: the writer's end names reader ``reader``."""
        return ChannelSpec(self.name, self.capacity, self.role, self.readers, reader)

    @property
    def spec(self) -> ChannelSpec:
        return self.spec_for(0)

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid). Idempotent."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Mark this end closed (its peers see ``ChannelClosedError``), unmap, unlink.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._store(self._line + _CLOSED, 1)
        if self._futex:  # a blocked peer sees the close at once
            self._fence()
            futex_wake(self._base + _WRITER + _POS)
            for off in self._reader_lines:
                futex_wake(self._base + off + _POS)
        self._words.release()
        self._mm.close()
        os.close(self._fd)
        if self._creator:
            self.unlink()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- messages --------------------------------------------------------------------------

    @property
    def max_message_bytes(self) -> int:
        """Largest encoded payload that fits the ring."""
        return self.capacity - _FRAME.size

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Encode ``obj`` and append it for every reader; blocks while the slowest reader leaves
        no room (up to ``timeout`` s, None = forever). Raises ``MessageTooLargeError``,
        ``ChannelTimeoutError``, ``ChannelClosedError`` (a reader closed) or
        ``ChannelPeerLostError`` (a reader that blocks the ring died)."""
        self._check_role("writer")
        mm, lines, line3 = self._mm, self._reader_lines, _LINE3.unpack_from
        low = None
        for off in lines:  # one read per reader: its position, pid and closed flag
            rpos, _, closed = line3(mm, off)
            if closed:
                raise ChannelClosedError("a reader closed its end", self.name)
            if low is None or rpos < low:
                low = rpos
        payload = self._codec.dumps(obj)
        n = len(payload)
        if n > self.capacity - _FRAME.size:
            raise MessageTooLargeError(n, self.max_message_bytes, self.name)
        frame = _FRAME.size + ((n + 7) & ~7)
        pos, cap, load = self._pos, self.capacity, self._load
        if cap - (pos - low) < frame:
            self._wait(lambda: cap - (pos - min(load(off + _POS) for off in lines)) >= frame,
                       timeout, "no room in the ring")
        off = pos % cap
        data = self._data
        if off + frame <= cap:  # the common case: one contiguous frame
            _FRAME.pack_into(mm, data + off, n, self._seq)
            mm[data + off + 16:data + off + 16 + n] = payload
        else:
            self._put(pos, _FRAME.pack(n, self._seq) + payload)
        self._pos = pos + frame
        self._seq += 1
        self._words[_WRITER >> 3] = self._pos  # publish (one 8-byte store: see _store)
        if self._futex:  # wake the readers blocked on write_pos
            self._fence()
            for off in lines:
                if load(off + _WAITING):
                    futex_wake(self._base + _WRITER + _POS)
                    break

    def recv(self, timeout: float | None = None) -> Any:
        """Take the next message (in send order); blocks up to ``timeout`` s (None = forever).
        Raises ``ChannelTimeoutError``, ``ChannelClosedError`` (writer closed and ring drained),
        ``ChannelPeerLostError`` (writer died with nothing left to read), or ``ChannelError``
        for a corrupt frame or an unreadable message (never a crash, never a silent misread)."""
        self._check_role("reader")
        pos, mm, load = self._pos, self._mm, self._load
        w = load(_WRITER + _POS)
        if w == pos:
            self._wait(lambda: load(_WRITER + _POS) != pos, timeout, "no message")
            w = load(_WRITER + _POS)
        self.ready_t = time.perf_counter()
        cap, data = self.capacity, self._data
        self._seen.append((pos, w))
        if not 0 < w - pos <= cap:  # the writer is behind this reader, or a lap ahead
            raise ChannelError(f"ring positions out of order: writer at {w}, reader at {pos} "
                               f"(capacity {cap}); {self._where(pos)}", self.name)
        off = pos % cap
        if off + _FRAME.size <= cap:
            length, seq = _FRAME.unpack_from(mm, data + off)
        else:  # the header wraps
            length, seq = _FRAME.unpack(self._get(pos, _FRAME.size))
        if seq != self._seq or length > cap - _FRAME.size:
            raise ChannelError(f"corrupt frame: seq {seq} (expected {self._seq}), "
                               f"length {length}; {self._where(pos)}", self.name)
        start = off + _FRAME.size
        if start + length <= cap:
            payload = mm[data + start:data + start + length]
        else:
            payload = self._get(pos + _FRAME.size, length)
        self._pos = pos + _FRAME.size + ((length + 7) & ~7)
        self._seq += 1
        line = self._line
        self._words[line >> 3] = self._pos  # free the frame before decoding
        if self._futex:
            self._fence()
            if load(_WRITER + _WAITING):
                futex_wake(self._base + line + _POS)
        return self._load_payload(payload)

    def _where(self, pos: int) -> str:
        """(error path) Where a corrupt frame was met: this reader's position, the writer's
        position now, the header at ``pos`` read again, and where a header with the expected
        sequence number lies, if anywhere (diagnoses a lost publish from a misplaced frame)."""
        cap, data, want = self.capacity, self._data, self._seq
        again = _FRAME.unpack(self._get(pos, _FRAME.size))
        headers = ((o, _FRAME.unpack_from(self._mm, data + o))
                   for o in range(0, cap - _FRAME.size + 1, 8))
        hits = [o for o, (length, seq) in headers if seq == want and 0 < length <= cap][:4]
        return (f"read at {pos} (offset {pos % cap}), writer at {self._load(_WRITER + _POS)}, "
                f"header there now (length, seq) = {again}, seq {want} found at offsets {hits}, "
                f"last (reader, writer) positions seen {list(self._seen)}")

    def _load_payload(self, payload: bytes) -> Any:
        try:
            return self._codec.loads(payload)
        except ChannelError:
            raise
        except Exception as err:  # noqa: BLE001 - a corrupt message is an error, never a crash
            raise ChannelError(f"unreadable message: {err!r}", self.name) from None

    def pending(self) -> bool:
        """Reader: whether a message is ready (``recv`` would not block)."""
        self._check_role("reader")
        return self._load(_WRITER + _POS) != self._pos

    def wait_pending(self, timeout: float, others: tuple[ShmRing, ...] = ()) -> bool:
        """Reader: block until this ring or any of ``others`` (readers in this process) has a
        message, up to ``timeout`` s; False on timeout. Waits like ``recv`` (spin, yield, then a
        futex on this ring only: a message on another is seen within ``futex_slice_s``); same
        ``ChannelClosedError`` / ``ChannelPeerLostError`` for this ring's writer."""
        self._check_role("reader")
        pos, load = self._pos, self._load
        ready = (lambda: load(_WRITER + _POS) != pos or any(o.pending() for o in others))
        if ready():
            return True
        try:
            self._wait(ready, timeout, "no message")
        except ChannelTimeoutError:
            return False
        return True

    # -- internals -------------------------------------------------------------------------

    def _check_role(self, role: Role) -> None:
        if self._closed:
            raise ChannelClosedError("this end is closed", self.name)
        if self.role != role:
            raise ChannelError(f"this end is a {self.role}; cannot act as a {role}", self.name)

    def _load(self, off: int) -> int:
        return self._words[off >> 3]

    def _store(self, off: int, value: int) -> None:
        """One 8-byte store of a shared word (``off`` 8-byte aligned). Never ``struct.pack_into``
        on a word a peer reads: CPython zero-fills its destination before packing, so a peer can
        read 0 in between (a published position that reads 0 looked like a new frame to a
        reader: the Python ring's corrupt-frame failures of 2026-12-01). A memoryview item
        assignment is one ``memcpy`` of 8 bytes (``tests/channel/test_ring_words.py``)."""
        self._words[off >> 3] = value

    def _put(self, pos: int, data: bytes) -> None:
        off, n, mm, base = pos % self.capacity, len(data), self._mm, self._data
        first = min(n, self.capacity - off)
        mm[base + off:base + off + first] = memoryview(data)[:first]
        if first < n:
            mm[base:base + n - first] = memoryview(data)[first:]

    def _get(self, pos: int, n: int) -> bytes:
        off, mm, base = pos % self.capacity, self._mm, self._data
        first = min(n, self.capacity - off)
        if first == n:
            return mm[base + off:base + off + n]
        return mm[base + off:base + self.capacity] + mm[base:base + n - first]

    def _fence(self) -> None:
        """A full memory fence (the uncontended lock round trip executes a locked instruction)."""
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _blocker(self) -> int:
        """The line this end waits on: the writer's for a reader, the slowest reader's for the
        writer."""
        if self.role == "reader":
            return _WRITER
        return min(self._reader_lines, key=lambda off: self._load(off + _POS))

    def _wait(self, ready, timeout: float | None, what: str) -> None:
        """Block until ``ready()``: a reader waits for the writer's position, the writer for the
        slowest reader's."""
        policy = self._policy
        my_flag = self._line + _WAITING
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        sleep, next_check = policy.min_sleep_s, start
        flagged = False
        try:
            while True:
                if ready():
                    return
                now = time.monotonic()
                peer = self._blocker()
                if self._load(peer + _CLOSED):
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
                    pid = self._load(peer + _PID)
                    if pid and not pid_alive(pid):
                        if ready():
                            return
                        raise ChannelPeerLostError(f"{what}: peer pid {pid} died", self.name)
                if self._futex:
                    if not flagged:
                        self._store(my_flag, 1)
                        flagged = True
                    self._fence()
                    word = _U32.unpack_from(self._mm, peer + _POS)[0]
                    if ready():
                        return
                    left = policy.futex_slice_s if deadline is None else deadline - now
                    futex_wait(self._base + peer + _POS, word,
                               max(1e-6, min(policy.futex_slice_s, left)))
                    continue
                time.sleep(sleep if deadline is None else max(0.0, min(sleep, deadline - now)))
                sleep = min(sleep * 2, policy.max_sleep_s)
        finally:
            if flagged and not self._closed:
                self._store(my_flag, 0)
