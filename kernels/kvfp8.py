"""KV-row and index-key byte codecs (ring 2: torch only): how one token's MLA row is stored in the
host pool, the hot buffer and the landing bytes, for each KV-cache dtype.

An MLA row is ``kv_lora_rank`` (R) latent values followed by ``qk_rope_head_dim`` (r) rope values.

* ``"fp32"`` / ``"bf16"`` rows: the R + r values in that dtype (bf16 at DeepSeek-V3.2's shape:
  576 values = 1152 B).
* ``"fp8"`` rows, DeepSeek-V3.2's layout (the one FlashMLA's sparse fp8 decode reads, 656 B at
  R = 512, r = 64): R e4m3 latent values, then ``ceil(R / 128)`` fp32 scales (one per tile of 128
  latent values, little-endian), then r bf16 rope values. A tile's scale is ``amax / 448`` (448 =
  e4m3's largest finite value), floored at fp32's smallest normal number so an all-zero tile
  stays zero; value ``i`` decodes as ``e4m3[i] * scale[i // 128]``.

Quantization is plain torch arithmetic (fp32 divide, round-to-nearest-even cast), so CPU and GPU
produce identical bytes (tested on the H200). The dequantizing path is the reference that
FlashMLA's fp8 kernel is compared with.

Index keys in fp8 (DeepSeek's indexer cache, what ``sgl-deep-gemm``'s paged logits read): one
e4m3 vector of ``index_head_dim`` values plus one fp32 scale per token (132 B at 128 dims); the
paged layout is in :mod:`hisparse_ray.fastpath.index_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hisparse_ray.config import FP8_TILE, KV_CACHE_DTYPES, kv_row_bytes
from hisparse_ray.errors import ConfigError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
TILE = FP8_TILE  # latent values per fp8 scale
FP8 = torch.float8_e4m3fn
_TINY = torch.finfo(torch.float32).tiny
KV_DTYPES = KV_CACHE_DTYPES


def fp8_scale(amax: Tensor) -> Tensor:
    """``amax / 448``, the e4m3 scale of a group whose largest magnitude is ``amax``, by true
    division on every device: CUDA computes ``tensor / python_scalar`` as a multiply by the
    rounded reciprocal (CPU divides), which changed some scales' last bit between CPU and GPU
    encodes. Every fp8 quantizer of the project (KV rows, index keys, weights, the activations'
    torch twin) takes its scales from here."""
    return amax / amax.new_full((), FP8_MAX)


def quantize_fp8(x: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    """``x [..., n]`` float -> ``(q [..., n] float8_e4m3fn, scales [..., ceil(n / tile)] fp32)``:
    per tile of ``tile`` values, ``scale = max(amax / 448, fp32 tiny)``, ``q = x / scale``. The last
    tile may be partial. Same device as ``x``."""
    n = x.shape[-1]
    tiles = -(-n // tile)
    xf = x.float()
    if tiles * tile != n:
        xf = torch.nn.functional.pad(xf, (0, tiles * tile - n))
    xt = xf.unflatten(-1, (tiles, tile))
    scale = fp8_scale(xt.abs().amax(-1)).clamp_min(_TINY)
    q = (xt / scale[..., None]).to(FP8).flatten(-2)[..., :n]
    return q, scale


def dequantize_fp8(q: Tensor, scales: Tensor, tile: int) -> Tensor:
    """Inverse of :func:`quantize_fp8`: ``q [..., n]`` e4m3, ``scales [..., tiles]`` -> fp32 ``[..., n]``."""
    n = q.shape[-1]
    per = scales.repeat_interleave(tile, dim=-1)[..., :n]
    return q.float() * per


@dataclass(frozen=True, slots=True)
class KVRowCodec:
    """Bytes of one token's MLA row for one KV-cache dtype (``"fp32"``, ``"bf16"`` or ``"fp8"``).

    ``encode(rows [..., R + r] float) -> [..., row_bytes] uint8`` and ``decode(bytes, dtype) ->
    [..., R + r]`` (lossless for fp32/bf16 storage of values of that dtype; fp8 dequantizes the
    latent). Both run on the tensor's device.
    """

    kind: str
    kv_lora_rank: int
    rope_dim: int

    def __post_init__(self) -> None:
        kv_row_bytes(self.kind, self.kv_lora_rank, self.rope_dim)  # ConfigError on a bad kind / shape

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def tiles(self) -> int:
        return -(-self.kv_lora_rank // TILE)

    @property
    def row_bytes(self) -> int:
        return kv_row_bytes(self.kind, self.kv_lora_rank, self.rope_dim)

    @property
    def storage_dtype(self) -> torch.dtype | None:
        """The element dtype of fp32/bf16 rows; None for fp8 (mixed layout)."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.kind)

    def encode(self, rows: Tensor) -> Tensor:
        if rows.shape[-1] != self.row_dim:
            raise ValueError(f"rows have {rows.shape[-1]} values, the codec {self.row_dim}")
        lead = rows.shape[:-1]
        if self.kind != "fp8":
            data = rows.to(self.storage_dtype).contiguous().view(torch.uint8)
            return data.reshape(*lead, self.row_bytes)
        R = self.kv_lora_rank
        q, scale = quantize_fp8(rows[..., :R], TILE)
        rope = rows[..., R:].to(torch.bfloat16).contiguous()
        return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8),
                          rope.view(torch.uint8)], dim=-1)

    def decode(self, data: Tensor, dtype: torch.dtype) -> Tensor:
        if data.dtype != torch.uint8 or data.shape[-1] != self.row_bytes:
            raise ValueError(f"expected [..., {self.row_bytes}] uint8, got {tuple(data.shape)} {data.dtype}")
        if self.kind != "fp8":
            return data.contiguous().view(self.storage_dtype).to(dtype)
        R, t = self.kv_lora_rank, self.tiles
        q = data[..., :R].contiguous().view(FP8)
        scale = data[..., R:R + 4 * t].contiguous().view(torch.float32)
        rope = data[..., R + 4 * t:].contiguous().view(torch.bfloat16)
        return torch.cat([dequantize_fp8(q, scale, TILE).to(dtype), rope.to(dtype)], dim=-1)


def resolve_kv_dtype(value: str, model_dtype: torch.dtype) -> str:
    """The config value ``"auto"`` (= the model's dtype) | ``"fp32"`` | ``"bf16"`` | ``"fp8"`` -> a
    codec kind; ConfigError names anything else."""
    if value == "auto":
        if model_dtype == torch.float32:
            return "fp32"
        if model_dtype == torch.bfloat16:
            return "bf16"
        raise ConfigError("kv_cache_dtype", value, f"'auto' needs a fp32 or bf16 model, got {model_dtype}")
    if value not in KV_DTYPES:
        raise ConfigError("kv_cache_dtype", value, f"must be 'auto' or one of {KV_DTYPES}")
    return value


def row_codec(value: str, model_cfg, model_dtype: torch.dtype) -> KVRowCodec:
    """The row codec of config value ``value`` for a model config (``kv_lora_rank``,
    ``qk_rope_head_dim``) of parameter dtype ``model_dtype``."""
    return KVRowCodec(resolve_kv_dtype(value, model_dtype), model_cfg.kv_lora_rank,
                      model_cfg.qk_rope_head_dim)
