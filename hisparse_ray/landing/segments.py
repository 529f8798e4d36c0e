"""A landing WRITE as transfer segments (pure planning over the transfer contract): the prefill
worker turns each ``LandingDest`` of its order into ``WriteSegment``s from its send buffers, split
by layer group and by memory kind where one WRITE cannot move them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hisparse_ray.errors import StateError
from hisparse_ray.landing.plan import layer_group, page_runs
from hisparse_ray.transfer.base import WriteSegment
from hisparse_ray.types import LandingDest


def write_segments(dest: LandingDest, local: str, local_layer_stride: int, row_bytes: int,
                   page_size: int, num_positions: int, *, key_local: str = "",
                   key_layer_stride: int = 0, key_row_bytes: int = 0) -> list[WriteSegment]:
    """Segments moving ``dest``'s pages from a local send buffer laid out ``[L, max_T, row_bytes]``
    (``local_layer_stride`` bytes per layer) into ``dest``'s per-layer regions (row ``block *
    page_size + offset``). Pages without positions are skipped. Consecutive pages landing in
    consecutive blocks become one segment (per layer), so a chunk of pages into a contiguous
    block run is one descriptor per layer.

    With ``dest.key_rows``, also the indexer keys: from local ``key_local`` laid out ``[L, max_T,
    key_row_bytes]`` (``key_layer_stride`` bytes per layer) into ``dest.key_layers`` (row
    ``row + r`` of each layer's region): one descriptor per layer, after the KV segments."""
    return [seg for group in write_groups(dest, local, local_layer_stride, row_bytes, page_size,
                                          num_positions, key_local=key_local,
                                          key_layer_stride=key_layer_stride,
                                          key_row_bytes=key_row_bytes)
            for seg in group]


def write_groups(dest: LandingDest, local: str, local_layer_stride: int, row_bytes: int,
                 page_size: int, num_positions: int, *, key_local: str = "",
                 key_layer_stride: int = 0, key_row_bytes: int = 0
                 ) -> list[list[WriteSegment]]:
    """``write_segments`` split in ``dest.layer_groups`` WRITEs: group g holds the KV segments of
    the layers with ``layer_group(l, L, G) == g``; the key segments go with the last group.
    Empty groups are kept (every group has its notification); one group when not split."""
    G = max(1, dest.layer_groups)
    L = len(dest.layers)
    runs = page_runs(dest.pages, page_size, num_positions)
    groups: list[list[WriteSegment]] = [[] for _ in range(G)]
    for layer, region in enumerate(dest.layers):
        groups[layer_group(layer, L, G)].extend(
            WriteSegment(local=local, local_offset=layer * local_layer_stride + lo * row_bytes,
                         nbytes=n * row_bytes, remote=region, remote_offset=row * row_bytes)
            for lo, row, n in runs)
    if dest.key_rows is not None and dest.key_rows[2] > 0:
        if not dest.key_layers or not key_local or key_row_bytes <= 0:
            raise StateError("a landing WRITE names key rows but no key regions")
        lo, row, n = dest.key_rows
        groups[-1] += [WriteSegment(local=key_local,
                                    local_offset=layer * key_layer_stride + lo * key_row_bytes,
                                    nbytes=n * key_row_bytes, remote=region,
                                    remote_offset=row * key_row_bytes)
                       for layer, region in enumerate(dest.key_layers)]
    return groups


def split_by_memory_kind(segments: Sequence[WriteSegment], local_kind: Any
                         ) -> list[list[WriteSegment]]:
    """``segments`` in groups that one WRITE can move (NIXL moves one memory kind per side per
    transfer): grouped by ``(local_kind(seg.local), seg.remote.kind)``, order kept within a
    group, groups in order of first appearance. E.g. a direct host landing's KV rows (device ->
    DRAM) and its indexer keys (device -> VRAM key staging) are two WRITEs."""
    groups: dict[tuple, list[WriteSegment]] = {}
    for seg in segments:
        groups.setdefault((local_kind(seg.local), seg.remote.kind), []).append(seg)
    return list(groups.values())
