"""Reservations: the blocks every live request may still take from each pool (pure ring).

Why: a request grows by one page every ``page_size`` decode steps. If admission only checked what
a request needs *now*, the pools run dry mid-decode and every request stalls at once (issue #15,
item 3: two host-tier requests that each fit alone, 20/20 host blocks used, no progress). The rule
here makes that impossible: *reserve the host tier, spill the device tier*.

* Host pool (the bottom tier; nothing below it to spill to): every live request reserves, at
  admission, every host block it may still take over its life (``L = pages_for(prompt +
  max_new_tokens - 1)`` pages). A host-bound request reserves ``L - pages``; a resident request
  with *host backing* reserves ``L`` (what a spill to the host tier plus its growth there takes);
  a resident request without backing reserves none.
* Device pool: a host-bound request reserves the rest of its fixed hot buffer; a resident request
  without backing reserves its whole life (``L - pages``) and never spills; a resident request
  with backing reserves only the floor ``hot_blocks - pages`` (so that it can always become a
  host-tier request: its own pages then make its hot buffer) and grows on demand. When such a
  request needs a page and the device has no unreserved block, it is *stalled*: the coordinator
  spills one resident request to the host tier (itself, or one that frees more), which is
  lossless, unlike recomputing evicted KV.

Invariants (``check_coordinator``): ``host.available() >= sum of host reservations`` and
``device.num_free >= sum of device reservations``. Every growth allocation is inside its
request's reservation, so it always succeeds, and every conversion and restore is started only
when the pools keep the invariants afterwards. Liveness: a running request needs nothing but its
workers' acks to finish; a waiting one is admitted at the latest when the pools are empty again,
which admission guaranteed it fits (else ``CapacityError``). Stalled requests *claim* a device
block each: while a claim is open, admissions and restores see that many fewer device blocks, so
new arrivals cannot starve a running request (each stall converts one resident request, of
which there are finitely many while admissions are held back).

Why reservation and not preemption on the host tier: preempting a host-tier request means
dropping its KV and recomputing it, and a recomputed prefill is not bitwise the KV that decode
wrote (matmul shapes differ: M = T rows against M = 1), so the request would no longer decode
exactly like full-resident decode. Reserving costs little: a reserved block stays available to
the prefix cache (cached blocks count as available; one is evicted only when a reservation is
drawn), and the unused part of a reservation is only the tokens that eos cut short.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.request import Conversion, Request
from hisparse_ray.types import LandingTarget, RequestState

LIVE = (RequestState.LANDING, RequestState.RUNNING)


def life_pages(cfg: CoordinatorConfig, req: Request) -> int:
    """Pages of every position that gets KV over the request's life."""
    return cfg.pages_for(req.lifetime_positions)


def resident_bound(req: Request) -> bool:
    """Whether the request is (or is becoming) a resident one: stable resident, landing on
    resident pages (with or without admission restores), or restoring to resident pages. A
    spilling request is host-bound."""
    if req.conversion is Conversion.RESTORE:
        return True
    return req.tier is LandingTarget.RESIDENT and req.conversion is not Conversion.SPILL


def obligations(cfg: CoordinatorConfig, req: Request) -> tuple[int, int]:
    """(host blocks, device blocks) the request may still take; (0, 0) unless LANDING or
    RUNNING (a finished request only returns what it holds)."""
    if req.state not in LIVE:
        return 0, 0
    life, n, hot_n = life_pages(cfg, req), len(req.pages), cfg.hot_blocks_per_request
    if resident_bound(req):
        return (life, max(0, hot_n - n)) if req.backed else (0, life - n)
    have = len(req.hot)
    if have < hot_n and req.conversion is Conversion.SPILL:
        have += sum(1 for p in req.pages if p.device is not None)  # they become hot blocks
    return life - n, max(0, hot_n - have)


@dataclass(frozen=True, slots=True)
class Room:
    """Unreserved capacity now: ``host`` = available host blocks minus every host reservation,
    ``device`` = free device blocks minus every device reservation, ``claims`` = stalled
    requests (one device block each, ahead of admissions and restores)."""

    host: int
    device: int
    claims: int

    @property
    def admit_device(self) -> int:
        """Device blocks an admission or a restore may take."""
        return self.device - self.claims


def room(cfg: CoordinatorConfig, host_available: int, device_free: int,
         requests: Iterable[Request]) -> Room:
    h_sum = d_sum = claims = 0
    for req in requests:
        h, d = obligations(cfg, req)
        h_sum += h
        d_sum += d
        if req.stalled and req.state is RequestState.RUNNING and resident_bound(req):
            claims += 1
    return Room(host_available - h_sum, device_free - d_sum, claims)


def resident_backing(room: Room, life: int, floor: int, host_need: int) -> bool | None:
    """How a request becomes resident now: True = backed (``floor`` device blocks, at least a
    hot buffer's worth, and ``host_need`` more host room), False = unbacked (its ``life`` in
    device room), None = neither fits. Backed is preferred (device blocks are the scarce ones,
    taken only as the request grows) unless unbacked costs the device no more than the floor or
    the host room is short."""
    dev = room.admit_device
    backed_ok = dev >= floor and room.host >= host_need
    if dev >= life and (life <= floor or not backed_ok):
        return False
    return True if backed_ok else None
