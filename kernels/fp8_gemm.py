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
from hisparse_ray.kernels.kvfp8 import FP8, FP8_MAX, fp8_scale

GROUP = 128
MASKED_ALIGN = 128  # rows a masked-layout group is padded to (whole output tiles)


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


def masked_shapes_ok(k: int, n: int) -> bool:
    """Whether a masked grouped GEMM of inner size ``k`` and ``n`` outputs is a shape the kernels
    take: both multiples of :data:`GROUP` (the fp8 recipe's blocks; bf16 weights are held to the
    same, the shapes the library was run with here). Smaller or unaligned MoE layers (the tiny
    test models: hidden 64, experts of 32) take the every-expert path instead: on the H100 the
    bf16 kernel at such shapes left a decode step without a report for 60 s (2026-12-05)."""
    return k > 0 and n > 0 and k % GROUP == 0 and n % GROUP == 0


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


@functools.lru_cache(maxsize=None)
def _fused_quant():
    """sglang-kernel's one-kernel per-token-group fp8 quantization, when installed (else None)."""
    try:
        from sgl_kernel import sgl_per_token_group_quant_8bit
    except Exception:
        return None
    return sgl_per_token_group_quant_8bit


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., K]`` -> ``(xq float8_e4m3fn [..., K], xs fp32 [..., K/128])``, one scale per token
    and group of 128 values (amax / 448, at least 1e-10 / 448). On CUDA with sglang-kernel
    installed one fused kernel does it (same rule; the torch ops below are its twin)."""
    fused = _fused_quant() if x.is_cuda and x.dim() == 2 and x.is_contiguous() and x.shape[0] else None
    if fused is not None:
        xq = torch.empty(x.shape, dtype=FP8, device=x.device)
        xs = torch.empty(x.shape[0], x.shape[1] // GROUP, dtype=torch.float32, device=x.device)
        fused(x, xq, xs, GROUP, 1e-10, -FP8_MAX, FP8_MAX)
        return xq, xs
    return _quantize_torch(x)


def _quantize_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    *lead, k = x.shape
    g = x.float().view(*lead, k // GROUP, GROUP)
    xs = fp8_scale(g.abs().amax(dim=-1).clamp(min=1e-10))
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


def grouped_linear_masked(x: Tensor, group: Tensor, pos: Tensor, masked_m: Tensor, max_m: int,
                          weight: Tensor, scale_inv: Tensor | None = None, *, expected_m: int = 1) -> Tensor:
    """Rows ``x [R, K]`` bf16, row i multiplied by ``weight[group[i]]`` -> bf16 ``[R, N]``: one grouped
    kernel call (DeepGEMM's masked layout) for every group at once, no host sync.

    ``group``, ``pos`` [R] int64: row i is slot ``pos[i]`` of group ``group[i]``; the slots of group g
    are exactly ``0..masked_m[g]-1`` (``masked_m`` [G] int32) and ``masked_m[g] <= max_m``.
    ``weight`` fp8 ``[G, N, K]`` with ``scale_inv`` ``[G, ceil(N/128), K/128]``, or bf16 ``[G, N, K]``
    with ``scale_inv`` None. ``expected_m``: typical rows per group (a tile-size hint; any value >= 1
    is correct). The layout ``[G, Mpad, K]`` pads ``max_m`` to :data:`MASKED_ALIGN` rows: the kernel
    stores whole row tiles, so an unpadded group's tile would overwrite the next group's rows."""
    _check("x", x, torch.bfloat16, 2, x.device)
    _check("masked_m", masked_m, torch.int32, 1, x.device)
    G = weight.shape[0]
    if scale_inv is None:
        _check("weight", weight, torch.bfloat16, 3, x.device)
        if weight.shape[2] != x.shape[1]:
            raise KernelPreconditionError(f"weight {tuple(weight.shape)}: K must equal x's {x.shape[1]}")
        if not masked_shapes_ok(weight.shape[2], weight.shape[1]):
            raise KernelPreconditionError(f"weight {tuple(weight.shape)}: N and K must be multiples "
                                          f"of {GROUP} (masked_shapes_ok)")
    else:
        _check_weight(weight, scale_inv, x.shape[1], x.device, grouped=True)
    if masked_m.shape[0] != G or group.shape != pos.shape or group.shape[0] != x.shape[0]:
        raise KernelPreconditionError(f"x {tuple(x.shape)}, group {tuple(group.shape)}, pos "
                                      f"{tuple(pos.shape)}, masked_m {tuple(masked_m.shape)}, {G} groups")
    mpad = -(-max(1, max_m) // MASKED_ALIGN) * MASKED_ALIGN
    K, N = x.shape[1], weight.shape[1]
    out = torch.empty(G, mpad, N, dtype=torch.bfloat16, device=x.device)
    expected = max(1, int(expected_m))
    if scale_inv is None:
        buf = torch.empty(G, mpad, K, dtype=torch.bfloat16, device=x.device)
        buf[group, pos] = x
        _lib().m_grouped_bf16_gemm_nt_masked(buf, weight, out, masked_m, expected)
    else:
        xq, xs = quantize_activations(x)  # only the real rows
        bq = torch.empty(G, mpad, K, dtype=FP8, device=x.device)
        bs = torch.empty(G, mpad, K // GROUP, dtype=torch.float32, device=x.device)
        bq[group, pos], bs[group, pos] = xq, xs
        _lib().m_grouped_fp8_fp4_gemm_nt_masked((bq, bs), (weight, scale_inv), out, masked_m, expected)
    return out[group, pos]


# -- torch twins (any device; the oracle of the parity tests) ------------------------------------
def _dequant(weight: Tensor, scale_inv: Tensor) -> Tensor:
    n, k = weight.shape[-2:]
    s = scale_inv.repeat_interleave(GROUP, dim=-2)[..., :n, :].repeat_interleave(GROUP, dim=-1)
    return weight.float() * s


def linear_reference(x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """:func:`linear` in torch: the same activation quantization, fp32 products, out in ``x.dtype``
    (bf16 like the kernel for bf16 ``x``; any float dtype and device)."""
    xq, xs = _quantize_torch(x)
    xd = (xq.float().view(*xs.shape, GROUP) * xs[..., None]).view(x.shape)
    return (xd @ _dequant(weight, scale_inv).T).to(x.dtype)


def grouped_linear_masked_reference(x: Tensor, group: Tensor, pos: Tensor, masked_m: Tensor, max_m: int,
                                    weight: Tensor, scale_inv: Tensor | None = None, *,
                                    expected_m: int = 1) -> Tensor:
    """:func:`grouped_linear_masked` in torch (fp8: the twin's arithmetic; bf16: fp32 products)."""
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero()[:, 0]
        if scale_inv is None:
            out[rows] = (x[rows].float() @ weight[g].float().T).to(x.dtype)
        else:
            out[rows] = linear_reference(x[rows], weight[g], scale_inv[g])
    return out
