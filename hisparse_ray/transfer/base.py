"""The transfer-engine contract: registered regions, WRITE posts, states, notifications (adapter ring).

Everything here is plain data or a ``Protocol``; the NIXL adapter and the in-process loopback both
satisfy it, so code above (landing, spill) takes a ``TransferEngine`` and never imports NIXL. The
regions a peer names (``RegionDesc``, ``MemKind``) are wire values and live in
:mod:`hisparse_ray.types`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from hisparse_ray.errors import TransferError, TransferTimeoutError
from hisparse_ray.types import MemKind, RegionDesc


class XferState(enum.Enum):
    """State of a posted transfer as seen by its initiator (a failed one raises instead)."""

    PENDING = "PROC"
    DONE = "DONE"


@dataclass(frozen=True, slots=True)
class WriteSegment:
    """Copy ``nbytes`` from local region ``local`` at ``local_offset`` to ``remote`` at
    ``remote_offset``. All segments of one write target one peer agent."""

    local: str
    local_offset: int
    nbytes: int
    remote: RegionDesc
    remote_offset: int


def registered(regions: dict[str, tuple], name: str, engine: str, *, pop: bool = False) -> tuple:
    """An engine's entry for region ``name`` (``(RegionDesc, ...)``), removed with ``pop``;
    ``TransferError`` naming the region and the engine when it is not registered."""
    entry = regions.pop(name, None) if pop else regions.get(name)
    if entry is None:
        raise TransferError(f"region {name!r} is not registered on {engine!r}")
    return entry


def coalesce(segments: Sequence[WriteSegment]) -> list[WriteSegment]:
    """Merge each run of segments that continue one another on both sides (same local region,
    same remote region, both offsets contiguous) into one; order and bytes moved are unchanged.
    Page-granular landings of contiguous pages become one descriptor instead of thousands."""
    out: list[WriteSegment] = []
    for seg in segments:
        if out:
            last = out[-1]
            if (seg.local == last.local and seg.remote == last.remote
                    and seg.local_offset == last.local_offset + last.nbytes
                    and seg.remote_offset == last.remote_offset + last.nbytes):
                out[-1] = WriteSegment(last.local, last.local_offset, last.nbytes + seg.nbytes,
                                       last.remote, last.remote_offset)
                continue
        out.append(seg)
    return out


@runtime_checkable
class TransferEngine(Protocol):
    """One agent in one process. Lifecycle: register regions -> export ``agent_metadata()`` (after
    registering: metadata taken earlier does not know the regions) -> peers ``add_peer()`` it ->
    ``post_write`` / ``poll`` / ``release`` -> ``deregister`` -> ``close``.

    Invariants: a transfer id is live from ``post_write`` until ``release``; ``poll`` of a failed
    transfer raises ``TransferError`` (and the id stays live until released); notifications are
    delivered to the target once, in ``take_notifications``, as ``(sender agent, message)``.
    """

    name: str

    def register(self, name: str, tensor: Any) -> RegionDesc: ...

    def deregister(self, name: str) -> None: ...

    def region(self, name: str) -> RegionDesc: ...

    def agent_metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

    def post_write(self, segments: Sequence[WriteSegment], notif: bytes = b"") -> int: ...

    def poll(self, xfer_id: int) -> XferState: ...

    def release(self, xfer_id: int) -> None: ...

    def take_notifications(self) -> list[tuple[str, bytes]]: ...

    def supports_direct_host_write(self, peer: str, source: MemKind = MemKind.DEVICE) -> bool: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class PreparedWrite:
    """A WRITE whose descriptors an engine already built (``prepare_writes``), to be posted later
    without that cost: before the source bytes exist, say, since a WRITE reads them only once
    posted. ``handle``: the engine's prepared transfer (None: nothing prepared, or consumed)."""

    segments: Sequence[WriteSegment]
    notif: bytes
    handle: Any = None


