"""The page-copy engine of a GPU worker (adapter ring): spills, restores, eager backups and fills
between the device pool's per-layer views and the host pool. On CUDA the copies are enqueued on a
side stream and a :class:`CopyHandle` polls their completion; on CPU they run at once.

``device_layers`` is a list (one per layer) of [device_rows, row_bytes] uint8 tensors, all on one
device; a device block is rows ``[block * page_size, (block + 1) * page_size)`` of every layer, the
same page geometry as the host pool (``host_pool.layout``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from hisparse_ray.errors import TransferError
from hisparse_ray.hostpool import HostPool

Rows = Sequence[int] | torch.Tensor


class CopyHandle:
    """Completion of one batch of enqueued copies.

    ``done()`` never blocks (``torch.cuda.Event.query()``), so a worker reports *enqueued* at once
    and *completed* when it turns True; CPU copies are done when the call returns.
    """

    __slots__ = ("_event",)

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block the calling thread until the copies finished."""
        if self._event is not None:
            self._event.synchronize()

    def order_before(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for the copies before its later work (e.g. the
        next forward overwriting a backed-up slot). No-op on CPU."""
        if self._event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self._event)


def _check_layers(device_layers: Sequence[torch.Tensor], pool: HostPool) -> torch.device:
    layout = pool.layout
    if len(device_layers) != layout.num_layers:
        raise TransferError(f"{len(device_layers)} device layers for a {layout.num_layers}-layer pool")
    dev = device_layers[0].device
    for l, t in enumerate(device_layers):
        if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != layout.bytes_per_token_layer:
            raise TransferError(f"device layer {l}: expected [rows, {layout.bytes_per_token_layer}] "
                                f"uint8, got {list(t.shape)} {t.dtype}")
        if t.device != dev or t.stride(1) != 1:
            raise TransferError(f"device layer {l}: all layers must be row-contiguous on {dev}")
    return dev


def _block_slice(block: int, rows: int, page: int, what: str) -> slice:
    if not 0 <= block or (block + 1) * page > rows:
        raise TransferError(f"{what} block {block} out of range ({rows // page} blocks)")
    return slice(block * page, (block + 1) * page)


def _row_index(rows: Rows, limit: int, what: str) -> torch.Tensor:
    idx = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        raise TransferError(f"{what} rows out of range 0..{limit - 1}")
    return idx


def _streams(device: torch.device, stream: Any) -> Any:
    """The side stream to enqueue on; it first waits for work already queued on the current one."""
    if device.type != "cuda":
        return None
    side = stream if stream is not None else torch.cuda.current_stream(device)
    current = torch.cuda.current_stream(device)
    if side != current:
        side.wait_stream(current)
    return side


def _finish(side: Any) -> CopyHandle:
    if side is None:
        return CopyHandle()
    event = torch.cuda.Event()
    event.record(side)
    return CopyHandle(event)


def _page_copy(device_layers, pool: HostPool, device_block: int, host_block: int, stream: Any,
               to_host: bool) -> CopyHandle:
    device = _check_layers(device_layers, pool)
    page = pool.layout.page_size
    dsl = _block_slice(device_block, device_layers[0].shape[0], page, "device")
    hsl = _block_slice(host_block, pool.rows, page, "host")
    side = _streams(device, stream)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for l, dev in enumerate(device_layers):
            host = pool.layer(l)
            if to_host:
                host[hsl].copy_(dev[dsl], non_blocking=side is not None)
            else:
                dev[dsl].copy_(host[hsl], non_blocking=side is not None)
    return _finish(side)


def spill_page(device_layers: Sequence[torch.Tensor], host_pool: HostPool, device_block: int,
               host_block: int, stream: Any = None) -> CopyHandle:
    """Copy device block ``device_block`` (all layers) to host block ``host_block`` (D2H)."""
    return _page_copy(device_layers, host_pool, device_block, host_block, stream, to_host=True)


def restore_page(device_layers: Sequence[torch.Tensor], host_pool: HostPool, device_block: int,
                 host_block: int, stream: Any = None) -> CopyHandle:
    """Copy host block ``host_block`` (all layers) into device block ``device_block`` (H2D)."""
    return _page_copy(device_layers, host_pool, device_block, host_block, stream, to_host=False)


def _runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both row lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src.tolist(), dst.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def _row_copy(device_layers, pool: HostPool, src: Rows, dst: Rows, stream: Any, to_host: bool,
              use_uva: bool | None) -> CopyHandle:
    device = _check_layers(device_layers, pool)
    dev_rows = device_layers[0].shape[0]
    s_idx = _row_index(src, dev_rows if to_host else pool.rows, "source")
    d_idx = _row_index(dst, pool.rows if to_host else dev_rows, "destination")
    if s_idx.numel() != d_idx.numel():
        raise TransferError(f"{s_idx.numel()} source rows but {d_idx.numel()} destination rows")
    if torch.unique(d_idx).numel() != d_idx.numel():
        raise TransferError("destination rows must be distinct")
    side = _streams(device, stream)
    if s_idx.numel() == 0:
        return _finish(side)
    if side is None:
        for l, dev in enumerate(device_layers):
            host = pool.layer(l)
            if to_host:
                host.index_copy_(0, d_idx, dev.index_select(0, s_idx))
            else:
                dev.index_copy_(0, d_idx, host.index_select(0, s_idx))
        return _finish(side)
    alias = pool.device_layer(0) if use_uva is not False else None
    if use_uva and alias is None:
        raise TransferError(f"host pool {pool.name} has no UVA device alias (not registered?)")
    with torch.cuda.stream(side):
        if alias is not None:  # one gather/scatter kernel per layer, through UVA
            s_dev = s_idx.to(device, non_blocking=False)
            d_dev = d_idx.to(device, non_blocking=False)
            for l, dev in enumerate(device_layers):
                host = pool.device_layer(l)
                if to_host:
                    host.index_copy_(0, d_dev, dev.index_select(0, s_dev))
                else:
                    dev.index_copy_(0, d_dev, host.index_select(0, s_dev))
        else:  # one async memcpy per contiguous run and layer
            runs = _runs(s_idx, d_idx)
            for l, dev in enumerate(device_layers):
                host = pool.layer(l)
                for s, d, n in runs:
                    if to_host:
                        host[d:d + n].copy_(dev[s:s + n], non_blocking=True)
                    else:
                        dev[d:d + n].copy_(host[s:s + n], non_blocking=True)
    return _finish(side)


def backup_rows(device_layers: Sequence[torch.Tensor], host_pool: HostPool, src_device_rows: Rows,
                dst_host_rows: Rows, stream: Any = None, *, use_uva: bool | None = None) -> CopyHandle:
    """Eager backup: device row ``src_device_rows[i]`` -> host row ``dst_host_rows[i]`` in every
    layer (D2H). Rows: 1-D int sequences/tensors of equal length; destinations distinct.
    use_uva: None = scatter through the pool's UVA alias when available, else per-run memcpys."""
    return _row_copy(device_layers, host_pool, src_device_rows, dst_host_rows, stream, True, use_uva)


def fill_rows(device_layers: Sequence[torch.Tensor], host_pool: HostPool, src_host_rows: Rows,
              dst_device_rows: Rows, stream: Any = None, *, use_uva: bool | None = None) -> CopyHandle:
    """Host row ``src_host_rows[i]`` -> device row ``dst_device_rows[i]`` in every layer (H2D;
    e.g. filling a short sequence's hot slots at admission). Same row rules as backup_rows."""
    return _row_copy(device_layers, host_pool, src_host_rows, dst_device_rows, stream, False, use_uva)

