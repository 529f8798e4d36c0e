"""HiSparseWorker: one TP rank's executor of the coordinator's step commands (ring 2, adapters).

It owns the rank's :class:`~hisparse_ray.rank.runtime.HiSparseRuntime` (device KV, block tables, GPU LRU
state), the attention-facing :class:`~hisparse_ray.rank.runtime.HiSparseCacheHandle`, the indexer key
caches, and schedules page copies (:mod:`hisparse_ray.host.copies`) against the shared host pool. The
in-process :class:`~hisparse_ray.engine.Engine` and the ``DecodeWorker`` actor both drive it.

Per command (one per step, the same for every rank), in order: forget released handles and
their requests; take the handles it defines; a peer orders its host reads after rank 0's
writes: on the host, generation ``host_seq`` (rank 0's latest reported) and, when rank 0
wrote the host in the command before (backups or spills), that step by number
(``HostPool.wait_step``: the step ring, then its stream waits on the step's IPC event, which
covers every copy rank 0 enqueued in that step and before); apply block-table diffs; enqueue page
transfers (SPILL device -> host is written by rank 0 only, the one host-pool writer; RESTORE host
-> device on every rank, MLA KV is replicated); bind hot buffers (a new buffer of a short
sequence, n <= H, is filled so that slot p holds position p); run the forward (the compute stream
first waits on every copy still in flight, so a reused block or a backed-up slot is never
overwritten early, and a host row is never read before it was written); sample (every rank, where
the logits are: ``rank/sampler.py``; rank 0 reports the tokens); enqueue
the eager backups of the newest rows (rank 0; on the fast path while its launched step runs,
before its outputs are read back), then publish the step's host writes (rank 0: the
pool's next generation, named as the step's in the step ring, the step's IPC event recorded
on the copy stream after them; reported in ``StepReport.published``). On CUDA every copy runs
on the rank's copy stream, which first waits for the compute stream's work so far; nothing
blocks the host. Acks: every transfer id is
reported *enqueued* in the step that issued it and *completed* once its copy event has fired; on
CPU both in the same report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hisparse_ray.checks import check_int, check_number
from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.errors import ConfigError, StateError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.fastpath.executor import FastExecutor
from hisparse_ray.fastpath.step import spare_rows_for
from hisparse_ray.host.copies import CopyHandle, backup_rows, fill_rows, restore_pages, spill_pages
from hisparse_ray.host.pool import HostPool
from hisparse_ray.model.cache import IndexerKeyCache
from hisparse_ray.rank.rows import Launched, Row, name_rows
from hisparse_ray.rank.runtime import HiSparseCacheHandle, HiSparseRuntime
from hisparse_ray.rank.sampler import sample_rows
from hisparse_ray.types import (
    NO_BLOCK, Admission, RequestId, SamplingParams, StepCommand, StepReport, TransferKind,
)



# Launched and Row live in rank/rows.py, SamplingParams in types (the wire)
__all__ = ["HiSparseWorker", "Launched", "Row", "SamplingParams"]


class HiSparseWorker:
    """One rank's step executor. ``model`` is this rank's (possibly head-sharded) DSA model.

    batch_invariant: run every batch row as its own forward so that a request's logits do not
    depend on its batch mates (bit-exact comparisons across modes and schedules); False batches the
    forward (throughput).
    host_wait_s: how long a peer waits for rank 0 to publish the generation a command names
    (published before rank 0 reported the step that wrote it, so a wait means a broken protocol:
    ``HostPoolError``), or the step before the command when rank 0 wrote the host in it (rank 0
    publishes it at the end of its launch of that step: ``HostPoolError`` naming the step).
    kv_codec: the KV-cache dtype's row codec (:mod:`hisparse_ray.kernels.kvfp8`; default: rows in
    the model's dtype); ``layout`` must use its row bytes.
    fast: run batches through the fast decode step (:mod:`hisparse_ray.fastpath`): batched, paged
    GPU index keys, library kernels where they run, CUDA graphs; None = the reference path.
    hot_counts_every: on the reference path rank 0 accumulates each request's hot-buffer hits and
    misses on the device and reads them back (one sync) every this many steps and before it drops
    released requests, reporting them in ``StepReport.hits_by_request``; peers never read them
    (1: every step; the CPU's "device" is the host, so there a read costs nothing).

    ``handles`` maps the commands' request handles to request ids (defined and released by the
    commands); ``on_logits(rows, logits [B, V])``, when set, sees every forward's rows (``Row``)
    and logits (tests, tools)."""

    def __init__(
        self,
        model: Any,
        cfg: HiSparseConfig,
        layout: KVLayout,
        num_device_blocks: int,
        pool: HostPool,
        *,
        rank: int = 0,
        device: str | torch.device = "cpu",
        max_requests: int = 64,
        backend: str = "auto",
        batch_invariant: bool = True,
        host_wait_s: float = 60.0,
        kv_codec: Any = None,
        fast: FastPathConfig | None = None,
        hot_counts_every: int = 1,
    ) -> None:
        self.model, self.cfg, self.layout, self.pool, self.rank = model, cfg, layout, pool, rank
        self.device = torch.device(device)
        mcfg = model.cfg
        cfg.check_model(mcfg.index_topk, model=f"the {mcfg.kind} model")
        L = mcfg.num_hidden_layers
        if L != layout.num_layers:
            raise ConfigError("num_layers", layout.num_layers, f"must equal the model's {L} layers")
        host_layers = [self._host_view(l) for l in range(L)]
        self.runtime = HiSparseRuntime(
            cfg, layout, num_device_blocks, host_layers, device=self.device,
            max_requests=max_requests, anchor_of=[mcfg.anchor_of(l) for l in range(L)],
            backend=backend,
            spare_rows=0 if fast is None else spare_rows_for(num_device_blocks * layout.page_size))
        self.handle = HiSparseCacheHandle(self.runtime, mcfg.row_dim, model.dtype, kv_codec)
        self.fast = None if fast is None else FastExecutor(
            model, self.runtime, self.handle.codec, fast, block_threads=cfg.swap_in_block_size)
        # every bucket captured / compiled before the first request (FastPathConfig.warm_up)
        warmed = self.fast.warm_up() if fast is not None and fast.warms_up(self.device.type) else []
        self.index: dict[RequestId, IndexerKeyCache] = {}
        self.samplers: dict[RequestId, SamplingParams] = {}  # absent = greedy
        # copies in flight: (step that enqueued them, transfer ids, handle); a step's report
        # lists completions of its own and earlier steps only (a later launch may be enqueued)
        self._pending: list[tuple[int, tuple[int, ...], CopyHandle]] = []
        self._step = 0  # the command being launched
        self.batch_invariant = batch_invariant
        self.host_wait_s = check_number("host_wait_s", host_wait_s, lo=0, lo_open=True,
                                        why="seconds")
        self.handles: dict[int, RequestId] = {}
        self._host_seq = 0  # (peer) the host-pool generation this rank last waited for
        self._rank0_wrote = -1  # (peer) the last command's step if rank 0 wrote the host in it
        # every page copy of this rank runs here (CUDA), off the compute stream
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.hot_counts_every = check_int("hot_counts_every", hot_counts_every, lo=1)
        self._steps_uncounted = 0  # reference-path forwards since rank 0 last read the hot counts
        self.trace: Any = None  # TopkTraceRecorder-like: begin_step(step, rows), hook(layer, topk)
        self.on_logits: Any = None  # on_logits(rows, logits [B, V]) after each forward
        self.counters = {"steps": 0, "hot_hits": 0, "hot_misses": 0, "spills": 0, "restores": 0,
                         "backups": 0, "fast_steps": 0, "warm_up_steps": len(warmed)}
        # the last launched step with rows: (step, fast launch | host tokens), what a chained
        # row of the next command reads its input from; and the last finished one's host tokens
        self._last: tuple[int, Any] | None = None
        self._finished: tuple[int, list[int]] | None = None

    def _host_view(self, l: int) -> Tensor:
        """The host layer as the resolver reads it: the UVA alias on GPU, the mapping on CPU."""
        if self.device.type == "cuda":
            alias = self.pool.device_layer(l)
            if alias is not None:
                return alias
        return self.pool.layer(l)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    # -- admission-time state ------------------------------------------------------------------
    def set_sampling(self, rid: RequestId, params: SamplingParams) -> None:
        """How ``rid`` samples (every rank; before its first step). Greedy needs no call."""
        if params.greedy:
            self.samplers.pop(rid, None)
        else:
            self.samplers[rid] = params

    def forget(self, rid: RequestId) -> None:
        """Drop what a landing installed for ``rid`` (keys, sampler): it will never decode;
        nothing if none is installed."""
        self.index.pop(rid, None)
        self.samplers.pop(rid, None)
        if self.fast is not None:
            self.fast.release(rid)

    def install_index_keys(self, rid: RequestId, keys: Tensor | None, capacity: int) -> None:
        """Room for ``capacity`` positions of a request's indexer keys, holding the prefix's keys
        ``[L, T, d]`` if given (dense, device-resident, model-owned; paged in the GPU pool on the
        fast path). Replaces keys installed before for ``rid``."""
        if self.fast is not None:
            self.fast.release(rid)
            self.fast.install(rid, keys, capacity)
            return
        mcfg = self.model.cfg
        cache = IndexerKeyCache(mcfg.num_hidden_layers, mcfg.index_head_dim, max(capacity, 1),
                                dtype=self.model.dtype, device=self.device)
        if keys is not None and keys.shape[1]:
            cache.keys[:, : keys.shape[1]] = keys.to(self.device, self.model.dtype)
            cache.length = keys.shape[1]
        self.index[rid] = cache

    def has_index_keys(self, rid: RequestId) -> bool:
        return rid in (self.fast.keys.pages if self.fast is not None else self.index)

    def write_index_keys(self, rid: RequestId, lo: int, raw: Tensor) -> None:
        """A landing chunk's keys: ``raw [L, n, d * itemsize]`` uint8, the model dtype's bytes
        (the landing wire format), become positions ``lo..lo+n-1`` of an installed request (on
        the fast path encoded into the paged pool's key dtype)."""
        keys = raw.view(self.model.dtype)
        if self.fast is not None:
            self.fast.keys.write_positions(rid, lo, keys)
            return
        cache = self.index[rid]
        cache.keys[:, lo:lo + keys.shape[1]] = keys.to(cache.keys.device, cache.keys.dtype)

    def set_index_length(self, rid: RequestId, length: int) -> None:
        """The landing ended: positions ``0..length-1`` hold keys (the paged pool needs no
        length: each step masks at the row's ``seq_len``)."""
        if self.fast is None:
            self.index[rid].length = length

    def land_local(self, adm: Admission, kv_rows: Tensor) -> None:
        """In-process landing: write ``kv_rows [L, T, row_dim]`` of positions ``0..T-1`` into the
        admission's non-reused pages (device blocks on every rank, host blocks by rank 0)."""
        ps = self.layout.page_size
        data = self.handle.codec.encode(kv_rows)  # [L, T, row_bytes] uint8 (the KV-cache dtype)
        T = data.shape[1]
        wrote_host = False
        for page in adm.pages:
            lo, hi = page.page * ps, min(T, (page.page + 1) * ps)
            if page.reused or lo >= hi:
                continue
            if page.device_block != NO_BLOCK:
                base = page.device_block * ps
                for l, layer in enumerate(self.runtime.device_kv):
                    layer[base: base + hi - lo] = data[l, lo:hi].to(self.device)
            elif self.writer:
                wrote_host = True
                base = page.host_block * ps
                for l in range(self.layout.num_layers):
                    self.pool.layer(l)[base: base + hi - lo] = data[l, lo:hi].cpu()
        if wrote_host:
            self.pool.publish()

    # -- one step ------------------------------------------------------------------------------
    def execute(self, cmd: StepCommand) -> StepReport:
        """Run one command: :meth:`launch` then :meth:`finish`."""
        return self.finish(self.launch(cmd))

    def launch(self, cmd: StepCommand) -> Launched:
        """Everything of a command up to its outputs: on the fast path the step is enqueued and
        the host returns at once (step N + 1 may then be launched before step N is finished, the
        pipeline of ``EngineConfig.lookahead``); the reference path runs it to the end. Every
        launched step is finished, in launch order."""
        rt, names = self.runtime, self.handles
        self._step = cmd.step
        released: list[RequestId] = []
        for h in cmd.released:
            rid = names.pop(h, None)
            if rid is None:
                raise StateError(f"step {cmd.step} releases handle {h}, which names no request")
            released.append(rid)
        counts: dict[RequestId, tuple[int, int]] = {}
        if self.writer and any(rid in rt.requests for rid in released):
            self._take_hot_counts(counts)  # a released request's last counts go out first
        for rid in released:
            if rid in rt.requests:
                rt.remove(rid)
            self.index.pop(rid, None)
            self.samplers.pop(rid, None)
            if self.fast is not None:
                self.fast.release(rid)
        for d in cmd.handles:
            if d.handle in names:
                raise StateError(f"step {cmd.step} defines handle {d.handle} as {d.request_id!r}; "
                                 f"it still names {names[d.handle]!r}")
            names[d.handle] = d.request_id
        if not self.writer:
            self._order_after_rank_0(cmd)
        for diff in cmd.table_diffs:
            rt.apply_diff(self._name(cmd, diff.handle), diff.page, diff.host_block,
                          diff.device_block)
        enqueued: list[int] = []
        # Page copies take the one-launch UVA gather/scatter when the pool is registered (auto):
        # measured on the H200 at 4.6x (spill) / 2.8x (restore) the per-layer memcpy path.
        wrote = self._enqueue_transfers(cmd, enqueued)
        fast = self.fast is not None and self.trace is None and bool(cmd.batch)
        rows = self._rows(cmd, fast)
        forward: Any = ()
        if rows:
            for handle in (h for _, _, h in self._pending):
                handle.order_before()
            forward = self._forward(cmd, rows, enqueued)
            self._last = (cmd.step, forward)
            if not fast:
                self._steps_uncounted += 1
                if self.writer and self._steps_uncounted >= self.hot_counts_every:
                    self._take_hot_counts(counts)
        if cmd.backups and not fast:  # the fast path enqueued them while its step ran
            self._enqueue_backups(cmd, enqueued)
        if wrote or (cmd.backups and self.writer):
            # one generation per step, named as the step's in the pool's step ring, its IPC
            # event (slot by step) after every copy of the step: a peer's next command waits
            # on it (wait_step)
            self.pool.publish(self.copy_stream, step=cmd.step)
        return Launched(cmd, rows, enqueued, counts, fast, forward)

    def _order_after_rank_0(self, cmd: StepCommand) -> None:
        """(peer) Order this command's host reads after rank 0's writes. On the host: generation
        ``host_seq`` (rank 0's latest reported; a landing's writes are in host memory before its
        ``complete_landing`` returns, so they need no event). On the GPU: when rank 0 wrote the
        host in the command before (K: backups or spills, which every rank sees), step K by
        number (``HostPool.wait_step``: the step ring, then the current stream waits on step K's
        IPC event; the copy stream waits on the current stream before each batch of copies).
        Step K's event follows every copy rank 0 enqueued in K and before (one copy stream), and
        each writing step is waited for at the first command after it, so every host row rank 0
        wrote in an earlier command is covered. Never a slot chosen by generation: see
        docs/architecture.md "How the ranks are ordered"."""
        wrote, self._rank0_wrote = self._rank0_wrote, (
            cmd.step if cmd.backups or any(t.kind is TransferKind.SPILL for t in cmd.transfers)
            else -1)  # rank 0 publishes in this step (launch: wrote or backups)
        if cmd.host_seq > self._host_seq:
            self.pool.wait_published(cmd.host_seq, timeout_s=self.host_wait_s)
            self._host_seq = cmd.host_seq
        if wrote >= 0:
            g = self.pool.wait_step(wrote, timeout_s=self.host_wait_s)
            self._host_seq = max(self._host_seq, g)

    def finish(self, step: Launched) -> StepReport:
        """Wait for a launched step's outputs and report it (rank 0: its sampled tokens)."""
        cmd, rows, counts, fast = step.cmd, step.rows, step.counts, step.fast
        sampled: tuple = ()
        if rows:
            if fast:
                sampled, fast_counts = self._collect_fast(rows, step.forward)
                for rid, h, m in fast_counts:  # the fast step reads its own (with its tokens)
                    counts[rid] = (h, m)
            else:
                sampled = step.forward if self.writer else ()
            if self.writer:
                self._finished = (cmd.step, [t for _, t in sampled])
        per_request = [(rid, h, m) for rid, (h, m) in counts.items()]
        hits = sum(h for _, h, _ in per_request)
        misses = sum(m for _, _, m in per_request)
        self.counters["steps"] += 1
        self.counters["fast_steps"] += fast
        self.counters["hot_hits"] += hits
        self.counters["hot_misses"] += misses
        return StepReport(
            cmd.step, self.rank, enqueued=tuple(step.enqueued),
            completed=self._take_completed(wait=not rows, upto=cmd.step),
            sampled=sampled if self.writer else (), hot_hits=hits, hot_misses=misses,
            hits_by_request=tuple(per_request) if self.writer else (),
            published=self.pool.published() if self.writer else 0)

    def _rows(self, cmd: StepCommand, fast: bool) -> list[Row]:
        return name_rows(cmd, self._name, self._last, fast=fast,
                         tokens_of=None if self.fast is None else self.fast.tokens_of)

    def wait(self, step: Launched) -> None:
        """Block until a launched step's outputs reached the host (touches no executor state:
        a pipelined rank waits here outside its lock, then calls :meth:`finish`)."""
        if step.fast and step.forward is not None and step.forward.ready is not None:
            step.forward.ready.synchronize()

    def _name(self, cmd: StepCommand, handle: int) -> RequestId:
        rid = self.handles.get(handle)
        if rid is None:
            raise StateError(f"step {cmd.step} names handle {handle}, which no command defined")
        return rid

    def _take_hot_counts(self, into: dict[RequestId, tuple[int, int]]) -> None:
        """(rank 0) Add the hot counts accumulated on the device since the last read to ``into``."""
        for rid, (h, m) in self.runtime.take_hot_counts().items():
            h0, m0 = into.get(rid, (0, 0))
            into[rid] = (h0 + h, m0 + m)
        self._steps_uncounted = 0

    def _enqueue_backups(self, cmd: StepCommand, enqueued: list[int]) -> None:
        """The newest rows of host-tier requests, device -> host on the copy stream (after the
        forward that wrote them: the copy stream waits for the compute stream's work so far);
        ``execute`` publishes them with the step's other host writes."""
        ids = tuple(b.transfer_id for b in cmd.backups)
        if self.writer:
            row = self.fast.device_row if self.fast is not None else self.runtime.device_row
            src = [row(self._name(cmd, b.handle), b.position) for b in cmd.backups]
            dst = [b.host_block * self.layout.page_size + b.offset for b in cmd.backups]
            handle = backup_rows(self.runtime.device_kv, self.pool, src, dst, self.copy_stream)
            self._pending.append((self._step, ids, handle))
        else:
            self._pending.append((self._step, ids, CopyHandle()))
        enqueued.extend(ids)
        self.counters["backups"] += len(ids)

    def _enqueue_transfers(self, cmd: StepCommand, enqueued: list[int]) -> bool:
        """Enqueue the command's page transfers; True when rank 0 wrote the host pool."""
        spills = [t for t in cmd.transfers if t.kind is TransferKind.SPILL]
        restores = [t for t in cmd.transfers if t.kind is TransferKind.RESTORE]
        if spills:
            ids = tuple(t.transfer_id for t in spills)
            if self.writer:
                handle = spill_pages(self.runtime.device_kv, self.pool,
                                     [(t.device_block, t.host_block) for t in spills],
                                     self.copy_stream, use_uva=None)
            else:
                handle = CopyHandle()
            self._pending.append((self._step, ids, handle))
            enqueued.extend(ids)
            self.counters["spills"] += len(ids)
        if restores:
            ids = tuple(t.transfer_id for t in restores)
            handle = restore_pages(self.runtime.device_kv, self.pool,
                                   [(t.device_block, t.host_block) for t in restores],
                                   self.copy_stream, use_uva=None)
            self._pending.append((self._step, ids, handle))
            enqueued.extend(ids)
            self.counters["restores"] += len(ids)
        return bool(spills) and self.writer

    def _take_completed(self, wait: bool, upto: float = float("inf")) -> tuple[int, ...]:
        """Transfer ids of the copies enqueued by steps ``<= upto`` that completed (``wait``:
        wait for each of them first); they leave the pending list."""
        done: list[int] = []
        still = []
        for entry in self._pending:
            step, ids, handle = entry
            if step <= upto:
                if wait:
                    handle.wait()
                if handle.done():
                    done.extend(ids)
                    continue
            still.append(entry)
        self._pending = still
        return tuple(done)

    def _index_cache(self, rid: RequestId, seq_len: int) -> IndexerKeyCache:
        cache = self.index.get(rid)
        if cache is None:
            raise StateError(f"request {rid!r} has no indexer keys installed")
        if cache.keys.shape[1] < seq_len:
            grown = IndexerKeyCache(cache.keys.shape[0], cache.keys.shape[2], 2 * seq_len,
                                    dtype=cache.keys.dtype, device=self.device)
            grown.keys[:, : cache.length] = cache.keys[:, : cache.length]
            grown.length = cache.length
            self.index[rid] = cache = grown
        return cache

    def _forward(self, cmd: StepCommand, batch: list[Row], enqueued: list[int]):
        rt, H = self.runtime, self.cfg.device_buffer_size
        for row in batch:
            if (row.hot_blocks is not None and rt.set_hot_blocks(row.request_id, row.hot_blocks)
                    and row.hot_blocks):
                n = row.seq_len
                if 1 < n <= H:  # short path: slot p holds position p; fill it from host
                    slots = rt.slot_rows_of(row.request_id)
                    fill_rows(rt.device_kv, self.pool,
                              [rt.host_row(row.request_id, p) for p in range(n - 1)],
                              slots[: n - 1], self.copy_stream).order_before()
        if self.fast is not None and self.trace is None:
            return self._launch_fast(cmd, batch, enqueued)
        # Batch-invariant mode runs each row as its own batch of one: matmul results depend on the
        # batch shape (measured: torch CPU linear differs bitwise between M=1 and M=5), so only
        # this makes a request's logits independent of what else the scheduler batched with it.
        groups = [(r,) for r in batch] if self.batch_invariant else [batch]
        parts: list[Tensor] = []
        for rows in groups:
            caches = [self._index_cache(r.request_id, r.seq_len) for r in rows]
            rt.begin_step(rows)
            if self.trace is not None:
                self.trace.begin_step(cmd.step, rows)
            ids = torch.tensor([r.input_token for r in rows], dtype=torch.int64, device=self.device)
            pos = torch.tensor([r.seq_len - 1 for r in rows], dtype=torch.int64, device=self.device)
            hook = self.trace.hook if self.trace is not None else None
            parts.append(self.model.decode(ids, pos, self.handle, caches, topk_hook=hook))
            if self.writer:  # on the device; read every hot_counts_every steps (execute)
                rt.accumulate_hot_counts()
        logits = torch.cat(parts)
        if self.on_logits is not None:
            self.on_logits(batch, logits)
        # every rank samples: a peer's tokens feed its chained rows of the next step (its logits
        # are rank 0's: the same all-reduced hidden state through the same replicated head, and
        # the same counter-based draws); rank 0 reports them
        toks = sample_rows(logits.detach(), [self.samplers.get(r.request_id) for r in batch],
                           [r.seq_len - 1 for r in batch]).tolist()
        return tuple((r.request_id, t) for r, t in zip(batch, toks))

    def _launch_fast(self, cmd: StepCommand, batch: list[Row], enqueued: list[int]):
        """Enqueue the batch as one fast step. The step's backups are enqueued while the GPU runs
        (the copy stream waits for the launched step, which writes the rows they copy)."""
        launched = self.fast.launch(batch, keep_logits=self.on_logits is not None,
                                    sampling=[self.samplers.get(r.request_id) for r in batch])
        if cmd.backups:
            self._enqueue_backups(cmd, enqueued)
        return launched

    def _collect_fast(self, batch: list[Row], launched: Any):
        """A launched fast step's outputs: its tokens (sampled on the device) and counts."""
        toks, hits, misses, logits = self.fast.collect(launched)
        if self.on_logits is not None:
            fin = self._finished
            batch = [r if r.from_row < 0 or r.input_token >= 0 or fin is None
                     else r._replace(input_token=fin[1][r.from_row]) for r in batch]
            self.on_logits(batch, logits)
        per_request = [(r.request_id, h, m) for r, h, m in zip(batch, hits, misses)]
        if not self.writer:
            return (), per_request
        return tuple((r.request_id, t) for r, t in zip(batch, toks)), per_request

    def close(self) -> None:
        self._take_completed(wait=True)
