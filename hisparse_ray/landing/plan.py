"""Prefill -> decode KV landing (ring 3): the orders the coordinator hands a prefill worker, the
NIXL WRITE segments they turn into, and the bounded decode-side staging pool.

Path per peer, picked from what the transport offers (``TransferEngine.supports_direct_host_write``):

* **direct**: the prefill worker WRITEs straight into rank 0's host pool layer regions (RDMA NICs;
  CPU-only machines, where everything is DRAM);
* **staged**: it WRITEs into rank 0's GPU staging pool (GPU -> GPU is CUDA IPC on one node) and rank
  0 copies staging blocks into host blocks locally (55 GB/s D2H vs ~0.5 GB/s TCP-emulated UCX).
  The staging pool is bounded and FIFO; a request larger than it lands in chunks, holding staging
  space only while its chunk is in flight, so a full pool delays landings but never deadlocks them.
  A chunk takes a CONTIGUOUS run of staging blocks (``acquire_run``), so it is one WRITE
  descriptor per layer and one local copy (or one gather/scatter) per layer into host blocks.

Descriptor count: ``write_segments`` merges consecutive pages into consecutive blocks into one
segment per layer (``page_runs``); the direct path gets one descriptor per layer and host-block
run. Per-descriptor and per-call costs, not bandwidth, bound small-page landings.

A resident landing WRITEs into every rank's device pool (MLA KV is replicated over TP ranks).
"""

from __future__ import annotations

import collections
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hisparse_ray.errors import StateError
from hisparse_ray.transfer import RegionDesc, WriteSegment
from hisparse_ray.transfer.base import region_columns, regions_from_columns


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
    # every rank (when the replica has a staging pool): indexer-key landing rows, one region per
    # layer of ``staging_blocks * page_size`` rows of ``key_row_bytes``, indexed like the staging
    # pool's blocks (the lander's staging lease covers them on every rank)
    key_layers: tuple[RegionDesc, ...] = ()


@dataclass(frozen=True, slots=True)
class LandingDest:
    """One WRITE into one rank: ``pages`` are (page of the request, block of ``layers``) pairs;
    page p holds positions ``[p * page_size, (p + 1) * page_size)`` clipped to the prompt."""

    rank: int
    layers: tuple[RegionDesc, ...]
    pages: tuple[tuple[int, int], ...]
    notif: bytes
    # indexer keys of positions ``[lo, lo + n)`` into rows ``[row, row + n)`` of every layer's
    # ``key_layers`` region: ``key_rows = (lo, row, n)``; None: no keys in this WRITE
    key_layers: tuple[RegionDesc, ...] = ()
    key_rows: tuple[int, int, int] | None = None
    # > 1: the KV rows go as this many WRITEs by layer group (layer l in group l * G // L), each
    # with notification ``group_notif(notif, g)`` (the keys ride with the last group), so the
    # rank can copy group g to host while later groups are still being written
    layer_groups: int = 1

    def __reduce__(self):
        # the layer regions as columns (one endpoint's: same agent, kind, device): an order of a
        # 16K-token prompt names 183 of them, pickled one by one they were most of pack()
        return _landing_dest, (self.rank, region_columns(self.layers), self.pages, self.notif,
                               region_columns(self.key_layers), self.key_rows, self.layer_groups)


def _landing_dest(rank, layers, pages, notif, key_layers, key_rows, layer_groups) -> LandingDest:
    return LandingDest(rank, regions_from_columns(layers), pages, notif,
                       regions_from_columns(key_layers), key_rows, layer_groups)


def group_notif(notif: bytes, group: int, groups: int) -> bytes:
    """The notification of layer group ``group`` of a WRITE split in ``groups`` (``notif`` itself
    when not split)."""
    return notif if groups <= 1 else notif + b"#%d" % group


def layer_group(layer: int, num_layers: int, groups: int) -> int:
    """The group of ``layer`` when ``num_layers`` layers are split in ``groups`` (contiguous,
    sizes differ by at most one)."""
    return layer * groups // num_layers


