"""What a lander may see of its decode replica, and whom it tells (pure: standard library and the
wire module). The coordinator actor builds one :class:`LandingContext` and implements
:class:`LandingSink`; the lander calls nothing else of it, and the coordinator calls only the
lander's queue and lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hisparse_ray.landing.staging import StagingPool
from hisparse_ray.types import Admission, RankEndpoint

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hisparse_ray.actors.decode_worker import DecodeWorker
    from hisparse_ray.deploy import ReplicaSpec


@dataclass(frozen=True)
class LandingContext:
    """A replica's landing resources: its spec (page size and the ``landing_*`` options), every
    rank's endpoint and actor handle (rank order), and rank 0's staging pool (None without one;
    shared FIFO by every lander of the replica)."""

    spec: ReplicaSpec
    endpoints: tuple[RankEndpoint, ...]
    ranks: tuple[ActorHandle[DecodeWorker], ...]
    staging: StagingPool | None

    @property
    def keys_by_write(self) -> bool:
        """Whether indexer keys travel by NIXL into the ranks' key staging rows (else through
        Ray's object store)."""
        return bool(self.endpoints[0].key_layers) and self.staging is not None


class LandingSink(Protocol):
    """Where a lander reports each admission's outcome (the coordinator actor). Every admission
    handed to a lander ends in exactly one of ``landed``, ``landing_failed`` or ``reroute``."""

    def abort_requested(self, request_id: str) -> bool:
        """Whether the request was aborted while queued (the lander then lands nothing)."""

    def landed(self, request_id: str, nbytes: int, seconds: float, data_s: float,
               path: str) -> None:
        """The request's KV and indexer keys are on every rank: it may decode."""

    def landing_failed(self, request_id: str, error: BaseException | None) -> None:
        """The landing failed (``error``; None: aborted): release every lease of the request."""

    def reroute(self, adm: Admission) -> None:
        """The lander was retired with ``adm`` still queued: hand it to a live lander."""

    def fence(self, error: BaseException) -> None:
        """A landing's calls outlived every deadline: memory the request held may still be
        written, so the replica stops (no steps, no admissions, typed errors to waiters)."""
