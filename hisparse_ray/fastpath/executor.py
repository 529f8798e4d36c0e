"""Glue between a rank's step executor (``HiSparseWorker``) and the fast decode step (ring 2): the
paged index keys of its requests, the host work that turns a step's batch rows into the static
inputs, and reading the step's outputs back.

Host work per step is O(1) per row plus a table copy for rows whose request or tables changed
(:class:`~hisparse_ray.fastpath.inputs.StepInputs`); the only device -> host read is the sampled
tokens and hit counts (one sync, from a pinned copy made behind the step at launch), plus the
logits when a logits observer is set.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from hisparse_ray.errors import CapacityError, StateError
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig
from hisparse_ray.fastpath.index_keys import PagedIndexKeys
from hisparse_ray.fastpath.inputs import RowInput, RowTables
from hisparse_ray.fastpath.step import FastDecodeStep, index_pages_for
from hisparse_ray.kernels.kvfp8 import KVRowCodec
from hisparse_ray.rank.sampler import sample_rows

log = logging.getLogger(__name__)


def index_key_kind(value: str, model_dtype: torch.dtype) -> str:
    """``index_key_dtype`` -> storage kind ("auto" = the model's dtype)."""
    if value != "auto":
        return value
    return "bf16" if model_dtype == torch.bfloat16 else "fp32"


@dataclass(eq=False)
class FastLaunch:
    """One launched fast step: its outputs copied (tokens, hits, misses) to a pinned host buffer
    behind the step on the stream, so that the next step may be launched before this one is read
    (it overwrites the step's static outputs); ``logits`` is a copy when asked for, else None."""

    B: int
    out: Tensor  # [3, B] int64: host (pinned on CUDA), valid once ``ready`` fired
    ready: Any  # torch.cuda.Event | None (CPU: already valid)
    logits: Tensor | None
    values: list[list[int]] | None = None  # ``out`` as lists, once read

    def read(self) -> list[list[int]]:
        if self.values is None:
            if self.ready is not None:
                self.ready.synchronize()
            self.values = self.out.tolist()
        return self.values


class FastExecutor:
    """The fast path of one rank: owns the :class:`PagedIndexKeys` and the :class:`FastDecodeStep`.

    Lifecycle per request: :meth:`install` (admission: its prefill keys, ``capacity`` positions
    <= ``max_context``) -> :meth:`forward` of the steps it is batched in -> :meth:`release`.
    """

    def __init__(self, model, runtime, codec: KVRowCodec, cfg: FastPathConfig, *,
                 block_threads: int) -> None:
        m = model.cfg
        if cfg.max_batch < 1:
            raise CapacityError("fast path batch", 1, cfg.max_batch)
        self.model, self.rt, self.cfg = model, runtime, cfg
        kind = index_key_kind(cfg.index_key_dtype, model.dtype)
        pages, cap = index_pages_for(cfg)
        self.keys = PagedIndexKeys(m.indexer_layers, m.index_head_dim, kind, pages, runtime.device,
                                   max_pages=cap)
        self.step = FastDecodeStep(model, runtime, self.keys, codec, cfg, block_threads=block_threads)
        self._tables: dict[object, RowTables] = {}
        cuda = runtime.device.type == "cuda"
        # two output slots: step N + 1 is launched before step N is read (EngineConfig.lookahead)
        self._outs = [torch.zeros(3 * cfg.max_batch, dtype=torch.int64, pin_memory=cuda)
                      for _ in range(2)]
        self._dev_out = (torch.zeros(3 * cfg.max_batch, dtype=torch.int64, device=runtime.device)
                         if cuda else None)
        self._out_users: list[FastLaunch | None] = [None, None]
        self._launches = 0

    # -- requests ---------------------------------------------------------------------------------
    def install(self, rid, keys: Tensor | None, capacity: int) -> None:
        if capacity > self.cfg.max_context:
            raise CapacityError(f"positions of request {rid!r} (fast path max_context)", capacity,
                                self.cfg.max_context)
        self.keys.install(rid, keys, capacity)

    def release(self, rid) -> None:
        if rid in self.keys.pages:
            self.keys.free(rid)
        self._tables.pop(rid, None)

    # -- host work ----------------------------------------------------------------------------------
    def _tables_of(self, rid) -> RowTables:
        st = self.rt.requests[rid]
        t = self._tables.get(rid)
        if t is not None and t.key[1] == st.version:
            return t
        H, ps = self.rt.H, self.rt.page
        if st.hot_blocks:
            s = np.arange(H + 1)
            slots = (np.asarray(st.hot_blocks, dtype=np.int64)[s // ps] * ps + s % ps).astype(np.int32)
        else:
            slots = np.full(H + 1, -1, dtype=np.int32)
        t = RowTables((rid, st.version), slots, np.asarray(st.device_table, dtype=np.int32),
                      np.asarray(st.host_table, dtype=np.int32), self.keys.pages[rid])
        self._tables[rid] = t
        return t

    def device_row(self, rid, position: int) -> int:
        """The row the newest ``position`` of a request was written to (``HiSparseRuntime.device_row``
        in O(1) from the cached tables: the runtime's version builds the H + 1 slot rows)."""
        t = self._tables_of(rid)
        page, off = divmod(position, self.rt.page)
        if page < t.resident.shape[0] and t.resident[page] >= 0:
            return int(t.resident[page]) * self.rt.page + off
        row = int(t.slot_rows[self.rt.H if position + 1 > self.rt.H else position])
        if row < 0:
            raise StateError(f"request {rid!r} has neither a resident page nor a hot buffer for {position}")
        return row

    def row_input(self, row: Any) -> RowInput:
        """``row`` names ``request_id``, ``seq_len``, ``input_token`` and ``from_row`` (the rank
        executor's ``Row``: a command's ``BatchRow`` with its handle resolved). ``from_row >= 0``
        with ``input_token < 0``: the input is the token row ``from_row`` of the previous launch
        sampled, read by the step on the device."""
        rid, n = row.request_id, row.seq_len
        if rid not in self.keys.pages:
            raise StateError(f"request {rid!r} has no index keys installed on the fast path")
        t = self._tables_of(rid)
        p = n - 1
        write = self.device_row(rid, p)
        ip = p // INDEX_PAGE
        if ip >= t.index_table.shape[0]:
            raise CapacityError(f"index key positions of {rid!r}", n, t.index_table.shape[0] * INDEX_PAGE)
        iwrite = int(t.index_table[ip]) * INDEX_PAGE + p % INDEX_PAGE
        src = row.from_row if row.input_token < 0 else -1
        return RowInput(max(row.input_token, 0), n, self.rt.requests[rid].state_row, write, iwrite,
                        t, src)

    def warm_up(self) -> list[tuple[int, float]]:
        """One step of inert padding rows per bucket, ascending, waited for: captures each
        bucket's CUDA graph and compiles every kernel the step uses before a request arrives
        (:attr:`FastPathConfig.warm_up`). Padding rows read nothing of any request and write
        only the sink rows, so every result after it is what it would have been without. On a
        TP replica every rank must call it (the step's all-reduces pair up). Returns
        ``(bucket, seconds)`` per bucket; each is logged."""
        done = []
        for i, bucket in enumerate(self.cfg.buckets):
            t0 = time.perf_counter()
            self._run([], bucket)
            if self.rt.device.type == "cuda":
                torch.cuda.synchronize(self.rt.device)
            done.append((bucket, time.perf_counter() - t0))
            log.info("fast step: bucket %d ready in %.1f s (%d of %d)%s", bucket, done[-1][1],
                     i + 1, len(self.cfg.buckets), "" if self.step.use_graphs else ", eager")
        return done

    # -- one step -----------------------------------------------------------------------------------
    def _run(self, rows: list[RowInput], bucket: int) -> None:
        """Fill the step's inputs with ``rows`` (padding up to ``bucket``) and enqueue it."""
        self.step.inputs.set_sink("index_write", self.keys.sink_row)  # moves when the pool grows
        self.step.inputs.fill(rows, bucket)
        self.step.run(bucket)

    def launch(self, batch: Sequence[Any], keep_logits: bool = False,
               sampling: Sequence[Any] | None = None) -> FastLaunch:
        """Fill the inputs and enqueue one step and the copy of its outputs (no sync); read it
        with :meth:`collect`. ``batch``: rows as :meth:`row_input` takes them. At most two
        launches are unread at a time (the one before the previous must have been read).
        keep_logits: keep a copy of the logits for :meth:`collect` (else it returns the step's
        static logits, valid only until the next launch). sampling: each row's
        ``SamplingParams`` (None: greedy); rows with a temperature are drawn on the device
        (:func:`~hisparse_ray.rank.sampler.sample`, counter = the row's position) into the
        step's tokens, where the next step's chained rows read them."""
        B = len(batch)
        bucket = self.cfg.bucket(B)
        slot = self._launches % 2
        prior = self._out_users[slot]
        if prior is not None and prior.values is None:
            raise StateError("a third fast step launched before the first of them was read")
        self._run([self.row_input(r) for r in batch], bucket)
        st = self.step
        if sampling is not None and any(p is not None and not p.greedy for p in sampling):
            sample_rows(st.logits[:B], sampling, [r.seq_len - 1 for r in batch], into=st.tokens[:B])
        out = self._outs[slot][: 3 * B].view(3, B)
        ready = None
        if self._dev_out is not None:  # one kernel and one copy behind the step
            dev = self._dev_out[: 3 * B].view(3, B)
            torch.stack([st.tokens[:B], st.hits[:B], st.misses[:B]], out=dev)
            out.copy_(dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            torch.stack([st.tokens[:B], st.hits[:B], st.misses[:B]], out=out)
        logits = st.logits[:B].clone() if keep_logits else None
        launched = FastLaunch(B, out, ready, logits)
        self._out_users[slot] = launched
        self._launches += 1
        return launched

    def tokens_of(self, launched: FastLaunch) -> list[int]:
        """A launch's sampled tokens (waits for it)."""
        return launched.read()[0]

    def collect(self, launched: FastLaunch) -> tuple[list[int], list[int], list[int], Tensor]:
        """Wait for a launched step -> ``(sampled tokens, hot hits, hot misses)`` per row and its
        logits ``[B, V]`` fp32 (the kept copy, else a view of the step's static output: valid
        until the next launch)."""
        out = launched.read()
        logits = launched.logits if launched.logits is not None else self.step.logits[:launched.B]
        return out[0], out[1], out[2], logits

    def forward(self, batch: Sequence[Any]) -> tuple[list[int], list[int], list[int], Tensor]:
        """:meth:`launch` then :meth:`collect`."""
        return self.collect(self.launch(batch))
