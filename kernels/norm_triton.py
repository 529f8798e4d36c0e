"""The fast step's RMSNorm as ONE Triton kernel (ring 2: triton, optional). Eager torch runs a
norm as ~6 kernels (cast, square, mean, add + rsqrt, multiply, cast, weight multiply): at batch 1
each is a ~2 us launch over a few KB, four norms a layer; this is one launch per norm.

Contract (:func:`rms_norm`): ``x [..., D]`` (rows contiguous in D), ``weight [D]`` ->
``weight * (x_f32 * rsqrt(mean(x_f32 ** 2) + eps)).to(x.dtype)`` in
``torch.promote_types(weight.dtype, x.dtype)``, the arithmetic of
:class:`~hisparse_ray.model.layers.RMSNorm` (HF's): fp32 statistics, the normalized row rounded to
the input dtype, then the weight product rounded to the output dtype. The sum of squares is
reduced in the kernel's own order, so a row can differ from eager torch in the last bits of the
statistic (an output by about one ulp of the input dtype: ``tests/kernels/test_norm_triton.py``
bounds it at 4); every row alone, so it is batch-invariant, and HiSparse and
full-resident run the same kernel. Used by the fast decode step on CUDA
(:func:`~hisparse_ray.model.layers.fused_norms`; ``HISPARSE_TRITON_NORM=0`` switches it off).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

NUM_WARPS = 8


def _rms_norm_rows(X, stride_x, W, Y, stride_y, D, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / D
    normed = (x * (1.0 / tl.sqrt_rn(mean_sq + eps))).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


_kernel = triton.jit(_rms_norm_rows)  # interpreted (on CPU tensors) when TRITON_INTERPRET=1 at import


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See the module docstring. CUDA tensors, or any device under Triton's interpreter."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    rows = x.reshape(-1, D)  # a view when rows are contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _kernel[(rows.shape[0],)](rows, rows.stride(0), weight, out, out.stride(0), D, float(eps),
                                  BLOCK_D=triton.next_power_of_2(D), num_warps=NUM_WARPS)
    return out.view(*x.shape[:-1], D)
