"""The page-copy engine of a GPU worker (adapter ring): spills, restores, eager backups and fills
between the device pool's per-layer views and the host pool. On CUDA the copies are enqueued on a
side stream and a :class:`CopyHandle` polls their completion; on CPU they run at once.

``device_layers`` is a list (one per layer) of [device_rows, row_bytes] uint8 tensors, all on one
device; a device block is rows ``[block * page_size, (block + 1) * page_size)`` of every layer, the
same page geometry as the host pool (``host_pool.layout``). The device tensors must stay alive
until the returned handle is done (the worker's device pool does); temporaries made here are
allocated on the side stream, so the caching allocator cannot hand them out early.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from hisparse_ray.errors import TransferError
from hisparse_ray.host.pool import HostPool

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


def _page_rows(pairs: Sequence[tuple[int, int]], page: int, dev_rows: int, host_rows: int):
    """(device rows, host rows) of whole pages; validates every block."""
    for d, h in pairs:
        _block_slice(d, dev_rows, page, "device")
        _block_slice(h, host_rows, page, "host")
    off = torch.arange(page, dtype=torch.int64)
    dev = torch.as_tensor([d for d, _ in pairs], dtype=torch.int64).reshape(-1, 1) * page + off
    host = torch.as_tensor([h for _, h in pairs], dtype=torch.int64).reshape(-1, 1) * page + off
    return dev.reshape(-1), host.reshape(-1)


def _pages(device_layers, pool: HostPool, pairs, stream: Any, to_host: bool,
           use_uva: bool | None) -> CopyHandle:
    _check_layers(device_layers, pool)
    dev_rows, host_rows = _page_rows(pairs, pool.layout.page_size, device_layers[0].shape[0],
                                     pool.rows)
    src, dst = (dev_rows, host_rows) if to_host else (host_rows, dev_rows)
    return _row_copy(device_layers, pool, src, dst, stream, to_host, use_uva)


def spill_pages(device_layers: Sequence[torch.Tensor], host_pool: HostPool,
                pairs: Sequence[tuple[int, int]], stream: Any = None, *,
                use_uva: bool | None = False) -> CopyHandle:
    """Spill several pages at once: device block ``d`` -> host block ``h`` (all layers) for each
    ``(d, h)`` in ``pairs``; host blocks distinct. Default: copy-engine memcpys (one per layer and
    run of consecutive blocks), leaving the SMs to the forward; use_uva=True: one UVA scatter."""
    return _pages(device_layers, host_pool, pairs, stream, True, use_uva)


def restore_pages(device_layers: Sequence[torch.Tensor], host_pool: HostPool,
                  pairs: Sequence[tuple[int, int]], stream: Any = None, *,
                  use_uva: bool | None = False) -> CopyHandle:
    """Restore several pages at once: host block ``h`` -> device block ``d`` for each ``(d, h)``
    in ``pairs``; device blocks distinct. Same modes as :func:`spill_pages`."""
    return _pages(device_layers, host_pool, pairs, stream, False, use_uva)


def spill_page(device_layers: Sequence[torch.Tensor], host_pool: HostPool, device_block: int,
               host_block: int, stream: Any = None) -> CopyHandle:
    """Copy device block ``device_block`` (all layers) to host block ``host_block`` (D2H)."""
    return spill_pages(device_layers, host_pool, [(device_block, host_block)], stream)


def restore_page(device_layers: Sequence[torch.Tensor], host_pool: HostPool, device_block: int,
                 host_block: int, stream: Any = None) -> CopyHandle:
    """Copy host block ``host_block`` (all layers) into device block ``device_block`` (H2D)."""
    return restore_pages(device_layers, host_pool, [(device_block, host_block)], stream)


def stack_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """[L, rows, row_bytes] strided view when the per-layer tensors are equally spaced views of
    one storage (e.g. ``big[l]`` of one [L, rows, row_bytes] allocation), else None."""
    first = layers[0]
    if len(layers) == 1:
        return first.unsqueeze(0)
    step = layers[1].data_ptr() - first.data_ptr()
    if step <= 0:
        return None
    for l, t in enumerate(layers):
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.shape != first.shape or t.stride() != first.stride()
                or t.data_ptr() - first.data_ptr() != l * step):
            return None
    return first.as_strided((len(layers), *first.shape), (step, *first.stride()),
                            first.storage_offset())


def _runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both row lists advance by one together."""
    if src.numel() == 0:
        return []
    brk = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).reshape(-1) + 1])
    ends = torch.cat([starts[1:], torch.tensor([src.numel()])])
    return list(zip(src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()))


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
    if side is None:  # CPU: the pool's own views
        _gather_scatter(device_layers, host_pool_views(pool, False), s_idx, d_idx, to_host)
        return _finish(side)
    alias = pool.device_stacked() if use_uva is not False else None
    if use_uva and alias is None:
        raise TransferError(f"host pool {pool.name} has no UVA device alias (not registered?)")
    with torch.cuda.stream(side):
        if alias is not None:  # gather/scatter kernels reading or writing host memory via UVA
            # pinned + non_blocking: a blocking upload would sync the side stream, i.e. wait
            # for the forward it was just ordered after
            s_dev = s_idx.pin_memory().to(device, non_blocking=True)
            d_dev = d_idx.pin_memory().to(device, non_blocking=True)
            _gather_scatter(device_layers, host_pool_views(pool, True), s_dev, d_dev, to_host)
        else:  # copy engine: one async memcpy per contiguous run and layer
            runs = _runs(s_idx, d_idx)
            for l, dev in enumerate(device_layers):
                host = pool.layer(l)
                for s, d, n in runs:
                    if to_host:
                        host[d:d + n].copy_(dev[s:s + n], non_blocking=True)
                    else:
                        dev[d:d + n].copy_(host[s:s + n], non_blocking=True)
    return _finish(side)


def host_pool_views(pool: HostPool, uva: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per-layer views, stacked view) of the pool: CPU views, or the CUDA UVA alias."""
    stacked = pool.device_stacked() if uva else pool.stacked()
    return list(stacked.unbind(0)), stacked


def _gather_scatter(device_layers, host, s_idx: torch.Tensor, d_idx: torch.Tensor,
                    to_host: bool) -> None:
    """dst[d_idx[i]] = src[s_idx[i]] in every layer; one gather + one scatter over all layers
    when the device layers stack, else two per layer."""
    host_layers, host_stacked = host
    dev_stacked = stack_layers(device_layers)
    if dev_stacked is not None:
        src, dst = (dev_stacked, host_stacked) if to_host else (host_stacked, dev_stacked)
        dst.index_copy_(1, d_idx, src.index_select(1, s_idx))
        return
    for dev, hst in zip(device_layers, host_layers):
        src, dst = (dev, hst) if to_host else (hst, dev)
        dst.index_copy_(0, d_idx, src.index_select(0, s_idx))


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