def prepare_writes(engine: TransferEngine, jobs: Sequence[tuple[Sequence[WriteSegment], bytes]]
                   ) -> list[PreparedWrite]:
    """Build every job's WRITE now where the engine can (``prepare_write``; else nothing is
    prepared and ``write_all_with_retry`` posts as usual). On an error, releases what it built.
    Release unposted ones with ``discard_prepared``."""
    prep = getattr(engine, "prepare_write", None)
    out: list[PreparedWrite] = []
    try:
        for segments, notif in jobs:
            out.append(prep(segments, notif) if prep is not None
                       else PreparedWrite(segments, notif))
    except BaseException:
        discard_prepared(engine, out)
        raise
    return out


def discard_prepared(engine: TransferEngine, prepared: Sequence[PreparedWrite]) -> None:
    """Release prepared WRITEs that were never posted (idempotent)."""
    for p in prepared:
        if p.handle is not None:
            engine.discard_prepared(p)


def _post(engine: TransferEngine, job: Any) -> int:
    if isinstance(job, PreparedWrite):
        if job.handle is not None:
            return engine.post_prepared(job)
        return engine.post_write(job.segments, job.notif)
    return engine.post_write(job[0], job[1])


def wait(engine: TransferEngine, xfer_id: int, timeout_s: float, *, poll_sleep_s: float = 1e-4
         ) -> None:
    """Poll ``xfer_id`` until DONE; ``TransferError`` on failure, ``TransferTimeoutError`` after
    ``timeout_s`` seconds. The id is left live (the caller releases it)."""
    deadline = time.monotonic() + timeout_s
    sleep = 0.0
    while engine.poll(xfer_id) is not XferState.DONE:
        if time.monotonic() >= deadline:
            raise TransferTimeoutError(f"transfer {xfer_id} not done after {timeout_s:.3g} s")
        time.sleep(sleep)
        sleep = min(max(sleep * 2, 1e-5), poll_sleep_s)


def write_with_retry(engine: TransferEngine, segments: Sequence[WriteSegment],
                     notif: bytes = b"", *, attempts: int = 3, timeout_s: float = 10.0,
                     request_id: Any = None) -> None:
    """Post, wait and release one WRITE, re-posting it up to ``attempts`` times in total
    (``write_all_with_retry`` of one job)."""
    write_all_with_retry(engine, [(segments, notif)], attempts=attempts, timeout_s=timeout_s,
                         request_id=request_id)


def write_all_with_retry(engine: TransferEngine,
                         jobs: Sequence[tuple[Sequence[WriteSegment], bytes] | PreparedWrite], *,
                         attempts: int = 3, timeout_s: float = 10.0,
                         request_id: Any = None) -> None:
    """Post every WRITE of ``jobs`` (``(segments, notification)`` pairs) before waiting for any,
    so they overlap; wait for each (``timeout_s``) and release it; re-post the ones that failed
    or timed out, together, until each was posted ``attempts`` times in total.

    A job may be a ``PreparedWrite``: its first post uses the prepared transfer (consumed even
    if that post fails); re-posts build a new one.
    A WRITE is idempotent (same bytes to the same place), so re-posting after a failure is safe;
    the notification may then arrive more than once and receivers must tolerate duplicates.
    Raises the first error of the last round (``TransferTimeoutError`` if that WRITE timed out,
    else ``TransferError``), tagged with ``request_id``.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    todo = list(jobs)
    for _ in range(attempts):
        posted, failed = [], []
        for job in todo:
            try:
                posted.append((job, _post(engine, job)))
            except TransferError as err:
                failed.append((job, err))
        for job, xfer_id in posted:
            try:
                wait(engine, xfer_id, timeout_s)
            except TransferError as err:
                failed.append((job, err))
            finally:
                try:
                    engine.release(xfer_id)
                except TransferError:
                    pass  # a stuck handle cannot be cancelled; the engine drops it on close
        if not failed:
            return
        todo = [job for job, _ in failed]
    last = failed[0][1]
    msg = f"after {attempts} attempt(s): {last.message}"
    if isinstance(last, TransferTimeoutError):
        raise TransferTimeoutError(msg, request_id)
    raise TransferError(msg, request_id)
