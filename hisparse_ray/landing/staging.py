"""The bounded decode-side staging pool of host landings (pure: standard library): rank 0's GPU
staging blocks leased FIFO in contiguous runs, one run per landing chunk, and the lander's
no-deadlock lease rule (``lease_run``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, Callable

from hisparse_ray.errors import StateError


def _first_run(blocks, n: int) -> int | None:
    """Lowest start of a run of ``n`` consecutive block ids in ``blocks`` (any order)."""
    if len(blocks) < n:
        return None
    start, length = -2, 0
    for b in sorted(blocks):
        if b == start + length:
            length += 1
        else:
            start, length = b, 1
        if length == n:
            return start
    return None


def lease_run(pool: "StagingPool", n: int, inflight: collections.deque,
              finish: Callable[[Any], None]) -> tuple[int, ...]:
    """A contiguous run of ``n`` staging blocks for a lander that may hold chunks in flight
    (``inflight``, oldest first; ``finish(item)`` waits for one and releases its blocks). With
    anything in flight it only TRIES the pool, finishing its oldest chunk after each miss; it
    blocks on the pool only with nothing in flight. So no lander ever waits for blocks while
    holding blocks that only it can release: landers sharing one pool cannot deadlock."""
    while inflight:
        try:
            return pool.acquire_run(n, timeout=0)
        except TimeoutError:
            finish(inflight.popleft())
    return pool.acquire_run(n)


class StagingPool:
    """Bounded FIFO allocator of staging blocks (thread-safe).

    ``acquire(n)`` blocks until ``n`` blocks are free AND every earlier waiter was served (FIFO: a
    large request is not starved by small ones); ``release`` returns blocks. Invariant: free +
    leased == capacity, no block both free and leased. ``n`` above the capacity is refused (the
    caller lands in chunks of at most ``capacity``). ``acquire_run(n)`` is the same with ``n``
    contiguous blocks (first fit), what the lander uses.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: collections.deque[int] = collections.deque(range(capacity))
        self._leased: set[int] = set()
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    def acquire(self, n: int, timeout: float | None = None) -> tuple[int, ...]:
        """Any ``n`` free blocks, in FIFO turn with every other waiter."""
        def pick() -> tuple[int, ...] | None:
            return tuple(list(self._free)[:n]) if len(self._free) >= n else None

        return self._take(n, timeout, pick, f"no {n} staging blocks")

    def acquire_run(self, n: int, timeout: float | None = None) -> tuple[int, ...]:
        """``n`` CONTIGUOUS blocks ``(b, b + 1, ..., b + n - 1)``, first fit (lowest ``b``).

        Same FIFO queue as ``acquire``: blocks until the request is at the head and a free run of
        ``n`` exists. Never deadlocks: every lease is released independently of waiters, and
        with nothing leased the whole pool is one run of ``capacity >= n`` blocks. A chunk in
        one run is one NIXL descriptor per layer and one local copy per layer."""
        def pick() -> tuple[int, ...] | None:
            start = self._first_fit(n)
            return None if start is None else tuple(range(start, start + n))

        return self._take(n, timeout, pick, f"no run of {n} staging blocks")

    def try_acquire_run(self, n: int, spare: int) -> tuple[int, ...] | None:
        """``n`` contiguous blocks now (first fit), or None: only when nobody waits for the pool
        and, after this lease, a contiguous run of ``spare`` blocks stays free. Never blocks.
        What the lander uses to hold a run through a prefill only while another landing of
        ``spare`` blocks can still lease at once."""
        self._check_size(n)
        with self._cond:
            if self._queue or len(self._free) - n < spare:
                return None
            start = self._first_fit(n)
            if start is None:
                return None
            got = tuple(range(start, start + n))
            if spare and _first_run(set(self._free).difference(got), spare) is None:
                return None
            self._lease(got)
            return got

    def _check_size(self, n: int) -> None:
        if not 1 <= n <= self.capacity:
            raise StateError(f"staging request of {n} blocks; pool holds {self.capacity}")

    def _lease(self, got: tuple[int, ...]) -> None:
        """Move ``got`` from free to leased (caller holds the lock)."""
        taken = set(got)
        self._free = collections.deque(b for b in self._free if b not in taken)
        self._leased.update(got)

    def _take(self, n: int, timeout: float | None, pick, what: str) -> tuple[int, ...]:
        """Wait (FIFO) until this caller is at the head of the queue and ``pick()`` finds blocks;
        lease them. ``pick`` runs under the lock and returns the blocks or None."""
        self._check_size(n)
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                ok = self._cond.wait_for(
                    lambda: self._queue[0] is ticket and pick() is not None, timeout)
                if not ok:
                    raise TimeoutError(f"{what} within {timeout} s")
                got = pick()
                self._lease(got)
                return got
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _first_fit(self, n: int) -> int | None:
        """Lowest start of a run of ``n`` free blocks (caller holds the lock)."""
        return _first_run(self._free, n)

    def release(self, blocks: Sequence[int]) -> None:
        with self._cond:
            for b in blocks:
                if b not in self._leased:
                    raise StateError(f"staging block {b} released but not leased")
                self._leased.discard(b)
                self._free.append(b)
            self._cond.notify_all()

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def check_invariants(self) -> None:
        with self._cond:
            free = set(self._free)
            assert len(free) == len(self._free), "a staging block is free twice"
            assert not free & self._leased, "a staging block is both free and leased"
            assert free | self._leased == set(range(self.capacity)), "staging blocks lost"
