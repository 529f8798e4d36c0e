"""The lander's plan of a prefill -> decode KV landing (pure: standard library and the wire
module): which pages go in which chunk, which WRITE each rank gets (``LandingDest``), what each
rank does afterwards (``RankLandingStep``), and the row runs those become.

Path per peer, picked from what the transport offers (``TransferEngine.supports_direct_host_write``):

* **direct**: the prefill worker WRITEs straight into rank 0's host pool layer regions (RDMA NICs;
  CPU-only machines, where everything is DRAM);
* **staged**: it WRITEs into rank 0's GPU staging pool (GPU -> GPU is CUDA IPC on one node) and rank
  0 copies staging blocks into host blocks locally (55 GB/s D2H vs ~0.5 GB/s TCP-emulated UCX).
  The staging pool is bounded and FIFO; a request larger than it lands in chunks, holding staging
  space only while its chunk is in flight, so a full pool delays landings but never deadlocks them.
  A chunk takes a CONTIGUOUS run of staging blocks (``acquire_run``), so it is one WRITE
  descriptor per layer and one local copy (or one gather/scatter) per layer into host blocks.

Descriptor count: ``segments.write_segments`` merges consecutive pages into consecutive blocks into one
segment per layer (``page_runs``); the direct path gets one descriptor per layer and host-block
run. Per-descriptor and per-call costs, not bandwidth, bound small-page landings.

A resident landing WRITEs into every rank's device pool (MLA KV is replicated over TP ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

from hisparse_ray.errors import StateError
from hisparse_ray.types import LandingDest, RankEndpoint, RankLandingStep, SamplingParams


def group_notif(notif: bytes, group: int, groups: int) -> bytes:
    """The notification of layer group ``group`` of a WRITE split in ``groups`` (``notif`` itself
    when not split)."""
    return notif if groups <= 1 else notif + b"#%d" % group


def layer_group(layer: int, num_layers: int, groups: int) -> int:
    """The group of ``layer`` when ``num_layers`` layers are split in ``groups`` (contiguous,
    sizes differ by at most one)."""
    return layer * groups // num_layers


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
               layer_groups: int = 1, sampling: SamplingParams | None = None
               ) -> tuple[list[LandingDest], list[RankLandingStep]]:
    """The WRITEs and the per-rank steps of one landing chunk (pure; the lander issues them).

    ``path``: "resident" (KV into every rank's device blocks), "direct" (rank 0's host blocks)
    or "staged" (rank 0's staging run, then copied to host). ``block[page]``: the target block of
    each page to push (pages absent from it are reused: only their keys travel). ``part``: the
    chunk's pages; ``run``: its staging run (page ``part[j]`` -> staging block ``run[j]``), or ()
    when the chunk leases none. With key staging on the ranks and a run, every rank also gets
    the indexer keys of all the chunk's positions. Returns one ``LandingDest`` per rank that is
    written and one ``RankLandingStep`` per rank (in endpoint order); every rank's step of the
    last chunk carries ``sampling`` (every rank draws the same token: a peer feeds it to its
    chained row of the next step, ``ReplicaSpec.lookahead``)."""
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
            layer_groups=groups, sampling=sampling if last else None))
    return dests, steps


def page_positions(page: int, page_size: int, num_positions: int) -> tuple[int, int]:
    """(first position, count) of ``page`` clipped to ``num_positions``; count may be 0."""
    lo = page * page_size
    return lo, max(0, min(page_size, num_positions - lo))


def chunks(items: Sequence, size: int) -> list[tuple]:
    """``items`` in consecutive chunks of at most ``size`` (``size >= 1``)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


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
