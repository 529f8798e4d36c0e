"""The KV-cache interface sparse attention calls, its full-resident baseline, and the indexer key cache (ring 2).

A KV row is one token's post-norm latent (``kv_lora_rank``) followed by its post-rope rope key
(``qk_rope_head_dim``): ``row_dim = kv_lora_rank + qk_rope_head_dim``. The decode forward, per layer:
``write_newest(layer, rows)`` for the step's new token of every batch row, then (after the indexer)
``gather(layer, topk)``; the gathered rows must include the row just written when its position is
selected. HiSparse implements :class:`AttentionKVCache` with a hot buffer + host tier; :class:`DenseKVCache`
keeps everything on the device.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from hisparse_ray.errors import CapacityError, StateError


@runtime_checkable
class AttentionKVCache(Protocol):
    def write_newest(self, layer: int, kv: Tensor) -> None:
        """``kv [B, row_dim]`` float: the newest token's latent+rope row (post-norm, post-rope) for each
        batch row of the current decode step."""
        ...

    def gather(self, layer: int, topk: Tensor) -> Tensor:
        """``topk [B, K]`` int64 positions (-1 = padding) -> ``[B, K, row_dim]`` rows (padding rows are
        ignored by attention via the -1 mask; their contents may be anything)."""
        ...


class DenseKVCache:
    """Full-resident baseline: every row of every request on one device.

    Storage ``[L, max_requests, max_len, row_dim]`` of ``dtype``. Lifecycle per request slot:
    ``load(slot, rows)`` after prefill (or nothing, for an empty start), then per decode step
    ``begin_step(slots, positions)`` which fixes, for each batch row, the slot and the position the
    newest token is written at (= n - 1); ``write_newest``/``gather`` then address batch rows.
    Invariant: ``lengths[s]`` is the number of valid rows of slot ``s``; positions beyond it are never
    gathered (checked).
    """

    def __init__(
        self,
        num_layers: int,
        row_dim: int,
        max_requests: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.rows = torch.zeros(num_layers, max_requests, max_len, row_dim, dtype=dtype, device=device)
        self.lengths = [0] * max_requests
        self._slots: Tensor | None = None
        self._positions: Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.rows.shape[2]

    def load(self, slot: int, rows: Tensor) -> None:
        """``rows [L, T, row_dim]`` from prefill become positions ``0..T-1`` of ``slot``."""
        T = rows.shape[1]
        if T > self.max_len:
            raise CapacityError("dense KV cache rows", T, self.max_len)
        self.rows[:, slot, :T] = rows.to(self.rows.dtype)
        self.lengths[slot] = T

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def begin_step(self, slots: Tensor, positions: Tensor) -> None:
        """``slots [B]``, ``positions [B]`` int64: batch row b writes position ``positions[b]`` of
        ``slots[b]``, which must equal that slot's current length (append-only)."""
        for s, p in zip(slots.tolist(), positions.tolist()):
            if p != self.lengths[s]:
                raise StateError(f"slot {s} has {self.lengths[s]} rows; cannot write position {p}")
            if p >= self.max_len:
                raise CapacityError(f"dense KV cache slot {s}", p + 1, self.max_len)
            self.lengths[s] = p + 1
        self._slots = slots.to(self.rows.device, torch.int64)
        self._positions = positions.to(self.rows.device, torch.int64)

    def write_newest(self, layer: int, kv: Tensor) -> None:
        assert self._slots is not None, "begin_step() first"
        self.rows[layer, self._slots, self._positions] = kv.to(self.rows.dtype)

    def gather(self, layer: int, topk: Tensor) -> Tensor:
        assert self._slots is not None and self._positions is not None, "begin_step() first"
        assert bool((topk <= self._positions[:, None]).all()), "gather beyond the newest position"
        pos = topk.clamp(min=0)
        return self.rows[layer, self._slots[:, None], pos]


class IndexerKeyCache:
    """One request's dense indexer keys, model-owned: ``keys [L, capacity, index_head_dim]``.

    Only layers with their own indexer (``indexer_types == "full"``) are ever written; rows of shared
    layers stay zero. ``length`` is the number of positions held (all layers advance together: the
    decode forward appends one key per indexer layer, then :meth:`advance`).
    """

    def __init__(
        self,
        num_layers: int,
        index_head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.keys = torch.zeros(num_layers, capacity, index_head_dim, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def from_prefill(cls, index_keys: Tensor, capacity: int) -> "IndexerKeyCache":
        """``index_keys [L, T, d]`` as returned by ``prefill``; ``capacity >= T`` positions."""
        L, T, d = index_keys.shape
        if capacity < T:
            raise CapacityError("indexer key cache", T, capacity)
        cache = cls(L, d, capacity, dtype=index_keys.dtype, device=index_keys.device)
        cache.keys[:, :T] = index_keys
        cache.length = T
        return cache

    def write(self, layer: int, position: int, key: Tensor) -> None:
        """``key [d]`` at ``position`` (must be ``length``: the step's newest token)."""
        if position != self.length:
            raise StateError(f"indexer cache holds {self.length} keys; cannot write position {position}")
        if position >= self.keys.shape[1]:
            raise CapacityError("indexer key cache", position + 1, self.keys.shape[1])
        self.keys[layer, position] = key.to(self.keys.dtype)

    def advance(self) -> None:
        self.length += 1

    def view(self, layer: int, n: int) -> Tensor:
        """Keys ``[n, d]`` of positions ``0..n-1``."""
        return self.keys[layer, :n]
