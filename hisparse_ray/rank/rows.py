"""A command's batch rows as a rank executes them (ring 2): ``Row`` (a ``BatchRow`` with its
request named and, for a chained row, its input token found), and ``Launched``, a step between
``HiSparseWorker.launch`` and ``finish``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from hisparse_ray.errors import StateError
from hisparse_ray.types import RequestId, StepCommand


class Row(NamedTuple):
    """A batch row with its request named (``BatchRow`` carries the request's handle).
    ``from_row >= 0``: a chained row, whose input is the token row ``from_row`` of the previous
    step sampled (``input_token`` is then that token where the host knows it, else -1)."""

    request_id: RequestId
    seq_len: int
    input_token: int
    hot_blocks: tuple[int, ...] | None
    from_row: int = -1


class Launched(NamedTuple):
    """A step between :meth:`HiSparseWorker.launch` and :meth:`HiSparseWorker.finish`."""

    cmd: StepCommand
    rows: list[Row]
    enqueued: list[int]
    counts: dict
    fast: bool
    forward: Any  # the fast executor's launch, or the reference path's sampled tokens


def name_rows(cmd: StepCommand, name: Callable[[StepCommand, int], RequestId],
              last: tuple[int, Any] | None, *,
              fast: bool, tokens_of: Callable[[Any], list[int]] | None) -> list[Row]:
    """The command's rows with their requests named (``name(cmd, handle)``). A chained row
    (``prev_row >= 0``) reads the token its request's row of the previous command sampled:
    ``last`` is ``(step, what it left)``, the reference path's ``(request, token)`` pairs (every
    rank samples) or a fast launch (``tokens_of`` reads it back). On the fast step after a fast step the token
    stays on the device (``input_token`` -1, ``from_row`` set); otherwise it is filled in here.
    StateError for a chained row whose previous step this rank did not run with rows."""
    rows = []
    for r in cmd.batch:
        rid = name(cmd, r.handle)
        if r.prev_row < 0:
            rows.append(Row(rid, r.seq_len, r.input_token, r.hot_blocks))
            continue
        if last is None or last[0] != cmd.step - 1:
            raise StateError(f"step {cmd.step} chains request {rid!r} to row {r.prev_row} of "
                             f"step {cmd.step - 1}, which this rank did not run with rows")
        src = last[1]
        if isinstance(src, tuple):  # the reference path's (request, token) pairs
            token = src[r.prev_row][1]
        elif fast:  # the previous fast step: the step reads it on the device
            rows.append(Row(rid, r.seq_len, -1, r.hot_blocks, r.prev_row))
            continue
        else:
            assert tokens_of is not None
            token = tokens_of(src)[r.prev_row]
        rows.append(Row(rid, r.seq_len, token, r.hot_blocks, r.prev_row))
    return rows
