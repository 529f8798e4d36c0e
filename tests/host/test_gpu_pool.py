"""Registered host pool on a GPU machine: pinned views, UVA aliases, chunked registration."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_ray.config import GIB, KVLayout
from hisparse_ray.host import copies
from hisparse_ray.host.pool import HostPool, list_segments, mem_available_bytes, pool_bytes
from hisparse_ray.host.segment import MAX_REGISTER_BYTES, register_chunks

PREFIX = f"hs-test-gpupool-{os.getpid()}"


@pytest.mark.gpu
def test_registered_views_are_pinned_and_the_uva_alias_sees_host_writes():
    layout = KVLayout(num_layers=4, page_size=16, row_bytes=64)
    with HostPool.create("g", layout, 32, register_cuda=True, prefix=PREFIX) as pool:
        assert pool.registered
        for l in range(4):
            assert pool.layer(l).is_pinned()
        pool.block(2, 5).fill_(7)
        alias = pool.device_layer(2)
        assert alias is not None and alias.is_cuda and alias.shape == pool.layer(2).shape
        assert int(alias[5 * 16:6 * 16].sum().item()) == 7 * 16 * 64
        alias[0].fill_(9)  # a GPU write lands in host memory
        torch.cuda.synchronize()
        assert bool((pool.layer(2)[0] == 9).all())
    assert list_segments(PREFIX) == []


@pytest.mark.gpu
@pytest.mark.slow
def test_pool_over_64_gib_registers_in_chunks_and_copies_in_every_chunk():
    layout = KVLayout(num_layers=2, page_size=64, row_bytes=1152)
    blocks = (36 * GIB) // layout.page_bytes_per_layer  # two 36 GiB layers: 2 registrations
    need, st = pool_bytes(layout, blocks), os.statvfs("/dev/shm")
    if need > 0.9 * mem_available_bytes() or need > st.f_bavail * st.f_frsize:
        pytest.skip("not enough host memory or /dev/shm space for a 72 GiB pool")
    with HostPool.create("big", layout, blocks, register_cuda=True, prefix=PREFIX) as pool:
        chunks = register_chunks(0, 4096, pool.layer_stride, 2)
        assert len(chunks) == 2 and all(s <= MAX_REGISTER_BYTES for _, s in chunks)
        assert pool.layer(0).is_pinned() and pool.layer(1).is_pinned()
        dev = [torch.randint(0, 256, (4 * 64, 1152), dtype=torch.uint8, device="cuda") for _ in range(2)]
        last = blocks - 1
        copies.spill_pages(dev, pool, [(0, 0), (1, last)], torch.cuda.Stream()).wait()
        back = [torch.zeros_like(t) for t in dev]
        copies.restore_pages(back, pool, [(2, 0), (3, last)], torch.cuda.Stream()).wait()
        for l in range(2):
            assert torch.equal(back[l][128:192], dev[l][0:64])
            assert torch.equal(back[l][192:256], dev[l][64:128])
    assert list_segments(PREFIX) == []
