"""Page-copy engine: byte-exact spill / restore / backup / fill round trips (CPU; CUDA under `gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.errors import TransferError
from hisparse_ray.host import copies
from hisparse_ray.host.pool import HostPool, list_segments

PREFIX = f"hs-test-copies-{os.getpid()}"
LAYOUT = KVLayout(num_layers=3, page_size=8, row_bytes=48)
DEVICE_BLOCKS, HOST_BLOCKS = 6, 10


def _device_layers(device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = DEVICE_BLOCKS * LAYOUT.page_size
    return [torch.randint(0, 256, (rows, LAYOUT.row_bytes), dtype=torch.uint8, generator=g).to(device)
            for _ in range(LAYOUT.num_layers)]


@pytest.fixture
def pool():
    register = torch.cuda.is_available()
    with HostPool.create("c", LAYOUT, HOST_BLOCKS, register_cuda=register, prefix=PREFIX) as p:
        yield p
    assert list_segments(PREFIX) == []


def _roundtrip_pages(pool, device, stream):
    src = _device_layers(device, 1)
    dst = [torch.zeros_like(t) for t in src]
    pairs = [(0, 9), (3, 0), (5, 4)]  # (device block, host block)
    handles = [copies.spill_page(src, pool, d, h, stream) for d, h in pairs]
    for h in handles:
        h.wait()
        assert h.done()
    for d, h in pairs:
        for l in range(LAYOUT.num_layers):
            assert torch.equal(pool.block(l, h), src[l][d * 8:(d + 1) * 8].cpu())
    restored = [copies.restore_page(dst, pool, d2, h, stream) for (_, h), d2 in zip(pairs, (1, 2, 4))]
    restored[-1].wait()
    for (d, _), d2 in zip(pairs, (1, 2, 4)):
        for l in range(LAYOUT.num_layers):
            assert torch.equal(dst[l][d2 * 8:(d2 + 1) * 8], src[l][d * 8:(d + 1) * 8])
    untouched = [b for b in range(DEVICE_BLOCKS) if b not in (1, 2, 4)]
    for l in range(LAYOUT.num_layers):
        for b in untouched:
            assert int(dst[l][b * 8:(b + 1) * 8].count_nonzero()) == 0


def _roundtrip_rows(pool, device, stream, use_uva):
    src = _device_layers(device, 2)
    g = torch.Generator().manual_seed(3)
    n = 13
    src_rows = torch.randperm(src[0].shape[0], generator=g)[:n]
    others = torch.randperm(pool.rows - 24, generator=g)[: n - 4] + 24
    host_rows = torch.cat([torch.arange(20, 24), others])  # starts with a contiguous run
    src_rows[:4] = torch.arange(5, 9)
    h = copies.backup_rows(src, pool, src_rows, host_rows, stream, use_uva=use_uva)
    h.wait()
    for l in range(LAYOUT.num_layers):
        assert torch.equal(pool.layer(l)[host_rows], src[l][src_rows].cpu())
    dst = [torch.zeros_like(t) for t in src]
    dev_rows = torch.randperm(dst[0].shape[0], generator=g)[:n]
    h = copies.fill_rows(dst, pool, host_rows, dev_rows, stream, use_uva=use_uva)
    h.wait()
    for l in range(LAYOUT.num_layers):
        assert torch.equal(dst[l][dev_rows], src[l][src_rows])
        assert int(dst[l].count_nonzero(dim=1).bool().sum()) <= n


def test_cpu_spill_restore_roundtrip_is_byte_exact(pool):
    _roundtrip_pages(pool, "cpu", None)


def test_cpu_backup_fill_roundtrip_is_byte_exact(pool):
    _roundtrip_rows(pool, "cpu", None, None)


def test_cpu_handles_are_done_at_once(pool):
    h = copies.backup_rows(_device_layers("cpu", 0), pool, [], [])
    assert h.done()
    h.order_before()  # no-op without CUDA


def test_runs_coalesce_consecutive_rows():
    src, dst = torch.tensor([4, 5, 6, 9, 1, 2]), torch.tensor([10, 11, 12, 13, 0, 1])
    assert copies._runs(src, dst) == [(4, 10, 3), (9, 13, 1), (1, 0, 2)]


def test_rejects_bad_arguments(pool):
    layers = _device_layers("cpu", 0)
    with pytest.raises(TransferError, match="device layers"):
        copies.spill_page(layers[:2], pool, 0, 0)
    with pytest.raises(TransferError, match="host block"):
        copies.spill_page(layers, pool, 0, HOST_BLOCKS)
    with pytest.raises(TransferError, match="device block"):
        copies.restore_page(layers, pool, DEVICE_BLOCKS, 0)
    with pytest.raises(TransferError, match="distinct"):
        copies.backup_rows(layers, pool, [0, 1], [3, 3])
    with pytest.raises(TransferError, match="source rows"):
        copies.backup_rows(layers, pool, [0, 1], [3])
    with pytest.raises(TransferError, match="out of range"):
        copies.fill_rows(layers, pool, [pool.rows], [0])
    wrong = [torch.zeros(8, 47, dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(TransferError, match="uint8"):
        copies.spill_page(wrong, pool, 0, 0)


@pytest.mark.gpu
def test_cuda_spill_restore_roundtrip_on_a_side_stream(pool):
    assert pool.registered and pool.layer(0).is_pinned()
    _roundtrip_pages(pool, "cuda", torch.cuda.Stream())


@pytest.mark.gpu
@pytest.mark.parametrize("use_uva", [True, False])
def test_cuda_backup_fill_roundtrip(pool, use_uva):
    if use_uva:
        assert pool.device_layer(0) is not None, "torch refused the UVA alias of registered memory"
    _roundtrip_rows(pool, "cuda", torch.cuda.Stream(), use_uva)


@pytest.mark.gpu
def test_cuda_handle_polls_without_blocking(pool):
    side = torch.cuda.Stream()
    src = _device_layers("cuda", 4)
    torch.cuda._sleep(50_000_000)  # keep the current stream busy; the side stream waits on it
    h = copies.spill_page(src, pool, 1, 1, side)
    first = h.done()
    h.wait()
    assert h.done() and first in (False, True)
    assert torch.equal(pool.block(0, 1), src[0][8:16].cpu())


def _stacked_device(device: str, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 256, (LAYOUT.num_layers, DEVICE_BLOCKS * 8, LAYOUT.row_bytes),
                        dtype=torch.uint8, generator=g).to(device)
    return big, list(big.unbind(0))


def test_stack_layers_detects_one_allocation_only():
    big, layers = _stacked_device("cpu", 0)
    stacked = copies.stack_layers(layers)
    assert stacked is not None and stacked.data_ptr() == big.data_ptr() and torch.equal(stacked, big)
    assert copies.stack_layers(_device_layers("cpu", 0)) is None
    assert copies.stack_layers([layers[0], layers[2], layers[1]]) is None


def _batch_roundtrip(pool, device, stream, use_uva, stacked):
    src = _stacked_device(device, 5)[1] if stacked else _device_layers(device, 5)
    pairs = [(0, 4), (1, 5), (2, 6), (5, 0), (3, 9)]  # consecutive blocks coalesce into one run
    copies.spill_pages(src, pool, pairs, stream, use_uva=use_uva).wait()
    for d, h in pairs:
        for l in range(LAYOUT.num_layers):
            assert torch.equal(pool.block(l, h), src[l][d * 8:(d + 1) * 8].cpu())
    back = _stacked_device(device, 6)[1] if stacked else _device_layers(device, 6)
    before = [t.clone() for t in back]
    moved = [(4, 4), (0, 5), (1, 9)]
    copies.restore_pages(back, pool, moved, stream, use_uva=use_uva).wait()
    for l in range(LAYOUT.num_layers):
        for d in range(DEVICE_BLOCKS):
            h = dict(moved).get(d)
            want = pool.block(l, h).to(device) if h is not None else before[l][d * 8:(d + 1) * 8]
            assert torch.equal(back[l][d * 8:(d + 1) * 8], want)


@pytest.mark.parametrize("stacked", [False, True])
def test_cpu_batched_pages_roundtrip(pool, stacked):
    _batch_roundtrip(pool, "cpu", None, None, stacked)


def test_pool_stacked_view_matches_layer_views(pool):
    st = pool.stacked()
    assert st.shape == (LAYOUT.num_layers, pool.rows, LAYOUT.row_bytes)
    for l in range(LAYOUT.num_layers):
        assert st[l].data_ptr() == pool.layer(l).data_ptr()
    assert pool.device_stacked() is None or torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize("use_uva", [True, False])
@pytest.mark.parametrize("stacked", [False, True])
def test_cuda_batched_pages_roundtrip(pool, use_uva, stacked):
    _batch_roundtrip(pool, "cuda", torch.cuda.Stream(), use_uva, stacked)
