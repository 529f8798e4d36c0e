"""The engine contract on the in-process loopback (what code above the transport is tested
against), and the retry helper's behaviour on success, failure and deadline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import TransferError, TransferTimeoutError
from hisparse_ray.transfer import (
    LoopbackFabric,
    LoopbackTransferEngine,
    MemKind,
    RegionDesc,
    TransferEngine,
    WriteSegment,
    XferState,
    coalesce,
    wait,
    write_with_retry,
)


@pytest.fixture
def pair():
    fabric = LoopbackFabric()
    a = LoopbackTransferEngine(fabric, "a")
    b = LoopbackTransferEngine(fabric, "b", direct_host_write=False)
    src = torch.arange(4096, dtype=torch.int32)  # 16 KiB, any dtype: regions are bytes
    dst = torch.zeros(16384, dtype=torch.uint8)
    a.register("src", src)
    dst_desc = b.register("dst", dst)
    assert a.add_peer(b.agent_metadata()) == "b"
    b.add_peer(a.agent_metadata())
    yield a, b, src, dst, dst_desc
    a.close()
    b.close()


def test_satisfies_the_protocol(pair):
    assert isinstance(pair[0], TransferEngine)


def test_write_lands_bytes_and_notifies_once(pair):
    a, b, src, dst, dst_desc = pair
    segs = [WriteSegment("src", 0, 64, dst_desc, 1000), WriteSegment("src", 128, 8, dst_desc, 0)]
    xfer = a.post_write(segs, b"n1")
    assert a.poll(xfer) is XferState.DONE
    a.release(xfer)
    raw = src.view(torch.uint8)
    assert torch.equal(dst[1000:1064], raw[:64]) and torch.equal(dst[0:8], raw[128:136])
    assert b.take_notifications() == [("a", b"n1")]
    assert b.take_notifications() == []
    with pytest.raises(TransferError):
        a.poll(xfer)  # released


def test_spans_peers_and_regions_are_checked(pair):
    a, b, _, _, dst_desc = pair
    with pytest.raises(TransferError, match="outside region"):
        a.post_write([WriteSegment("src", 0, 64, dst_desc, 16384 - 8)])
    with pytest.raises(TransferError, match="not registered"):
        a.post_write([WriteSegment("nope", 0, 64, dst_desc, 0)])
    b.deregister("dst")
    with pytest.raises(TransferError, match="not registered"):
        a.post_write([WriteSegment("src", 0, 64, dst_desc, 0)])
    a.remove_peer("b")
    with pytest.raises(TransferError, match="unknown peer"):
        a.post_write([WriteSegment("src", 0, 64, dst_desc, 0)])


def test_direct_host_write_policy(pair):
    a, b, *_ = pair
    assert a.supports_direct_host_write("b") is True
    assert b.supports_direct_host_write("a", MemKind.DEVICE) is False
    assert b.supports_direct_host_write("a", MemKind.HOST) is True
    with pytest.raises(TransferError):
        a.supports_direct_host_write("stranger")


def test_write_with_retry_succeeds_and_reports_failure(pair):
    a, b, src, dst, dst_desc = pair
    write_with_retry(a, [WriteSegment("src", 4, 4, dst_desc, 8)], b"ok", attempts=2, timeout_s=1)
    assert torch.equal(dst[8:12], src.view(torch.uint8)[4:8])
    b.deregister("dst")
    with pytest.raises(TransferError, match="after 3 attempt") as ei:
        write_with_retry(a, [WriteSegment("src", 0, 4, dst_desc, 0)], attempts=3,
                         timeout_s=1, request_id="r7")
    assert ei.value.request_id == "r7"
    with pytest.raises(ValueError):
        write_with_retry(a, [WriteSegment("src", 0, 4, dst_desc, 0)], attempts=0)


def test_pending_writes_land_on_completion_and_deadline_gives_timeout():
    fabric = LoopbackFabric()
    a = LoopbackTransferEngine(fabric, "a", pending_polls=3)
    b = LoopbackTransferEngine(fabric, "b")
    a.register("src", torch.full((64,), 7, dtype=torch.uint8))
    dst = torch.zeros(64, dtype=torch.uint8)
    desc = b.register("dst", dst)
    a.add_peer(b.agent_metadata())
    xfer = a.post_write([WriteSegment("src", 0, 8, desc, 0)], b"late")
    assert [a.poll(xfer) for _ in range(3)] == [XferState.PENDING] * 3
    assert int(dst.sum()) == 0 and b.take_notifications() == []  # nothing lands early
    assert a.poll(xfer) is XferState.DONE
    assert int(dst.sum()) == 56 and b.take_notifications() == [("a", b"late")]

    stuck = LoopbackTransferEngine(fabric, "stuck", pending_polls=10**9)
    stuck.register("src", torch.zeros(64, dtype=torch.uint8))
    stuck.add_peer(b.agent_metadata())
    xfer = stuck.post_write([WriteSegment("src", 0, 8, desc, 0)])
    with pytest.raises(TransferTimeoutError):
        wait(stuck, xfer, timeout_s=0.01)
    assert stuck.poll(xfer) is XferState.PENDING  # wait leaves the id live
    with pytest.raises(TransferTimeoutError, match="after 2 attempt"):
        write_with_retry(stuck, [WriteSegment("src", 0, 8, desc, 0)], attempts=2, timeout_s=0.01)
    with pytest.raises(ValueError):
        LoopbackTransferEngine(fabric, "bad", pending_polls=-1)


def test_agent_names_are_unique_per_fabric():
    fabric = LoopbackFabric()
    LoopbackTransferEngine(fabric, "x")
    with pytest.raises(TransferError):
        LoopbackTransferEngine(fabric, "x")


_REMOTES = [RegionDesc("peer", name, 0, 4096, 0, MemKind.HOST) for name in ("r0", "r1")]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["l0", "l1"]), st.integers(0, 3000),
                          st.integers(1, 64), st.sampled_from([0, 1]), st.integers(0, 3000),
                          st.booleans()), max_size=30))
def test_coalesce_moves_the_same_bytes_with_fewer_segments(raw):
    """Segments (some made to continue the previous one) applied in order to a byte model give
    the same result before and after coalescing."""
    segs: list[WriteSegment] = []
    for local, lo, n, r, ro, chain in raw:
        if chain and segs:
            p = segs[-1]
            local, lo, r, ro = p.local, p.local_offset + p.nbytes, _REMOTES.index(p.remote), \
                p.remote_offset + p.nbytes
        segs.append(WriteSegment(local, lo, n, _REMOTES[r], ro))

    def apply(segments):
        src = {"l0": bytes(range(256)) * 32, "l1": bytes(reversed(range(256))) * 32}  # 8 KiB
        dst = {"r0": bytearray(8192), "r1": bytearray(8192)}
        for s in segments:
            dst[s.remote.name][s.remote_offset:s.remote_offset + s.nbytes] = \
                src[s.local][s.local_offset:s.local_offset + s.nbytes]
        return dst

    merged = coalesce(segs)
    assert apply(merged) == apply(segs)
    assert len(merged) <= len(segs)
    assert sum(s.nbytes for s in merged) == sum(s.nbytes for s in segs)
    if segs and all(c for *_, c in raw[1:]):
        assert len(merged) == 1


def test_region_desc_pickles_by_value_and_unpickles_to_one_shared_instance():
    import pickle

    from hisparse_ray.transfer import MemKind, RegionDesc

    descs = [RegionDesc("agent-a", f"layer.{l}", 1 << 40 | l * 4096, 4096, d, kind)
             for l in range(3) for d, kind in ((0, MemKind.HOST), (1, MemKind.DEVICE))]
    for d in descs:
        back = pickle.loads(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == d and type(back.kind) is MemKind and back.kind is d.kind
        # frozen: equal values share one rebuilt instance (the cache behind unpickling)
        assert pickle.loads(pickle.dumps(d)) is back
    assert len({id(pickle.loads(pickle.dumps(d))) for d in descs}) == len(descs)


def test_region_columns_round_trip_and_fall_back_for_mixed_regions():
    from hisparse_ray.transfer import MemKind, RegionDesc
    from hisparse_ray.types import region_columns, regions_from_columns

    layers = tuple(RegionDesc("rank0", f"staging.{l}", 4096 * (l + 1), 4096, 0, MemKind.DEVICE)
                   for l in range(5))
    cols = region_columns(layers)
    assert cols[0] == "rank0" and cols[3] == tuple(f"staging.{l}" for l in range(5))
    assert region_columns(layers) is cols  # memoized per tuple object
    back = regions_from_columns(cols)
    assert back == layers and regions_from_columns(cols) is back
    mixed = layers[:2] + (RegionDesc("rank1", "x", 1, 1, 0, MemKind.DEVICE),)
    other_kind = layers[:2] + (RegionDesc("rank0", "h", 1, 1, 0, MemKind.HOST),)
    for regions in (mixed, other_kind, ()):
        assert region_columns(regions) is regions and regions_from_columns(regions) is regions
