"""Cross-object invariants of the coordinator (pure ring): who owns, pins and references what.

Checked after every step of the property tests and the soak run; each violation is an
AssertionError naming the broken rule.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hisparse_ray.core.admission import index_pages_held
from hisparse_ray.core.request import Conversion, TransferOp
from hisparse_ray.core.reservations import obligations, resident_bound
from hisparse_ray.types import LandingTarget, RequestState

if TYPE_CHECKING:
    from hisparse_ray.core.coordinator import Coordinator


def check_coordinator(c: "Coordinator") -> None:
    """free + used == total in both pools; refs/pins >= 0 and equal to their holders; no block both
    free and leased; every prefix entry points at a live published block; no lease released before
    its ack (a pending transfer's blocks are still leased/owned and pinned); stable tiers have
    their shape; waiting/released requests hold nothing; a request handle names at most one
    request and is never both free and in use; a request's pages before ``table_from`` (not marked
    changed) have sent the workers their current blocks; the pools cover every reservation
    (available host blocks >= host reservations, free device blocks >= device reservations), so no
    request can run out of blocks mid-decode; a capped index-key pool covers the pages of every landed
    request not yet released."""
    host, device, book = c.host, c.device, c.book
    c.res.check_invariants()
    cfg = c.config
    ps = cfg.page_size
    if cfg.index_pages is not None:  # a capped index-key pool: landings never over-commit it
        held = index_pages_held(cfg, c._requests.values())
        assert held <= cfg.index_pages, f"index-key pages over-committed: {held} > {cfg.index_pages}"

    live = [r.handle for r in c._requests.values() if r.handle is not None]
    idle = set(c._free_handles) | set(c._released)
    assert len(set(live)) == len(live), "a handle names two requests"
    assert not idle & set(live), "a released or free handle still names a request"
    assert len(idle) == len(c._free_handles) + len(c._released), "a handle is freed twice"
    assert all(0 <= h < c._next_handle for h in (*live, *idle)), "a handle out of range"
    waiting = set(c._waiting)
    assert len(waiting) == len(c._waiting), "a request is queued twice"
    dev_owner: dict[int, str] = {}
    host_refs: Counter[int] = Counter()
    for rid, req in c._requests.items():
        assert req.rid == rid
        req.check_invariants(ps)
        if req.state in (RequestState.WAITING, RequestState.RELEASED):
            assert not req.pages and not req.hot and not req.in_flight, f"{rid} holds leases"
            assert (req.state is RequestState.WAITING) == (rid in waiting)
            continue
        assert rid not in waiting, f"{rid} is queued but {req.state}"
        clean = enumerate(req.pages[:req.table_from])
        assert all(req.sent.get(i) == p.entry() for i, p in clean), \
            f"{rid}: a page's blocks changed but mark_table was not called (workers miss the diff)"
        for i, page in enumerate(req.pages):
            assert 0 <= page.host_rows <= ps, f"{rid} page {i} host_rows={page.host_rows}"
            if page.device is not None:
                assert page.device not in dev_owner, f"device block {page.device} held twice"
                dev_owner[page.device] = rid
            if page.host is not None:
                host_refs[page.host] += 1
                if page.reused:
                    assert host.is_published(page.host), f"{rid} reuses unpublished {page.host}"
        for b in req.hot:
            assert b not in dev_owner, f"device block {b} held twice"
            dev_owner[b] = rid
        for tid in req.in_flight:
            assert tid in book.pending and book.pending[tid].rid == rid, f"{rid}: stray {tid}"
        if req.state in (RequestState.LANDING, RequestState.RUNNING):
            lo, hi = cfg.pages_for(req.written), cfg.pages_for(req.written + 1)
            if not cfg.host_tier:  # a full-resident baseline leases its whole life at admission
                hi = max(hi, cfg.pages_for(req.lifetime_positions))
            assert lo <= len(req.pages) <= hi, f"{rid}: {len(req.pages)} pages for {req.written}"
            assert len(req.tokens) + req.unknown_written >= req.written, f"{rid}: wrote past its tokens"
        page_ops = [book.pending[t].kind for t in req.in_flight
                    if book.pending[t].kind is not TransferOp.BACKUP]
        stable = req.conversion is None and not page_ops
        if req.state is RequestState.RUNNING and stable:
            if req.tier is LandingTarget.RESIDENT:
                assert all(p.device is not None and p.host is None for p in req.pages), rid
                assert not req.hot, f"resident {rid} holds a hot buffer"
            else:
                assert all(p.host is not None and p.device is None for p in req.pages), rid
                assert len(req.hot) == cfg.hot_blocks_per_request, f"{rid} hot buffer incomplete"
        if req.conversion is Conversion.SPILL:
            assert TransferOp.SPILL in page_ops, f"{rid} spilling with no spill in flight"
    h_sum = d_sum = 0
    for rid, req in c._requests.items():
        h, d = obligations(cfg, req)
        assert h >= 0 and d >= 0, f"{rid}: negative reservation (host {h}, device {d})"
        h_sum, d_sum = h_sum + h, d_sum + d
        if req.stalled and req.state is RequestState.RUNNING and resident_bound(req):
            assert req.backed, f"{rid}: stalled without host backing"
    assert host.available() >= h_sum, (
        f"host reservations {h_sum} exceed the {host.available()} available host blocks")
    assert device.num_free >= d_sum, (
        f"device reservations {d_sum} exceed the {device.num_free} free device blocks")
    for b in range(device.num_blocks):
        assert device.owner(b) == dev_owner.get(b), (
            f"device block {b}: pool owner {device.owner(b)!r}, request holder {dev_owner.get(b)!r}")
    for b in range(host.num_blocks):
        assert host.refs(b) == host_refs.get(b, 0), (
            f"host block {b}: refs {host.refs(b)}, held by {host_refs.get(b, 0)} pages")

    host_pins: Counter[int] = Counter()
    dev_pins: Counter[int] = Counter()
    for tid, p in book.pending.items():
        req = c._requests.get(p.rid)
        assert req is not None and tid in req.in_flight, f"transfer {tid} of a forgotten request"
        page = req.pages[p.page]
        host_pins[p.host_block] += 1
        assert page.host == p.host_block, f"transfer {tid}: page lost its host block"
        if p.kind is TransferOp.RESTORE or (p.kind is TransferOp.SPILL and not p.enqueue_applied):
            dev_pins[p.device_block] += 1
            assert page.device == p.device_block, f"transfer {tid}: device lease released early"
    for b in range(host.num_blocks):
        assert host.pins(b) == host_pins.get(b, 0), f"host block {b} pins {host.pins(b)}"
    for b in range(device.num_blocks):
        assert device.pins(b) == dev_pins.get(b, 0), f"device block {b} pins {device.pins(b)}"
