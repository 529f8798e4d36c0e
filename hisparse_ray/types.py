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
