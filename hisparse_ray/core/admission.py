"""Admission helpers of the coordinator: request validation, prefix match, fit test against the
unreserved room (:mod:`~hisparse_ray.core.reservations`), landing plan (pure ring).

Landing plan per page: a resident target gets a device block for every page of positions
``0..P-1``; matched prefix pages are marked reused and restored from their host blocks by the
coordinator (a RESTORE transfer), the rest are landed by the prefill path. A host target gets a
host block per page (matched ones shared, ref-counted) plus a hot buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hisparse_ray.core.device_blocks import HOT_GROUP
from hisparse_ray.core.prefix_index import chain_keys
from hisparse_ray.core.request import Page, Request
from hisparse_ray.core.reservations import Room, life_pages, resident_backing
from hisparse_ray.core.residency import Residency
from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.errors import CapacityError, InvalidRequestError
from hisparse_ray.types import (
    NO_BLOCK, Admission, HostBlockId, LandingPage, LandingTarget, RequestState,
)

MAX_TOKEN = 1 << 63


def validate_request(rid: object, prompt: Sequence[int], max_new: object, eos: object) -> list[int]:
    """The prompt as a list; InvalidRequestError for a bad id, prompt, max_new_tokens or eos."""
    if not isinstance(rid, str):
        raise InvalidRequestError(rid, "request id must be a str")
    tokens = list(prompt)
    if not tokens:
        raise InvalidRequestError(rid, "prompt must hold at least one token")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN:
            raise InvalidRequestError(rid, f"token {t!r} is not an int in [0, 2**63)")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise InvalidRequestError(rid, f"max_new_tokens={max_new!r} must be an int >= 1")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise InvalidRequestError(rid, f"eos_token_id={eos!r} must be an int or None")
    return tokens


def pools_that_fit(cfg: CoordinatorConfig, rid: object, prompt_len: int,
                   max_new: int) -> tuple[bool, bool]:
    """``(resident_ever, host_ever)``: whether the request's whole life fits the empty device
    pool, and the empty host tier; CapacityError naming its size and the pools when neither."""
    index_need = index_pages_of(cfg, prompt_len, max_new)
    if cfg.index_pages is not None and index_need > cfg.index_pages:
        raise CapacityError(
            f"request {rid!r} ({prompt_len} prompt + {max_new} new tokens) needs more index-key "
            f"pages of {cfg.index_page_tokens} positions than the capped pool holds; pages",
            index_need, cfg.index_pages)
    life = cfg.pages_for(prompt_len + max_new - 1)
    resident_ever = life <= cfg.num_device_blocks
    host_ever = cfg.host_tier and life <= cfg.num_host_blocks
    if resident_ever or host_ever:
        return resident_ever, host_ever
    size = (f"request {rid!r} ({prompt_len} prompt + {max_new} new tokens = {life} pages of "
            f"{cfg.page_size} positions)")
    if not cfg.host_tier:  # a full-resident budget: the device pool is the only pool
        raise CapacityError(f"{size} does not fit the device pool ({cfg.num_device_blocks} "
                            f"blocks, no host tier); pages", life, cfg.num_device_blocks)
    raise CapacityError(
        f"{size} fits neither the device pool ({cfg.num_device_blocks} blocks) nor the host pool "
        f"({cfg.num_host_blocks} blocks); pages", life,
        max(cfg.num_device_blocks, cfg.num_host_blocks))


def index_pages_of(cfg: CoordinatorConfig, prompt_len: int, max_new: int) -> int:
    """Index-key pages a request holds from landing to release: its whole life's positions."""
    return -(-max(prompt_len + max_new, 1) // cfg.index_page_tokens)


def index_pages_held(cfg: CoordinatorConfig, requests: Iterable[Request]) -> int:
    """Index-key pages the landed requests not yet released hold. (The worker learns of a
    release from the next command; the engine gives a released request's pages back before a
    landing, so released requests hold none here.)"""
    return sum(index_pages_of(cfg, r.prompt_len, r.max_new_tokens) for r in requests
               if r.state in _HOLDS_INDEX_PAGES)


def index_pages_short(cfg: CoordinatorConfig, requests: Iterable[Request], req: Request) -> bool:
    """Whether a capped index-key pool (``CoordinatorConfig.index_pages``) lacks room for ``req``
    now: the pages :func:`index_pages_held` counts, plus ``req``'s, exceed the cap."""
    if cfg.index_pages is None:
        return False
    held = index_pages_held(cfg, requests)
    return held + index_pages_of(cfg, req.prompt_len, req.max_new_tokens) > cfg.index_pages


_HOLDS_INDEX_PAGES = (RequestState.LANDING, RequestState.RUNNING, RequestState.FINISHED)


def match_prefix(res: Residency, req: Request) -> list[HostBlockId]:
    """Published host blocks of the longest matching run of full landed pages."""
    return res.host.index.match(chain_keys(req.tokens[:req.prompt_len - 1], res.ps))


def resident_pages(res: Residency, req: Request) -> int:
    """Device blocks a resident landing leases: the prompt's pages, or its whole life's when the
    coordinator has no host tier (a full-resident baseline reserves at admission)."""
    n = req.prompt_len if res.config.host_tier else req.lifetime_positions
    return res.config.pages_for(n)


@dataclass(frozen=True, slots=True)
class Fit:
    """How an admission lands: ``backed`` (resident target only: its life reserved on the host
    tier, so it may grow on demand and spill) and the matched prefix blocks it reuses."""

    backed: bool
    matched: list[HostBlockId]


def _affordable(res: Residency, matched: list[HostBlockId], budget: int) -> list[HostBlockId]:
    """Longest head of ``matched`` whose cached blocks (which leave the available count while
    shared) number at most ``budget``."""
    used = 0
    for i, b in enumerate(matched):
        used += res.host.is_cached(b)
        if used > budget:
            return matched[:i]
    return matched


def fit(res: Residency, req: Request, target: LandingTarget, matched: list[HostBlockId],
        room: Room) -> Fit | None:
    """How ``req`` can land on ``target`` now, keeping every reservation; None if it cannot.

    Resident (:func:`resident_backing`): its prompt pages (at least a hot buffer's worth) on the
    device with its life reserved on the host tier (backed), or its whole life on the device
    (unbacked); matched blocks are restored, so only as many cached ones as the host room left
    allows are reused. Host: a hot buffer on the device and its life in host blocks, less the
    matched (shared) ones; cached matched blocks count against the room (they stop being
    evictable)."""
    life, hot_n = life_pages(res.config, req), res.hot_n
    if not res.config.host_tier:  # a full-resident baseline: its whole life on the device
        fits_life = target is LandingTarget.RESIDENT and room.admit_device >= life
        return Fit(False, []) if fits_life else None
    if target is LandingTarget.RESIDENT:
        floor = max(res.config.pages_for(req.prompt_len), hot_n)
        backed = resident_backing(room, life, floor, life)
        if backed is None:
            return None
        return Fit(backed, _affordable(res, matched, room.host - (life if backed else 0)))
    cached = sum(1 for b in matched if res.host.is_cached(b))
    if room.admit_device >= hot_n and room.host - cached >= life - len(matched):
        return Fit(False, matched)
    return None


def waiting_target(cfg: CoordinatorConfig, requests: Iterable[Request], req: Request,
                   resident_ever: bool, host_ever: bool) -> LandingTarget:
    """The target a request that fits neither tier now waits with (and keeps: the landing target
    is chosen once). RESIDENT when its whole life fits the device pool (``resident_ever``) and
    converting every other request to the host tier could make device room for its prompt: each
    keeps a hot buffer, or its pages if fewer (those are never converted). Else HOST when its life
    fits the host tier (``host_ever``; both flags from :func:`pools_that_fit`): a RESIDENT wait the conversions cannot serve would leave the
    device idle until requests finish, room for hot buffers meanwhile."""
    if not (resident_ever and host_ever):
        return LandingTarget.RESIDENT if resident_ever else LandingTarget.HOST
    hot_n = cfg.hot_blocks_per_request
    kept = sum(min(hot_n, len(r.hot) + len(r.pages)) for r in requests if r.pages or r.hot)
    floor = max(cfg.pages_for(req.prompt_len), hot_n)
    return LandingTarget.RESIDENT if floor <= cfg.num_device_blocks - kept else LandingTarget.HOST


def land(res: Residency, req: Request, how: Fit) -> Admission:
    """Lease the landing target of a request that ``fit`` placed and return its landing plan."""
    ps, matched = res.ps, how.matched
    req.backed = how.backed
    n0 = res.config.pages_for(req.prompt_len)
    for b in matched:
        res.host.acquire(b)
    res.stats["prefix_hit_pages"] += len(matched)
    if req.target is LandingTarget.RESIDENT:
        blocks = res.device.lease(resident_pages(res, req), req.rid)
        assert blocks is not None
        req.pages = [Page(device=d) for d in blocks]
        for i, b in enumerate(matched):
            req.pages[i].host, req.pages[i].reused, req.pages[i].host_rows = b, True, ps
        if matched:
            res.start_restore(req, list(range(len(matched))))
        plan = tuple(LandingPage(i, NO_BLOCK, p.entry()[1], p.reused) for i, p in enumerate(req.pages))
    else:
        fresh = res.host.allocate(n0 - len(matched))
        hot = res.device.lease(res.hot_n, req.rid, HOT_GROUP)
        assert fresh is not None and hot is not None
        req.pages = [Page(host=b, reused=True, host_rows=ps) for b in matched]
        req.pages += [Page(host=b) for b in fresh]
        req.hot = list(hot)
        plan = tuple(LandingPage(i, *p.entry(), p.reused) for i, p in enumerate(req.pages))
    req.state = RequestState.LANDING
    req.mark_table()
    res.stats["admitted"] += 1
    return Admission(req.rid, req.target, req.prompt_len - 1, plan, tuple(req.hot))
