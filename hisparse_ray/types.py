"""The wire module: every value that crosses a process boundary (pure ring: standard library only).

Small frozen dataclasses of ints and tuples, with ``NewType`` ids so that a host block id cannot be
passed where a device block id is expected. Commands carry diffs, not snapshots.

Device memory model (shared by coordinator, worker runtime and kernels):
  * The device pool is ``num_device_blocks`` blocks of ``page_size`` rows per layer. A block is
    leased either as a *resident page* of one request, or as part of a request's *hot buffer*
    (``ceil((H + 1) / page_size)`` blocks giving H hot slots + 1 reserved newest-token slot).
  * The host pool is ``num_host_blocks`` blocks of ``page_size`` rows per layer (layer-major).
  * Row of position p of a request: page ``p // page_size``, offset ``p % page_size``; physical row
    ``block * page_size + offset`` in that pool's per-layer view.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

RequestId = NewType("RequestId", str)
HostBlockId = NewType("HostBlockId", int)
DeviceBlockId = NewType("DeviceBlockId", int)
TransferId = NewType("TransferId", int)
Rank = NewType("Rank", int)

NO_BLOCK = -1  # "no block" in block tables sent to workers and kernels


class LandingTarget(enum.Enum):
    """Where a request's prefix KV lands at admission; chosen once per request."""

    RESIDENT = "resident"  # whole prefix in device pages
    HOST = "host"  # host blocks + a fixed hot buffer on the device


class TransferKind(enum.Enum):
    SPILL = "spill"  # resident device page -> host block (all layers)
    RESTORE = "restore"  # host block -> resident device page (all layers)


@dataclass(frozen=True, slots=True)
class PageTransfer:
    """Copy one page (all layers) between the device pool and the host pool."""

    transfer_id: TransferId
    kind: TransferKind
    device_block: DeviceBlockId
    host_block: HostBlockId


@dataclass(frozen=True, slots=True)
class Backup:
    """Eager backup: after this step's forward, copy the newest token's rows (all layers) from the
    request's reserved slot to ``host_block``/``offset``. The next forward waits on it."""

    transfer_id: TransferId
    request_id: RequestId
    position: int
    host_block: HostBlockId
    offset: int


@dataclass(frozen=True, slots=True)
class TableDiff:
    """Set one page of a request's block tables (``NO_BLOCK`` clears an entry)."""

    request_id: RequestId
    page: int
    host_block: int  # HostBlockId or NO_BLOCK
    device_block: int  # DeviceBlockId (resident page) or NO_BLOCK


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request in this step's decode batch.

    seq_len: n, the number of positions after this step's token is written (newest = n - 1).
    hot_blocks: the device blocks of the request's hot buffer (empty for fully resident requests).
    """

    request_id: RequestId
    seq_len: int
    input_token: int
    hot_blocks: tuple[DeviceBlockId, ...] = ()


@dataclass(frozen=True, slots=True)
class StepCommand:
    """What one TP rank executes for one decode step."""

    step: int
    rank: Rank
    batch: tuple[BatchRow, ...]
    table_diffs: tuple[TableDiff, ...] = ()
    transfers: tuple[PageTransfer, ...] = ()
    backups: tuple[Backup, ...] = ()
    released: tuple[RequestId, ...] = ()  # requests whose worker-side state may be dropped


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one TP rank reports back after a step: transfer acks and (rank 0) sampled tokens."""

    step: int
    rank: Rank
    enqueued: tuple[TransferId, ...] = ()
    completed: tuple[TransferId, ...] = ()
    sampled: tuple[tuple[RequestId, int], ...] = ()
    hot_hits: int = 0
    hot_misses: int = 0
    # (request, hits, misses) per batch row, summed over anchor layers (added by actors; additive)
    hits_by_request: tuple[tuple[RequestId, int, int], ...] = ()


# --- Coordinator-facing values (added by the core; additive) ------------------------------------


class RequestState(enum.Enum):
    """Lifecycle of a request in the coordinator: WAITING -> LANDING -> RUNNING -> FINISHED ->
    RELEASED. FINISHED still holds leases while transfers (or an in-flight step) of the request are
    outstanding; RELEASED holds nothing."""

    WAITING = "waiting"  # admission did not fit yet; the landing target is already chosen
    LANDING = "landing"  # leases handed out, the prefill path is writing the landing plan
    RUNNING = "running"  # landed; takes part in decode batches
    FINISHED = "finished"  # done or aborted; draining in-flight transfers
    RELEASED = "released"  # every lease returned


@dataclass(frozen=True, slots=True)
class LandingPage:
    """Destination of one page of an admitted prefix.

    host_block / device_block: HostBlockId / DeviceBlockId or NO_BLOCK (exactly one is set).
    reused: True when the page needs no landing (a published host page matched the prefix; for a
        resident target the coordinator restores it into ``device_block`` itself).
    """

    page: int
    host_block: int
    device_block: int
    reused: bool


@dataclass(frozen=True, slots=True)
class Admission:
    """Landing plan of an admitted request: write KV of positions ``0..num_positions-1`` into the
    non-reused pages, then call ``Coordinator.apply_landed``.

    pages: one entry per page ``0..ceil((num_positions + 1) / page_size) - 1`` (the last may hold
        only the position the first decode step writes).
    hot_blocks: device blocks of the hot buffer (host target), () for a resident target.
    """

    request_id: RequestId
    target: LandingTarget
    num_positions: int
    pages: tuple[LandingPage, ...]
    hot_blocks: tuple[DeviceBlockId, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestView:
    """Read-only snapshot of one request for callers (``Coordinator.view``)."""

    request_id: RequestId
    state: RequestState
    target: LandingTarget
    tier: LandingTarget  # current tier (a resident request may have been converted to host)
    tokens: tuple[int, ...]  # prompt + sampled tokens
    prompt_len: int
    num_generated: int
    finish_reason: str | None = None  # "length", "eos", "abort", "landing_failed"


@dataclass(frozen=True, slots=True)
class CoordinatorCounters:
    """Metrics snapshot of the coordinator (hot hits/misses are the worker's, not counted here)."""

    steps: int = 0
    admitted: int = 0
    waiting: int = 0
    running: int = 0
    finished: int = 0
    spills: int = 0  # completed SPILL page transfers
    restores: int = 0  # completed RESTORE page transfers
    backups: int = 0  # completed newest-row backups
    spill_bytes: int = 0
    restore_bytes: int = 0
    backup_bytes: int = 0
    conversions_to_host: int = 0
    prefix_hit_pages: int = 0
    published_pages: int = 0
    evictions: int = 0
    stalls: int = 0  # batch slots skipped because a pool had no block for the next page
    device_blocks_total: int = 0
    device_blocks_used: int = 0
    host_blocks_total: int = 0
    host_blocks_used: int = 0  # referenced or pinned host blocks
    host_blocks_cached: int = 0  # published, unreferenced (evictable) host blocks
