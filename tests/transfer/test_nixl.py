"""Real NIXL (UCX) WRITEs of CPU memory between processes: two Ray actors and two spawned
processes; byte-exact landing, notifications, and failures that raise instead of hanging."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

import pytest
import torch

from hisparse_ray.channel.ring import pid_alive
from hisparse_ray.errors import TransferError
from hisparse_ray.transfer import (
    NixlTransferEngine, RegionDesc, WriteSegment, discard_prepared, prepare_writes,
    write_all_with_retry, write_with_retry,
)
from tests.transfer import _nixl_peers as P

pytestmark = pytest.mark.nixl

REGION = 4 << 20
PAGE = 4096


@pytest.fixture(scope="module")
def actors(ray_cluster):
    """src (pattern), dst (zeros) and victim (two regions, for the destructive tests); every
    engine knows every other's metadata. Module-scoped: each actor start imports torch and NIXL."""
    ray = ray_cluster
    Peer = ray.remote(num_cpus=0)(P.NixlPeer)
    src, dst, victim = Peer.remote("src-actor"), Peer.remote("dst-actor"), Peer.remote("victim")
    (src_md, _), (dst_md, (dst_desc,)), (vic_md, vic_descs) = ray.get(
        [src.setup.remote(REGION, 7), dst.setup.remote(REGION, None),
         victim.setup.remote(REGION, None, ("kv", "kv2"))], timeout=90)
    assert ray.get(src.add_peer.remote(dst_md), timeout=30) == "dst-actor"
    assert ray.get(src.add_peer.remote(vic_md), timeout=30) == "victim"
    assert ray.get(dst.add_peer.remote(src_md), timeout=30) == "src-actor"
    yield ray, src, dst, dst_desc, victim, vic_descs
    for a in (src, dst, victim):
        ray.kill(a)


@pytest.mark.ray
def test_random_pages_land_byte_exact_with_notifications(actors):
    ray, src, dst, dst_desc, *_ = actors
    writes = P.random_pages(seed=3, n=300, region_bytes=REGION, page=PAGE)
    sent = ray.get(src.write.remote(dst_desc, writes, b"step-", 16), timeout=60)
    got, data = ray.get(dst.collect.remote(len(sent)), timeout=60)
    assert sorted(m for _, m in got) == sorted(sent)  # each notification once
    assert {a for a, _ in got} == {"src-actor"}
    want = P.expected_after(writes, P.pattern(REGION, 7), REGION)
    assert data == want.numpy().tobytes()


@pytest.mark.ray
def test_host_sources_write_host_directly(actors):
    ray, src, *_ = actors
    host, device = ray.get(src.supports_direct_host_write.remote("dst-actor"), timeout=30)
    assert host is True and device is False  # device sources stage on the peer's GPU


@pytest.mark.ray
def test_bad_remote_address_is_rejected(actors):
    ray, src, _, dst_desc, *_ = actors
    outside = RegionDesc(dst_desc.agent, dst_desc.name, dst_desc.addr + REGION, REGION,
                         dst_desc.device_id, dst_desc.kind)  # not registered at the peer
    with pytest.raises(TransferError, match="rejected"):
        ray.get(src.write_one.remote(outside, 0, 0, PAGE), timeout=30)
    with pytest.raises(TransferError, match="outside region"):
        ray.get(src.write_one.remote(dst_desc, 0, REGION - 10, 20), timeout=30)
    ray.get(src.write_one.remote(dst_desc, 0, 0, PAGE), timeout=30)  # the engine still works


@pytest.mark.ray
def test_deregistered_region_then_dead_peer(actors):
    ray, src, _, _, victim, (kv, kv2) = actors
    ray.get(src.write_one.remote(kv, 0, 0, PAGE), timeout=30)
    fresh_md = ray.get(victim.deregister_and_metadata.remote("kv"), timeout=30)
    assert ray.get(src.add_peer.remote(fresh_md), timeout=30) == "victim"
    with pytest.raises(TransferError, match="rejected"):
        ray.get(src.write_one.remote(kv, 0, 0, PAGE), timeout=30)
    ray.get(src.write_one.remote(kv2, 0, 0, PAGE), timeout=30)  # still registered: fine
    pid = ray.get(victim.pid.remote(), timeout=30)
    ray.kill(victim)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    ok, err = ray.get(src.write_until_error.remote(kv2, 100, 3.0), timeout=120)
    assert err in ("TransferError", "TransferTimeoutError"), (ok, err)
    assert ok <= 20  # NIXL notices the disconnect within about a second


@contextlib.contextmanager
def _spawned_pair(name: str, src: torch.Tensor):
    """An engine here with ``src`` registered as "kv", and a spawned target process (one
    notification expected) known as its peer: yields (engine, target's region, result queue)."""
    ctx = mp.get_context("spawn")
    md_q, res_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=P.spawned_target, args=(md_q, res_q, REGION, 1), daemon=True)
    child.start()
    engine = NixlTransferEngine(name)
    try:
        engine.register("kv", src)
        md, dst_desc = md_q.get(timeout=60)
        assert engine.add_peer(md) == "spawned-target"
        yield engine, dst_desc, res_q
    finally:
        engine.close()
        child.join(30)
    assert child.exitcode == 0


