"""Residency transactions of the coordinator: spill, restore, backup and their acks (pure ring).

Spill-before-free (resident -> host), per page::

    emit:      lease host block h (owned by the page), pin h and the resident block d
    enqueued:  (every rank) replace the table entry (h, d) -> (h, -), unpin d, then hand d to the
               request's hot buffer if it is still incomplete, else release d to the device pool
    completed: (every rank) the host page is valid: publish it if full, unpin h

Restore (host -> resident) is the reverse: lease and pin d, pin h; on completed unpin both; when a
request's last restore completes, drop every host reference and the hot buffer (tier RESIDENT).
Backup (newest row -> host): pin h at emit; on completed count the row and publish a full page.
"""

from __future__ import annotations

from collections import Counter

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.device_blocks import HOT_GROUP, DeviceBlockPool
from hisparse_ray.core.host_blocks import HostBlockPool
from hisparse_ray.core.prefix_index import PrefixKey, ROOT_KEY, page_key
from hisparse_ray.core.request import Conversion, Page, Pending, Request, TransferBook, TransferOp
from hisparse_ray.types import LandingTarget, RequestState


class Residency:
    """Pools + transfer book + the transactions that move pages between them.

    ``outbox`` holds emitted page transfers (spills, restores) not yet put in a step command;
    ``stats`` counts what the coordinator reports in its counters.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.ps = config.page_size
        self.hot_n = config.hot_blocks_per_request
        self.host = HostBlockPool(config.num_host_blocks)
        self.device = DeviceBlockPool(config.num_device_blocks)
        self.book = TransferBook(config.tp_size)
        self.outbox: list[Pending] = []
        self.stats: Counter[str] = Counter()

    # -- prefix keys and publishing ----------------------------------------------------------------
    def page_key(self, req: Request, i: int) -> PrefixKey:
        """Chained key of full page ``i`` (its tokens are known once its last position is fed)."""
        ps = self.ps
        while len(req.keys) <= i:
            j = len(req.keys)
            parent = req.keys[j - 1] if j else ROOT_KEY
            req.keys.append(page_key(parent, req.tokens[j * ps:(j + 1) * ps]))
        return req.keys[i]

    def publish_if_full(self, req: Request, i: int) -> None:
        page = req.pages[i]
        if page.host is None or page.reused or page.host_rows < self.ps:
            return
        if (i + 1) * self.ps > len(req.tokens):
            return  # a chained row wrote the position of a token never appended (an abort)
        if not self.config.publish_decoded and (i + 1) * self.ps > req.prompt_len - 1:
            return  # a decode step wrote a row of it (CoordinatorConfig.publish_decoded)
        if self.host.is_published(page.host):
            return
        if self.host.publish(page.host, self.page_key(req, i)):
            self.stats["published_pages"] += 1

    # -- emitting transactions ---------------------------------------------------------------------
    def _emit(self, op: TransferOp, req: Request, i: int, page: Page) -> Pending:
        assert page.host is not None
        p = self.book.new(op, req.rid, i, page.device, page.host)
        req.in_flight.add(p.tid)
        self.host.pin(page.host)
        if op is not TransferOp.BACKUP:
            assert page.device is not None
            self.device.pin(page.device)
            self.outbox.append(p)
        return p

    def start_spill(self, req: Request) -> bool:
        """Convert a stable resident request to the host tier; False (nothing changed) if the host
        pool cannot take every page now."""
        assert req.tier is LandingTarget.RESIDENT and req.conversion is None and not req.in_flight
        blocks = self.host.allocate(len(req.pages))
        if blocks is None:
            return False
        req.conversion, req.stalled = Conversion.SPILL, False
        req.mark_table()
        for i, (page, h) in enumerate(zip(req.pages, blocks)):
            page.host, page.host_rows = h, 0
            self._emit(TransferOp.SPILL, req, i, page)
        self.stats["conversions_to_host"] += 1
        return True

    def start_restore(self, req: Request, pages: list[int]) -> None:
        """Emit RESTORE for ``pages`` (each has a host block and a freshly leased device block)."""
        req.conversion = Conversion.RESTORE
        for i in pages:
            self._emit(TransferOp.RESTORE, req, i, req.pages[i])

    def emit_backup(self, req: Request, i: int) -> Pending:
        return self._emit(TransferOp.BACKUP, req, i, req.pages[i])

    # -- acks --------------------------------------------------------------------------------------
    def on_enqueued(self, p: Pending, req: Request) -> None:
        if p.kind is not TransferOp.SPILL:
            return  # restores and backups act on completion only
        page = req.pages[p.page]
        d = p.device_block
        assert d is not None and page.device == d
        page.device = None
        req.mark_table(p.page)
        self.device.unpin(d)
        if len(req.hot) < self.hot_n and req.state is not RequestState.FINISHED:
            req.hot.append(d)  # stream order makes reuse as a hot block safe
        else:
            self.device.release(d)

    def on_completed(self, p: Pending, req: Request) -> None:
        self.host.unpin(p.host_block)
        page = req.pages[p.page]
        if p.kind is TransferOp.BACKUP:
            page.host_rows += 1
            self.stats["backups"] += 1
            self.stats["backup_bytes"] += self.config.row_bytes
            self.publish_if_full(req, p.page)
            return
        if p.kind is TransferOp.SPILL:
            page.host_rows = max(0, min(self.ps, req.written - p.page * self.ps))
            self.stats["spills"] += 1
            self.stats["spill_bytes"] += self.config.page_bytes
            self.publish_if_full(req, p.page)
            if not self._has(req, TransferOp.SPILL, exclude=p):
                req.tier = LandingTarget.HOST
                req.conversion = Conversion.HOT
                self.finish_hot(req)
            return
        assert p.device_block is not None
        self.device.unpin(p.device_block)
        self.stats["restores"] += 1
        self.stats["restore_bytes"] += self.config.page_bytes
        if not self._has(req, TransferOp.RESTORE, exclude=p):
            for page in req.pages:
                if page.host is not None:
                    self.host.release(page.host)
                page.host, page.host_rows, page.reused = None, 0, False
            req.mark_table()
            for b in req.hot:
                self.device.release(b)
            req.hot.clear()
            req.tier = LandingTarget.RESIDENT
            req.conversion = None

    def finish_hot(self, req: Request) -> bool:
        """Complete a converted request's hot buffer from the pool; True when it is complete."""
        if req.state is RequestState.FINISHED:
            req.conversion = None
            return True
        need = self.hot_n - len(req.hot)
        if need > 0:
            got = self.device.lease(need, req.rid, HOT_GROUP)
            if got is None:
                return False
            req.hot.extend(got)
        req.conversion = None
        return True

    def _has(self, req: Request, op: TransferOp, exclude: Pending) -> bool:
        return any(t != exclude.tid and self.book.pending[t].kind is op for t in req.in_flight)

    def check_invariants(self) -> None:
        """Both pools and the transfer book; every outbox entry is still pending."""
        self.host.check_invariants()
        self.device.check_invariants()
        self.book.check_invariants()
        for p in self.outbox:
            assert p.tid in self.book.pending, f"outbox holds retired transfer {p.tid}"

    # -- releasing ---------------------------------------------------------------------------------
    def release_all(self, req: Request) -> None:
        """Return every lease of a request with no transfer in flight."""
        assert not req.in_flight
        for page in req.pages:
            if page.host is not None:
                self.host.release(page.host)
            if page.device is not None:
                self.device.release(page.device)
        for b in req.hot:
            self.device.release(b)
        req.pages.clear()
        req.hot.clear()