@dataclass(frozen=True, slots=True)
class RankLandingStep:
    """What one decode rank does for one landing chunk, in one Ray call
    (``DecodeWorker.complete_landing``), in this order:

    1. wait for the WRITE notification ``notif`` (None: nothing was written to this rank);
    2. rank 0, staged path: ``unstage = (first staging block, host blocks, pages)``: copy the
       chunk's pages from the staging run into host blocks; ``host_written``: a direct WRITE
       went into host blocks (publish them to the peers);
    3. ``keys = (lo, row, n)``: copy indexer keys of positions ``[lo, lo + n)`` from key
       staging rows ``[row, row + n)`` into the request's key cache (created on first use with
       room for ``capacity`` positions);
    4. ``last``: the request's key cache holds ``num_positions`` keys (it may decode once every
       rank finished its steps)."""

    request_id: str
    num_positions: int
    capacity: int
    timeout_s: float
    notif: bytes | None = None
    unstage: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    host_written: bool = False
    keys: tuple[int, int, int] | None = None
    last: bool = False
    layer_groups: int = 1  # > 1: wait and unstage group by group (``LandingDest.layer_groups``)


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
    """What prefill returns besides the pushed KV: timings and, only when asked (``keys_inline``:
    replicas without key staging), the indexer keys (model-owned, dense, replicated over ranks)
    as numpy ``[L, T, index_head_dim]`` (float32 on the wire for bf16 models); otherwise None
    and the keys travel by NIXL with the KV (``LandingDest.key_rows``)."""

    request_id: str
    num_positions: int
    index_keys: object
    prefill_s: float


def pack(obj: Any) -> bytes:
    """A landing order or rank step as the bytes its Ray call carries. Ray serializes a nested
    dataclass argument several times slower than the same bytes (measured on the dev VM: 560 vs
    160 us per ``.remote()`` for a 16K-token order of 61 layer regions and 256 pages), and the
    lander makes three such calls on a landing's critical path. ``RegionDesc`` pickles by value
    through a cache (``transfer.base``), which cut a 16K-token order's loads from 370 to 70 us."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(arg: Any) -> Any:
    """The object behind :func:`pack`'s bytes; anything else as it is (direct callers, tests)."""
    return pickle.loads(arg) if isinstance(arg, (bytes, bytearray)) else arg


def landing_notif(request_id: str, rank: int, chunk: int) -> bytes:
    """The notification tag of ``request_id``'s WRITE to ``rank`` for landing chunk ``chunk``."""
    return f"land:{request_id}:{rank}:{chunk}".encode()