def test_spawned_processes_write_with_retry():
    src = P.pattern(REGION, 9)
    with _spawned_pair("spawned-source", src) as (engine, dst_desc, res_q):
        writes = P.random_pages(seed=4, n=64, region_bytes=REGION, page=PAGE)
        segs = [WriteSegment("kv", lo, n, dst_desc, ro) for lo, ro, n in writes]
        write_with_retry(engine, segs, b"landed", attempts=2, timeout_s=20)
        got, data = res_q.get(timeout=60)
        assert got == [("spawned-source", b"landed")]
        assert data == P.expected_after(writes, src, REGION).numpy().tobytes()


def test_a_prepared_write_reads_its_bytes_when_posted():
    """``prefill_and_push`` builds its WRITEs before the prefill wrote the send buffer: the
    bytes that land are the ones there at the post. A discarded or consumed preparation cannot
    be posted again."""
    src = torch.zeros(REGION, dtype=torch.uint8)
    with _spawned_pair("prepared-source", src) as (engine, dst_desc, res_q):
        writes = P.random_pages(seed=5, n=64, region_bytes=REGION, page=PAGE)
        segs = [WriteSegment("kv", lo, n, dst_desc, ro) for lo, ro, n in writes]
        spare = prepare_writes(engine, [(segs[:1], b"")])
        discard_prepared(engine, spare)
        assert spare[0].handle is None
        with pytest.raises(TransferError, match="already posted or discarded"):
            engine.post_prepared(spare[0])
        prepared = prepare_writes(engine, [(segs, b"landed")])
        assert prepared[0].handle is not None
        src.copy_(P.pattern(REGION, 11))  # "the prefill": after the WRITE was built
        write_all_with_retry(engine, prepared, attempts=2, timeout_s=20)
        assert prepared[0].handle is None  # consumed by its post
        got, data = res_q.get(timeout=60)
        assert got == [("prepared-source", b"landed")]
        assert data == P.expected_after(writes, src, REGION).numpy().tobytes()


def test_local_misuse_raises_transfer_error():
    engine = NixlTransferEngine("misuse")
    try:
        t = torch.zeros(PAGE, dtype=torch.uint8)
        desc = engine.register("a", t)
        with pytest.raises(TransferError):
            engine.register("a", t)
        with pytest.raises(TransferError):
            engine.register("strided", torch.zeros(8, 8)[:, ::2])
        with pytest.raises(TransferError, match="unknown peer"):
            engine.post_write([WriteSegment("a", 0, 16, desc, 0)])
        with pytest.raises(TransferError):
            engine.post_write([])
        with pytest.raises(TransferError):
            engine.poll(12345)
        engine.deregister("a")
        with pytest.raises(TransferError):
            engine.deregister("a")
    finally:
        engine.close()
        engine.close()  # idempotent


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("dst_device", ["cuda", "cpu"])
def test_gpu_source_lands_byte_exact(ray_cluster, dst_device):
    """On the GPU node: device region -> another actor's device region (CUDA IPC) or pinned host
    region (UCX's TCP-emulated path, which the landing code avoids but must still be correct)."""
    ray = ray_cluster
    Peer = ray.remote(num_cpus=0, num_gpus=0.5)(P.NixlPeer)
    src, dst = Peer.remote("gpu-src"), Peer.remote(f"gpu-dst-{dst_device}")
    try:
        (_, _), (dst_md, (dst_desc,)) = ray.get(
            [src.setup.remote(REGION, 5, ("kv",), "cuda"),
             dst.setup.remote(REGION, None, ("kv",), dst_device)], timeout=120)
        ray.get(src.add_peer.remote(dst_md), timeout=30)
        host, device = ray.get(src.supports_direct_host_write.remote(dst_desc.agent), timeout=30)
        assert host is True and device is False
        writes = P.random_pages(seed=8, n=128, region_bytes=REGION, page=PAGE)
        sent = ray.get(src.write.remote(dst_desc, writes, b"gpu-", 32), timeout=120)
        got, data = ray.get(dst.collect.remote(len(sent)), timeout=60)
        assert sorted(m for _, m in got) == sorted(sent)
        assert data == P.expected_after(writes, P.pattern(REGION, 5), REGION).numpy().tobytes()
    finally:
        ray.kill(src)
        ray.kill(dst)


@pytest.mark.parametrize("tls", ["shm", "^tcp", "rc,cuda_copy"])
def test_ucx_tls_without_tcp_is_refused(monkeypatch, tls):
    monkeypatch.setenv("UCX_TLS", tls)
    with pytest.raises(TransferError, match="UCX_TLS"):
        NixlTransferEngine("tls-check")
