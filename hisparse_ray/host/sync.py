"""Cross-process ordering for the shared host pool (adapter ring): the header's generation counter,
the ring of CUDA IPC events that rank 0 records after each step's GPU writes (indexed by step
number: :func:`event_slot`), and the step ring that names the generation rank 0 published in a
given step (a peer waits by step number, before the coordinator has the report that carries it).

The counter is a u64 in the shared header, stored with release and loaded with acquire semantics
through libatomic (``__atomic_store_8`` / ``__atomic_load_8``) so that the ordering also holds on
weakly ordered CPUs. Without libatomic the fallback is a plain aligned 8-byte store/load, which is
correct on x86-64 (TSO: each ctypes/numpy call is a compiler barrier and stores stay in order).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

from hisparse_ray.errors import HostPoolError

_ACQUIRE, _RELEASE = 2, 3


def _load_libatomic() -> tuple[Any, Any] | None:
    """(load_8, store_8) from libatomic, None if it cannot be loaded."""
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            load, store = getattr(lib, "__atomic_load_8"), getattr(lib, "__atomic_store_8")
        except (OSError, AttributeError):
            continue
        load.restype, load.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_int)
        store.restype, store.argtypes = None, (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int)
        return load, store
    return None


_ATOMICS = _load_libatomic()
_LOAD, _STORE = _ATOMICS if _ATOMICS is not None else (None, None)


class SharedCounter:
    """A u64 at a fixed, 8-byte aligned address inside a shared mapping.

    ``store`` has release semantics (every earlier write of this thread is visible to a reader that
    observes the new value), ``load`` acquire semantics. The caller keeps the mapping alive.
    """

    def __init__(self, address: int) -> None:
        if address % 8:
            raise HostPoolError(f"shared counter address {address:#x} is not 8-byte aligned")
        self._addr = address
        self._plain = ctypes.c_uint64.from_address(address)

    def load(self) -> int:
        if _LOAD is not None:
            return int(_LOAD(self._addr, _ACQUIRE))
        return int(self._plain.value)

    def store(self, value: int) -> None:
        if _STORE is not None:
            _STORE(self._addr, value, _RELEASE)
        else:
            self._plain.value = value


class StepRing:
    """``slots`` pairs of u64 ``[generation][step + 1]`` at ``address`` in a shared mapping: the
    owner (rank 0), after publishing generation g for step N's host writes, stores g into slot
    ``N % slots`` and then the tag ``N + 1`` (release); a reader that loads the tag (acquire) and
    sees ``N + 1`` then reads a generation at least g. Tag 0: never written. A tag past ``N + 1``
    means the owner ran ``slots`` steps past N before the reader looked: its generation is lost
    and the reader gets ``HostPoolError`` (the step pipeline keeps rank 0 at most two steps ahead
    of any peer)."""

    def __init__(self, address: int, slots: int) -> None:
        self.slots = slots
        self._gen = [SharedCounter(address + 16 * i) for i in range(slots)]
        self._tag = [SharedCounter(address + 16 * i + 8) for i in range(slots)]

    def store(self, step: int, generation: int) -> None:
        i = step % self.slots
        self._gen[i].store(generation)
        self._tag[i].store(step + 1)

    def load(self, step: int) -> int | None:
        """The generation published for ``step``, None if not stored yet."""
        i = step % self.slots
        tag = self._tag[i].load()
        if tag == step + 1:
            gen = self._gen[i].load()
            if self._tag[i].load() == tag:  # not overwritten while we read it
                return gen
            tag = self._tag[i].load()
        if tag > step + 1:
            raise HostPoolError(f"step ring overrun: the slot of step {step} holds step "
                                f"{tag - 1} (the writer ran {self.slots} steps ahead)")
        return None


def spin_until(predicate, timeout_s: float | None, what: str) -> None:
    """Poll ``predicate`` (busy first, then with short sleeps); HostPoolError after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    spins = 0
    while not predicate():
        spins += 1
        if spins > 200:
            time.sleep(min(1e-3, 1e-6 * spins))
        if deadline is not None and time.monotonic() > deadline:
            raise HostPoolError(f"timed out after {timeout_s} s waiting for {what}")


def event_slot(step: int, size: int) -> int:
    """The IPC event slot of rank 0's step ``step`` in a ring of ``size``: the slot rank 0 records
    when it publishes the step's GPU writes (``HostPool.publish(stream, step=step)``) and the one
    a peer's stream waits on for them (``HostPool.wait_step``). By step, never by generation:
    generations without a step (landings) would otherwise push a slot a peer still needs to a
    later step's record, behind that step's all-reduce, which needs the peer's own forward queued
    after its wait (a deadlock)."""
    return step % size


class IpcEventRing:
    """Rank 0's ring of interprocess CUDA events, or a peer's opened copies of them.

    Step N's publish records slot :func:`event_slot` ``(N, size)`` on rank 0's copy stream; a peer
    waits on it at its first command after N, before rank 0 can record step N + ``size`` there
    (rank 0 runs at most two steps ahead of a peer; ``MIN_EVENT_RING``). A slot re-recorded for
    a later step would make a peer wait for that later step's forward: possibly forever (its
    all-reduce needs the peer's forward of the same step, queued after the wait).
    """

    def __init__(self, size: int, owner: bool) -> None:
        import torch

        self.size, self.owner = size, owner
        self._device = torch.cuda.current_device()
        self._events: dict[int, Any] = {}
        self._handles: dict[int, bytes] = {}
        if owner:
            for slot in range(size):
                ev = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                self._events[slot] = ev
                self._handles[slot] = bytes(ev.ipc_handle())

    def handle(self, slot: int) -> bytes:
        return self._handles[slot]

    def record(self, slot: int, stream: Any = None) -> None:
        assert self.owner, "only the pool owner records publication events"
        import torch

        self._events[slot].record(stream if stream is not None else torch.cuda.current_stream())

    def wait(self, slot: int, handle: bytes, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait on the event of ``slot`` (opened from ``handle``)."""
        import torch

        ev = self._events.get(slot)
        if ev is None or (not self.owner and self._handles.get(slot) != handle):
            ev = torch.cuda.Event.from_ipc_handle(self._device, handle)
            self._events[slot], self._handles[slot] = ev, handle
        (stream if stream is not None else torch.cuda.current_stream()).wait_event(ev)

    def close(self) -> None:
        self._events.clear()
        self._handles.clear()
