"""Fast-path options and the engine keys around them: every bad value is a ConfigError naming it."""

from __future__ import annotations

import pytest

from hisparse_ray.engine import EngineConfig
from hisparse_ray.errors import ConfigError
from hisparse_ray.fastpath.config import FastPathConfig


def test_bucket_is_the_smallest_that_holds_the_batch():
    c = FastPathConfig(buckets=(1, 2, 4, 8))
    assert [c.bucket(b) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert c.max_batch == 8
    with pytest.raises(ConfigError, match="buckets"):
        c.bucket(9)


def test_index_pages_per_request():
    assert FastPathConfig(max_context=64).index_pages_per_request == 1
    assert FastPathConfig(max_context=131072 + 1).index_pages_per_request == 2049


@pytest.mark.parametrize("kw,key", [
    (dict(max_context=0), "max_context"),
    (dict(buckets=()), "buckets"),
    (dict(buckets=[1, 2]), "buckets"),
    (dict(buckets=(2, 1)), "buckets"),
    (dict(buckets=(1, 1)), "buckets"),
    (dict(buckets=(0, 4)), "buckets"),
    (dict(index_key_dtype="int8"), "index_key_dtype"),
    (dict(attention="triton"), "attention"),
    (dict(logits="cublas"), "logits"),
    (dict(cuda_graphs=1), "cuda_graphs"),
    (dict(index_pages=0), "index_pages"),
    (dict(max_context=1000, index_pages=15), r"index_pages=15: must hold one request of "
                                             r"max_context=1000 positions \(16 pages"),
])
def test_bad_fast_options(kw, key):
    with pytest.raises(ConfigError, match=key):
        FastPathConfig(**kw)


@pytest.mark.parametrize("kw,key", [
    (dict(kv_cache_dtype="e5m2"), "kv_cache_dtype"),
    (dict(device_pool_gib=0), "device_pool_gib"),
    (dict(device_pool_gib=True), "device_pool_gib"),
    (dict(fast_path={"max_context": 8}), "fast_path"),
    (dict(max_batch=16, fast_path=FastPathConfig(buckets=(1, 8))), "max_batch=16"),
])
def test_bad_engine_keys(kw, key):
    with pytest.raises(ConfigError, match=key):
        EngineConfig(**kw)
