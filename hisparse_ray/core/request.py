"""Per-request residency state and the in-flight transfer book (pure ring).

A request's pages each hold at most one host block and one device block. In a *stable* tier the
shape is fixed: RESIDENT = every page has a device block, no host blocks, no hot buffer; HOST =
every page has a host block, no device block, a full hot buffer. Mixed shapes exist only while a
conversion (spill to host, restore to resident) or an admission restore is in flight, and such a
request is kept out of decode batches until it is stable again.

Transfer lifecycle: emitted (source and destination pinned) -> enqueued by every rank (spill:
resident lease released, table entry replaced) -> completed by every rank (host page valid and
maybe published, remaining pins dropped) -> retired (its id becomes unknown).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hisparse_ray.core.prefix_index import PrefixKey
from hisparse_ray.types import (
    NO_BLOCK, DeviceBlockId, HostBlockId, LandingTarget, Rank, RequestId, RequestState, TransferId,
)


@dataclass(slots=True)
class Page:
    """One page of a request. ``host_rows`` counts positions of this page whose host copy is
    complete; ``reused`` marks a matched prefix page (already published, never republished)."""

    host: HostBlockId | None = None
    device: DeviceBlockId | None = None
    host_rows: int = 0
    reused: bool = False

    def entry(self) -> tuple[int, int]:
        """The worker-visible (host_block, device_block) table entry."""
        return (NO_BLOCK if self.host is None else int(self.host),
                NO_BLOCK if self.device is None else int(self.device))


class Conversion(enum.Enum):
    SPILL = "spill"  # resident -> host: page spills in flight
    HOT = "hot"  # resident -> host: spills done, waiting for the rest of the hot buffer
    RESTORE = "restore"  # host -> resident (or admission restores of matched pages)


@dataclass(slots=True)
class Request:
    """Mutable coordinator-side record of one request (never crosses a process boundary)."""

    rid: RequestId
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    eos_token_id: int | None
    target: LandingTarget
    tier: LandingTarget
    state: RequestState = RequestState.WAITING
    pages: list[Page] = field(default_factory=list)
    hot: list[DeviceBlockId] = field(default_factory=list)
    written: int = 0  # positions whose KV is written (landed, or emitted in a step)
    awaiting: list[int] = field(default_factory=list)  # steps whose sampled token is due, ascending
    awaiting_row: int = -1  # its row in the newest of them (a chained row's ``prev_row``)
    chain: bool = False  # may run a step before its previous token is known (Coordinator.admit)
    in_flight: set[TransferId] = field(default_factory=set)
    conversion: Conversion | None = None
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker's view of the table
    table_from: int = 0  # pages from this index on may differ from ``sent`` (see table_changes)
    handle: int | None = None  # its integer name in step commands, from its first command on
    sent_hot: tuple[int, ...] | None = None  # the hot buffer the workers last received
    keys: list[PrefixKey] = field(default_factory=list)  # keys of full pages, computed lazily
    finish_reason: str | None = None
    forget_when_released: bool = False
    backed: bool = False  # resident with its life reserved on the host tier (see reservations)
    stalled: bool = False  # resident, waiting for a device page; claims one (see reservations)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def check_invariants(self, page_size: int) -> None:
        """Record-local rules: token counts, written positions and page row counts in range."""
        assert 1 <= self.prompt_len <= len(self.tokens), f"{self.rid}: prompt/tokens mismatch"
        assert self.num_generated <= self.max_new_tokens, f"{self.rid}: generated past its limit"
        assert self.written <= len(self.tokens) + self.unknown_written, \
            f"{self.rid}: wrote a position with no token"
        assert all(0 <= p.host_rows <= page_size for p in self.pages), f"{self.rid}: host_rows"
        if self.awaiting:
            assert self.state in (RequestState.RUNNING, RequestState.FINISHED), self.rid
            assert self.awaiting == sorted(set(self.awaiting)), f"{self.rid}: {self.awaiting}"
            assert len(self.awaiting) == 1 or self.chain, f"{self.rid}: unchained steps in flight"
            assert len(self.awaiting) <= 2, f"{self.rid}: {self.awaiting} in flight"
        if self.state is RequestState.RELEASED:
            assert not (self.pages or self.hot or self.in_flight), f"{self.rid} released with leases"

    def mark_table(self, page: int = 0) -> None:
        """Page ``page`` (default: every page) may have changed blocks: the next
        :meth:`table_changes` scans from it. Call it wherever a page's ``host`` / ``device``
        changes; a page appended at the end needs no call (it lies past ``table_from``)."""
        self.table_from = min(self.table_from, page)

    def table_changes(self) -> list[tuple[int, int, int]]:
        """``(page, host_block, device_block)`` of every page whose entry the workers have not
        received, now marked received. Scans only pages from ``table_from`` on (then set past
        the last page): a step costs O(requests + changed pages), not O(all pages)."""
        out = []
        for i in range(self.table_from, len(self.pages)):
            e = self.pages[i].entry()
            if self.sent.get(i) != e:
                self.sent[i] = e
                out.append((i, *e))
        self.table_from = len(self.pages)
        return out

    @property
    def unknown_written(self) -> int:
        """Written positions whose token is not known (yet): a chained row's input is the token
        its previous step samples (one while RUNNING with two steps in flight); once finished,
        at most one (an abort drops the token of a step in flight, whose chained row was fed it)."""
        if self.state is RequestState.RUNNING:
            return max(0, len(self.awaiting) - 1)
        return 1 if self.chain else 0

    @property
    def lifetime_positions(self) -> int:
        """Positions that get KV over the request's life: the last sampled token is never fed."""
        return self.prompt_len + self.max_new_tokens - 1


