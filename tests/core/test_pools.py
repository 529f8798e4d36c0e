"""Host block pool, device block pool and prefix index: each rule with literal values."""

import pickle

import pytest

from hisparse_ray.config import CoordinatorConfig, HiSparseConfig, KVLayout
from hisparse_ray.core import (
    HOT_GROUP, SOURCE_GROUP, DeviceBlockPool, HostBlockPool, PrefixIndex, chain_keys,
    device_pool_id, page_key,
)
from hisparse_ray.errors import ConfigError, DoubleFreeError, StateError


def test_host_allocate_free_list_order_and_exhaustion():
    pool = HostBlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None  # all or nothing
    assert (pool.num_free, pool.num_used, pool.num_cached) == (1, 2, 0)
    pool.check_invariants()


def test_host_release_unpublished_goes_free_published_goes_to_lru():
    pool = HostBlockPool(3)
    a, b = pool.allocate(2)
    assert pool.publish(b, b"k1") is True
    pool.release(a)
    pool.release(b)
    assert (pool.num_free, pool.num_cached, pool.available()) == (2, 1, 3)
    assert pool.index.lookup(b"k1") == b
    pool.check_invariants()


def test_host_lru_evicts_least_recently_released_and_drops_prefix_entry():
    pool = HostBlockPool(2)
    a, b = pool.allocate(2)
    pool.publish(a, b"ka")
    pool.publish(b, b"kb")
    pool.release(b)
    pool.release(a)  # b is older in the LRU
    (got,) = pool.allocate(1)
    assert got == b and pool.evictions == 1
    assert pool.index.lookup(b"kb") is None and pool.index.lookup(b"ka") == a
    pool.check_invariants()


def test_host_acquire_takes_block_out_of_lru_and_refcounts():
    pool = HostBlockPool(1)
    (a,) = pool.allocate(1)
    pool.publish(a, b"k")
    pool.release(a)
    pool.acquire(a)
    pool.acquire(a)
    assert (pool.refs(a), pool.available()) == (2, 0)
    pool.release(a)
    pool.release(a)
    assert pool.available() == 1
    with pytest.raises(DoubleFreeError):
        pool.release(a)
    pool.check_invariants()


def test_host_pinned_block_is_never_freed_or_evicted():
    pool = HostBlockPool(1)
    (a,) = pool.allocate(1)
    pool.publish(a, b"k")
    pool.pin(a)
    pool.release(a)
    assert (pool.available(), pool.num_used) == (0, 1)
    assert pool.allocate(1) is None
    pool.unpin(a)
    assert pool.num_cached == 1
    with pytest.raises(DoubleFreeError):
        pool.unpin(a)
    pool.check_invariants()


def test_host_duplicate_key_keeps_first_block_and_refuses_unowned():
    pool = HostBlockPool(3)
    a, b = pool.allocate(2)
    assert pool.publish(a, b"k") is True
    assert pool.publish(b, b"k") is False
    pool.release(b)
    assert pool.num_free == 2  # the duplicate stayed private, so it went back to the free list
    with pytest.raises(StateError):
        pool.publish(b, b"k2")
    with pytest.raises(StateError):
        pool.acquire(b)
    pool.check_invariants()


def test_device_lease_release_pin_rules():
    pool = DeviceBlockPool(3)
    assert pool.lease(2, "r") == [0, 1]
    assert pool.lease(2, "s") is None
    pool.pin(1)
    with pytest.raises(StateError):
        pool.release(1)  # a pinned lease waits for its ack
    pool.unpin(1)
    pool.release(1)
    with pytest.raises(DoubleFreeError):
        pool.release(1)
    assert (pool.num_free, pool.num_used, pool.owner(0)) == (2, 1, "r")
    pool.check_invariants()


def test_source_group_has_no_device_pool_id():
    with pytest.raises(StateError):
        device_pool_id(SOURCE_GROUP)
    with pytest.raises(StateError):
        DeviceBlockPool(2).lease(1, "r", SOURCE_GROUP)
    assert device_pool_id(HOT_GROUP) == 0


def test_chained_keys_depend_on_the_whole_prefix():
    k = chain_keys([1, 2, 3, 4, 5], 2)
    assert len(k) == 2  # the trailing partial page has no key
    assert k[1] == page_key(page_key(b"", [1, 2]), [3, 4])
    assert chain_keys([9, 2, 3, 4], 2)[1] != k[1]  # same page tokens, different parent
    assert chain_keys([1, 2, 3, 4], 2) == k


def test_prefix_index_match_stops_at_first_miss():
    idx = PrefixIndex()
    k = chain_keys([1, 2, 3, 4, 5, 6], 2)
    assert idx.insert(k[0], 7) and idx.insert(k[2], 9)
    assert idx.match(k) == [7]
    assert idx.insert(k[0], 8) is False
    idx.remove_block(7)
    assert idx.match(k) == [] and len(idx) == 1
    idx.check_invariants()


def test_coordinator_config_validation_and_derivation():
    cfg = CoordinatorConfig(num_device_blocks=4, num_host_blocks=8, page_size=4, device_buffer_size=4)
    assert cfg.hot_blocks_per_request == 2  # ceil((4 + 1) / 4)
    with pytest.raises(ConfigError) as e:
        CoordinatorConfig(num_device_blocks=1, num_host_blocks=8, page_size=4, device_buffer_size=4)
    assert e.value.key == "num_device_blocks"
    with pytest.raises(ConfigError):
        CoordinatorConfig(num_device_blocks=4, num_host_blocks=0, page_size=4, device_buffer_size=4)
    with pytest.raises(ConfigError):
        CoordinatorConfig(num_device_blocks=4, num_host_blocks=True, page_size=4, device_buffer_size=4)
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_host_capacity_rounds_down_to_whole_blocks():
    layout = KVLayout(num_layers=2, page_size=4, row_bytes=128)  # block = 2 * 4 * 128 = 1024 B
    hs = HiSparseConfig(top_k=4, device_buffer_size=8, host_pool_gib=(10 * 1024 + 1000) / (1 << 30))
    cfg = CoordinatorConfig.from_hisparse(hs, layout, num_device_blocks=16, tp_size=2)
    assert (cfg.num_host_blocks, cfg.page_bytes, cfg.row_bytes, cfg.tp_size) == (10, 1024, 256, 2)
    with pytest.raises(ConfigError):
        CoordinatorConfig.from_hisparse(HiSparseConfig(top_k=4, device_buffer_size=8,
                                                       host_pool_gib=1e-9), layout, 16)
