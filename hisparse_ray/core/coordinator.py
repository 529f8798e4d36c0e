"""The coordinator state machine: admission, decode steps, reports, finishing (pure ring).

Synchronous and deterministic; it never awaits and never calls another actor. Commands leave
through ``take_command()`` (and ``admit``/``poll_waiting`` landing plans), feedback enters through
``apply_*``. Every public method validates its input before changing anything: bad input raises a
typed error from :mod:`hisparse_ray.errors` and leaves the state unchanged.

Request lifecycle: admit -> WAITING | LANDING -> apply_landed -> RUNNING -> (max_new_tokens, eos or
finish) -> FINISHED (draining in-flight transfers and the in-flight step) -> RELEASED -> free.

Sequence bookkeeping: a prompt of P tokens lands the KV of positions ``0..P-2``; the first decode
step feeds ``prompt[P-1]`` with ``seq_len = P`` and samples the first new token. Each step with
``seq_len = n`` writes position ``n-1``; a request therefore writes ``P + max_new_tokens - 1``
positions over its life.

Worker contract for one StepCommand (one command per step, broadcast to every rank): forget
``released`` handles (with their request's state), take the ``handles`` it defines (a request's
integer handle is defined in the first command that names it and stays until the command that
releases it; the first command that names a request also carries every page of it in
``table_diffs``), make host reads wait for host-pool generation ``host_seq`` (peers, on the host)
and for the previous step by number when rank 0 wrote the host in it (peers: its IPC event), apply
``table_diffs``, enqueue ``transfers`` on the stream in order, run the forward of ``batch`` (a
row's ``hot_blocks``, sent only when they changed, bind a new hot buffer, e.g. after a spill
conversion), then the ``backups`` on the side stream; report each transfer id enqueued and
completed, and (rank 0 only) one sampled token per batch row and the host pool's published
generation, in a StepReport naming any emitted step. Device blocks are released on *enqueued*,
which is safe for work ordered after the worker's stream; a landing path that writes device
blocks outside that stream must order itself after it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.admission import (
    fit, index_pages_short, land, match_prefix, pools_that_fit, validate_request, waiting_target,
)
from hisparse_ray.core.invariants import check_coordinator
from hisparse_ray.core.reports import check_report
from hisparse_ray.core.request import Conversion, Page, Request, TransferOp
from hisparse_ray.core.reservations import Room, life_pages, resident_backing, room
from hisparse_ray.core.residency import Residency
from hisparse_ray.errors import (
    DoubleFreeError, DuplicateRequestError, InvalidRequestError, StateError, UnknownRequestError,
)
from hisparse_ray.types import (
    Admission, Backup, BatchRow, CoordinatorCounters, LandingTarget, PageTransfer, RequestHandle,
    RequestId, RequestState, RequestView, StepCommand, StepReport, TableDiff, TransferKind,
    TransferId,
)

FREED_MEMORY = 1 << 16  # how many forgotten ids still answer DoubleFreeError
_KIND = {TransferOp.SPILL: TransferKind.SPILL, TransferOp.RESTORE: TransferKind.RESTORE}
_STAT_COUNTERS = ("steps", "admitted", "finished", "spills", "restores", "backups", "spill_bytes",
                  "restore_bytes", "backup_bytes", "conversions_to_host", "prefix_hit_pages",
                  "published_pages", "stalls", "chained_rows", "dropped_rows")  # res.stats keys


class Coordinator:
    """Owns host block ids, prefix identity, device leases and the residency state machine.

    Admission reserves what a request can grow to (:mod:`~hisparse_ray.core.reservations`), so
    the pools never run dry mid-decode. Landing target (chosen once, at the first admission
    attempt), judged against the unreserved room: RESIDENT if its prompt pages fit the device and
    its life the host tier (backed: grows on demand, spills when the device runs dry) or its whole
    life fits the device (unbacked: never spills; preferred when that costs the device no more,
    or when the host room is short); else HOST if a hot buffer and its life in host blocks
    (beyond the matched prefix) fit; else the request waits with the target
    :func:`~hisparse_ray.core.admission.waiting_target` picks, and keeps it across retries. A
    request that does not fit even empty pools is refused (CapacityError).

    Waiting requests are retried in FIFO order by :meth:`poll_waiting` (a new request waits
    behind earlier waiting ones). Under device pressure (a waiting admission, or a resident request
    needing a page) one resident request at a time is converted to the host tier.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.res = Residency(config)
        self.host, self.device, self.book = self.res.host, self.res.device, self.res.book
        self._requests: dict[RequestId, Request] = {}
        self._waiting: list[RequestId] = []
        self._freed: OrderedDict[RequestId, None] = OrderedDict()  # recent ids, for double free
        self._released: list[int] = []  # handles of released requests, for the next command
        self._step = 0
        self._free_handles: list[int] = []  # released handles, reused smallest first
        self._next_handle = 0
        self._host_seq = 0  # rank 0's latest reported host-pool generation

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, request_id: RequestId, prompt_tokens: Sequence[int], max_new_tokens: int,
              eos_token_id: int | None = None, *, chain: bool = False) -> Admission | None:
        """Admit a request; returns its landing plan, or None when it waits (see class doc).

        chain: the request's next row may be emitted while its previous step is in flight (one
        step ahead: the caller takes command N + 1 before applying report N); the row then names
        its input as ``prev_row``, the token its row of the previous command samples, which the
        worker reads where it was sampled (on the device on the fast path). See
        :meth:`take_command`.

        Raises DuplicateRequestError, InvalidRequestError, or CapacityError when the request
        could never fit (its life exceeds the device pool and host tier alike)."""
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        tokens = validate_request(request_id, prompt_tokens, max_new_tokens, eos_token_id)
        resident_ever, host_ever = pools_that_fit(self.config, request_id, len(tokens),
                                                  max_new_tokens)
        if not isinstance(chain, bool):
            raise InvalidRequestError(request_id, f"chain={chain!r} must be a bool")
        req = Request(RequestId(request_id), tokens, len(tokens), max_new_tokens, eos_token_id,
                      LandingTarget.RESIDENT, LandingTarget.RESIDENT, chain=chain)
        req.written = len(tokens) - 1
        matched = match_prefix(self.res, req)
        how = None
        short = index_pages_short(self.config, self._requests.values(), req)
        if not self._waiting and not short:
            free = self._room()
            how = fit(self.res, req, LandingTarget.RESIDENT, matched, free)
            target = LandingTarget.RESIDENT
            if how is None and host_ever:
                how = fit(self.res, req, LandingTarget.HOST, matched, free)
                target = LandingTarget.HOST
        if how is None:
            target = waiting_target(self.config, self._requests.values(), req,
                                    resident_ever, host_ever)
            req.target = req.tier = target
            self._record(req)
            self._waiting.append(req.rid)
            self.res.stats["waited"] += 1
            if not short:  # a release gives index-key pages back; a conversion would not
                self._relieve(req)
            return None
        req.target = req.tier = target
        self._record(req)
        return land(self.res, req, how)

    def _room(self) -> Room:
        return room(self.config, self.host.available(), self.device.num_free,
                    self._requests.values())

    def _record(self, req: Request) -> None:
        self._requests[req.rid] = req
        self._freed.pop(req.rid, None)

    def poll_waiting(self) -> tuple[Admission, ...]:
        """Retry waiting requests in FIFO order with their kept target; stops at the first that
        still does not fit (and relieves device pressure for it)."""
        out: list[Admission] = []
        while self._waiting:
            req = self._requests[self._waiting[0]]
            if index_pages_short(self.config, self._requests.values(), req):
                break  # a release gives pages back; converting a request to host would not
            how = fit(self.res, req, req.target, match_prefix(self.res, req), self._room())
            if how is None:
                self._relieve(req)
                break
            self._waiting.pop(0)
            out.append(land(self.res, req, how))
        return tuple(out)

    def apply_landed(self, request_id: RequestId) -> None:
        """The prefill path wrote every non-reused page: host pages become valid (full ones are
        published) and the request joins decode batches (once admission restores completed)."""
        req = self._get(request_id, RequestState.LANDING)
        landed = req.prompt_len - 1
        for i, page in enumerate(req.pages):
            if page.host is not None and not page.reused:
                page.host_rows = max(0, min(self.config.page_size, landed - i * self.config.page_size))
                self.res.publish_if_full(req, i)
        req.state = RequestState.RUNNING

    def apply_landing_failed(self, request_id: RequestId) -> None:
        """The landing failed: the request finishes and frees every lease it held (after any
        admission restore in flight completes)."""
        req = self._get(request_id, RequestState.LANDING)
        self._finish(req, "landing_failed")

    # -- decode steps ------------------------------------------------------------------------------
    def take_command(self) -> StepCommand | None:
        """Build the next step: one command for every TP rank, or None when there is nothing to
        send. Eligible requests: RUNNING, stable tier, no page transfer in flight, previous token
        sampled; admission order, at most ``max_batch``. Requests are named by integer handles
        (defined in the command that first names them, freed after the one that releases them);
        hot buffers travel only when they changed.

        A chained request (``admit(chain=True)``) is also eligible while its row of the previous
        command is in flight (never two steps ahead, never past ``max_new_tokens``): its row
        carries ``prev_row``, its row index in that command, instead of the token. If that step
        samples eos, the chained row ran for nothing: its token is dropped and the request
        released once both reports are in (the rule aborts follow)."""
        cfg, res = self.config, self.res
        step = self._step + 1
        for req in self._requests.values():
            if req.conversion is Conversion.HOT:
                done = res.finish_hot(req)
                assert done, f"{req.rid}: hot buffer outside its device reservation"
        defined: list[RequestHandle] = []
        batch: list[BatchRow] = []
        backups: list[Backup] = []
        room_dev: int | None = None  # unreserved device blocks, computed when first needed
        for req in self._requests.values():
            if len(batch) >= cfg.max_batch:
                break
            if not self._eligible(req):
                continue
            pos = req.written
            i = pos // cfg.page_size
            if i == len(req.pages):
                if req.tier is LandingTarget.RESIDENT:
                    if req.backed and len(req.pages) >= res.hot_n:  # beyond its reservation
                        if room_dev is None:
                            room_dev = self._room().device
                        if room_dev < 1:
                            req.stalled = True
                            res.stats["stalls"] += 1
                            self._relieve(req)
                            continue
                        room_dev -= 1
                    got = self.device.lease(1, req.rid)
                    assert got is not None, f"{req.rid}: device page outside every reservation"
                    req.stalled = False
                    req.pages.append(Page(device=got[0]))
                else:
                    hb = self.host.allocate(1)
                    assert hb is not None, f"{req.rid}: host page outside its reservation"
                    req.pages.append(Page(host=hb[0]))
            h = self._handle(req, defined)
            if req.tier is LandingTarget.HOST:
                p = res.emit_backup(req, i)
                backups.append(Backup(p.tid, h, pos, p.host_block, pos % cfg.page_size))
            hot = tuple(req.hot) if req.tier is LandingTarget.HOST else ()
            new_hot = None if hot == req.sent_hot else hot
            req.sent_hot = hot
            if req.awaiting:  # chained: its input is what its row of the previous command samples
                batch.append(BatchRow(h, pos + 1, 0, new_hot, req.awaiting_row))
                res.stats["chained_rows"] += 1
            else:
                batch.append(BatchRow(h, pos + 1, req.tokens[pos], new_hot))
            req.written += 1
            req.awaiting.append(step)
            req.awaiting_row = len(batch) - 1
        transfers = tuple(PageTransfer(p.tid, _KIND[p.kind], p.device_block, p.host_block)
                          for p in res.outbox)
        res.outbox.clear()
        diffs: list[TableDiff] = []
        for req in self._requests.values():
            if req.state not in (RequestState.WAITING, RequestState.RELEASED):
                changes = req.table_changes()
                if changes:
                    h = self._handle(req, defined)
                    diffs += [TableDiff(h, *c) for c in changes]
        released = tuple(self._released)
        self._released.clear()
        if not (batch or transfers or diffs or released):
            return None
        for h in released:  # reused from the next command on
            heapq.heappush(self._free_handles, h)
        self._step = step
        res.stats["steps"] += 1
        return StepCommand(step, tuple(batch), tuple(diffs), transfers, tuple(backups),
                           released, tuple(defined), self._host_seq)

    def rows_chain(self, cmd: StepCommand) -> bool:
        """Whether every row of ``cmd`` chains: the next command may be taken before its report."""
        handles = {r.handle for r in cmd.batch}
        return all(r.chain for r in self._requests.values() if r.handle in handles)

    def _handle(self, req: Request, defined: list[RequestHandle]) -> int:
        """``req``'s handle; a new one (smallest free) is defined in this command."""
        if req.handle is None:
            if self._free_handles:
                req.handle = heapq.heappop(self._free_handles)
            else:
                req.handle = self._next_handle
                self._next_handle += 1
            req.sent_hot = None
            defined.append(RequestHandle(req.handle, req.rid))
        return req.handle

    def _eligible(self, req: Request) -> bool:
        """Whether ``req`` takes a row in the next command (see :meth:`take_command`)."""
        if req.awaiting and not (req.chain and req.awaiting == [self._step]
                                 and req.num_generated + 1 < req.max_new_tokens):
            # a host-tier row may read the previous row from its backup, not yet in ``host_seq``:
            # a peer waits for that step's writes by step number (``HostPool.wait_step``)
            return False
        return (req.state is RequestState.RUNNING and req.conversion is None
                and all(self.book.pending[t].kind is TransferOp.BACKUP for t in req.in_flight))

    def _stable(self, req: Request) -> bool:
        """Eligible with no step in flight: what a conversion or a restore starts from."""
        return not req.awaiting and self._eligible(req)

    def _relieve(self, needy: Request) -> None:
        """Device pressure: convert one resident request to the host tier, unless a conversion is
        already in flight. Victim: the stable resident request holding at least a hot buffer's
        worth of pages whose conversion frees the most unreserved device blocks (a backed one frees
        its pages beyond a hot buffer; an unbacked one also its reservation, and needs its life in
        host room); the needy request itself qualifies if it frees none but stops needing new
        device pages."""
        if not self.config.host_tier:
            return  # a full-resident baseline never converts: it waits
        hot_n = self.config.hot_blocks_per_request
        if any(r.conversion in (Conversion.SPILL, Conversion.HOT) for r in self._requests.values()):
            return
        free: Room | None = None  # computed only when needed: O(requests)
        if needy.state is RequestState.WAITING and needy.target is LandingTarget.HOST:
            free = self._room()
            if free.admit_device >= hot_n:
                return  # the host pool is its bottleneck: spilling would only make it worse
        best, best_gain = None, -1
        for req in self._requests.values():
            if not (self._stable(req) and req.tier is LandingTarget.RESIDENT and not req.in_flight):
                continue
            n = len(req.pages)
            if n < hot_n:
                continue  # its hot buffer would take more device blocks than it frees
            if req.backed:
                gain = n - hot_n
            else:
                life = life_pages(self.config, req)
                if free is None:
                    free = self._room()
                if life > free.host:
                    continue  # no host room for its life
                gain = life - hot_n
            if (gain > 0 or (req is needy and gain == 0)) and gain > best_gain:
                best, best_gain = req, gain
        if best is not None:
            started = self.res.start_spill(best)
            assert started, f"{best.rid}: spill outside the host room"

    # -- reports -----------------------------------------------------------------------------------
    def apply_report(self, report: StepReport) -> None:
        """Apply one rank's report. A transfer's enqueued/completed action runs once every rank
        acknowledged it; sampled tokens (rank 0 only) are appended to requests of ``report.step``.
        Reports may arrive in any order and a rank may report one step several times."""
        check_report(self.config.tp_size, self._step, self.book, self._requests, report)
        rank = report.rank
        if rank == 0:
            self._host_seq = max(self._host_seq, report.published)
        touched: dict[TransferId, None] = {}
        for tid in (*report.enqueued, *report.completed):
            self.book.pending[tid].enqueued.add(rank)
            touched[tid] = None
        for tid in report.completed:
            self.book.pending[tid].completed.add(rank)
        affected: dict[RequestId, Request] = {}
        for tid in touched:
            p = self.book.pending[tid]
            req = self._requests[p.rid]
            affected[req.rid] = req
            if not p.enqueue_applied and self.book.all_enqueued(p):
                p.enqueue_applied = True
                self.res.on_enqueued(p, req)
            if self.book.all_completed(p):
                self.res.on_completed(p, req)
                self.book.retire(tid)
                req.in_flight.discard(tid)
        for rid, tok in report.sampled:
            req = self._requests[rid]
            affected[rid] = req
            req.awaiting.pop(0)  # report.step (checked)
            if req.state is not RequestState.RUNNING:
                self.res.stats["dropped_rows"] += 1
                continue  # finished while its step was in flight: the token is dropped
            req.tokens.append(tok)
            full, rest = divmod(len(req.tokens), self.config.page_size)
            if not rest and full <= len(req.pages):  # a page a chained row filled, backed up
                self.res.publish_if_full(req, full - 1)  # before this, its last token, arrived
            if req.num_generated >= req.max_new_tokens:
                self._finish(req, "length")
            elif req.eos_token_id is not None and tok == req.eos_token_id:
                self._finish(req, "eos")
        for req in affected.values():
            self._drain(req)

    # -- finishing ---------------------------------------------------------------------------------
    def finish(self, request_id: RequestId) -> None:
        """Abort a request (any state before FINISHED); leases are freed once nothing of it is in
        flight."""
        req = self._lookup(request_id)
        if req.state in (RequestState.FINISHED, RequestState.RELEASED):
            raise StateError(f"request {request_id!r} already finished")
        self._finish(req, "abort")

    def free(self, request_id: RequestId) -> None:
        """Forget a finished request (now if RELEASED, else once it is). DoubleFreeError for a
        second free, StateError for a request not finished yet."""
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self._freed:
                raise DoubleFreeError("request", request_id)
            raise UnknownRequestError(request_id)
        if req.forget_when_released:
            raise DoubleFreeError("request", request_id)
        if req.state not in (RequestState.FINISHED, RequestState.RELEASED):
            raise StateError(f"request {request_id!r} is {req.state.value}; finish it first")
        req.forget_when_released = True
        self._drain(req)

    def _finish(self, req: Request, reason: str) -> None:
        if req.state is RequestState.WAITING:
            self._waiting.remove(req.rid)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        self._drain(req)

    def _drain(self, req: Request) -> None:
        if req.state is RequestState.FINISHED and not req.in_flight and not req.awaiting:
            self.res.release_all(req)
            req.state = RequestState.RELEASED
            self.res.stats["finished"] += 1
            if req.handle is not None:  # the workers know it: tell them to forget it
                self._released.append(req.handle)
                req.handle = None
        if (req.state is RequestState.RELEASED and req.forget_when_released
                and self._requests.get(req.rid) is req):
            del self._requests[req.rid]
            self._freed[req.rid] = None
            if len(self._freed) > FREED_MEMORY:
                self._freed.popitem(last=False)

    # -- restore policy ------------------------------------------------------------------------------
    def restore(self, request_id: RequestId) -> bool:
        """Move a stable host-tier request back to resident pages. False (nothing changed) when
        the unreserved device room cannot hold every page now (or, backed, the host room its
        life); StateError when it is not stable host tier."""
        req = self._get(request_id, RequestState.RUNNING)
        if req.tier is not LandingTarget.HOST or not self._stable(req) or req.in_flight:
            raise StateError(f"request {request_id!r} is not a stable host-tier request")
        n = len(req.pages)
        # backed: its host reservation grows back from ``life - n`` to ``life`` (a later spill)
        backed = resident_backing(self._room(), life_pages(self.config, req),
                                  max(n, self.res.hot_n), n)
        if backed is None:
            return False
        blocks = self.device.lease(n, req.rid)
        assert blocks is not None
        req.backed, req.stalled = backed, False
        req.mark_table()
        for page, d in zip(req.pages, blocks):
            page.device = d
        self.res.start_restore(req, list(range(len(req.pages))))
        return True

    # -- views -------------------------------------------------------------------------------------
    def _lookup(self, request_id: RequestId) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id)
        return req

    def _get(self, request_id: RequestId, state: RequestState) -> Request:
        req = self._lookup(request_id)
        if req.state is not state:
            raise StateError(f"request {request_id!r} is {req.state.value}, expected {state.value}")
        return req

    def view(self, request_id: RequestId) -> RequestView:
        """A snapshot, O(tokens): it copies the whole sequence (per step, use :meth:`state`)."""
        req = self._lookup(request_id)
        return RequestView(req.rid, req.state, req.target, req.tier, tuple(req.tokens),
                           req.prompt_len, req.num_generated, req.finish_reason)

    def state(self, request_id: RequestId) -> RequestState:
        """The request's state, O(1)."""
        return self._lookup(request_id).state

    def generated(self, request_id: RequestId, start: int = 0) -> tuple[int, ...]:
        """Tokens the request generated from index ``start`` on (for streaming: O(new), where
        ``view`` copies the whole sequence)."""
        req = self._lookup(request_id)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return tuple(req.tokens[req.prompt_len + start:])

    def request_ids(self) -> tuple[RequestId, ...]:
        return tuple(self._requests)

    @property
    def step(self) -> int:
        """Number of the last emitted step (0 before the first)."""
        return self._step

    @property
    def counters(self) -> CoordinatorCounters:
        return CoordinatorCounters(
            **{k: self.res.stats[k] for k in _STAT_COUNTERS}, waiting=len(self._waiting),
            running=sum(r.state is RequestState.RUNNING for r in self._requests.values()),
            evictions=self.host.evictions, device_blocks_total=self.device.num_blocks,
            device_blocks_used=self.device.num_used, host_blocks_total=self.host.num_blocks,
            host_blocks_used=self.host.num_used, host_blocks_cached=self.host.num_cached)

    def check_invariants(self) -> None:
        """Raise AssertionError if any coordinator, pool or transfer invariant is broken."""
        check_coordinator(self)
