"""KV-row codecs: DeepSeek-V3.2's fp8 row layout byte for byte, round trips, and CPU == GPU bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from hisparse_ray.errors import ConfigError
from hisparse_ray.kernels.kvfp8 import FP8, KVRowCodec, quantize_fp8, resolve_kv_dtype, row_codec
from hisparse_ray.model.config import tiny_config


def rows(n, dim, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * scale


def test_fp8_row_is_deepseek_layout_byte_for_byte():
    c = KVRowCodec("fp8", 512, 64)
    assert c.row_bytes == 656 and c.tiles == 4
    x = rows(3, 576)
    data = c.encode(x)
    assert data.shape == (3, 656) and data.dtype == torch.uint8
    raw = data[1].numpy().tobytes()
    for t in range(4):  # bytes 512..527: 4 little-endian fp32 scales = tile amax / 448
        (scale,) = struct.unpack_from("<f", raw, 512 + 4 * t)
        amax = float(x[1, 128 * t: 128 * (t + 1)].abs().max())
        assert scale == pytest.approx(amax / 448.0, rel=1e-6)
        # the tile's 128 e4m3 bytes are x / scale rounded to e4m3
        want = (x[1, 128 * t: 128 * (t + 1)] / torch.tensor(scale)).to(FP8).view(torch.uint8)
        assert raw[128 * t: 128 * (t + 1)] == want.numpy().tobytes()
    rope = np.frombuffer(raw[528:], dtype=np.uint16)  # 64 bf16 values: the top halves of fp32
    want_rope = x[1, 512:].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (rope == want_rope).all()


def test_fp8_round_trip_error_and_idempotence():
    c = KVRowCodec("fp8", 512, 64)
    x = rows(64, 576, seed=1)
    y = c.decode(c.encode(x), torch.float32)
    lat, tiles = x[:, :512].view(64, 4, 128), (y - x)[:, :512].view(64, 4, 128)
    # e4m3 keeps 3 mantissa bits: |error| <= half a step of the tile's top binade = amax / 16
    assert bool((tiles.abs() <= lat.abs().amax(-1, keepdim=True) / 16 + 1e-12).all())
    assert torch.equal(y[:, 512:], x[:, 512:].to(torch.bfloat16).float())
    assert torch.equal(c.encode(y), c.encode(x))  # decoded rows re-encode to the same bytes


def test_zero_tiles_stay_zero_and_partial_tiles():
    c = KVRowCodec("fp8", 32, 16)  # tiny models: one partial tile of 32 values
    assert c.row_bytes == 32 + 4 + 32
    x = rows(5, 48)
    x[2] = 0.0
    y = c.decode(c.encode(x), torch.float32)
    assert torch.equal(y[2], torch.zeros(48)) and torch.isfinite(y).all()
    assert (y - x)[:, :32].abs().max() <= x[:, :32].abs().max() / 16


@pytest.mark.parametrize("kind,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_plain_rows_are_lossless(kind, dtype):
    c = KVRowCodec(kind, 32, 16)
    x = rows(4, 48).to(dtype)
    assert c.row_bytes == 48 * x.element_size()
    assert torch.equal(c.decode(c.encode(x), dtype), x)


def test_quantize_fp8_scales_per_tile():
    x = torch.tensor([[1.0, -4.0, 0.5, 2.0]])
    q, s = quantize_fp8(x, 2)
    assert torch.allclose(s, torch.tensor([[4.0 / 448, 2.0 / 448]]))
    assert q.float()[0, 1] == -448.0 and q.float()[0, 3] == 448.0


def test_kv_dtype_resolution_and_errors():
    cfg = tiny_config()
    assert resolve_kv_dtype("auto", torch.float32) == "fp32"
    assert resolve_kv_dtype("auto", torch.bfloat16) == "bf16"
    assert row_codec("fp8", cfg, torch.float32).row_bytes == 32 + 4 + 32
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        resolve_kv_dtype("int4", torch.float32)
    with pytest.raises(ConfigError, match="'auto' needs"):
        resolve_kv_dtype("auto", torch.float16)
    with pytest.raises(ConfigError, match="kv_lora_rank % 4"):
        KVRowCodec("fp8", 30, 16)


@pytest.mark.gpu
def test_cpu_and_gpu_encode_identical_bytes():
    c = KVRowCodec("fp8", 512, 64)
    x = rows(256, 576, seed=3).to(torch.bfloat16)
    cpu = c.encode(x)
    gpu = c.encode(x.cuda()).cpu()
    assert torch.equal(cpu, gpu)
    assert torch.equal(c.decode(cpu, torch.bfloat16), c.decode(gpu.cuda(), torch.bfloat16).cpu())