def chunk_pages(pages: Sequence[int], capacity: int, in_flight: int = 2) -> list[tuple]:
    """The lander's chunks of ``pages``: one chunk when they fit the staging pool's
    ``capacity`` blocks, else chunks of ``capacity // in_flight`` (>= 1) so that ``in_flight``
    chunks can be leased at once."""
    if not pages:
        return [()]
    size = capacity if len(pages) <= capacity else max(1, capacity // in_flight)
    return chunks(pages, size)


def plan_chunk(request_id: str, num_positions: int, page_size: int, path: str,
               block: dict[int, int], part: tuple, run: tuple, chunk: int, last: bool,
               capacity: int, endpoints: Sequence[RankEndpoint], *, timeout_s: float,
               layer_groups: int = 1) -> tuple[list[LandingDest], list[RankLandingStep]]:
    """The WRITEs and the per-rank steps of one landing chunk (pure; the lander issues them).

    ``path``: "resident" (KV into every rank's device blocks), "direct" (rank 0's host blocks)
    or "staged" (rank 0's staging run, then copied to host). ``block[page]``: the target block of
    each page to push (pages absent from it are reused: only their keys travel). ``part``: the
    chunk's pages; ``run``: its staging run (page ``part[j]`` -> staging block ``run[j]``), or ()
    when the chunk leases none. With key staging on the ranks and a run, every rank also gets
    the indexer keys of all the chunk's positions. Returns one ``LandingDest`` per rank that is
    written and one ``RankLandingStep`` per rank (in endpoint order)."""
    T, P = num_positions, page_size
    slot = {page: run[j] for j, page in enumerate(part)} if run else {}
    kv = [(page, block[page]) for page in part if page in block]
    keys = None
    if run and endpoints[0].key_layers:  # this chunk's positions, all pages (reused ones too)
        lo = part[0] * P
        keys = (lo, run[0] * P, min(T, (part[-1] + 1) * P) - lo)
    dests, steps = [], []
    for ep in endpoints:
        r = ep.rank
        if path == "resident":
            pages_r, layers = tuple(kv), ep.device_layers
        elif r == 0 and path == "direct":
            pages_r, layers = tuple(kv), ep.host_layers
        elif r == 0:  # staged: page j of the chunk into staging block run[j]
            pages_r = tuple((page, slot[page]) for page, _ in kv)
            layers = ep.staging_layers
        else:
            pages_r, layers = (), ()
        # staged KV: split in layer groups so rank 0 copies group g while g+1 is written
        groups = min(layer_groups, len(layers)) if pages_r and r == 0 and path == "staged" else 1
        notif = None
        if pages_r or keys is not None:
            notif = landing_notif(request_id, r, chunk)
            dests.append(LandingDest(r, layers if pages_r else (), pages_r, notif,
                                     ep.key_layers if keys else (), keys, groups))
        unstage = None
        if r == 0 and path == "staged" and kv:
            # the pushed pages are the chunk's pages after its reused prefix: consecutive
            # staging blocks (unstage_run's contract)
            first = slot[kv[0][0]]
            if [slot[page] for page, _ in kv] != list(range(first, first + len(kv))):
                raise StateError(f"landing chunk {chunk} of {request_id!r}: pushed pages "
                                 f"{[p for p, _ in kv]} are not consecutive in staging")
            unstage = (first, tuple(hb for _, hb in kv), tuple(page for page, _ in kv))
        steps.append(RankLandingStep(
            request_id, T, capacity, timeout_s, notif, unstage,
            host_written=r == 0 and path == "direct" and bool(kv), keys=keys, last=last,
            layer_groups=groups))
    return dests, steps


def page_positions(page: int, page_size: int, num_positions: int) -> tuple[int, int]:
    """(first position, count) of ``page`` clipped to ``num_positions``; count may be 0."""
    lo = page * page_size
    return lo, max(0, min(page_size, num_positions - lo))


def write_segments(dest: LandingDest, local: str, local_layer_stride: int, row_bytes: int,
                   page_size: int, num_positions: int, *, key_local: str = "",
                   key_layer_stride: int = 0, key_row_bytes: int = 0) -> list[WriteSegment]:
    """Segments moving ``dest``'s pages from a local send buffer laid out ``[L, max_T, row_bytes]``
    (``local_layer_stride`` bytes per layer) into ``dest``'s per-layer regions (row ``block *
    page_size + offset``). Pages without positions are skipped. Consecutive pages landing in
    consecutive blocks become one segment (per layer), so a chunk of pages into a contiguous
    block run is one descriptor per layer.

    With ``dest.key_rows``, also the indexer keys: from local ``key_local`` laid out ``[L, max_T,
    key_row_bytes]`` (``key_layer_stride`` bytes per layer) into ``dest.key_layers`` (row
    ``row + r`` of each layer's region): one descriptor per layer, after the KV segments."""
    return [seg for group in write_groups(dest, local, local_layer_stride, row_bytes, page_size,
                                          num_positions, key_local=key_local,
                                          key_layer_stride=key_layer_stride,
                                          key_row_bytes=key_row_bytes)
            for seg in group]


def write_groups(dest: LandingDest, local: str, local_layer_stride: int, row_bytes: int,
                 page_size: int, num_positions: int, *, key_local: str = "",
                 key_layer_stride: int = 0, key_row_bytes: int = 0
                 ) -> list[list[WriteSegment]]:
    """``write_segments`` split in ``dest.layer_groups`` WRITEs: group g holds the KV segments of
    the layers with ``layer_group(l, L, G) == g``; the key segments go with the last group.
    Empty groups are kept (every group has its notification); one group when not split."""
    G = max(1, dest.layer_groups)
    L = len(dest.layers)
    runs = page_runs(dest.pages, page_size, num_positions)
    groups: list[list[WriteSegment]] = [[] for _ in range(G)]
    for layer, region in enumerate(dest.layers):
        groups[layer_group(layer, L, G)].extend(
            WriteSegment(local=local, local_offset=layer * local_layer_stride + lo * row_bytes,
                         nbytes=n * row_bytes, remote=region, remote_offset=row * row_bytes)
            for lo, row, n in runs)
    if dest.key_rows is not None and dest.key_rows[2] > 0:
        if not dest.key_layers or not key_local or key_row_bytes <= 0:
            raise StateError("a landing WRITE names key rows but no key regions")
        lo, row, n = dest.key_rows
        groups[-1] += [WriteSegment(local=key_local,
                                    local_offset=layer * key_layer_stride + lo * key_row_bytes,
                                    nbytes=n * key_row_bytes, remote=region,
                                    remote_offset=row * key_row_bytes)
                       for layer, region in enumerate(dest.key_layers)]
    return groups


def split_by_memory_kind(segments: Sequence[WriteSegment], local_kind: Any
                         ) -> list[list[WriteSegment]]:
    """``segments`` in groups that one WRITE can move (NIXL moves one memory kind per side per
    transfer): grouped by ``(local_kind(seg.local), seg.remote.kind)``, order kept within a
    group, groups in order of first appearance. E.g. a direct host landing's KV rows (device ->
    DRAM) and its indexer keys (device -> VRAM key staging) are two WRITEs."""
    groups: dict[tuple, list[WriteSegment]] = {}
    for seg in segments:
        groups.setdefault((local_kind(seg.local), seg.remote.kind), []).append(seg)
    return list(groups.values())


def page_runs(pages: Sequence[tuple[int, int]], page_size: int, num_positions: int
              ) -> list[tuple[int, int, int]]:
    """``(first position, first block row, rows)`` runs of ``pages`` = (page, block) pairs, in
    the given order, clipped to ``num_positions`` (pages without positions skipped): a run
    continues while the page and the block both advance by one and the previous page was full.
    Row r of a run is position ``first position + r`` and block row ``first block row + r``."""
    runs: list[list[int]] = []
    prev: tuple[int, int, int] | None = None  # (page, block, rows) of the last page kept
    for page, block in pages:
        lo, n = page_positions(page, page_size, num_positions)
        if n == 0:
            continue
        if (prev is not None and page == prev[0] + 1 and block == prev[1] + 1
                and prev[2] == page_size):
            runs[-1][2] += n
        else:
            runs.append([lo, block * page_size, n])
        prev = (page, block, n)
    return [(lo, row, n) for lo, row, n in runs]


def unstage_runs(first_staging_block: int, host_blocks: Sequence[int], pages: Sequence[int],
                 page_size: int, num_positions: int) -> list[tuple[int, int, int]]:
    """``(staging row, host row, rows)`` copies that move a chunk landed in the contiguous
    staging run starting at ``first_staging_block`` (page ``pages[i]`` in staging block
    ``first_staging_block + i``) into host blocks ``host_blocks[i]``, rows clipped to
    ``num_positions``; consecutive host blocks of consecutive full pages merge into one copy."""
    if len(host_blocks) != len(pages):
        raise ValueError(f"{len(host_blocks)} host blocks for {len(pages)} pages")
    out: list[list[int]] = []
    prev: tuple[int, int, int] | None = None  # (page, host block, rows) of the last page kept
    for i, (hb, page) in enumerate(zip(host_blocks, pages)):
        _, n = page_positions(page, page_size, num_positions)
        if n == 0:
            continue
        src = (first_staging_block + i) * page_size
        if (prev is not None and hb == prev[1] + 1 and prev[2] == page_size
                and src == out[-1][0] + out[-1][2]):
            out[-1][2] += n
        else:
            out.append([src, hb * page_size, n])
        prev = (page, hb, n)
    return [(s, d, n) for s, d, n in out]


def copy_runs(src_layers: Sequence[Any], dst_layers: Sequence[Any],
              runs: Sequence[tuple[int, int, int]], *, max_memcpys: int = 4) -> None:
    """``dst_layers[l][d:d + n] = src_layers[l][s:s + n]`` for every run and layer (torch 2-D
    ``[rows, row_bytes]`` tensors; sources may sit on a GPU, destinations on the host). Up to
    ``max_memcpys`` runs: one copy per run and layer. More: per layer one copy of the spanned
    source rows to the destination device and one ``index_copy_`` scatter. Synchronous (returns
    after every copy finished)."""
    import torch

    if not runs:
        return
    if len(runs) <= max_memcpys:
        # asynchronous copies, one synchronize below: no per-layer stall between DMA copies
        # (safe for any destination: the synchronize precedes every reader)
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
    if src_layers and getattr(src_layers[0], "is_cuda", False):
        torch.cuda.synchronize()


def chunks(items: Sequence, size: int) -> list[tuple]:
    """``items`` in consecutive chunks of at most ``size`` (``size >= 1``)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


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
