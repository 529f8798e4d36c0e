"""Per-cache HiSparse runtime and the attention-facing cache handle (ring 2, adapters).

``HiSparseRuntime`` owns one rank's device KV (per-layer views of the device pool), the per-request
GPU replacement state (``slot_pos`` / ``lru`` tables of every anchor layer) and the block tables it
builds from the coordinator's diffs; each step it builds the resolver's batch tensors once and runs
the resolver per layer. ``HiSparseCacheHandle`` is what attention calls
(:class:`hisparse_ray.model.cache.AttentionKVCache`): ``write_newest`` writes the step's new rows to
their write rows, ``gather`` resolves the top-k and returns the rows.

Request lifecycle inside the runtime: ``add`` (state row taken, tables empty) -> ``apply_diff`` per page
-> ``set_hot_blocks`` (host tier: slot state reset, slot rows derived) -> steps -> ``remove``.
Index sharing: a skip layer shares its anchor's slot state and resolved rows; the anchor's miss plan
is replayed into the skip layer's own views (bit-identical to resolving it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hisparse_ray import kernels
from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.errors import CapacityError, DuplicateRequestError, StateError, UnknownRequestError
from hisparse_ray.kernels.kvfp8 import KVRowCodec, resolve_kv_dtype
from hisparse_ray.types import NO_BLOCK, RequestId


@dataclass
class _RequestState:
    state_row: int
    host_table: list[int] = field(default_factory=list)
    device_table: list[int] = field(default_factory=list)
    hot_blocks: tuple[int, ...] = ()
    version: int = 0  # bumped on every table or hot-buffer change (the fast path's staging cache)

    def set_page(self, page: int, host_block: int, device_block: int) -> None:
        self.version += 1
        for table in (self.host_table, self.device_table):
            if len(table) <= page:
                table.extend([NO_BLOCK] * (page + 1 - len(table)))
        self.host_table[page] = host_block
        self.device_table[page] = device_block


class HiSparseRuntime:
    """One rank's device KV, block tables and GPU LRU state; runs the resolver.

    device_kv[l]: [num_device_blocks * page_size, row_bytes] uint8 on ``device``.
    host_layers[l]: [num_host_blocks * page_size, row_bytes] uint8 (pinned / shared host pool view).
    anchor_of[l]: the layer whose top-k layer ``l`` reuses (``anchor_of[l] == l`` for an indexer layer).
    spare_rows: extra device rows per layer after the pool's blocks, owned by no block (the fast
        decode step writes padded batch rows there and views a layer as whole 64-row pages).
    """

    def __init__(
        self,
        cfg: HiSparseConfig,
        layout: KVLayout,
        num_device_blocks: int,
        host_layers: list[Tensor],
        *,
        device: torch.device | str = "cpu",
        max_requests: int = 64,
        anchor_of: list[int] | None = None,
        backend: str = "auto",
        spare_rows: int = 0,
    ) -> None:
        if len(host_layers) != layout.num_layers:
            raise StateError(f"host pool has {len(host_layers)} layers, layout {layout.num_layers}")
        self.cfg, self.layout, self.device = cfg, layout, torch.device(device)
        self.page = layout.page_size
        self.H = cfg.device_buffer_size
        self.backend = backend
        rows = num_device_blocks * self.page + spare_rows
        self.device_kv = [
            torch.zeros(rows, layout.bytes_per_token_layer, dtype=torch.uint8, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self.host_layers = host_layers
        self.anchor_of = list(anchor_of) if anchor_of is not None else list(range(layout.num_layers))
        anchors = sorted(set(self.anchor_of))
        self.slot_pos = {a: torch.full((max_requests, self.H), -1, dtype=torch.int32, device=self.device)
                         for a in anchors}
        self.lru = {a: self._identity_lru(max_requests) for a in anchors}
        self._free_state_rows = list(range(max_requests - 1, -1, -1))
        self.requests: dict[RequestId, _RequestState] = {}
        self._step: _StepTensors | None = None
        self._anchor_rows: dict[int, Tensor] = {}
        self._anchor_plan: dict[int, Tensor] = {}
        # per state row: (hits, misses) not yet taken (accumulate_hot_counts / take_hot_counts)
        self._hot_totals = torch.zeros(max_requests, 2, dtype=torch.int64, device=self.device)

    def _identity_lru(self, n: int) -> Tensor:
        return torch.arange(self.H, dtype=torch.int32, device=self.device).repeat(n, 1).contiguous()

    # --- request bookkeeping (from step commands) ---------------------------------------------
    def add(self, rid: RequestId) -> None:
        if rid in self.requests:
            raise DuplicateRequestError(rid)
        if not self._free_state_rows:
            raise CapacityError("runtime request state rows", len(self.requests) + 1, len(self.requests))
        self.requests[rid] = _RequestState(self._free_state_rows.pop())

    def remove(self, rid: RequestId) -> None:
        st = self.requests.pop(rid, None)
        if st is None:
            raise UnknownRequestError(rid)
        self._reset_state(st.state_row)
        self._hot_totals[st.state_row].zero_()  # the row's next request starts from 0
        self._free_state_rows.append(st.state_row)

    def apply_diff(self, rid: RequestId, page: int, host_block: int, device_block: int) -> None:
        """Set one page of ``rid``'s block tables (a ``TableDiff``; the first one adds it)."""
        if rid not in self.requests:
            self.add(rid)
        self.requests[rid].set_page(page, host_block, device_block)

    def set_hot_blocks(self, rid: RequestId, hot_blocks: tuple[int, ...]) -> bool:
        """Bind the request's hot buffer; a new buffer starts with empty slots. Returns True when the
        buffer changed (the caller then fills short-sequence slots)."""
        st = self.requests[rid]
        hot_blocks = tuple(hot_blocks)
        if hot_blocks == st.hot_blocks:
            return False
        need = -(-(self.H + 1) // self.page)
        if hot_blocks and len(hot_blocks) < need:
            raise StateError(f"hot buffer of {rid!r} has {len(hot_blocks)} blocks, needs {need}")
        st.hot_blocks = hot_blocks
        st.version += 1
        self._reset_state(st.state_row)
        return True

    def _reset_state(self, row: int) -> None:
        for a in self.slot_pos:
            self.slot_pos[a][row].fill_(-1)
            self.lru[a][row].copy_(torch.arange(self.H, dtype=torch.int32, device=self.device))

    def slot_rows_of(self, rid: RequestId) -> list[int]:
        """Device row of each of the H + 1 slots (-1 without a hot buffer)."""
        st = self.requests[rid]
        if not st.hot_blocks:
            return [-1] * (self.H + 1)
        p = self.page
        return [st.hot_blocks[s // p] * p + s % p for s in range(self.H + 1)]

    def device_row(self, rid: RequestId, position: int) -> int:
        """The row the forward writes ``position`` to when it is the newest (the write row)."""
        st = self.requests[rid]
        page, off = divmod(position, self.page)
        if page < len(st.device_table) and st.device_table[page] != NO_BLOCK:
            return st.device_table[page] * self.page + off
        slots = self.slot_rows_of(rid)
        n = position + 1
        row = slots[self.H] if n > self.H else slots[position]
        if row < 0:
            raise StateError(f"request {rid!r} has neither a resident page nor a hot buffer for {position}")
        return row

    def host_row(self, rid: RequestId, position: int) -> int:
        st = self.requests[rid]
        page, off = divmod(position, self.page)
        if page >= len(st.host_table) or st.host_table[page] == NO_BLOCK:
            raise StateError(f"request {rid!r} has no host block for position {position}")
        return st.host_table[page] * self.page + off

    # --- per step --------------------------------------------------------------------------------
    def begin_step(self, batch) -> Tensor:
        """Build the resolver's batch tensors for this step (``batch``: rows with ``request_id``
        and ``seq_len``, the executor's ``Row``s); returns the write rows ``[B]`` int64."""
        for row in batch:
            if row.request_id not in self.requests:
                raise UnknownRequestError(row.request_id)
        B = len(batch)
        states = [self.requests[r.request_id] for r in batch]
        P = max([len(s.host_table) for s in states] + [1])

        def table(which: str) -> Tensor:
            t = torch.full((B, P), NO_BLOCK, dtype=torch.int32)
            for b, s in enumerate(states):
                vals = getattr(s, which)
                if vals:
                    t[b, : len(vals)] = torch.tensor(vals, dtype=torch.int32)
            return t.to(self.device)

        self._step = _StepTensors(
            seq_lens=torch.tensor([r.seq_len for r in batch], dtype=torch.int32, device=self.device),
            state_idx=torch.tensor([s.state_row for s in states], dtype=torch.int32, device=self.device),
            slot_rows=torch.tensor([self.slot_rows_of(r.request_id) for r in batch],
                                   dtype=torch.int32, device=self.device).reshape(B, self.H + 1),
            resident_table=table("device_table"),
            host_table=table("host_table"),
        )
        self._anchor_rows.clear()
        self._anchor_plan.clear()
        write = [self.device_row(r.request_id, r.seq_len - 1) for r in batch]
        self._step.write_rows = torch.tensor(write, dtype=torch.int64, device=self.device)
        return self._step.write_rows

    def resolve(self, layer: int, topk: Tensor) -> Tensor:
        """Top-k positions ``[B, K]`` -> device rows ``[B, K]`` int64 (-1 for padding) of ``layer``."""
        st = self._step
        if st is None:
            raise StateError("resolve() before begin_step()")
        anchor = self.anchor_of[layer]
        if anchor != layer:
            rows, plan = self._anchor_rows.get(anchor), self._anchor_plan.get(anchor)
            if rows is None:
                raise StateError(f"layer {layer} shares layer {anchor}'s top-k, resolved out of order")
            kernels.replay(plan=plan, host_kv=self.host_layers[layer], device_kv=self.device_kv[layer],
                           backend=self.backend)
            return rows
        B, K = topk.shape
        out = torch.empty(B, K, dtype=torch.int32, device=self.device)
        plan = torch.empty(B, K, 2, dtype=torch.int32, device=self.device)
        kernels.resolve(
            top_k=topk.to(device=self.device, dtype=torch.int32).contiguous(),
            seq_lens=st.seq_lens,
            state_idx=st.state_idx,
            slot_pos=self.slot_pos[layer],
            lru=self.lru[layer],
            slot_rows=st.slot_rows,
            resident_table=st.resident_table,
            host_table=st.host_table,
            host_kv=self.host_layers[layer],
            device_kv=self.device_kv[layer],
            page_size=self.page,
            out_rows=out,
            plan=plan,
            block_threads=self.cfg.swap_in_block_size,
            backend=self.backend,
        )
        rows = out.to(torch.int64)
        self._anchor_rows[layer], self._anchor_plan[layer] = rows, plan
        return rows

    def hot_counts(self) -> tuple[list[int], list[int]]:
        """Per batch row, this step's hot-buffer (hits, misses) summed over anchor layers: positions
        served by a hot slot that already held them, and positions copied in from host. Reads back
        to the host (one GPU -> CPU sync): for tests and tools; the executor accumulates
        ``hot_count_tensor`` on the device instead and reads it every few steps."""
        counts = self.hot_count_tensor()
        if counts is None:
            return [], []
        hits, misses = counts.t().tolist()
        return hits, misses

    def hot_count_tensor(self) -> Tensor | None:
        """This step's ``[B, 2]`` int64 (hits, misses) per batch row, on the device (no sync);
        None before the first step. Computed for the whole batch and every anchor layer at once."""
        st = self._step
        if st is None:
            return None
        B = st.slot_rows.shape[0]
        if not self._anchor_rows or B == 0:
            return torch.zeros(B, 2, dtype=torch.int64, device=st.slot_rows.device)
        # hot[b, r]: device row r is one of row b's hot slots; then one gather answers "was this
        # resolved row served from b's hot buffer" for every anchor layer, row and top-k entry
        slots = st.slot_rows[:, : self.H].to(torch.int64)
        R = self.device_kv[0].shape[0]  # device rows; column R collects empty (-1) slots
        hot = torch.zeros(B, R + 1, dtype=torch.bool, device=slots.device)
        hot.scatter_(1, torch.where(slots >= 0, slots, R), torch.ones_like(slots, dtype=torch.bool))
        rows = torch.stack(list(self._anchor_rows.values()))  # [A, B, K]
        in_hot = hot.unsqueeze(0).expand(rows.shape[0], -1, -1).gather(2, rows.clamp(min=0))
        served = (in_hot & (rows >= 0)).sum(dim=(0, 2))
        plan_rows = torch.stack([p[..., 0] for p in self._anchor_plan.values()])  # [A, B, K]
        miss = (plan_rows >= 0).sum(dim=(0, 2))
        # short sequences resolve without the LRU: neither hits nor misses
        counted = (st.seq_lens > self.H).to(torch.int64)
        return torch.stack(((served - miss) * counted, miss * counted), dim=1)

    def accumulate_hot_counts(self) -> None:
        """Add this step's (hits, misses) to each request's device-side totals (no host sync;
        ``take_hot_counts`` reads them)."""
        counts = self.hot_count_tensor()
        if counts is not None and counts.shape[0]:
            self._hot_totals.index_add_(0, self._step.state_idx.to(torch.int64), counts)

    def take_hot_counts(self) -> dict[RequestId, tuple[int, int]]:
        """(hits, misses) accumulated per live request since the last take, then zeroed: one GPU
        -> CPU read for every request at once. Requests without any are left out."""
        totals = self._hot_totals.tolist()
        out = {}
        for rid, st in self.requests.items():
            hits, misses = totals[st.state_row]
            if hits or misses:
                out[rid] = (hits, misses)
        self._hot_totals.zero_()
        return out


def hot_counts_reference(step, anchor_rows: dict[int, Tensor], anchor_plan: dict[int, Tensor],
                         H: int) -> tuple[list[int], list[int]]:
    """The definition of ``HiSparseRuntime.hot_counts``, row by row (two GPU -> CPU reads per
    anchor layer and row, one per anchor layer): the reference its batched form is tested and
    benchmarked against."""
    B = step.slot_rows.shape[0]
    hits, misses = [0] * B, [0] * B
    for layer, rows in anchor_rows.items():
        miss = (anchor_plan[layer][:, :, 0] >= 0).sum(dim=1).tolist()
        for b in range(B):
            in_hot = torch.isin(rows[b], step.slot_rows[b, :H].to(rows.dtype)) & (rows[b] >= 0)
            if int(step.seq_lens[b]) > H:
                hits[b] += int(in_hot.sum()) - miss[b]
                misses[b] += miss[b]
    return hits, misses


@dataclass
class _StepTensors:
    seq_lens: Tensor
    state_idx: Tensor
    slot_rows: Tensor
    resident_table: Tensor
    host_table: Tensor
    write_rows: Tensor | None = None


class HiSparseCacheHandle:
    """The attention-facing cache (``AttentionKVCache``): rows are ``row_dim`` values of ``dtype``
    stored as bytes in the runtime's per-layer device views, encoded by ``codec`` (a
    :class:`~hisparse_ray.kernels.kvfp8.KVRowCodec`: the KV-cache dtype, e.g. fp8 rows for a bf16
    model; default: the model's own dtype). ``gather`` decodes (dequantizes) the resolved rows."""

    def __init__(self, runtime: HiSparseRuntime, row_dim: int, dtype: torch.dtype, codec=None) -> None:
        if codec is None:
            codec = KVRowCodec(resolve_kv_dtype("auto", dtype), row_dim, 0)
        if codec.row_dim != row_dim or codec.row_bytes != runtime.layout.bytes_per_token_layer:
            raise StateError(
                f"{codec.kind} rows of {codec.row_dim} values = {codec.row_bytes} B != layout row "
                f"bytes {runtime.layout.bytes_per_token_layer} (row_dim {row_dim})")
        self.runtime, self.row_dim, self.dtype, self.codec = runtime, row_dim, dtype, codec

    def write_newest(self, layer: int, kv: Tensor) -> None:
        rows = self.runtime._step.write_rows  # type: ignore[union-attr]
        self.runtime.device_kv[layer][rows] = self.codec.encode(kv).to(self.runtime.device)

    def gather(self, layer: int, topk: Tensor) -> Tensor:
        rows = self.runtime.resolve(layer, topk)
        safe = rows.clamp_min(0)
        return self.codec.decode(self.runtime.device_kv[layer][safe], self.dtype)  # [B, K, row_dim]
