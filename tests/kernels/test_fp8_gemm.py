"""The fp8 GEMM adapter (DeepGEMM, sm90) against its torch twin, and the twin against plain
dequantized matmuls. Bounds: the kernel and the twin round the same fp8 inputs and accumulate in
fp32, so they agree to bf16 output rounding (rel 1e-2 of the row norm); the twin differs from the
unquantized product by the activations' fp8 rounding (e4m3: 2^-4 relative per value)."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.errors import KernelPreconditionError
from hisparse_ray.kernels import fp8_gemm
from hisparse_ray.model.fp8 import dequantize, quantize


def _weights(n, k, g=None, device="cpu", groups=None):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (n, k) if groups is None else (groups, n, k)
    w = torch.randn(shape, generator=gen, device=device) * k**-0.5
    return quantize(w, ue8m0=True)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_twin_is_the_dequantized_product_up_to_activation_rounding():
    q, s = _weights(384, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = x.float() @ dequantize(q, s, dtype=torch.float32).T
    assert _rel(fp8_gemm.linear_reference(x, q, s), exact) < 0.05
    xq, xs = fp8_gemm.quantize_activations(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (5, 2)
    back = (xq.float().view(5, 2, 128) * xs[..., None]).view(5, 256)
    assert _rel(back, x) < 0.04


def test_preconditions_are_checked_before_the_library():
    q, s = _weights(256, 256)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(KernelPreconditionError, match="scale_inv"):
        fp8_gemm.linear(x, q, s[:1])
    with pytest.raises(KernelPreconditionError, match="expected 2-d torch.bfloat16"):
        fp8_gemm.linear(x.float(), q, s)
    with pytest.raises(KernelPreconditionError, match="multiple of 128"):
        fp8_gemm.linear(torch.zeros(2, 200, dtype=torch.bfloat16), q[:, :200].contiguous(), s)
    assert not fp8_gemm.supported("cpu")


def test_masked_grouped_shapes_outside_the_kernels_are_refused_or_routed_around(monkeypatch):
    """bf16 experts of unaligned sizes (the tiny models: hidden 64, experts of 32) never reach
    the masked grouped kernel: the call refuses them before the library, and ``Experts`` takes
    the every-expert path (on the H100 such a call left a decode step hanging, 2026-12-05)."""
    from hisparse_ray.model.config import tiny_config
    from hisparse_ray.model.layers import Experts

    assert fp8_gemm.masked_shapes_ok(7168, 4096) and fp8_gemm.masked_shapes_ok(128, 256)
    assert not any(fp8_gemm.masked_shapes_ok(k, n) for k, n in ((64, 128), (128, 64), (0, 128),
                                                                 (200, 256), (256, 96)))
    G, rows = 4, 6
    group, pos, masked = _routing(G, rows, "cpu", seed=1)
    for n, k in ((64, 64), (128, 32), (96, 128)):
        w = torch.zeros(G, n, k, dtype=torch.bfloat16)
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        with pytest.raises(KernelPreconditionError, match="multiples of 128"):
            fp8_gemm.grouped_linear_masked(x, group, pos, masked, int(masked.max()), w)
    monkeypatch.setattr(fp8_gemm, "supported", lambda device=None: True)  # as on an sm90 GPU
    for hidden, inter, kernel in ((64, 32, False), (128, 64, False), (256, 128, True)):
        experts = Experts(tiny_config().with_(hidden_size=hidden, moe_intermediate_size=inter))
        experts.to(torch.bfloat16)
        x = torch.zeros(2, hidden, dtype=torch.bfloat16)
        assert experts._masked_kernel(x) is kernel, (hidden, inter)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gemm.supported(), reason="needs sm90 and sgl-deep-gemm")
@pytest.mark.parametrize("m,n,k", [(1, 576, 7168), (8, 24576, 1536), (37, 7168, 16384), (128, 4096, 7168)])
def test_kernel_equals_twin(m, n, k):
    q, s = _weights(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = fp8_gemm.linear(x, q, s)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, fp8_gemm.linear_reference(x, q, s)) < 1e-2


def _routing(G, R, device, seed=0):
    """R rows spread over G groups: (group, pos, masked_m) as the MoE builds them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    group = torch.randint(0, G, (R,), generator=g)
    group[0] = G - 1  # the last group is used: its tile sits at the buffer's end
    order = torch.argsort(group, stable=True)
    group = group[order]
    counts = torch.bincount(group, minlength=G)
    pos = torch.arange(R) - (torch.cumsum(counts, 0) - counts)[group]
    return group.to(device), pos.to(device), counts.to(torch.int32).to(device)


def test_grouped_twin_is_the_per_group_product():
    q, s = _weights(256, 256, groups=4)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    group, pos, masked = _routing(4, 11, "cpu")
    out = fp8_gemm.grouped_linear_masked_reference(x, group, pos, masked, 11, q, s)
    for i in range(11):  # a group's rows as one matmul vs one row: the CPU's matmul blocking
        # may round a sum differently (AVX-512: one bf16 ulp seen), so within an ulp, not equal
        torch.testing.assert_close(
            out[i], fp8_gemm.linear_reference(x[i:i + 1], q[group[i]], s[group[i]])[0],
            rtol=2 ** -7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gemm.supported(), reason="needs sm90 and sgl-deep-gemm")
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_grouped_masked_kernels_equal_twins(rows):
    G, N, K = 32, 4096, 7168
    q, s = _weights(N, K, device="cuda", groups=G)
    x = torch.randn(rows, K, device="cuda").to(torch.bfloat16)
    group, pos, masked = _routing(G, rows, "cuda", seed=rows)
    max_m = int(masked.max())
    out = fp8_gemm.grouped_linear_masked(x, group, pos, masked, max_m, q, s, expected_m=max(1, rows // G))
    ref = fp8_gemm.grouped_linear_masked_reference(x, group, pos, masked, max_m, q, s)
    assert out.shape == (rows, N) and _rel(out, ref) < 1e-2
    wb = dequantize(q, s, dtype=torch.bfloat16)
    outb = fp8_gemm.grouped_linear_masked(x, group, pos, masked, max_m, wb, expected_m=1)
    refb = fp8_gemm.grouped_linear_masked_reference(x, group, pos, masked, max_m, wb)
    assert _rel(outb, refb) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(fp8_gemm._fused_quant() is None, reason="needs sglang-kernel")
def test_fused_activation_quantization_equals_the_torch_rule():
    x = torch.randn(37, 7168, device="cuda").to(torch.bfloat16)
    xq, xs = fp8_gemm.quantize_activations(x)
    tq, ts = fp8_gemm._quantize_torch(x)
    torch.testing.assert_close(xs, ts, rtol=1e-6, atol=0)
    same = (xq.view(torch.uint8) == tq.view(torch.uint8)).float().mean()
    assert same > 0.99  # x * (1/s) vs x / s rounds some values to the neighbouring e4m3 (H200: 99.86 % equal)
