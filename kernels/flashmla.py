"""Thin adapter to FlashMLA's sm90 sparse MLA kernels in ``sglang-kernel`` (ring 2; the ``gpu``
extra). Imported lazily: CI has neither the library nor CUDA.

Layout this module states and checks (DeepSeek-V3.2's MLA: 512 latent + 64 rope values a row):

* queries ``q [B, Hq, 576]`` bf16 with ``Hq`` 64 or 128 (pad heads with zeros: :func:`padded_heads`),
  absorbed: ``[q_lat (512), q_rope (64)]``;
* ``indices [B, K]`` int32 rows of the layer's device pool, -1 = padding: the resolver's
  ``out_rows`` as they are; K a multiple of 64;
* fp8 rows (:func:`sparse_decode_fp8`): the layer's pool ``[rows, 656]`` uint8 in the
  :mod:`~hisparse_ray.kernels.kvfp8` layout, ``rows % 64 == 0`` (viewed as 64-row blocks; an index
  is ``block * 64 + offset`` = the pool row); metadata from :func:`decode_metadata` (once per batch
  shape, it depends only on B, heads and K here);
* bf16 rows (:func:`sparse_prefill_bf16`): the pool ``[rows, 1152]`` uint8 = 576 bf16 values.

Output: ``[B, Hq, 512]`` bf16, the softmax-weighted latent (``sum_t p[h, t] c(t)``). A row whose
indices are all -1 has undefined output (callers mask padded rows).
"""

from __future__ import annotations

import torch

from hisparse_ray.errors import KernelPreconditionError

LATENT, ROPE = 512, 64
FP8_ROW, BF16_ROW = 656, 1152


def available() -> bool:
    """True when ``sgl_kernel.flash_mla`` imports and a CUDA device of compute capability 9.x is
    visible (FlashMLA's sm90 kernels)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import sgl_kernel.flash_mla  # noqa: F401
    except Exception:
        return False
    return True


def _lib():
    try:
        from sgl_kernel import flash_mla
    except Exception as e:  # pragma: no cover - needs the gpu extra
        raise KernelPreconditionError(
            f"FlashMLA needs the 'gpu' extra (sglang-kernel): {e}") from e
    return flash_mla


def padded_heads(heads: int) -> int:
    """Query heads FlashMLA runs for ``heads`` local heads (64 or 128)."""
    if heads <= 64:
        return 64
    if heads <= 128:
        return 128
    raise KernelPreconditionError(f"FlashMLA takes at most 128 query heads per rank, got {heads}")


def _check(q: torch.Tensor, indices: torch.Tensor, pool: torch.Tensor, row_bytes: int) -> tuple[int, int, int]:
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[-1] != LATENT + ROPE:
        raise KernelPreconditionError(f"q must be [B, H, 576] bf16, got {tuple(q.shape)} {q.dtype}")
    B, H, _ = q.shape
    if H not in (64, 128):
        raise KernelPreconditionError(f"q must have 64 or 128 heads (pad with zeros), got {H}")
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != B:
        raise KernelPreconditionError(f"indices must be [{B}, K] int32, got {tuple(indices.shape)} {indices.dtype}")
    K = indices.shape[1]
    if K % 64:
        raise KernelPreconditionError(f"top-k width {K} must be a multiple of 64")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != row_bytes:
        raise KernelPreconditionError(f"pool must be [rows, {row_bytes}] uint8, got {tuple(pool.shape)} {pool.dtype}")
    for name, t in (("q", q), ("indices", indices), ("pool", pool)):
        if not t.is_cuda or t.device != q.device or not t.is_contiguous():
            raise KernelPreconditionError(f"{name} must be contiguous on {q.device}")
    return B, H, K


def decode_metadata(batch: int, heads: int, topk: int, device: torch.device) -> tuple:
    """Tile-scheduler metadata of the fp8 sparse decode for a batch shape: ``(metadata, num_splits,
    cache_seqlens, block_table)``. Sparse decode attends exactly ``topk`` rows per query, so every
    row's length is ``topk`` and the block table is an unread dummy: compute it once per shape,
    outside any graph, and pass it to every layer of every step."""
    lib = _lib()
    seqlens = torch.full((batch,), topk, dtype=torch.int32, device=device)
    meta, splits = lib.get_mla_metadata(seqlens, heads, 1, heads, True, topk)
    table = torch.zeros((batch, 1), dtype=torch.int32, device=device)
    return meta, splits, seqlens, table


def sparse_decode_fp8(q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, metadata: tuple,
                      scale: float) -> torch.Tensor:
    """fp8 656 B rows: ``q [B, H, 576]`` bf16, ``pool [rows, 656]`` uint8, ``indices [B, K]`` int32
    -> ``[B, H, 512]`` bf16 (``flash_mla_with_kvcache`` with ``is_fp8_kvcache`` and ``indices``)."""
    B, H, K = _check(q, indices, pool, FP8_ROW)
    if pool.shape[0] % 64:
        raise KernelPreconditionError(f"pool rows {pool.shape[0]} must be a multiple of 64")
    meta, splits, seqlens, table = metadata
    if seqlens.shape[0] != B:
        raise KernelPreconditionError(f"metadata is for batch {seqlens.shape[0]}, not {B}")
    out, _ = _lib().flash_mla_with_kvcache(
        q[:, None], pool.view(pool.shape[0] // 64, 64, 1, FP8_ROW), table, seqlens, LATENT, meta,
        splits, softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=indices[:, None])
    return out[:, 0]


def sparse_prefill_bf16(q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """bf16 1152 B rows: ``q [B, H, 576]``, ``pool [rows, 1152]`` uint8, ``indices [B, K]`` int32 ->
    ``[B, H, 512]`` bf16 (``flash_mla_sparse_fwd``, one query per row)."""
    _check(q, indices, pool, BF16_ROW)
    kv = pool.view(torch.bfloat16).view(pool.shape[0], 1, LATENT + ROPE)
    out, _max_logits, _lse = _lib().flash_mla_sparse_fwd(q, kv, indices[:, None], scale, LATENT)
    return out
