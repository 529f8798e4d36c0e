"""The lander (ring 3): one thread per prefill worker inside the coordinator actor that takes
admitted requests in FIFO order through prefill -> NIXL WRITE (direct or via the staging pool) ->
notification on the decode ranks -> index keys installed -> ``apply_landed``.

Ray round trips per landing after prefill: one ``push`` per step (the last one also frees the
prefill worker's send buffer) and one ``complete_landing`` per rank per step (notification wait,
staging -> host copy, key install in one call): 2 sequential round trips for a direct or resident
landing, 2 per staging chunk for a staged one (was 4, and 3 per chunk + 2).

Any failure (``TransferError`` / ``TransferTimeoutError`` after the prefill worker's retries, a
missing notification, a dead prefill worker) ends the request with that typed error and releases
every lease it held (the coordinator calls the core's ``apply_landing_failed``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from hisparse_ray.actors.landing import (
    LandingDest, LandingOrder, StagingPool, chunks, page_positions,
)
from hisparse_ray.errors import HiSparseError, TransferError, TransferTimeoutError
from hisparse_ray.types import Admission, LandingTarget

PREFILL_TIMEOUT_S = 600.0  # one prompt through the prefill model
CALL_TIMEOUT_S = 120.0  # any other Ray call of a landing (beyond its own transfer deadlines)

if TYPE_CHECKING:
    from hisparse_ray.actors.coordinator import Coordinator


class Lander:
    """Lands one request at a time for one prefill worker.

    path: "direct" (WRITE into rank 0's host pool) or "staged" (WRITE into a contiguous run of rank
    0's staging pool in chunks of at most its capacity, then a local copy into host blocks). Resident landings always
    WRITE every rank's device pool.
    """

    def __init__(self, coord: "Coordinator", prefill: Any, agent: str, *, direct: bool) -> None:
        self.coord, self.prefill, self.agent = coord, prefill, agent
        self.path = "direct" if direct else "staged"
        self.staging: StagingPool | None = coord.staging  # one per replica, shared by landers
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"lander-{agent}", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def enqueue(self, adm: Admission, prompt: list[int]) -> None:
        self._queue.put((adm, prompt))

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            adm, prompt = item
            rid = adm.request_id
            if self.coord.abort_requested(rid):  # aborted while queued: release, land nothing
                self.coord.landing_failed(rid, None)
                continue
            try:
                nbytes, seconds, data_s, path = self.land(adm, prompt)
            except Exception as err:  # any failure ends this request, never the lander
                self._cleanup(rid)
                self.coord.landing_failed(rid, _typed(err, rid))
                continue
            self.coord.landed(rid, nbytes, seconds, data_s, path)

    def _cleanup(self, rid: str) -> None:
        try:
            ray.get([r.drop_landing.remote(rid) for r in self.coord.ranks], timeout=30)
        except Exception:
            pass
        try:
            ray.get(self.prefill.drop.remote(rid), timeout=30)
        except Exception:
            pass

    # -- one request -------------------------------------------------------------------------------
    def land(self, adm: Admission, prompt: list[int]) -> tuple[int, float, float, str]:
        """Prefill, push and install one admission; returns (bytes moved, seconds end to end
        after prefill, seconds of data movement only (NIXL WRITEs + staging copies), path)."""
        spec, ranks, eps = self.coord.spec, self.coord.ranks, self.coord.endpoints
        rid, P, T = adm.request_id, spec.page_size, adm.num_positions
        todo = [(p.page, p.host_block if adm.target is LandingTarget.HOST else p.device_block)
                for p in adm.pages if not p.reused and page_positions(p.page, P, T)[1] > 0]
        result = ray.get(self.prefill.prefill.remote(rid, list(prompt[:T])),
                         timeout=PREFILL_TIMEOUT_S)
        t0 = time.perf_counter()
        moved, self._data_s = 0, 0.0
        timeout = spec.landing_timeout_s * spec.landing_attempts
        keys = ray.put(result.index_keys)
        install = dict(request_id=rid, index_keys=keys,
                       capacity=len(prompt) + self.coord.records[rid].max_new_tokens + 1)
        # per step: one push call (the prefill worker WRITEs, waits for DONE; the last push also
        # frees its send buffer), then ONE call per rank that waits for the notification,
        # unstages and (last step) installs the keys
        if adm.target is LandingTarget.RESIDENT:
            path = "resident"
            dests = tuple(LandingDest(ep.rank, ep.device_layers, tuple(todo), _notif(rid, ep.rank, 0))
                          for ep in eps)
            if todo:
                moved = self._push(rid, dests, last=True)
            self._complete([r.complete_landing.remote(d.notif if todo else None, timeout,
                                                      host_written=False, **install)
                            for r, d in zip(ranks, dests)], timeout)
        elif self.path == "direct":
            path = "direct"
            dest = LandingDest(0, eps[0].host_layers, tuple(todo), _notif(rid, 0, 0))
            if todo:
                moved = self._push(rid, (dest,), last=True)
            self._complete(
                [ranks[0].complete_landing.remote(dest.notif if todo else None, timeout,
                                                  host_written=bool(todo), **install)]
                + [r.complete_landing.remote(None, timeout, host_written=False, **install)
                   for r in ranks[1:]], timeout)
        else:
            path = "staged"
            parts = chunks(todo, self.staging.capacity)
            for i, chunk in enumerate(parts):
                last = i == len(parts) - 1
                blocks = self.staging.acquire_run(len(chunk))  # contiguous: 1 descriptor / layer
                try:
                    dest = LandingDest(0, eps[0].staging_layers,
                                       tuple((page, sb) for (page, _), sb in zip(chunk, blocks)),
                                       _notif(rid, 0, i))
                    moved += self._push(rid, (dest,), last=last)
                    unstage = (blocks[0], [hb for _, hb in chunk], [page for page, _ in chunk], T)
                    refs = [ranks[0].complete_landing.remote(
                        dest.notif, timeout, unstage, host_written=False,
                        **(install if last else {}))]
                    if last:
                        refs += [r.complete_landing.remote(None, timeout, host_written=False,
                                                           **install) for r in ranks[1:]]
                    self._complete(refs, timeout)
                finally:
                    self.staging.release(blocks)
            if not parts:
                self._complete([r.complete_landing.remote(None, timeout, host_written=False,
                                                          **install) for r in ranks], timeout)
        if not todo:  # nothing pushed, so no push freed the send buffer: no need to wait
            self.prefill.drop.remote(rid)
        return moved, time.perf_counter() - t0, self._data_s, path

    def _complete(self, refs: list, timeout: float) -> None:
        """Wait for ranks' ``complete_landing`` calls; their unstage seconds count as data path.
        On a failure, first let the other calls finish (bounded): an index-key install must not
        land on a rank after the failure cleanup dropped the request there."""
        try:
            self._data_s += sum(ray.get(refs, timeout=timeout + CALL_TIMEOUT_S))
        except Exception:
            ray.wait(refs, num_returns=len(refs), timeout=timeout + CALL_TIMEOUT_S)
            raise

    def _push(self, rid: str, dests: tuple[LandingDest, ...], *, last: bool) -> int:
        spec = self.coord.spec
        order = LandingOrder(rid, dests, attempts=spec.landing_attempts,
                             timeout_s=spec.landing_timeout_s)
        # the worker gives up (and cancels its WRITE) after attempts x timeout; the Ray deadline
        # is later, so a request's blocks are never released under a live WRITE
        moved, seconds = ray.get(
            self.prefill.push.remote(order, spec.page_size, drop_after=last),
            timeout=spec.landing_attempts * spec.landing_timeout_s + CALL_TIMEOUT_S)
        self._data_s += seconds
        return moved


def _notif(rid: str, rank: int, chunk: int) -> bytes:
    return f"land:{rid}:{rank}:{chunk}".encode()


def _typed(err: BaseException, rid: str) -> HiSparseError:
    """The error a failed landing reports: the typed error raised in another actor (unwrapped
    from Ray's RayTaskError), ``TransferTimeoutError`` for a Ray call past its deadline,
    ``TransferError`` for anything else (e.g. a dead prefill worker)."""
    if isinstance(err, ray.exceptions.RayTaskError):
        inner = getattr(err, "cause", None)
        if isinstance(inner, BaseException):
            err = inner
    if isinstance(err, HiSparseError):
        return err
    if isinstance(err, TimeoutError):
        return TransferTimeoutError(f"landing step timed out: {err}", rid)
    return TransferError(f"landing failed: {err!r}", rid)
