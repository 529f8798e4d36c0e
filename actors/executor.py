"""The step executor a DecodeWorker rank drives (ring 3 glue over ring-2 adapters): applies one
StepCommand to this rank's HiSparse runtime, page copies and model shard, and builds its StepReport.

Rank 0 is the only host-pool writer (spills, backups); every rank restores into its own device pool
(MLA KV is replicated) and runs the same forward; rank 0 samples (greedy) and reports tokens.
Host-pool ordering across ranks: rank 0 completes its host writes of step s (``CopyHandle.wait``)
and publishes them before reporting, and the coordinator sends step s+1 only after every report
of step s, so a peer never reads a host page before it is written.
"""

from __future__ import annotations

from typing import Any

import torch

from hisparse_ray.actors.spec import ReplicaSpec
from hisparse_ray.copies import backup_rows, fill_rows, restore_page, spill_page
from hisparse_ray.hostpool import HostPool
from hisparse_ray.model.cache import IndexerKeyCache
from hisparse_ray.runtime import HiSparseCacheHandle, HiSparseRuntime
from hisparse_ray.types import RequestId, StepCommand, StepReport, TransferKind


class StepExecutor:
    """One rank's worker side of the step protocol.

    State per request: the runtime's tables / hot state (from TableDiffs and BatchRow.hot_blocks)
    and an :class:`IndexerKeyCache` built from the landed indexer keys. ``install_landing`` must
    precede the request's first batch row (the coordinator only batches landed requests).
    """

    def __init__(self, spec: ReplicaSpec, rank: int, pool: HostPool) -> None:
        self.spec, self.rank, self.pool = spec, rank, pool
        self.device = torch.device(spec.device)
        self.model = spec.model.build(spec.device)
        cfg = self.model.cfg
        if spec.tp_size > 1:
            self.model.shard_heads(rank, spec.tp_size)
        self.row_dim, self.dtype = cfg.row_dim, self.model.dtype
        L = cfg.num_hidden_layers
        host_layers = [self._host_view(l) for l in range(L)]
        self.runtime = HiSparseRuntime(
            spec.hisparse, spec.layout, spec.num_device_blocks, host_layers, device=self.device,
            max_requests=max(spec.num_device_blocks, spec.max_batch),
            anchor_of=[cfg.anchor_of(l) for l in range(L)])
        self.handle = HiSparseCacheHandle(self.runtime, self.row_dim, self.dtype)
        self.index: dict[str, IndexerKeyCache] = {}
        self._landed_keys: dict[str, Any] = {}
        self.counters = {"steps": 0, "hot_hits": 0, "hot_misses": 0, "spills": 0, "restores": 0,
                         "backups": 0}

    def _host_view(self, l: int) -> torch.Tensor:
        """The host layer as the resolver reads it: the UVA alias on GPU, the mapping on CPU."""
        if self.device.type == "cuda":
            alias = self.pool.device_layer(l)
            if alias is not None:
                return alias
        return self.pool.layer(l)

    @property
    def device_layers(self) -> list[torch.Tensor]:
        return self.runtime.device_kv

    # -- landing ------------------------------------------------------------------------------------
    def install_landing(self, request_id: str, index_keys: Any) -> None:
        """Keep the landed indexer keys (numpy ``[L, T, d]`` or None for T = 0) until the request's
        first step."""
        self._landed_keys[request_id] = index_keys

    def drop_landing(self, request_id: str) -> None:
        self._landed_keys.pop(request_id, None)

    def _index_cache(self, rid: str, seq_len: int) -> IndexerKeyCache:
        cache = self.index.get(rid)
        need = seq_len + 16
        if cache is None:
            keys = self._landed_keys.pop(rid)
            cfg = self.model.cfg
            cap = max(need, 64)
            cache = IndexerKeyCache(cfg.num_hidden_layers, cfg.index_head_dim, cap, dtype=self.dtype,
                                    device=self.device)
            if keys is not None and keys.shape[1]:
                t = torch.from_numpy(keys.copy()).to(self.device, self.dtype)
                cache.keys[:, : t.shape[1]] = t
                cache.length = t.shape[1]
            self.index[rid] = cache
        elif cache.keys.shape[1] < seq_len:
            grown = IndexerKeyCache(cache.keys.shape[0], cache.keys.shape[2], 2 * need,
                                    dtype=self.dtype, device=self.device)
            grown.keys[:, : cache.length] = cache.keys[:, : cache.length]
            grown.length = cache.length
            self.index[rid] = cache = grown
        return cache

    # -- one step -----------------------------------------------------------------------------------
    def execute(self, cmd: StepCommand) -> StepReport:
        rt, layers, writer = self.runtime, self.runtime.device_kv, self.rank == 0
        for rid in cmd.released:
            if rid in rt.requests:
                rt.remove(rid)
            self.index.pop(rid, None)
        for diff in cmd.table_diffs:
            rt.apply_diff(diff)
        acked = []
        wrote_host = False
        for t in cmd.transfers:
            if t.kind is TransferKind.SPILL:
                if writer:
                    if not wrote_host:
                        self.pool.begin_write()
                        wrote_host = True
                    spill_page(layers, self.pool, t.device_block, t.host_block).wait()
                self.counters["spills"] += 1
            else:
                restore_page(layers, self.pool, t.device_block, t.host_block).wait()
                self.counters["restores"] += 1
            acked.append(t.transfer_id)
        if wrote_host:
            self.pool.publish()
        sampled: tuple = ()
        hits = misses = 0
        per_request: list[tuple[RequestId, int, int]] = []
        if cmd.batch:
            sampled, per_request = self._forward(cmd)
            hits = sum(h for _, h, _ in per_request)
            misses = sum(m for _, _, m in per_request)
        if cmd.backups:
            if writer:
                src = [rt.device_row(b.request_id, b.position) for b in cmd.backups]
                dst = [b.host_block * self.spec.page_size + b.offset for b in cmd.backups]
                self.pool.begin_write()
                backup_rows(layers, self.pool, src, dst).wait()
                self.pool.publish()
            self.counters["backups"] += len(cmd.backups)
            acked.extend(b.transfer_id for b in cmd.backups)
        self.counters["steps"] += 1
        self.counters["hot_hits"] += hits
        self.counters["hot_misses"] += misses
        ids = tuple(acked)
        return StepReport(cmd.step, cmd.rank, enqueued=ids, completed=ids,
                          sampled=sampled if writer else (), hot_hits=hits, hot_misses=misses,
                          hits_by_request=tuple(per_request) if writer else ())

    def _forward(self, cmd: StepCommand):
        rt, H = self.runtime, self.spec.hisparse.device_buffer_size
        for row in cmd.batch:
            if rt.set_hot_blocks(row.request_id, row.hot_blocks) and row.hot_blocks:
                n = row.seq_len
                if n <= H and n > 1:  # short path: slot p holds position p; fill from host
                    slots = rt.slot_rows_of(row.request_id)
                    fill_rows(rt.device_kv, self.pool,
                              [rt.host_row(row.request_id, p) for p in range(n - 1)],
                              slots[: n - 1]).wait()
        caches = [self._index_cache(r.request_id, r.seq_len) for r in cmd.batch]
        rt.begin_step(cmd.batch)
        selected: dict[int, torch.Tensor] = {}

        def hook(layer: int, topk: torch.Tensor):
            selected[layer] = topk
            return None

        ids = torch.tensor([r.input_token for r in cmd.batch], dtype=torch.int64, device=self.device)
        pos = torch.tensor([r.seq_len - 1 for r in cmd.batch], dtype=torch.int64, device=self.device)
        logits = self.model.decode(ids, pos, self.handle, caches, topk_hook=hook)
        per_request = []
        plans = rt._anchor_plan
        for b, row in enumerate(cmd.batch):
            sel = sum(int((t[b] >= 0).sum()) for t in selected.values())
            miss = sum(int((p[b, :, 0] >= 0).sum()) for l, p in plans.items() if l in selected)
            per_request.append((row.request_id, sel - miss, miss))
        sampled: tuple = ()
        if self.rank == 0:
            toks = logits.argmax(dim=-1).tolist()
            sampled = tuple((r.request_id, int(t)) for r, t in zip(cmd.batch, toks))
        return sampled, per_request

    def stats(self) -> dict:
        return dict(self.counters)


def build_executor(spec: ReplicaSpec, rank: int, pool: HostPool) -> StepExecutor:
    return StepExecutor(spec, rank, pool)
