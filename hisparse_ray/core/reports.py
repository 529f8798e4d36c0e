"""Validation of a rank's :class:`~hisparse_ray.types.StepReport` before the coordinator applies
it (pure ring): every check, nothing changed."""

from __future__ import annotations

from collections.abc import Mapping

from hisparse_ray.core.admission import MAX_TOKEN
from hisparse_ray.core.request import Request, TransferBook
from hisparse_ray.errors import (
    InvalidRequestError, StateError, UnknownRankError, UnknownRequestError, UnknownTransferError,
)
from hisparse_ray.types import RequestId, StepReport


def check_report(tp: int, last_step: int, book: TransferBook, requests: Mapping[RequestId, Request],
                 report: StepReport) -> None:
    """Raise the typed error for a report the coordinator must refuse (nothing is changed):
    an unknown rank, a step not emitted yet, an unknown or twice-acknowledged transfer, tokens
    from a peer or for a request with no token due at that step (or due at an earlier step
    first: a chained request's tokens come in step order), a bad token or host generation."""
    rank = report.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise UnknownRankError(rank, tp)
    if not 1 <= report.step <= last_step:
        raise StateError(f"report for step {report.step}; steps emitted so far: 1..{last_step}")
    for name, ids in (("enqueued", report.enqueued), ("completed", report.completed)):
        if len(set(ids)) != len(ids):
            raise StateError(f"rank {rank} lists a transfer twice in {name}")
        for tid in ids:
            p = book.pending.get(tid)
            if p is None:
                raise UnknownTransferError(tid)
            if rank in (p.enqueued if name == "enqueued" else p.completed):
                raise StateError(f"rank {rank} already acknowledged transfer {tid} {name}")
    if report.sampled and rank != 0:
        raise StateError(f"sampled tokens come from rank 0 only, got them from rank {rank}")
    pub = report.published
    if isinstance(pub, bool) or not isinstance(pub, int) or pub < 0 or (pub and rank != 0):
        raise StateError(f"rank {rank} reports host-pool generation {pub!r}: only rank 0 "
                         f"writes the host pool (an int >= 0)")
    seen: set = set()
    for rid, tok in report.sampled:
        req = requests.get(rid)
        if req is None:
            raise UnknownRequestError(rid)
        if rid in seen or report.step not in req.awaiting:
            raise StateError(f"request {rid!r} has no token due for step {report.step}")
        if req.awaiting[0] != report.step:
            raise StateError(f"request {rid!r}: the token of step {report.step} arrived before "
                             f"the one of step {req.awaiting[0]}")
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < MAX_TOKEN:
            raise InvalidRequestError(rid, f"sampled token {tok!r} is not an int in [0, 2**63)")
        seen.add(rid)
