"""The fast step's one-kernel RMSNorm (``hisparse_ray.kernels.norm_triton``): HF's arithmetic
(fp32 statistics, normed row in the input dtype, weight product in the promoted dtype) within
4 ulps (of the input dtype) of eager torch, any width / dtype / leading shape / strided input; on
CPU in Triton's interpreter (a fresh process), compiled for sm_90 without a GPU, and (``gpu``) on
CUDA, where :func:`~hisparse_ray.model.layers.fused_norms` switches ``RMSNorm`` to it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from ._triton import compile_sm90, run_interpreted  # noqa: E402


def test_interpreted_kernel_matches_eager_rmsnorm():
    run_interpreted("tests.kernels._norm_triton_cases")


def test_kernel_compiles_for_sm90_without_a_gpu():
    from hisparse_ray.kernels import norm_triton

    for x_ty, y_ty in [("*bf16", "*bf16"), ("*fp32", "*fp32"), ("*bf16", "*fp32")]:
        sig = {"X": x_ty, "stride_x": "i32", "W": "*bf16", "Y": y_ty, "stride_y": "i32",
               "D": "i32", "eps": "fp32", "BLOCK_D": "constexpr"}
        assert compile_sm90(norm_triton._kernel, sig, {"BLOCK_D": 8192}, norm_triton.NUM_WARPS)


def test_fused_norms_leaves_cpu_tensors_and_the_default_alone():
    """Outside ``fused_norms`` (prefill, the reference path) and on CPU tensors inside it,
    ``RMSNorm`` is eager torch, bit for bit."""
    from hisparse_ray.model.layers import RMSNorm, fused_norms

    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    want = norm(x)
    with fused_norms():
        assert torch.equal(norm(x), want)
    with fused_norms(False) as on:
        assert on is False and torch.equal(norm(x), want)


def test_bad_weight_names_the_shape():
    from hisparse_ray.kernels.norm_triton import rms_norm

    with pytest.raises(ValueError, match=r"weight must be \[8\], got \(7,\)"):
        rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)


@pytest.mark.gpu
def test_on_cuda_and_through_fused_norms():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tests.kernels._norm_triton_cases import main

    from hisparse_ray.kernels.norm_triton import rms_norm
    from hisparse_ray.model.layers import RMSNorm, fused_norms

    assert main("cuda") == 0
    norm = RMSNorm(7168).cuda().to(torch.bfloat16)
    x = torch.randn(8, 7168, device="cuda").to(torch.bfloat16)
    with fused_norms() as on:
        assert on and torch.equal(norm(x), rms_norm(x, norm.weight, norm.eps))
    # batch-invariant: a row alone gives the same bits as inside a batch
    assert torch.equal(rms_norm(x[3:4], norm.weight, norm.eps), rms_norm(x, norm.weight, norm.eps)[3:4])