class TransferOp(enum.Enum):
    SPILL = "spill"
    RESTORE = "restore"
    BACKUP = "backup"


@dataclass(slots=True)
class Pending:
    """One in-flight transfer: which ranks acknowledged it so far."""

    tid: TransferId
    kind: TransferOp
    rid: RequestId
    page: int
    device_block: DeviceBlockId | None
    host_block: HostBlockId
    enqueued: set[Rank] = field(default_factory=set)
    completed: set[Rank] = field(default_factory=set)
    enqueue_applied: bool = False


class TransferBook:
    """In-flight transfers keyed by id; ids are fresh and never reused (monotonic counter).

    The "all ranks reported" rule is uniform: a transfer's enqueued (completed) action runs once
    every rank in ``0..tp_size-1`` acknowledged it enqueued (completed); a completed ack implies
    the enqueued ack of the same rank. Backups follow the same rule even though rank 0 is the only
    host writer, so a peer never reads a host row the coordinator already treats as valid.
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._next = 1
        self.pending: dict[TransferId, Pending] = {}

    def new(self, kind: TransferOp, rid: RequestId, page: int,
            device_block: DeviceBlockId | None, host_block: HostBlockId) -> Pending:
        tid = TransferId(self._next)
        self._next += 1
        p = Pending(tid, kind, rid, page, device_block, host_block)
        self.pending[tid] = p
        return p

    def all_enqueued(self, p: Pending) -> bool:
        return len(p.enqueued) == self.tp_size

    def all_completed(self, p: Pending) -> bool:
        return len(p.completed) == self.tp_size

    def retire(self, tid: TransferId) -> None:
        del self.pending[tid]

    def check_invariants(self) -> None:
        for tid, p in self.pending.items():
            assert p.tid == tid and 0 < tid < self._next, f"transfer id {tid} is not fresh"
            assert p.completed <= p.enqueued, f"transfer {tid}: completed without enqueued"
            assert p.enqueued <= set(range(self.tp_size)), f"transfer {tid}: unknown rank acked"
            assert not self.all_completed(p), f"transfer {tid} completed but not retired"
            if p.enqueue_applied:
                assert self.all_enqueued(p), f"transfer {tid} acted on before every rank enqueued"
