"""The lander's plan of a landing (``chunk_pages`` + ``plan_chunk``), checked by carrying it out on
in-memory ranks: every WRITE segment the prefill worker would post (``write_groups``) is applied
byte for byte to the destination rank's memory and announces its notification, then each rank
runs its step with the real rank side of a landing (``RankLanding.complete``, what
``DecodeWorker.complete_landing`` calls): notification waits, staging -> host copies by layer group
into a real shared-memory host pool, key copies into the request's key cache. Hypothesis draws the
geometry (layers, page size, prompt length, reused prefix, staging pool size, TP size, path, layer
groups, key staging or not). Afterwards every pushed page must sit in its target block on the right
ranks, every rank's key cache must hold every position's keys, and no rank may hold a
notification nobody waited for. The transport is simulated (a unit test of the code above it);
the end-to-end tests run the same plan over real NIXL."""

from __future__ import annotations

import random
import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.config import KVLayout
from hisparse_ray.host.pool import HostPool
from hisparse_ray.landing.plan import chunk_pages, group_notif, plan_chunk
from hisparse_ray.landing.segments import write_groups
from hisparse_ray.model.cache import IndexerKeyCache
from hisparse_ray.rank.landing import RankLanding
from hisparse_ray.transfer import MemKind, RegionDesc
from hisparse_ray.types import LandingOrder, RankEndpoint, SamplingParams, pack, unpack

SAMPLING = SamplingParams(temperature=0.7, seed=11, top_k=5, top_p=0.9)

R, K = 3, 2  # KV row bytes and key row bytes per (token, layer)


def _pattern(L: int, T: int, width: int, salt: int) -> torch.Tensor:
    """[L, T, width] uint8, distinct per (layer, position, byte) modulo 251."""
    l, t, b = torch.meshgrid(torch.arange(L), torch.arange(T), torch.arange(width), indexing="ij")
    return ((l * 89 + t * 7 + b * 3 + salt) % 251 + 1).to(torch.uint8)


class _KeyCaches:
    """A rank's key caches (what ``HiSparseWorker`` offers a landing, ``rank.landing.KeyCaches``),
    keys as ``K`` raw bytes per (layer, position)."""

    def __init__(self, L: int) -> None:
        self.L = L
        self.index: dict[str, IndexerKeyCache] = {}

        self.sampling: dict[str, SamplingParams] = {}

    def install_index_keys(self, rid: str, keys, capacity: int) -> None:
        assert keys is None  # key staging: the keys come by WRITE, not by Ray
        self.index[rid] = IndexerKeyCache(self.L, K, max(capacity, 1), dtype=torch.uint8)

    def has_index_keys(self, rid: str) -> bool:
        return rid in self.index

    def write_index_keys(self, rid: str, lo: int, raw) -> None:
        self.index[rid].keys[:, lo:lo + raw.shape[1]] = raw

    def set_index_length(self, rid: str, length: int) -> None:
        self.index[rid].length = length

    def set_sampling(self, rid: str, params: SamplingParams) -> None:
        self.sampling[rid] = params

    def forget(self, rid: str) -> None:
        self.index.pop(rid, None)
        self.sampling.pop(rid, None)


