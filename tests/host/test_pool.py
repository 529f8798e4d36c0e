"""Host pool lifecycle on CPU: layout, sharing, capacity checks, memory accounting, stale cleanup."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal

import pytest
import torch

from hisparse_ray.config import GIB, HiSparseConfig, KVLayout
from hisparse_ray.errors import HostPoolError
from hisparse_ray.host.pool import (
    HEADER_BYTES, MAX_REGISTER_BYTES, HostPool, HostSharing, cleanup_stale, register_chunks,
    list_segments, mem_available_bytes, physical_pool_bytes, pool_bytes,
)
from tests.host import _hammer

PREFIX = f"hs-test-pool-{os.getpid()}"
LAYOUT = KVLayout(num_layers=4, page_size=16, row_bytes=40)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    leftovers = list_segments(PREFIX)
    for name in leftovers:
        os.unlink(os.path.join("/dev/shm", name))
    assert leftovers == []


def test_layer_views_are_layer_major_and_shared_with_peers():
    with HostPool.create("r", LAYOUT, 5, register_cuda=False, prefix=PREFIX) as owner:
        assert owner.layer(0).shape == (5 * 16, 40) and owner.layer(0).dtype == torch.uint8
        assert owner.block_rows(2) == slice(32, 48)
        with HostPool.attach(owner.name, register_cuda=False) as peer:
            assert peer.layout == LAYOUT and peer.num_blocks == 5 and not peer.is_owner
            for l in range(4):
                owner.block(l, 3).fill_(10 + l)
            for l in range(4):
                assert bool((peer.block(l, 3) == 10 + l).all())
                assert int(peer.layer(l).sum()) == (10 + l) * 16 * 40  # no overlap between layers
            starts = [peer.layer(l).data_ptr() - peer.layer(0).data_ptr() for l in range(4)]
            assert starts == [l * owner.layer_stride for l in range(4)]
            assert owner.layer_stride % 4096 == 0 and owner.layer_stride >= 5 * 16 * 40
        with pytest.raises(HostPoolError):
            owner.block_rows(5)


def test_capacity_from_config_and_header_roundtrip():
    cfg = HiSparseConfig(host_pool_gib=0.001)
    n = LAYOUT.host_blocks(cfg.host_pool_gib)
    assert n == int(0.001 * GIB) // LAYOUT.block_bytes
    with HostPool.create_for_capacity("cfg", LAYOUT, cfg.host_pool_gib, register_cuda=False,
                                      prefix=PREFIX) as pool:
        assert pool.num_blocks == n
        assert pool.nbytes == pool_bytes(LAYOUT, n) == os.stat(pool.path).st_size
        assert pool.rows * LAYOUT.bytes_per_token_layer * LAYOUT.num_layers <= 0.001 * GIB


def test_memory_accounting_is_one_segment_whatever_the_tp_size():
    tp = 4
    with HostPool.create("acct", LAYOUT, 64, register_cuda=False, prefix=PREFIX) as owner:
        peers = [HostPool.attach(owner.name, register_cuda=False) for _ in range(tp - 1)]
        assert list_segments(PREFIX) == [owner.name]
        st = os.stat(owner.path)
        assert st.st_size == pool_bytes(LAYOUT, 64)
        assert st.st_blocks * 512 >= st.st_size  # pre-allocated, not sparse
        for p in peers:
            p.close()
    assert physical_pool_bytes(LAYOUT, 64, tp, HostSharing.SHARED) == pool_bytes(LAYOUT, 64)
    assert physical_pool_bytes(LAYOUT, 64, tp, HostSharing.PRIVATE) == tp * pool_bytes(LAYOUT, 64)


def test_two_replicas_with_the_same_id_do_not_collide():
    with HostPool.create("same", LAYOUT, 2, register_cuda=False, prefix=PREFIX) as a, \
            HostPool.create("same", LAYOUT, 2, register_cuda=False, prefix=PREFIX) as b:
        assert a.name != b.name
        a.layer(0).fill_(1)
        assert int(b.layer(0).sum()) == 0


def test_refuses_a_pool_over_95_percent_of_available_memory():
    avail = mem_available_bytes()
    blocks = int(0.96 * avail) // LAYOUT.block_bytes + 1
    with pytest.raises(HostPoolError, match="exceeds 95% of available memory") as info:
        HostPool.create("big", LAYOUT, blocks, register_cuda=False, prefix=PREFIX)
    assert str(pool_bytes(LAYOUT, blocks)) in str(info.value)
    err = pickle.loads(pickle.dumps(info.value))
    assert str(err) == str(info.value)


def test_capacity_below_one_block_is_refused():
    with pytest.raises(HostPoolError, match="no whole host block"):
        HostPool.create_for_capacity("tiny", LAYOUT, 1e-9, register_cuda=False, prefix=PREFIX)


@pytest.mark.parametrize("bad", ["", "a/b"])
def test_rejects_bad_replica_ids(bad):
    with pytest.raises(HostPoolError):
        HostPool.create(bad, LAYOUT, 1, register_cuda=False, prefix=PREFIX)


def test_owner_only_operations_and_closed_pool():
    with HostPool.create("own", LAYOUT, 1, register_cuda=False, prefix=PREFIX) as owner:
        peer = HostPool.attach(owner.name, register_cuda=False)
        for op in (peer.publish, peer.destroy):
            with pytest.raises(HostPoolError, match="owner"):
                op()
        view = peer.layer(0)
        peer.close()
        peer.close()  # idempotent
        with pytest.raises(HostPoolError, match="closed"):
            peer.layer(0)
        owner.layer(0).fill_(3)
        assert int(view[0, 0]) == 3  # a held view keeps the mapping alive after close
    with pytest.raises(HostPoolError, match="cannot open"):
        HostPool.attach(owner.name, register_cuda=False)


def _spawn_many(target, *arg_tuples):
    """Start one spawned process per argument tuple (in parallel); (process, first message) each."""
    ctx = mp.get_context("spawn")
    started = []
    for args in arg_tuples:
        queue = ctx.Queue()
        proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
        proc.start()
        started.append((proc, queue))
    return [(proc, queue.get(timeout=120)) for proc, queue in started]


def _spawn(target, *args):
    return _spawn_many(target, args)[0]


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)


def test_segment_of_a_killed_owner_is_removed_at_start():
    (p1, name1), (p2, _) = _spawn_many(_hammer.hold_pool_process, ("crash", PREFIX), ("crash2", PREFIX))
    assert name1 in list_segments(PREFIX)
    with HostPool.create("live", LAYOUT, 1, register_cuda=False, prefix=PREFIX) as live:
        assert len(list_segments(PREFIX)) == 3  # both owners still alive: untouched
        _kill(p1)
        assert cleanup_stale(PREFIX) == [name1]
        assert live.name in list_segments(PREFIX)  # the live pool survives cleanup
        _kill(p2)
        with HostPool.create("next", LAYOUT, 1, register_cuda=False, prefix=PREFIX) as nxt:
            assert list_segments(PREFIX) == sorted([live.name, nxt.name])  # create() cleaned up


def test_teardown_leaves_nothing_after_a_killed_peer():
    owner = HostPool.create("peerkill", LAYOUT, 2, register_cuda=False, prefix=PREFIX)
    proc, total = _spawn(_hammer.attach_and_hold_process, owner.name)
    assert total == 0
    _kill(proc)
    owner.destroy()
    assert list_segments(PREFIX) == []


def test_an_unlinked_pool_stays_shared_and_a_killed_owner_leaves_nothing(private_shm):
    """Issue 15 item 8: rank 0 unlinks the segment's name once its peer attached. The directory
    (a private one on /dev/shm's tmpfs) is then empty while both still share the memory, and
    SIGKILL of rank 0 leaves nothing there: the memory lives on in the peer's mapping only and
    goes with it (``mapped_segments`` reads /proc/<pid>/maps, where it shows "(deleted)")."""
    from hisparse_ray.host.segment import mapped_segments

    ctx = mp.get_context("spawn")
    attached, queue = ctx.Event(), ctx.Queue()
    owner = ctx.Process(target=_hammer.unlinking_owner_process,
                        args=(private_shm, PREFIX, attached, queue), daemon=True)
    owner.start()
    try:
        name = queue.get(timeout=120)
        assert os.listdir(private_shm) == [name]  # before every peer attached: named
        peer = HostPool.attach(name, register_cuda=False, shm_dir=private_shm)
        attached.set()
        assert queue.get(timeout=120) == "unlinked"
        assert os.listdir(private_shm) == []
        assert set(mapped_segments(owner.pid, PREFIX, private_shm)) == {name}
        assert set(mapped_segments("self", PREFIX, private_shm)) == {name}
        _kill(owner)
        assert os.listdir(private_shm) == []
        for l in range(_hammer.LAYOUT.num_layers):  # the owner's bytes, still shared memory
            assert bool((peer.block(l, 1).view(torch.int64) == _hammer.stamp(1, 1, l)).all())
        assert peer.published() == 1
        peer.close()
        assert mapped_segments("self", PREFIX, private_shm) == {}
        with pytest.raises(HostPoolError, match="cannot open"):
            HostPool.attach(name, register_cuda=False, shm_dir=private_shm)
    finally:
        if owner.is_alive():
            _kill(owner)


def test_unlink_is_for_the_owner_and_idempotent(private_shm):
    with HostPool.create("u", LAYOUT, 2, register_cuda=False, prefix=PREFIX,
                         shm_dir=private_shm) as owner:
        with HostPool.attach(owner.name, register_cuda=False, shm_dir=private_shm) as peer:
            with pytest.raises(HostPoolError, match="owner"):
                peer.unlink()
            owner.unlink()
            owner.unlink()
            assert owner.unlinked and os.listdir(private_shm) == []
            owner.block(0, 1).fill_(9)
            assert int(peer.block(0, 1)[0, 0]) == 9
    assert os.listdir(private_shm) == []  # destroy after unlink: nothing to remove, no error


def test_register_chunks_cover_the_segment_within_the_limit():
    gib = GIB
    for stride, layers in [(8 * gib, 61), (100 * gib, 3), (64 * gib, 2), (4096, 1)]:
        chunks = register_chunks(0, HEADER_BYTES, stride, layers)
        assert chunks[0][0] == 0
        assert all(size <= MAX_REGISTER_BYTES for _, size in chunks)
        assert sum(size for _, size in chunks) == HEADER_BYTES + stride * layers
        assert all(a + s == b for (a, s), (b, _) in zip(chunks, chunks[1:]))
    # 8 GiB layers: chunk borders fall on layer borders
    for ptr, size in register_chunks(0, HEADER_BYTES, 8 * gib, 61)[1:]:
        assert (ptr - HEADER_BYTES) % (8 * gib) == 0
