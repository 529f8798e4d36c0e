"""The decode rank's side of a landing (torch): the local copies that move a landed chunk from
rank 0's staging run into the host pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def copy_runs(src_layers: Sequence[Any], dst_layers: Sequence[Any],
              runs: Sequence[tuple[int, int, int]], *, max_memcpys: int = 4) -> None:
    """``dst_layers[l][d:d + n] = src_layers[l][s:s + n]`` for every run and layer (torch 2-D
    ``[rows, row_bytes]`` tensors; sources may sit on a GPU, destinations on the host). Up to
    ``max_memcpys`` runs: one copy per run and layer. More: per layer one copy of the spanned
    source rows to the destination device and one ``index_copy_`` scatter. Synchronous (returns
    after every copy finished)."""
    import torch

    if not runs:
        return
    if len(runs) <= max_memcpys:
        # asynchronous copies, one synchronize below: no per-layer stall between DMA copies
        # (safe for any destination: the synchronize precedes every reader)
        for src, dst in zip(src_layers, dst_layers):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    else:
        lo = min(s for s, _, _ in runs)
        hi = max(s + n for s, _, n in runs)
        s_idx = torch.cat([torch.arange(s - lo, s - lo + n) for s, _, n in runs])
        d_idx = torch.cat([torch.arange(d, d + n) for _, d, n in runs])
        dense = s_idx.numel() == hi - lo and bool((s_idx == torch.arange(hi - lo)).all())
        for src, dst in zip(src_layers, dst_layers):
            span = src[lo:hi]
            if span.device != dst.device:
                span = span.to(dst.device)
            dst.index_copy_(0, d_idx, span if dense else span.index_select(0, s_idx))
    if src_layers and getattr(src_layers[0], "is_cuda", False):
        torch.cuda.synchronize()