class _Rank:
    def __init__(self, r: int, L: int, P: int, n_dev: int, n_host: int, cap: int, keys: bool):
        self.agent = f"rank{r}"
        self.mem: dict[str, torch.Tensor] = {}
        self.inbox: list[tuple[str, bytes]] = []  # notifications the simulated WRITEs announced
        dev = tuple(self._region(f"dev.{l}", torch.zeros(n_dev * P, R, dtype=torch.uint8),
                                 MemKind.DEVICE) for l in range(L))
        host = stage = ()
        self.pool = None
        staging: list[torch.Tensor] = []
        if r == 0:
            self.pool = HostPool.create(f"plan{r}", KVLayout(num_layers=L, page_size=P,
                                                             row_bytes=R), n_host,
                                        register_cuda=False)
            host = tuple(self._region(f"host.{l}", self.pool.layer(l), MemKind.HOST)
                         for l in range(L))
            staging = [torch.zeros(cap * P, R, dtype=torch.uint8) for _ in range(L)]
            stage = tuple(self._region(f"stage.{l}", t, MemKind.DEVICE)
                          for l, t in enumerate(staging))
        key_staging = torch.zeros(L, cap * P, K, dtype=torch.uint8) if keys else None
        key_layers = tuple(self._region(f"keys.{l}", key_staging[l], MemKind.DEVICE)
                           for l in range(L)) if keys else ()
        self.endpoint = RankEndpoint(r, self.agent, b"", "node", host, dev, stage,
                                     cap if r == 0 else 0, key_layers)
        self.caches = _KeyCaches(L)
        self.landing = RankLanding(r, P, self._take, self.caches, threading.Lock(),
                                   pool=self.pool, staging=staging, key_staging=key_staging)

    def _take(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def _region(self, name: str, t: torch.Tensor, kind: MemKind) -> RegionDesc:
        self.mem[name] = t
        return RegionDesc(self.agent, name, 0, t.numel(), 0, kind)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.destroy()


def _apply(seg, send: dict[str, torch.Tensor], ranks: dict[str, _Rank]) -> None:
    src = send[seg.local].reshape(-1)[seg.local_offset: seg.local_offset + seg.nbytes]
    dst = ranks[seg.remote.agent].mem[seg.remote.name].reshape(-1)
    seg.remote.check_span(seg.remote_offset, seg.nbytes)
    dst[seg.remote_offset: seg.remote_offset + seg.nbytes] = src


@settings(max_examples=150, deadline=None)
@given(L=st.integers(1, 4), P=st.integers(1, 5), T=st.integers(0, 40), tp=st.integers(1, 3),
       path=st.sampled_from(["resident", "direct", "staged"]), cap=st.integers(1, 6),
       groups=st.integers(1, 4), keys=st.booleans(), reuse=st.integers(0, 8),
       seed=st.integers(0, 2**16))
def test_a_planned_landing_puts_every_byte_where_decode_reads_it(L, P, T, tp, path, cap, groups,
                                                                 keys, reuse, seed):
    rng = random.Random(seed)
    n_pages = -(-T // P)
    reused = min(reuse, T // P)  # only full pages are ever reused (prefix cache)
    n_dev, n_host = n_pages + 3, n_pages + 5
    blocks = rng.sample(range(n_dev if path == "resident" else n_host), n_pages)
    block = {p: blocks[p] for p in range(reused, n_pages)}
    ranks = [_Rank(r, L, P, n_dev, n_host, cap, keys) for r in range(tp)]
    try:
        _land(ranks, L, P, T, path, cap, groups, keys, block, rng)
    finally:
        for rk in ranks:
            rk.close()


def _land(ranks, L, P, T, path, cap, groups, keys, block, rng):
    tp, n_pages = len(ranks), -(-T // P)
    by_agent = {rk.agent: rk for rk in ranks}
    eps = [rk.endpoint for rk in ranks]
    send = {"send": _pattern(L, max(T, 1), R, 0), "send.keys": _pattern(L, max(T, 1), K, 5)}

    # the lander's chunking (lander.land): all pages when keys travel by NIXL, else the pushed
    keys_nixl = keys
    staged = path == "staged" or keys_nixl
    pages = list(range(n_pages)) if keys_nixl else sorted(block)
    parts = chunk_pages(pages, cap) if staged else [tuple(pages)]
    capacity = T + 5
    for i, part in enumerate(parts):
        run = ()
        if staged and part:
            start = rng.randrange(cap - len(part) + 1)
            run = tuple(range(start, start + len(part)))
        dests, steps = plan_chunk("rq", T, P, path, block, part, run, i, i == len(parts) - 1,
                                  capacity, eps, timeout_s=1.0, layer_groups=groups,
                                  sampling=SAMPLING)
        assert len(steps) == tp and len({d.rank for d in dests}) == len(dests)
        # what the Ray calls carry (pack's bytes) is what was planned
        order = LandingOrder("rq", tuple(dests))
        assert unpack(pack(order)) == order and [unpack(pack(s)) for s in steps] == steps
        assert unpack(order) is order
        for dest in dests:  # the prefill worker's push: every group of every dest
            gs = write_groups(dest, "send", send["send"][0].numel(), R, P, T,
                              key_local="send.keys", key_layer_stride=send["send.keys"][0].numel(),
                              key_row_bytes=K)
            assert len(gs) == dest.layer_groups and (len(gs) == 1 or all(gs))
            assert dest.layer_groups == 1 or (path == "staged" and dest.rank == 0)
            for g, segs in enumerate(gs):
                for seg in segs:
                    assert seg.remote.agent == ranks[dest.rank].agent
                    _apply(seg, send, by_agent)
                if segs:  # the WRITE is done: the rank's agent gets its notification
                    ranks[dest.rank].inbox.append(("prefill", group_notif(dest.notif, g, len(gs))))
        for rk, step in zip(ranks, steps):  # DecodeWorker.complete_landing
            rk.landing.complete(unpack(pack(step)))
            assert not rk.landing.unclaimed, (rk.agent, rk.landing.unclaimed)
    # every pushed page in its block: resident on every rank, host on rank 0 (direct/staged)
    for p, b in block.items():
        lo, n = p * P, min(P, T - p * P)
        holders = ranks if path == "resident" else ranks[:1]
        prefix = "dev" if path == "resident" else "host"
        for rk in holders:
            for l in range(L):
                assert torch.equal(rk.mem[f"{prefix}.{l}"][b * P: b * P + n],
                                   send["send"][l, lo:lo + n]), (path, p, l, rk.agent)
    if path == "staged" and block:  # rank 0 published its host writes
        assert ranks[0].pool.published() > 0
    # every rank got the request's sampling with the last chunk (each draws the same token)
    assert [rk.caches.sampling.get("rq") for rk in ranks] == [SAMPLING] * tp  # every rank draws
    for rk in ranks:
        cache = rk.caches.index["rq"]
        assert cache.length == T  # the last chunk reached every rank
        if keys_nixl and T:
            assert torch.equal(cache.keys[:, :T], send["send.keys"][:, :T])
