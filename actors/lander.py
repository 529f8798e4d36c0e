"""The lander (ring 3): one thread per prefill worker inside the coordinator actor that takes
admitted requests in FIFO order through prefill -> NIXL WRITE (direct or via the staging pool) ->
notification on the decode ranks -> index keys installed -> ``LandingSink.landed``. It sees its
replica only through a :class:`~hisparse_ray.landing.context.LandingContext` and reports to a
:class:`~hisparse_ray.landing.context.LandingSink` (the coordinator actor); the plan of every
chunk is :mod:`hisparse_ray.landing.plan`'s, the ranks' side :mod:`hisparse_ray.rank.landing`.

A landing is a sequence of chunks of the request's pages (one chunk when the staging pool holds the
whole prompt, else chunks of half the pool). Per chunk the lander leases a contiguous staging run,
then issues at once ONE ``push`` to the prefill worker (one WRITE per rank: the KV pages, plus the
chunk's indexer keys into every rank's key staging rows) and ONE ``complete_landing`` per rank
(notification wait, staging -> host copy, key copy): the decode side waits for the WRITE's
notification, so the two calls overlap instead of following each other. Up to two chunks are in
flight: chunk i+1 is written while rank 0 copies chunk i into the host pool. So a landing costs
about one Ray round trip plus its data movement (was 2 sequential round trips per chunk).

The indexer keys travel by NIXL into the ranks' key staging rows (indexed like the staging pool's
blocks, so the same lease covers them); a replica without a staging pool falls back to shipping
them through Ray's object store.

Never deadlocks (``landing.staging.lease_run``): while a lander holds a chunk in flight it only TRIES to
lease the next run and finishes its oldest chunk when that fails; it blocks on the pool only with
nothing in flight.

Any failure (``TransferError`` / ``TransferTimeoutError`` after the prefill worker's retries, a
missing notification, a dead prefill worker) ends the request with that typed error and releases
every lease it held (the sink calls the core's ``apply_landing_failed``); in-flight chunk
calls are cancelled on the ranks (``drop_landing``) and awaited before their staging runs return
to the pool.

A call that outlives every deadline is different: a cancelled WRITE may still land later, so the
memory the request held cannot be reused yet. When only the prefill worker's push is still
running (every rank ended its calls), the lander RETIRES that worker: kill it, wait until Ray
reports it dead (a dead process posts no more WRITEs), remove it as a NIXL peer on every rank
(closing the connection drops bytes still in flight), then release the request's memory and fail
it; the replica keeps serving through its other prefill workers. A rank call still running, or
a worker whose death cannot be confirmed, fences the whole replica (``LandingSink.fence``). A
prefill worker that died (a landing failed with ``ActorDiedError`` and Ray reports it dead) is
retired the same way: its request fails, the requests behind it go to live workers.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import TYPE_CHECKING

import ray

from hisparse_ray.errors import HiSparseError, TransferError, TransferTimeoutError
from hisparse_ray.landing.context import LandingContext, LandingSink
from hisparse_ray.landing.plan import chunk_pages, page_positions, plan_chunk
from hisparse_ray.landing.staging import StagingPool, lease_run
from hisparse_ray.types import Admission, LandingOrder, LandingTarget, SamplingParams, pack

PREFILL_TIMEOUT_S = 600.0  # one prompt through the prefill model
CALL_TIMEOUT_S = 120.0  # cleanup calls of a failed landing
IN_FLIGHT = 2  # landing chunks in flight per lander (write chunk i+1 while chunk i is copied)
PEER_DEATH_TIMEOUT_S = 30.0  # a killed, stalled prefill worker must be reported dead within this

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from hisparse_ray.actors.prefill_worker import PrefillWorker


class Lander:
    """Lands one request at a time for one prefill worker.

    path: "direct" (WRITE into rank 0's host pool) or "staged" (WRITE into contiguous runs of rank
    0's staging pool, chunk by chunk (``chunk_pages``), then a local copy into host blocks).
    Resident landings always WRITE every rank's device pool.
    """

    def __init__(self, ctx: LandingContext, sink: LandingSink,
                 prefill: ActorHandle[PrefillWorker], agent: str, *, direct: bool) -> None:
        self.ctx, self.sink, self.prefill, self.agent = ctx, sink, prefill, agent
        self.path = "direct" if direct else "staged"
        self.staging: StagingPool | None = ctx.staging  # one per replica, shared by landers
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"lander-{agent}", daemon=True)
        self._stop = threading.Event()
        # (request id, prefill done, first chunk issued, every call ended): perf_counter() stamps
        self.trace: collections.deque = collections.deque(maxlen=10_000)
        # why this lander's prefill worker was retired (killed after a push outlived every
        # deadline); it lands nothing more and hands its queue to live landers
        self.retired: BaseException | None = None
        self._prefill_node: str | None = None  # the prefill worker's Ray node (asked once)
        self.pushes_with_prefill = 0  # landings that took the combined prefill_and_push call

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def enqueue(self, adm: Admission, prompt: list[int], max_new_tokens: int,
                sampling: SamplingParams | None = None) -> None:
        """Land ``adm`` after the ones queued before it; its key caches get room for the prompt
        and ``max_new_tokens``; every rank samples it by ``sampling`` (None: greedy)."""
        self._queue.put((adm, prompt, max_new_tokens, sampling))

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            adm, prompt, max_new_tokens, sampling = item
            rid = adm.request_id
            if self.retired is not None:  # queued before the retirement: another lander lands it
                self.sink.reroute(adm)
                continue
            if self.sink.abort_requested(rid):  # aborted while queued: release, land nothing
                self.sink.landing_failed(rid, None)
                continue
            try:
                nbytes, seconds, data_s, path = self.land(adm, prompt, max_new_tokens, sampling)
            except Exception as err:  # any failure ends this request, never the lander
                self._cleanup(rid)
                if isinstance(err, ray.exceptions.ActorDiedError) and self._prefill_died():
                    # a crashed worker: route its queue and later requests to live workers
                    self._disconnect(TransferError(
                        f"prefill worker {self.agent} died: {err!r}", rid))
                self.sink.landing_failed(rid, _typed(err, rid))
                continue
            self.sink.landed(rid, nbytes, seconds, data_s, path)
            # after the request is ready to decode (a submission costs ~0.2 ms); no need to
            # wait for it: a later prefill replaces the held buffers anyway
            self.prefill.drop.remote(rid)

    def _cleanup(self, rid: str) -> None:
        try:
            ray.get([r.drop_landing.remote(rid) for r in self.ctx.ranks], timeout=30)
        except Exception:
            pass
        try:
            ray.get(self.prefill.drop.remote(rid), timeout=30)
        except Exception:
            pass

    # -- one request -------------------------------------------------------------------------------
    def land(self, adm: Admission, prompt: list[int], max_new_tokens: int,
             sampling: SamplingParams | None = None) -> tuple[int, float, float, str]:
        """Prefill, push and install one admission; returns (bytes moved, seconds end to end
        after prefill, seconds of data movement (sum over chunks of the NIXL WRITEs and the
        staging copies; chunks overlap, so this may exceed the end-to-end time), path)."""
        spec = self.ctx.spec
        rid, P, T = adm.request_id, spec.page_size, adm.num_positions
        host = adm.target is LandingTarget.HOST
        path = "resident" if not host else self.path
        block = {p.page: (p.host_block if host else p.device_block)
                 for p in adm.pages if not p.reused and page_positions(p.page, P, T)[1] > 0}
        keys_nixl = self.ctx.keys_by_write
        staged = path == "staged" or keys_nixl  # chunks lease staging runs
        capacity = len(prompt) + max_new_tokens  # key positions it can reach, + 1 spare
        pages = list(range(-(-T // P))) if keys_nixl else sorted(block)
        parts = chunk_pages(pages, self.staging.capacity, IN_FLIGHT) if staged \
            else [tuple(pages)]
        if spec.landing_push_with_prefill != "never" and keys_nixl and T > 0 and len(parts) == 1:
            # "auto": hold a run through the prefill only while another landing still fits
            run = self.staging.try_acquire_run(len(parts[0]), spare=len(parts[0])) \
                if spec.landing_push_with_prefill == "auto" \
                else self.staging.acquire_run(len(parts[0]))  # nothing in flight: may wait
            if run is not None:
                self.pushes_with_prefill += 1
                return self._land_with_prefill(adm, prompt, path, block, parts[0], run, capacity,
                                               sampling)
        result = ray.get(self.prefill.prefill.remote(rid, list(prompt[:T]), not keys_nixl),
                         timeout=PREFILL_TIMEOUT_S)
        t0 = time.perf_counter()
        self._moved, self._data_s = 0, 0.0
        inflight: collections.deque = collections.deque()
        t_issued = None
        try:
            for i, part in enumerate(parts):
                blocks = lease_run(self.staging, len(part), inflight, self._finish) \
                    if staged and part else ()
                try:
                    refs = self._issue(adm, path, block, part, blocks, i, i == len(parts) - 1,
                                       capacity, None if keys_nixl else result.index_keys,
                                       sampling=sampling)
                except BaseException:
                    if blocks:
                        self.staging.release(blocks)
                    raise
                inflight.append((rid, refs, blocks))
                if t_issued is None:
                    t_issued = time.perf_counter()
                while len(inflight) >= IN_FLIGHT + (0 if staged else 1):
                    self._finish(inflight.popleft())
            while inflight:
                self._finish(inflight.popleft())
        except BaseException:
            self._abandon(rid, inflight)
            raise
        t_end = time.perf_counter()
        self.trace.append((rid, t0, t_issued, t_end))
        return self._moved, t_end - t0, self._data_s, path

    def _land_with_prefill(self, adm: Admission, prompt: list[int], path: str,
                           block: dict[int, int], part: tuple, blocks: tuple, capacity: int,
                           sampling: SamplingParams | None = None
                           ) -> tuple[int, float, float, str]:
        """``ReplicaSpec.landing_push_with_prefill``, one chunk with keys by NIXL, its staging
        run ``blocks`` leased BEFORE prefill: plan the WRITEs, then one ``prefill_and_push`` call
        (the worker WRITEs as soon as its KV exists: no round trip through the lander in between)
        and the ranks' ``complete_landing`` calls, whose notification deadline covers the
        prefill. The run stays leased through the prefill. Seconds end to end count from the
        worker's prefill end (its ``perf_counter``, one clock per host; from another node: the
        call's submission plus the prefill's own seconds)."""
        rid = adm.request_id
        self._moved, self._data_s = 0, 0.0
        t_issued = time.perf_counter()
        try:
            refs = self._issue(adm, path, block, part, blocks, 0, True, capacity, None,
                               prefill_tokens=list(prompt[:adm.num_positions]),
                               sampling=sampling)
        except BaseException:
            self.staging.release(blocks)
            raise
        try:
            _, _, t_done, prefill_s = self._finish((rid, refs, blocks), extra_s=PREFILL_TIMEOUT_S)
        except BaseException:
            self._abandon(rid, collections.deque())
            raise
        t_end = time.perf_counter()
        t0 = t_done if self._same_node() else t_issued + prefill_s
        self.trace.append((rid, t0, t_issued, t_end))
        return self._moved, t_end - t0, self._data_s, path

    def _same_node(self) -> bool:
        if self._prefill_node is None:
            self._prefill_node = ray.get(self.prefill.node_info.remote(),
                                         timeout=CALL_TIMEOUT_S)["node_id"]
        return self._prefill_node == ray.get_runtime_context().get_node_id()

    def _issue(self, adm: Admission, path: str, block: dict[int, int], part: tuple,
               blocks: tuple, i: int, last: bool, capacity: int, index_keys,
               prefill_tokens: list[int] | None = None,
               sampling: SamplingParams | None = None) -> list:
        """Start chunk ``i``: pages ``part`` (``block[page]``: the target block of each page to
        push; pages missing from it are reused and get only their keys), staging run ``blocks``
        (page ``part[j]`` -> ``blocks[j]``) or (). Issues one push (if anything is written) and
        one ``complete_landing`` per rank, all at once. Returns [push ref or None, rank refs].
        ``prefill_tokens``: the push is ``prefill_and_push`` of these tokens (the ranks' waits
        then also cover the prefill)."""
        spec, ranks = self.ctx.spec, self.ctx.ranks
        rid, P = adm.request_id, spec.page_size
        wait_s = spec.landing_timeout_s * spec.landing_attempts
        if prefill_tokens is not None:
            wait_s += PREFILL_TIMEOUT_S
        dests, steps = plan_chunk(
            rid, adm.num_positions, P, path, block, part, blocks, i, last, capacity,
            self.ctx.endpoints, timeout_s=wait_s, layer_groups=spec.landing_layer_groups,
            sampling=sampling)
        refs: list = [None]
        if dests:
            order = LandingOrder(rid, tuple(dests), attempts=spec.landing_attempts,
                                 timeout_s=spec.landing_timeout_s)
            # the worker gives up (and cancels its WRITE) after attempts x timeout; the Ray
            # deadline is later, so a request's blocks are never released under a live WRITE.
            # Pushes of one request may run out of order on the worker's threads: the lander
            # drops the send buffer once every chunk is done
            refs[0] = self.prefill.push.remote(pack(order), P) if prefill_tokens is None \
                else self.prefill.prefill_and_push.remote(rid, prefill_tokens, pack(order), P)
        # fallback without key staging: one object-store copy serves every rank (a top-level
        # argument, so Ray resolves it on the rank)
        keys_ref = ray.put(index_keys) if index_keys is not None and i == 0 else None
        for r, step in zip(ranks, steps):
            refs.append(r.complete_landing.remote(pack(step), keys_ref))
        return refs

    def _finish(self, item, extra_s: float = 0.0) -> tuple | None:
        """Wait for one chunk's calls, account its bytes and seconds, release its staging run;
        returns the push call's result (None without a push).

        A failed push cancels the ranks' notification waits at once. Every call of the chunk must
        END before its staging run returns to the pool (no block is reused under a live WRITE or
        copy). Calls still running past every deadline (``landing_attempts x landing_timeout_s +
        landing_call_timeout_s``: a stalled rank or prefill process) may still let a cancelled
        WRITE's bytes land later, anywhere in the blocks the request held: the lander then FENCES
        the replica (``LandingSink.fence``: it stops stepping and admitting, every waiter gets a
        typed error) and keeps the staging run leased, instead of reusing memory that may still
        be written. ``extra_s``: added to the deadline (a push that first prefills)."""
        rid, refs, blocks = item
        spec = self.ctx.spec
        live = [r for r in refs if r is not None]
        deadline = spec.landing_attempts * spec.landing_timeout_s + spec.landing_call_timeout_s \
            + extra_s
        if refs[0] is not None:
            try:
                ray.get(refs[0], timeout=deadline)
            except Exception:  # raised below from ray.get(live), or fenced
                self._cancel(rid)
        _, pending = ray.wait(live, num_returns=len(live), timeout=deadline)
        if pending:
            self._cancel(rid)
            if refs[0] is not None and pending == [refs[0]] and self._retire(refs[0], rid):
                # only the push outlived its deadline and that worker is dead and disconnected:
                # nothing can write the request's memory any more
                if blocks:
                    self.staging.release(blocks)
                raise TransferTimeoutError(
                    f"prefill worker {self.agent} still pushing {deadline:.3g} s after the "
                    f"deadline: retired (killed and disconnected)", rid)
            err = TransferTimeoutError(
                f"{len(pending)} call(s) of a landing still running {deadline:.3g} s after their "
                f"deadline (a stalled rank or prefill worker): blocks it wrote may still change, "
                f"so replica {spec.replica_id!r} stops", rid)
            self.sink.fence(err)
            raise err
        if blocks:
            self.staging.release(blocks)
        out = ray.get(live)  # every call ended: raises the first failure
        pushed = None
        if refs[0] is not None:
            pushed, out = out[0], out[1:]  # prefill_and_push adds its prefill's end and seconds
            self._moved += pushed[0]
            self._data_s += pushed[1]
        self._data_s += sum(out)
        return pushed

    def _retire(self, push_ref: ObjectRef, rid: str) -> bool:
        """Kill this lander's prefill worker, whose push of ``rid`` outlived every deadline while
        every rank's call ended; True once Ray reported it dead and every rank dropped it as a
        NIXL peer (the lander then lands nothing more). False when its death is not confirmed
        within ``PEER_DEATH_TIMEOUT_S`` (the caller fences the replica)."""
        try:
            ray.kill(self.prefill, no_restart=True)
        except Exception:
            pass
        done, _ = ray.wait([push_ref], timeout=PEER_DEATH_TIMEOUT_S)
        if not done:
            return False
        try:
            ray.get(push_ref)
        except Exception:  # RayActorError, expected; or the push failed just before the kill
            pass
        return self._disconnect(TransferTimeoutError(
            f"prefill worker {self.agent} was still pushing {rid!r} past every deadline", rid))

    def _prefill_died(self) -> bool:
        """Whether Ray reports this lander's prefill worker dead (not merely unreachable)."""
        try:
            ray.get(self.prefill.ready.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.ActorDiedError:
            return True
        except Exception:
            return False
        return False

    def _disconnect(self, why: BaseException) -> bool:
        """Retire this lander once its (dead) prefill worker is dropped as a NIXL peer on every
        rank: it lands nothing more and hands its queue to live landers. False (not retired)
        when a rank cannot drop the peer: that rank might still take the peer's bytes."""
        try:
            ray.get([r.remove_peer.remote(self.agent) for r in self.ctx.ranks],
                    timeout=CALL_TIMEOUT_S)
        except Exception:
            return False
        self.retired = why
        return True

    def _cancel(self, rid: str) -> None:
        """Stop the ranks' waits for ``rid``'s notifications (fire and forget)."""
        for rank in self.ctx.ranks:
            rank.drop_landing.remote(rid)

    def _abandon(self, rid: str, inflight: collections.deque) -> None:
        """A chunk failed: cancel the request's waits on the ranks, then wait out (bounded) every
        other chunk in flight and return its staging run."""
        self._cancel(rid)
        while inflight:
            try:
                self._finish(inflight.popleft())
            except Exception:
                pass


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
