"""Glue between a rank's step executor (``HiSparseWorker``) and the fast decode step (ring 2): the
paged index keys of its requests, the host work that turns a step's batch rows into the static
inputs, and reading the step's outputs back.

Host work per step is O(1) per row plus a table copy for rows whose request or tables changed
(:class:`~hisparse_ray.fastpath.inputs.StepInputs`); the only device -> host read is the sampled
tokens and hit counts (one sync), plus the logits when a row samples with a temperature or a
logits observer is set.
"""

from __future__ import annotations

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


def index_key_kind(value: str, model_dtype: torch.dtype) -> str:
    """``index_key_dtype`` -> storage kind ("auto" = the model's dtype)."""
    if value != "auto":
        return value
    return "bf16" if model_dtype == torch.bfloat16 else "fp32"


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
        """``row`` names ``request_id``, ``seq_len`` and ``input_token`` (the rank executor's
        ``Row``: a command's ``BatchRow`` with its handle resolved)."""
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
        return RowInput(row.input_token, n, self.rt.requests[rid].state_row, write, iwrite, t)

    # -- one step -----------------------------------------------------------------------------------
    def launch(self, batch: Sequence[Any]) -> int:
        """Fill the inputs and enqueue one step (no sync); returns B for :meth:`collect`. ``batch``:
        rows as :meth:`row_input` takes them."""
        B = len(batch)
        bucket = self.cfg.bucket(B)
        rows = [self.row_input(r) for r in batch]
        self.step.inputs.set_sink("index_write", self.keys.sink_row)  # moves when the pool grows
        self.step.inputs.fill(rows, bucket)
        self.step.run(bucket)
        return B

    def collect(self, B: int) -> tuple[list[int], list[int], list[int], Tensor]:
        """Wait for the launched step -> ``(greedy tokens, hot hits, hot misses)`` per row and the
        device logits ``[B, V]`` fp32 (a view of the step's static output: copy it before the
        next step)."""
        out = torch.stack([self.step.tokens[:B], self.step.hits[:B], self.step.misses[:B]]).tolist()
        return out[0], out[1], out[2], self.step.logits[:B]

    def forward(self, batch: Sequence[Any]) -> tuple[list[int], list[int], list[int], Tensor]:
        """:meth:`launch` then :meth:`collect`."""
        return self.collect(self.launch(batch))
