"""Prefill -> decode KV landing (ring 3): the orders the coordinator hands a prefill worker, the
NIXL WRITE segments they turn into, and the bounded decode-side staging pool.

Path per peer, picked from what the transport offers (``TransferEngine.supports_direct_host_write``):

* **direct**: the prefill worker WRITEs straight into rank 0's host pool layer regions (RDMA NICs;
  CPU-only machines, where everything is DRAM);
* **staged**: it WRITEs into rank 0's GPU staging pool (GPU -> GPU is CUDA IPC on one node) and rank
  0 copies staging blocks into host blocks locally (55 GB/s D2H vs ~0.5 GB/s TCP-emulated UCX).
  The staging pool is bounded and FIFO; a request larger than it lands in chunks, holding staging
  space only while its chunk is in flight, so a full pool delays landings but never deadlocks them.

A resident landing WRITEs into every rank's device pool (MLA KV is replicated over TP ranks).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Sequence

from hisparse_ray.errors import StateError
from hisparse_ray.transfer import RegionDesc, WriteSegment


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """How a prefill worker reaches one decode rank (published after the rank registered its
    regions). host_layers / staging_layers: rank 0 only, () on peers. device_layers: every rank.
    direct_host: whether this rank accepts direct host writes from a peer of the same memory kind
    as the prefill worker's send buffer (decided by the prefill side's engine; see module doc)."""

    rank: int
    agent: str
    metadata: bytes
    node_id: str
    host_layers: tuple[RegionDesc, ...]
    device_layers: tuple[RegionDesc, ...]
    staging_layers: tuple[RegionDesc, ...]
    staging_blocks: int


@dataclass(frozen=True, slots=True)
class LandingDest:
    """One WRITE into one rank: ``pages`` are (page of the request, block of ``layers``) pairs;
    page p holds positions ``[p * page_size, (p + 1) * page_size)`` clipped to the prompt."""

    rank: int
    layers: tuple[RegionDesc, ...]
    pages: tuple[tuple[int, int], ...]
    notif: bytes


@dataclass(frozen=True, slots=True)
class LandingOrder:
    """Push ``request_id``'s prefilled KV (already computed by ``PrefillWorker.prefill``) to
    ``dests``; each dest is one WRITE with its notification, retried ``attempts`` times with a
    ``timeout_s`` deadline per attempt."""

    request_id: str
    dests: tuple[LandingDest, ...]
    attempts: int = 3
    timeout_s: float = 20.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What prefill returns besides the pushed KV: the indexer keys (model-owned, dense, replicated
    over ranks; they travel through Ray's object store) and timings. index_keys: numpy
    ``[L, T, index_head_dim]`` of the model dtype (as float32 on the wire for bf16 models)."""

    request_id: str
    num_positions: int
    index_keys: object
    prefill_s: float


def page_positions(page: int, page_size: int, num_positions: int) -> tuple[int, int]:
    """(first position, count) of ``page`` clipped to ``num_positions``; count may be 0."""
    lo = page * page_size
    return lo, max(0, min(page_size, num_positions - lo))


def write_segments(dest: LandingDest, local: str, local_layer_stride: int, row_bytes: int,
                   page_size: int, num_positions: int) -> list[WriteSegment]:
    """Segments moving ``dest``'s pages from a local send buffer laid out ``[L, max_T, row_bytes]``
    (``local_layer_stride`` bytes per layer) into ``dest``'s per-layer regions (row ``block *
    page_size + offset``). Pages without positions are skipped."""
    segs: list[WriteSegment] = []
    for layer, region in enumerate(dest.layers):
        for page, block in dest.pages:
            lo, n = page_positions(page, page_size, num_positions)
            if n == 0:
                continue
            segs.append(WriteSegment(
                local=local, local_offset=layer * local_layer_stride + lo * row_bytes,
                nbytes=n * row_bytes, remote=region,
                remote_offset=block * page_size * row_bytes))
    return segs


def chunks(items: Sequence, size: int) -> list[tuple]:
    """``items`` in consecutive chunks of at most ``size`` (``size >= 1``)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


class StagingPool:
    """Bounded FIFO allocator of staging blocks (thread-safe).

    ``acquire(n)`` blocks until ``n`` blocks are free AND every earlier waiter was served (FIFO: a
    large request is not starved by small ones); ``release`` returns blocks. Invariant: free +
    leased == capacity, no block both free and leased. ``n`` above the capacity is refused (the
    caller lands in chunks of at most ``capacity``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: collections.deque[int] = collections.deque(range(capacity))
        self._leased: set[int] = set()
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    def acquire(self, n: int, timeout: float | None = None) -> tuple[int, ...]:
        if not 1 <= n <= self.capacity:
            raise StateError(f"staging request of {n} blocks; pool holds {self.capacity}")
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                ok = self._cond.wait_for(
                    lambda: self._queue[0] is ticket and len(self._free) >= n, timeout)
                if not ok:
                    raise TimeoutError(f"no {n} staging blocks within {timeout} s")
                got = tuple(self._free.popleft() for _ in range(n))
                self._leased.update(got)
                return got
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

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
