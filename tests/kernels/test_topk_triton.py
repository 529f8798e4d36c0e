"""The fast step's Triton top-k (``hisparse_ray.kernels.topk_triton``): ``select_topk``'s set in
ascending position order, on tie-heavy rows, signed-zero walls, masked tails, per-row lengths,
k above the row length, strided rows, int32 and int64 outputs, both histogram variants, and never
a write past a row's k slots. On CPU in Triton's interpreter (a fresh process: the switch must be
set before triton is first imported); ``gpu``: compiled, at the decode step's shapes (k 2048, up
to 128K positions) and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from ._triton import compile_sm90, run_interpreted  # noqa: E402


def test_interpreted_kernel_equals_select_topk_in_position_order():
    run_interpreted("tests.kernels._topk_triton_cases", "80")


@pytest.mark.parametrize("masked_hist", [True, False])
def test_kernel_compiles_for_sm90_without_a_gpu(masked_hist):
    """The interpreter runs Python semantics; this compiles the real kernel (Triton's own
    ptxas, no device needed) for the H200's sm_90 in both histogram variants, int32 and int64
    outputs, with and without lengths: a construct only the compiler rejects fails here."""
    from hisparse_ray.kernels import topk_triton

    if masked_hist and not topk_triton._masked_hist():
        pytest.skip("this triton's tl.histogram takes no mask")
    for out_ty, has_len in [("*i32", True), ("*i64", False)]:
        sig = {"S": "*fp32", "stride_s": "i32", "LEN": "*i64", "stride_l": "i32", "OUT": out_ty,
               "stride_o": "i32", "N": "i32", "kk": "i32", "K": "i32", "HAS_LEN": "constexpr",
               "MASKED_HIST": "constexpr", "BLOCK_": "constexpr"}
        assert compile_sm90(topk_triton._kernel, sig, {"HAS_LEN": has_len,
                            "MASKED_HIST": masked_hist, "BLOCK_": topk_triton.BLOCK},
                            topk_triton.NUM_WARPS)


def test_bad_arguments_name_the_value():
    from hisparse_ray.kernels import topk_triton

    with pytest.raises(ValueError, match="fp32"):
        topk_triton.select_positions(torch.zeros(2, 8, dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        topk_triton.select_positions(torch.zeros(2, 8), 0)
    with pytest.raises(ValueError, match=r"out must be \[2, 4\]"):
        topk_triton.select_positions(torch.zeros(2, 8), 4, out=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"lengths must be \[2\]"):
        topk_triton.select_positions(torch.zeros(2, 8), 4, lengths=torch.zeros(3))


@pytest.mark.gpu
def test_compiled_kernel_on_cuda_at_decode_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tests.kernels._topk_triton_cases import expected, main

    from hisparse_ray.kernels import topk_triton

    assert main(60, "cuda") == 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, N in [(1, 32768), (8, 131072), (64, 32768)]:
        s = torch.relu(torch.randn(B, N, device="cuda", generator=g) - 2.0)  # ~2 % positive
        lengths = torch.randint(N // 2, N + 1, (B,), device="cuda", dtype=torch.int32)
        assert torch.equal(topk_triton.select_positions(s, 2048, lengths=lengths),
                           expected(s, 2048, lengths))
    # replayed from a CUDA graph with new scores in the same buffers
    s = torch.randn(4, 8192, device="cuda")
    lengths = torch.tensor([0, 100, 5000, 8192], device="cuda", dtype=torch.int32)
    out = torch.empty(4, 2048, dtype=torch.int32, device="cuda")
    topk_triton.select_positions(s, 2048, lengths=lengths, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_triton.select_positions(s, 2048, lengths=lengths, out=out)
    s.copy_(torch.randn(4, 8192, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.long(), expected(s, 2048, lengths))
