"""The decode rank's side of a landing (torch): wait for a chunk's WRITE notifications, copy rank 0's
staging run into the host pool (layer group by layer group), install the chunk's indexer keys into
the request's key cache. ``DecodeWorker.complete_landing`` runs one :class:`RankLanding` step per
Ray call; the landing tests run the very same code on in-memory ranks.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from hisparse_ray.errors import StateError, TransferTimeoutError
from hisparse_ray.landing.plan import group_notif, layer_group, unstage_runs
from hisparse_ray.types import RankLandingStep

CANCELLED_MEMORY = 4096  # failed landings remembered per rank (to stop their late calls)
NOTIF_POLL_S = 1e-4  # landing notification polling (a 1 ms sleep added up to 1 ms per chunk)


class KeyCaches(Protocol):
    """Where a rank keeps each request's indexer keys (the step executor, ``HiSparseWorker``:
    dense per-request caches on the reference path, the paged GPU pool on the fast path)."""

    def install_index_keys(self, rid: str, keys: Any, capacity: int) -> None: ...

    def has_index_keys(self, rid: str) -> bool: ...

    def write_index_keys(self, rid: str, lo: int, raw: Any) -> None: ...

    def set_index_length(self, rid: str, length: int) -> None: ...

    def set_sampling(self, rid: str, params: Any) -> None: ...

    def forget(self, rid: str) -> None: ...


class HostWriter(Protocol):
    """The host pool as its writer (rank 0) sees it (``HostPool``)."""

    def layer(self, l: int) -> Any: ...

    def publish(self) -> Any: ...


class RankLanding:
    """One decode rank's landings. ``take_notifications()`` drains the rank's transfer agent:
    ``[(sender, message)]``. ``lock`` is the rank's executor lock: the host pool's publishes and
    every write into a key cache run under it, so between two decode steps, never inside one.
    Rank 0's staging -> host copies do not: they write host blocks leased to the landing request,
    which no step reads before the request decodes, on a landing stream of their own (CUDA) that
    is synchronized alone before the publish, so decode steps go on while a long prompt lands
    (a device-wide synchronize under the lock used to wait for the steps in flight and hold the
    step thread out). Rank 0 passes the
    host ``pool`` it writes and its GPU ``staging`` layers (``[staging rows, row_bytes]`` uint8
    each); every rank with key staging passes ``key_staging`` (``[L, staging rows, key_row_bytes]``
    uint8, indexed like the staging blocks).

    Invariant: a notification is consumed by exactly one wait (tags are unique per request, chunk
    and layer group; a retried WRITE's duplicate is harmless); a dropped request's waits and later
    steps fail fast (the last ``CANCELLED_MEMORY`` dropped ids are remembered)."""

    def __init__(self, rank: int, page_size: int,
                 take_notifications: Callable[[], list[tuple[str, bytes]]], keys: KeyCaches,
                 lock: threading.Lock, *, pool: HostWriter | None = None,
                 staging: Sequence[Any] = (), key_staging: Any = None) -> None:
        self.rank, self.page_size = rank, page_size
        self._take = take_notifications
        self.keys, self.lock, self.pool = keys, lock, pool
        self.staging, self.key_staging = list(staging), key_staging
        self._streams: dict[int, Any] = {}  # landing thread id -> its CUDA copy stream
        self._notif_lock = threading.Lock()
        self._notifs: set[bytes] = set()
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        # (request id, call started, first notification, staging copied, call done) per step:
        # perf_counter() stamps (benchmarks)
        self.trace: collections.deque = collections.deque(maxlen=10_000)

    @property
    def unclaimed(self) -> frozenset[bytes]:
        """Notifications that arrived and no wait has taken yet."""
        with self._notif_lock:
            self._notifs.update(msg for _, msg in self._take())
            return frozenset(self._notifs)

    def wait_notification(self, notif: bytes, timeout_s: float,
                          request_id: str | None = None) -> None:
        """Block until the landing WRITE tagged ``notif`` was announced to this rank
        (``TransferTimeoutError`` after ``timeout_s``; ``StateError`` as soon as ``request_id``'s
        landing was dropped). Notifications that other landings wait for are kept."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._notif_lock:
                self._notifs.update(msg for _, msg in self._take())
                if notif in self._notifs:
                    self._notifs.discard(notif)
                    return
                if request_id is not None and request_id in self._cancelled:
                    raise StateError(f"landing of {request_id!r} was dropped on rank {self.rank}")
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(f"no landing notification {notif!r} on rank "
                                           f"{self.rank} after {timeout_s} s")
            time.sleep(NOTIF_POLL_S)

    def unstage_run(self, first_staging_block: int, host_blocks: Sequence[int],
                    pages: Sequence[int], num_positions: int,
                    layers: Sequence[int] | None = None) -> float:
        """Rank 0: copy a chunk landed in the contiguous staging run starting at
        ``first_staging_block`` (page ``pages[i]`` in staging block ``first_staging_block + i``)
        into ``host_blocks[i]``, one copy (or one gather/scatter) per layer of ``layers`` (None:
        all), and publish it; returns its seconds."""
        runs = unstage_runs(first_staging_block, host_blocks, pages, self.page_size,
                            num_positions)
        layers = range(len(self.staging)) if layers is None else layers
        t0 = time.perf_counter()
        try:  # synchronous: the bytes are in host memory before the request may decode
            copy_runs([self.staging[l] for l in layers], [self.pool.layer(l) for l in layers],
                      runs, stream=self._stream())
        finally:
            with self.lock:  # the counter is rank 0's, bumped by its steps too
                self.pool.publish()
        return time.perf_counter() - t0

    def _stream(self) -> Any:
        """The calling landing thread's CUDA copy stream (None for host staging): landings of
        different chunks run at once, each synchronizes only its own copies."""
        if not self.staging or not getattr(self.staging[0], "is_cuda", False):
            return None
        import torch

        tid = threading.get_ident()
        with self._notif_lock:
            stream = self._streams.get(tid)
            if stream is None:
                stream = self._streams[tid] = torch.cuda.Stream(self.staging[0].device)
        return stream

    def complete(self, step: RankLandingStep, index_keys: Any = None) -> float:
        """This rank's part of one landing chunk (see :class:`~hisparse_ray.types.RankLandingStep`):
        notification waits, staging -> host copies by layer group, key copy, and on the last
        chunk the key cache's length. ``index_keys``: the whole prompt's keys as numpy ``[L, T,
        d]`` (replicas without key staging). Steps of different chunks may run at once. Returns
        the seconds of the staging -> host copies (0.0 without one)."""
        import torch

        t_enter = time.perf_counter()
        rid = step.request_id
        G = max(1, step.layer_groups)
        L = len(self.staging)
        seconds = 0.0
        t_notified = t_enter
        for g in range(G):  # group g is copied to host while later groups are still written
            if step.notif is not None:
                self.wait_notification(group_notif(step.notif, g, G), step.timeout_s, rid)
                if g == 0:
                    t_notified = time.perf_counter()
            if step.unstage is not None:
                first, host_blocks, pages = step.unstage
                seconds += self.unstage_run(first, host_blocks, pages, step.num_positions,
                                            [l for l in range(L) if layer_group(l, L, G) == g])
        t_copied = time.perf_counter()
        keys = None if index_keys is None else torch.from_numpy(index_keys.copy())
        with self.lock:
            if rid in self._cancelled:
                raise StateError(f"landing of {rid!r} was dropped on rank {self.rank}")
            if step.host_written and self.rank == 0:
                self.pool.publish()
            if keys is not None or not self.keys.has_index_keys(rid):
                self.keys.install_index_keys(rid, keys, step.capacity)
            if step.keys is not None:
                lo, row, n = step.keys
                self.keys.write_index_keys(rid, lo, self.key_staging[:, row:row + n])
                if self.key_staging.is_cuda:  # the lander re-leases the rows next
                    torch.cuda.current_stream().synchronize()
            if step.last:
                self.keys.set_index_length(rid, step.num_positions)
                if step.sampling is not None:
                    self.keys.set_sampling(rid, step.sampling)
        self.trace.append((rid, t_enter, t_notified, t_copied, time.perf_counter()))
        return seconds

    def drop(self, request_id: str) -> None:
        """Forget a landing that failed (its keys may have reached some ranks): running and later
        steps of it fail fast instead of waiting for their notifications."""
        with self._notif_lock:
            self._cancelled[request_id] = None
            while len(self._cancelled) > CANCELLED_MEMORY:
                self._cancelled.popitem(last=False)
        with self.lock:
            self.keys.forget(request_id)


def copy_runs(src_layers: Sequence[Any], dst_layers: Sequence[Any],
              runs: Sequence[tuple[int, int, int]], *, max_memcpys: int = 4,
              stream: Any = None) -> None:
    """``dst_layers[l][d:d + n] = src_layers[l][s:s + n]`` for every run and layer (torch 2-D
    ``[rows, row_bytes]`` tensors; sources may sit on a GPU, destinations on the host). Up to
    ``max_memcpys`` runs: one copy per run and layer. More: per layer one copy of the spanned
    source rows to the destination device and one ``index_copy_`` scatter. Synchronous (returns
    after every copy finished). On CUDA the copies run on ``stream`` (None: the current one),
    which alone is synchronized: work on other streams (decode steps) neither waits nor is
    waited for; the sources must be complete when called (NIXL writes, announced)."""
    import torch

    if not runs:
        return
    cuda = bool(src_layers) and getattr(src_layers[0], "is_cuda", False)
    if not cuda:
        _copy_runs(src_layers, dst_layers, runs, max_memcpys)
        return
    stream = torch.cuda.current_stream(src_layers[0].device) if stream is None else stream
    with torch.cuda.stream(stream):
        _copy_runs(src_layers, dst_layers, runs, max_memcpys)
    stream.synchronize()


def _copy_runs(src_layers: Sequence[Any], dst_layers: Sequence[Any],
               runs: Sequence[tuple[int, int, int]], max_memcpys: int) -> None:
    import torch

    if len(runs) <= max_memcpys:
        # asynchronous copies, one synchronize after them (copy_runs): no per-layer stall
        # between DMA copies (safe for any destination: the synchronize precedes every reader)
        for src, dst in zip(src_layers, dst_layers):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    else:
        lo = min(s for s, _, _ in runs)
        hi = max(s + n for s, _, n in runs)
        s_idx = torch.cat([torch.arange(s - lo, s - lo + n) for s, _, n in runs])
        d_idx = torch.cat([torch.arange(d, d + n) for _, d, n in runs])
        dense = s_idx.numel() == hi - lo and bool((s_idx == torch.arange(hi - lo)).all())
        for src, dst in zip(src_layers, dst_layers):
            span = src[lo:hi]
            if span.device != dst.device:
                span = span.to(dst.device)
            dst.index_copy_(0, d_idx, span if dense else span.index_select(0, s_idx))
