"""Block-scaled fp8 GEMMs for the released checkpoints' weights (ring 2, installed as
``hisparse_ray.kernels.fp8_gemm``): a thin adapter over DeepGEMM (``sgl-deep-gemm``, the ``gpu``
extra) plus a pure-torch twin of each call with the same signature and arithmetic model.

Layout (DeepGEMM's sm90 "NT" fp8 GEMM, recipe 1x128 activations / 128x128 weights):
* ``x`` bf16 ``[M, K]`` is quantized here per token and group of 128 values
  (:func:`quantize_activations`: ``xq`` float8_e4m3fn ``[M, K]``, ``xs`` fp32 ``[M, K/128]``,
  ``x ~= xq * xs`` per group, amax / 448 scales);
* ``weight`` float8_e4m3fn ``[N, K]`` (grouped: ``[G, N, K]``), ``scale_inv`` fp32
  ``[ceil(N/128), K/128]`` (grouped: ``[G, ...]``), exactly as stored in the checkpoint;
* out bf16 ``[M, N]``: ``sum_k (xq * xs)[m, k] * (weight * scale_inv)[n, k]``, fp32 accumulation.
``K % 128 == 0``; every tensor contiguous and on one CUDA device of compute capability 9.0.

Grouped calls (MoE experts, decode): ``x [G, Mmax, K]`` with ``masked_m[g]`` valid rows in group g
(no host sync; empty groups cost nothing). The library is imported on first use; :func:`supported` says whether a device can run it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from hisparse_ray.errors import KernelPreconditionError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


@functools.lru_cache(maxsize=None)
def _library() -> ModuleType | None:
    try:
        import deep_gemm
    except Exception:  # not installed, no CUDA toolkit, wrong torch ABI: the fallback serves
        return None
    return deep_gemm


def supported(device: torch.device | str | None = None) -> bool:
    """True when ``device`` is a CUDA device of compute capability 9.x and DeepGEMM imports."""
    if not torch.cuda.is_available():
        return False
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return _library() is not None


def _lib() -> ModuleType:
    lib = _library()
    if lib is None:
        raise KernelPreconditionError("fp8 GEMM needs sgl-deep-gemm (pip install 'hisparse-ray[gpu]')")
    return lib


def _check(name: str, t: Tensor, dtype: torch.dtype, dims: int, device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != dims:
        raise KernelPreconditionError(f"{name}: expected {dims}-d {dtype}, got {t.dim()}-d {t.dtype}")
    if t.device != device:
        raise KernelPreconditionError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise KernelPreconditionError(f"{name} must be contiguous")


def _check_weight(weight: Tensor, scale_inv: Tensor, k: int, device: torch.device, grouped: bool) -> None:
    d = 3 if grouped else 2
    _check("weight", weight, FP8, d, device)
    _check("scale_inv", scale_inv, torch.float32, d, device)
    n = weight.shape[-2]
    if weight.shape[-1] != k or k % GROUP:
        raise KernelPreconditionError(f"weight {tuple(weight.shape)}: K must equal x's {k} and be a "
                                      f"multiple of {GROUP}")
    want = (*weight.shape[:-2], -(-n // GROUP), k // GROUP)
    if tuple(scale_inv.shape) != want:
        raise KernelPreconditionError(f"scale_inv {tuple(scale_inv.shape)}: expected {want} for weight "
                                      f"{tuple(weight.shape)} (128x128 blocks)")


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., K]`` -> ``(xq float8_e4m3fn [..., K], xs fp32 [..., K/128])``, one scale per token
    and group of 128 values (amax / 448, at least 1e-10 / 448)."""
    *lead, k = x.shape
    g = x.float().view(*lead, k // GROUP, GROUP)
    xs = g.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    xq = (g / xs[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq.view(*lead, k), xs


def linear(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """``x [M, K]`` bf16 times fp8 ``weight [N, K]`` with block scales -> bf16 ``[M, N]`` (DeepGEMM)."""
    _check("x", x, torch.bfloat16, 2, x.device)
    _check_weight(weight, scale_inv, x.shape[1], x.device, grouped=False)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
    if x.shape[0]:
        _lib().fp8_gemm_nt(quantize_activations(x), (weight, scale_inv), out)
    return out


def grouped_linear_masked(x: Tensor, weight: Tensor, scale_inv: Tensor, masked_m: Tensor,
                          expected_m: int) -> Tensor:
    """``x [G, Mmax, K]`` bf16, rows ``< masked_m[g]`` valid in group g, times ``weight[g] [N, K]``
    -> bf16 ``[G, Mmax, N]`` (rows past ``masked_m[g]`` undefined). ``expected_m``: a hint of the
    typical rows per group (tile choice), any value >= 1 is correct."""
    _check("x", x, torch.bfloat16, 3, x.device)
    _check_weight(weight, scale_inv, x.shape[2], x.device, grouped=True)
    _check("masked_m", masked_m, torch.int32, 1, x.device)
    if weight.shape[0] != x.shape[0] or masked_m.shape[0] != x.shape[0]:
        raise KernelPreconditionError(f"groups differ: x {x.shape[0]}, weight {weight.shape[0]}, "
                                      f"masked_m {masked_m.shape[0]}")
    out = torch.empty(*x.shape[:2], weight.shape[1], dtype=torch.bfloat16, device=x.device)
    _lib().m_grouped_fp8_gemm_nt_masked(quantize_activations(x), (weight, scale_inv), out, masked_m,
                                        max(1, int(expected_m)))
    return out


def grouped_bf16_masked(x: Tensor, weight: Tensor, masked_m: Tensor, expected_m: int) -> Tensor:
    """:func:`grouped_linear_masked` for bf16 weights ``[G, N, K]`` (dequantized checkpoints)."""
    _check("x", x, torch.bfloat16, 3, x.device)
    _check("weight", weight, torch.bfloat16, 3, x.device)
    _check("masked_m", masked_m, torch.int32, 1, x.device)
    if weight.shape[0] != x.shape[0] or weight.shape[2] != x.shape[2] or masked_m.shape[0] != x.shape[0]:
        raise KernelPreconditionError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, masked_m "
                                      f"{tuple(masked_m.shape)} do not agree on groups and K")
    out = torch.empty(*x.shape[:2], weight.shape[1], dtype=torch.bfloat16, device=x.device)
    _lib().m_grouped_bf16_gemm_nt_masked(x, weight, out, masked_m, max(1, int(expected_m)))
    return out


# -- torch twins (any device; the oracle of the parity tests) ------------------------------------
def _dequant(weight: Tensor, scale_inv: Tensor) -> Tensor:
    n, k = weight.shape[-2:]
    s = scale_inv.repeat_interleave(GROUP, dim=-2)[..., :n, :].repeat_interleave(GROUP, dim=-1)
    return weight.float() * s


def linear_reference(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """:func:`linear` in torch: the same activation quantization, fp32 products, bf16 out."""
    xq, xs = quantize_activations(x)
    xd = (xq.float().view(*xs.shape, GROUP) * xs[..., None]).view(x.shape)
    return (xd @ _dequant(weight, scale_inv).T).to(torch.bfloat16)


def grouped_linear_masked_reference(x: Tensor, weight: Tensor, scale_inv: Tensor, masked_m: Tensor,
                                    expected_m: int) -> Tensor:
    """:func:`grouped_linear_masked` in torch (rows past ``masked_m[g]`` are zero here)."""
    out = torch.zeros(*x.shape[:2], weight.shape[1], dtype=torch.bfloat16, device=x.device)
    for g, m in enumerate(masked_m.tolist()):
        if m:
            out[g, :m] = linear_reference(x[g, :m], weight[g], scale_inv[g])
    return out
