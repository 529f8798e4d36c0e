"""Thin adapter to ``sgl-deep-gemm``'s fp8 paged MQA logits, the lightning indexer's decode
scores (ring 2; the ``gpu`` extra). Imported lazily: CI has neither the library nor CUDA. Its
kernels compile on first use (JIT, needs ``CUDA_HOME``, seconds): call :func:`warm_up` before
capturing a CUDA graph.

Layout this module states and checks:

* ``q8 [B, H, D]`` float8_e4m3fn queries (H = 64 index heads, D = 128), one query per row;
* ``weights [B, H]`` fp32: head weights with every positive scale folded in (query scales and
  ``D**-0.5``; see :func:`hisparse_ray.fastpath.index_keys.quantize_queries`);
* ``kv [pages, 64, 1, D + 4]`` uint8: per 64-token page, 64 e4m3 keys of D bytes then their 64
  fp32 scales (:class:`~hisparse_ray.fastpath.index_keys.PagedIndexKeys`' fp8 pool);
* ``context_lens [B]`` int32 (0 = padded row), ``block_table [B, P]`` int32 pages.

Returns ``[B, P * 64]`` fp32 logits ``sum_h weights[h] * relu(q8[h] . k8) * k_scale``; entries at or
past a row's context length are garbage (callers mask them).
"""

from __future__ import annotations

import torch

from hisparse_ray.errors import KernelPreconditionError

PAGE = 64


def available() -> bool:
    """True when ``deep_gemm`` imports and a CUDA device of compute capability 9.x is visible."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import deep_gemm  # noqa: F401
    except Exception:
        return False
    return True


def _lib():
    try:
        import deep_gemm
    except Exception as e:  # pragma: no cover - needs the gpu extra
        raise KernelPreconditionError(f"DeepGEMM needs the 'gpu' extra (sgl-deep-gemm): {e}") from e
    return deep_gemm


def schedule(context_lens: torch.Tensor) -> torch.Tensor:
    """The kernel's per-SM schedule for ``context_lens [B]`` int32 (a kernel: capturable), for the
    SM count the library launches with (``deep_gemm.get_num_sms()``)."""
    lib = _lib()
    return lib.get_paged_mqa_logits_metadata(context_lens[:, None], PAGE, lib.get_num_sms())


def paged_mqa_logits(q8: torch.Tensor, weights: torch.Tensor, kv: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor,
                     sched: torch.Tensor) -> torch.Tensor:
    """See the module docstring; ``sched`` from :func:`schedule` of the same ``context_lens``."""
    if q8.dtype != torch.float8_e4m3fn or q8.dim() != 3:
        raise KernelPreconditionError(f"q8 must be [B, H, D] e4m3, got {tuple(q8.shape)} {q8.dtype}")
    B, H, D = q8.shape
    if tuple(weights.shape) != (B, H) or weights.dtype != torch.float32:
        raise KernelPreconditionError(f"weights must be [{B}, {H}] fp32, got {tuple(weights.shape)} {weights.dtype}")
    if kv.dtype != torch.uint8 or kv.dim() != 4 or tuple(kv.shape[1:]) != (PAGE, 1, D + 4):
        raise KernelPreconditionError(f"kv must be [pages, 64, 1, {D + 4}] uint8, got {tuple(kv.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (B,):
        raise KernelPreconditionError(f"context_lens must be [{B}] int32")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise KernelPreconditionError(f"block_table must be [{B}, P] int32")
    for name, t in (("q8", q8), ("weights", weights), ("kv", kv), ("context_lens", context_lens),
                    ("block_table", block_table)):
        if not t.is_cuda or t.device != q8.device:
            raise KernelPreconditionError(f"{name} must be on {q8.device}")
    max_len = block_table.shape[1] * PAGE
    return _lib().fp8_paged_mqa_logits(q8[:, None].contiguous(), kv, weights.contiguous(),
                                       context_lens[:, None], block_table, sched, max_len, False)


def warm_up(device: torch.device, heads: int = 64, dim: int = 128) -> None:
    """Compile (JIT) the kernels for this head shape on ``device`` before any graph capture."""
    q8 = torch.zeros(1, heads, dim, device=device).to(torch.float8_e4m3fn)
    w = torch.zeros(1, heads, dtype=torch.float32, device=device)
    kv = torch.zeros(2, PAGE, 1, dim + 4, dtype=torch.uint8, device=device)
    lens = torch.full((1,), PAGE, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    paged_mqa_logits(q8, w, kv, lens, table, schedule(lens))
    torch.cuda.synchronize(device)
