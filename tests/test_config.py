"""HiSparseConfig / KVLayout: the SGLang JSON round trip and every rejection with its message."""

import json

import pytest

from hisparse_ray.config import GIB, HiSparseConfig, KVLayout
from hisparse_ray.errors import ConfigError

SGLANG_EXAMPLE = '{"top_k": 2048, "device_buffer_size": 6144, "host_to_device_ratio": 10, "swap_in_block_size": 960}'


def test_sglang_json_round_trip():
    cfg = HiSparseConfig.from_json(SGLANG_EXAMPLE)
    assert (cfg.top_k, cfg.device_buffer_size, cfg.host_to_device_ratio, cfg.swap_in_block_size) == (
        2048, 6144, 10, 960)
    again = HiSparseConfig.from_json(cfg.to_json())
    assert again == cfg
    dumped = json.loads(cfg.to_json())
    assert {k: dumped[k] for k in json.loads(SGLANG_EXAMPLE)} == json.loads(SGLANG_EXAMPLE)
    assert cfg.hot_slots == 6145


@pytest.mark.parametrize(
    "kwargs, key, fragment",
    [
        ({"top_k": 0}, "top_k", "must be >= 1"),
        ({"top_k": -5}, "top_k", "must be >= 1"),
        ({"top_k": 2.5}, "top_k", "must be an integer"),
        ({"top_k": True}, "top_k", "must be an integer"),
        ({"device_buffer_size": 0}, "device_buffer_size", "must be >= 1"),
        ({"top_k": 2048, "device_buffer_size": 1024}, "device_buffer_size", "must be >= top_k (2048)"),
        ({"host_to_device_ratio": 0}, "host_to_device_ratio", "must be >= 1"),
        ({"host_to_device_ratio": -1}, "host_to_device_ratio", "must be >= 1"),
        ({"swap_in_block_size": 32}, "swap_in_block_size", "multiple of 32 in [64, 1024]"),
        ({"swap_in_block_size": 0}, "swap_in_block_size", "multiple of 32 in [64, 1024]"),
        ({"swap_in_block_size": 1056}, "swap_in_block_size", "multiple of 32 in [64, 1024]"),
        ({"swap_in_block_size": 100}, "swap_in_block_size", "multiple of 32 in [64, 1024]"),
        ({"host_pool_gib": 0}, "host_pool_gib", "must be a finite number > 0"),
        ({"host_pool_gib": -1.0}, "host_pool_gib", "must be a finite number > 0"),
        ({"host_pool_gib": float("nan")}, "host_pool_gib", "must be a finite number > 0"),
        ({"host_pool_gib": "4"}, "host_pool_gib", "must be a finite number > 0"),
    ],
)
def test_rejections_name_key_value_and_rule(kwargs, key, fragment):
    with pytest.raises(ConfigError) as ei:
        HiSparseConfig(**kwargs)
    err = ei.value
    assert err.key == key
    assert err.value == kwargs[key] or err.value != err.value  # nan != nan
    msg = str(err)
    assert msg.startswith(f"invalid config {key}=")
    assert fragment in msg


def test_unknown_key_and_malformed_json():
    with pytest.raises(ConfigError) as ei:
        HiSparseConfig.from_json('{"top_k": 16, "device_buffer_sz": 64}')
    assert ei.value.key == "device_buffer_sz"
    assert "unknown key; allowed keys: ['device_buffer_size'" in str(ei.value)

    with pytest.raises(ConfigError) as ei:
        HiSparseConfig.from_json('{"top_k": 16,')
    assert ei.value.key == "hisparse-config"
    assert "must be valid JSON" in str(ei.value)

    with pytest.raises(ConfigError, match="must be a JSON object"):
        HiSparseConfig.from_json("[1, 2]")


def test_config_is_frozen():
    cfg = HiSparseConfig()
    with pytest.raises(AttributeError):
        cfg.top_k = 3  # type: ignore[misc]


def test_layout_capacities():
    bf16 = KVLayout(num_layers=61, kv_dtype="bf16", page_size=64)
    assert bf16.bytes_per_token_layer == 1152
    assert bf16.bytes_per_token == 1152 * 61
    assert bf16.block_bytes == 1152 * 64 * 61 == 4_497_408
    assert bf16.host_blocks(4.0) == (4 * GIB) // 4_497_408 == 954  # rounded down
    fp8 = KVLayout(num_layers=61, kv_dtype="fp8", page_size=64)
    assert fp8.bytes_per_token_layer == 656
    assert fp8.host_blocks(1.0) == GIB // (656 * 64 * 61)
    assert KVLayout(num_layers=2, row_bytes=24, page_size=4).block_bytes == 24 * 4 * 2
    assert bf16.pages_for(0) == 0 and bf16.pages_for(1) == 1 and bf16.pages_for(65) == 2


@pytest.mark.parametrize(
    "kwargs, key",
    [({"num_layers": 0}, "num_layers"), ({"kv_dtype": "fp16"}, "kv_dtype"),
     ({"page_size": 0}, "page_size"), ({"row_bytes": 0}, "row_bytes")],
)
def test_layout_rejections(kwargs, key):
    with pytest.raises(ConfigError) as ei:
        KVLayout(**kwargs)
    assert ei.value.key == key and key in str(ei.value)
