"""The GPU-resident, paged indexer-key pool of one rank (ring 2: torch) and the indexer's logits
over it: a torch reference for every key dtype, and the layout DeepGEMM's fp8 paged logits read.

Replaces the dense per-request ``IndexerKeyCache`` on the fast path: keys of every request live in
one pool per indexer layer, 64 tokens a page, so a batch's logits are one call over a block table
(no per-row Python loop) and a request's keys never move once written.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from hisparse_ray.errors import CapacityError, DuplicateRequestError, UnknownRequestError
from hisparse_ray.fastpath.config import INDEX_PAGE
from hisparse_ray.kernels.kvfp8 import FP8, dequantize_fp8, quantize_fp8

KEY_KINDS = ("fp32", "bf16", "fp8")


def quantize_queries(q: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """The fp8 indexer's query side: ``q [B, H, D]`` fp32 -> e4m3 ``[B, H, D]`` with one scale per
    (row, head) folded, together with the ``D**-0.5`` score scale, into the head weights ``w [B, H]``
    (relu commutes with a positive scale). Returns ``(q8, weights)``; both the reference and the
    DeepGEMM path use exactly these."""
    D = q.shape[-1]
    q8, qs = quantize_fp8(q, D)
    return q8, w * qs[..., 0] * D**-0.5


def fp8_scores(q8: Tensor, weights: Tensor, k8: Tensor, k_scale: Tensor) -> Tensor:
    """``sum_h weights[b, h] * relu(q8[b, h] . k8[b, t]) * k_scale[b, t]`` in fp32: ``q8 [B, H, D]``,
    ``weights [B, H]``, ``k8 [B, N, D]`` e4m3, ``k_scale [B, N]`` -> ``[B, N]`` (DeepGEMM's formula)."""
    s = torch.relu(torch.matmul(q8.float(), k8.float().transpose(-1, -2)))  # [B, H, N]
    return (weights[..., None] * s).sum(1) * k_scale


class PagedIndexKeys:
    """Indexer keys of every request on ``device``, paged ``INDEX_PAGE`` (64) tokens a page.

    ``layers`` are the model's indexer layers; pool ``i`` belongs to ``layers[i]``. Storage per pool:
      * "fp32" / "bf16": ``[num_pages + 1, 64, D]`` of that dtype;
      * "fp8": ``[num_pages + 1, 64 * (D + 4)]`` uint8 per page: 64 e4m3 keys of D bytes, then
        their 64 fp32 scales (DeepGEMM's paged layout, viewed ``[pages, 64, 1, D + 4]``).
    Page ``num_pages`` is the sink: never allocated, padded batch rows write there. Position ``p``
    of a request is row ``pages[p // 64] * 64 + p % 64`` of every pool.
    Lifecycle per request: :meth:`install` (pages for ``capacity`` positions, prefill keys
    written) -> one :meth:`write` per indexer layer and step -> :meth:`free`.
    Growth: an install that finds too few free pages doubles the pools (``max_pages`` caps them:
    CapacityError beyond) and bumps ``generation``; whoever captured the old pools (CUDA graphs,
    the sink row) must notice the new generation.
    """

    def __init__(self, layers: Sequence[int], dim: int, kind: str, num_pages: int,
                 device: torch.device | str = "cpu", *, max_pages: int | None = None) -> None:
        if kind not in KEY_KINDS:
            raise ValueError(f"index key kind {kind!r} not in {KEY_KINDS}")
        self.layers, self.dim, self.kind = tuple(layers), dim, kind
        self.slot = {l: i for i, l in enumerate(self.layers)}
        self.device = torch.device(device)
        self.max_pages = max_pages
        self.generation = 0
        self.num_pages = 0
        self.pools: list[Tensor] = []
        self._free: list[int] = []
        self.pages: dict[object, np.ndarray] = {}
        self._allocate(num_pages)

    def _allocate(self, num_pages: int) -> None:
        """(Re)allocate every pool with ``num_pages`` pages + the sink, keeping the pages in use."""
        P, dim, old = INDEX_PAGE, self.dim, self.num_pages
        if self.kind == "fp8":
            shape, dt = (num_pages + 1, P * (dim + 4)), torch.uint8
        else:
            shape, dt = (num_pages + 1, P, dim), {"fp32": torch.float32, "bf16": torch.bfloat16}[self.kind]
        pools = [torch.zeros(shape, dtype=dt, device=self.device) for _ in self.layers]
        for new, cur in zip(pools, self.pools):
            new[:old] = cur[:old]
        self.pools = pools
        if self.kind == "fp8":  # views into the page layout (no copies)
            self._keys = [p[:, : P * dim].view(num_pages + 1, P, dim) for p in self.pools]
            self._scales = [p[:, P * dim:].view(torch.float32) for p in self.pools]
        self._free = list(range(num_pages - 1, old - 1, -1)) + self._free
        self.num_pages = num_pages
        self.generation += 1

    @property
    def sink_row(self) -> int:
        return self.num_pages * INDEX_PAGE

    @property
    def free_pages(self) -> int:
        return len(self._free)

    # -- requests ---------------------------------------------------------------------------------
    def install(self, rid: object, keys: Tensor | None, capacity: int) -> None:
        """Pages for positions ``0..capacity-1``; ``keys [L, T, D]`` (all model layers, as prefill
        returns them) become positions ``0..T-1`` of every indexer layer."""
        if rid in self.pages:
            raise DuplicateRequestError(rid)
        n = -(-max(capacity, 1) // INDEX_PAGE)
        if n > len(self._free):
            want = max(2 * self.num_pages, self.num_pages + n - len(self._free))
            if self.max_pages is not None:
                want = min(want, self.max_pages)
            if want - self.num_pages + len(self._free) < n:
                raise CapacityError(f"index key pages ({len(self._free)} free, the rest held by "
                                    f"{len(self.pages)} requests)", n, want)
            self._allocate(want)
        pages = np.array([self._free.pop() for _ in range(n)], dtype=np.int32)
        self.pages[rid] = pages
        if keys is not None and keys.shape[1]:
            try:
                self.write_positions(rid, 0, keys)
            except CapacityError:
                self.free(rid)
                raise

    def write_positions(self, rid: object, lo: int, keys: Tensor) -> None:
        """Store ``keys [L, n, D]`` (all model layers, any device and float dtype: a landing's
        chunk) as positions ``lo..lo+n-1`` of every indexer layer of an installed request."""
        n = keys.shape[1]
        room = self.pages[rid].shape[0] * INDEX_PAGE
        if lo < 0 or lo + n > room:
            raise CapacityError(f"index key positions of {rid!r}", lo + n, room)
        if not n:
            return
        rows = self.rows_of(rid, torch.arange(lo, lo + n))
        for l in self.layers:
            self.write(self.slot[l], rows, keys[l].to(self.device))

    def free(self, rid: object) -> None:
        pages = self.pages.pop(rid, None)
        if pages is None:
            raise UnknownRequestError(rid)
        self._free.extend(int(p) for p in pages[::-1])

    def rows_of(self, rid: object, positions: Tensor) -> Tensor:
        """Pool rows ``[N]`` int64 (on the pool's device) of positions ``[N]`` of a request."""
        pages = torch.as_tensor(self.pages[rid], dtype=torch.int64)
        pos = positions.to(torch.int64).cpu()
        return (pages[pos // INDEX_PAGE] * INDEX_PAGE + pos % INDEX_PAGE).to(self.device)

    # -- batched (static shapes: capturable in a CUDA graph) ---------------------------------------
    def write(self, i: int, rows: Tensor, keys: Tensor) -> None:
        """Store ``keys [N, D]`` at pool rows ``rows [N]`` int64 of pool ``i`` (rows distinct, or
        the sink)."""
        page, off = rows // INDEX_PAGE, rows % INDEX_PAGE
        if self.kind == "fp8":
            q, s = quantize_fp8(keys, self.dim)
            self._keys[i][page, off] = q.view(torch.uint8)
            self._scales[i][page, off] = s[..., 0]
        else:
            self.pools[i][page, off] = keys.to(self.pools[i].dtype)

    def gather(self, i: int, table: Tensor) -> tuple[Tensor, Tensor | None]:
        """Keys of block table ``table [B, P]`` int32 (pages, -1 = none: read as page 0) ->
        ``(keys [B, P * 64, D], scales [B, P * 64] | None)``: storage dtype (e4m3 for fp8, with
        its scales)."""
        t = table.to(torch.int64).clamp_min(0)
        B = t.shape[0]
        if self.kind == "fp8":
            k = self._keys[i][t].view(torch.uint8).reshape(B, -1, self.dim).view(FP8)
            return k, self._scales[i][t].reshape(B, -1)
        return self.pools[i][t].reshape(B, -1, self.dim), None

    def dense(self, i: int, table: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Dequantized keys ``[B, P * 64, D]`` of ``dtype`` (the reference view of the pool)."""
        k, s = self.gather(i, table)
        if s is None:
            return k.to(dtype)
        return dequantize_fp8(k, s[..., None], self.dim).to(dtype)

    def logits_reference(self, i: int, indexer, q: Tensor, w: Tensor, table: Tensor) -> Tensor:
        """Unmasked logits ``[B, P * 64]`` fp32 of queries ``q [B, H, D]`` fp32 and head weights
        ``w [B, H]`` (``Indexer.queries``). fp32/bf16 keys: the model indexer's own ``scores``
        (the dense path's numbers); fp8: :func:`fp8_scores` of :func:`quantize_queries`."""
        k, s = self.gather(i, table)
        if s is None:
            return indexer.scores(q[:, None], w[:, None], k)[:, 0]
        q8, wq = quantize_queries(q, w)
        return fp8_scores(q8, wq, k, s)

    def deepgemm_view(self, i: int) -> Tensor:
        """Pool ``i`` as DeepGEMM's ``[pages + 1, 64, 1, D + 4]`` uint8 (fp8 pools only)."""
        if self.kind != "fp8":
            raise ValueError("DeepGEMM reads fp8 index keys only")
        return self.pools[i].view(self.num_pages + 1, INDEX_PAGE, 1, self.dim + 4)
