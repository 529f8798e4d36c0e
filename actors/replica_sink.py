"""The coordinator's side of its landers (ring 3): :class:`ReplicaSink` implements
:class:`~hisparse_ray.landing.context.LandingSink` for one :class:`ReplicaCoordinator`.

Why a separate object: Ray exposes every method of an actor class (underscored ones too) to any
holder of its handle, and a handle holder that could call ``landed`` or ``fence`` could let a
request decode KV that never landed, or stop the replica. These callbacks therefore live here, on
a plain object that only the coordinator's own lander threads hold (same process, no Ray call);
the actor's handle has no method that ends a landing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hisparse_ray.types import Admission, RequestId

if TYPE_CHECKING:
    from hisparse_ray.actors.coordinator import ReplicaCoordinator


class ReplicaSink:
    """Every admission a lander took ends in exactly one of ``landed``, ``landing_failed`` or
    ``reroute``; ``fence`` stops the replica. Each call takes the coordinator's lock."""

    def __init__(self, coord: ReplicaCoordinator) -> None:
        self._c = coord

    def abort_requested(self, request_id: str) -> bool:
        """Whether to skip this landing (the request was aborted while queued)."""
        with self._c.lock:
            return self._c.records[request_id].abort_requested

    def reroute(self, adm: Admission) -> None:
        """The lander was retired with ``adm`` still queued; hand it to a live lander (or fail it
        when none is left)."""
        c = self._c
        with c.cond:
            c._dispatch(adm)
            c.cond.notify_all()
        c._wake.set()

    def landed(self, request_id: str, nbytes: int, seconds: float, data_s: float,
               path: str) -> None:
        """The request's KV and index keys are on every rank; it may decode."""
        c = self._c
        with c.cond:
            rec = c.records[request_id]
            c.core.apply_landed(RequestId(request_id))
            rec.landed = time.monotonic()
            rec.landing_bytes, rec.landing_s, rec.landing_path = nbytes, seconds, path
            rec.landing_data_s = data_s
            c.landing_bytes += nbytes
            c.exporter.landed(nbytes, seconds)
            if rec.abort_requested:  # aborted while landing: finish it before any step
                c.core.finish(RequestId(request_id))
                c._collect(request_id)
                for r in c.ranks:  # no step ever named it: drop its keys on the ranks
                    r.drop_landing.remote(request_id)
                c.cond.notify_all()
        c._wake.set()

    def landing_failed(self, request_id: str, error: BaseException | None) -> None:
        """The landing failed after its retries (``error``; None: aborted): release every lease
        now."""
        c = self._c
        with c.cond:
            c._landing_failed_locked(request_id, error)
        c._wake.set()

    def fence(self, error: BaseException) -> None:
        """A landing's calls outlived every deadline, so memory its request held may still be
        written by a stalled peer. Stop the replica: no more steps or admissions, every waiter
        gets ``StateError("replica failed: ...")`` naming ``error``."""
        c = self._c
        with c.cond:
            if c._fatal is None:
                c._fatal = error
            c.cond.notify_all()
        c._wake.set()
