"""The fast step's Triton top-k (``hisparse_ray.kernels.topk_triton``): ``select_topk``'s set in
ascending position order, on tie-heavy rows, signed-zero walls, masked tails, per-row lengths,
k above the row length, strided rows, int32 and int64 outputs, both histogram variants, one
program per row and split rows (ties across chunk borders, rows ending in the first chunk), the
same buffer bit for bit whatever the split, and never a write past a row's k slots. On CPU in
Triton's interpreter (a fresh process: the switch must be set before triton is first imported);
every kernel compiled for sm_90; ``gpu``: compiled, at the decode step's shapes (k 2048, up to
128K positions), auto splits against one program per row, and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from ._triton import compile_sm90, run_interpreted  # noqa: E402


def test_interpreted_kernel_equals_select_topk_in_position_order():
    run_interpreted("tests.kernels._topk_triton_cases", "40")


ROWS = {"S": "*fp32", "stride_s": "i32", "LEN": "*i64", "stride_l": "i32"}
SPLIT = {"HIST": "*i32", "STATE": "*i64"}


@pytest.mark.parametrize("masked_hist", [True, False])
def test_kernels_compile_for_sm90_without_a_gpu(masked_hist):
    """The interpreter runs Python semantics; this compiles the real kernels (Triton's own
    ptxas, no device needed) for the H200's sm_90 in both histogram variants, int32 and int64
    outputs, with and without lengths: the one-program kernel and the split-row ones (every
    histogram pass, count, write): a construct only the compiler rejects fails here."""
    from hisparse_ray.kernels import topk_triton as t

    if masked_hist and not t._masked_hist():
        pytest.skip("this triton's tl.histogram takes no mask")
    C = "constexpr"
    for out_ty, has_len in [("*i32", True), ("*i64", False)]:
        sig = dict(ROWS, OUT=out_ty, stride_o="i32", N="i32", kk="i32", K="i32", HAS_LEN=C,
                   MASKED_HIST=C, BLOCK_=C)
        assert compile_sm90(t._kernel, sig, {"HAS_LEN": has_len, "MASKED_HIST": masked_hist,
                                             "BLOCK_": t.BLOCK}, t.NUM_WARPS)
        sig = dict(ROWS, **SPLIT, B="i32", N="i32", C="i32", kk="i32", P=C, HAS_LEN=C,
                   MASKED_HIST=C, BLOCK_=C)
        for p in range(4):
            assert compile_sm90(t._topk_hist, sig, {"P": p, "HAS_LEN": has_len, "BLOCK_": t.BLOCK,
                                                    "MASKED_HIST": masked_hist}, t.NUM_WARPS)
        if masked_hist:  # (count and write build no histogram)
            sig = dict(ROWS, **SPLIT, CNT="*i32", B="i32", N="i32", C="i32", kk="i32",
                       HAS_LEN=C, BLOCK_=C)
            assert compile_sm90(t._topk_count, sig, {"HAS_LEN": has_len, "BLOCK_": t.BLOCK},
                                t.NUM_WARPS)
            sig = dict(ROWS, STATE="*i64", CNT="*i32", OUT=out_ty, stride_o="i32", B="i32",
                       N="i32", C="i32", K="i32", HAS_LEN=C, SP=C, BLOCK_=C)
            assert compile_sm90(t._topk_write, sig, {"HAS_LEN": has_len, "SP": 32,
                                                     "BLOCK_": t.BLOCK}, t.NUM_WARPS)


def test_auto_splits_fill_the_gpu_at_small_batch_only():
    """The heuristic's picks at the decode step's shapes on a 132-SM device (the CPU's fixed
    count), and the chunk rounding (``chunk_size``): aligned, never more chunks than asked."""
    from hisparse_ray.kernels import topk_triton as t

    cpu = torch.device("cpu")
    picks = {(B, N): t.auto_splits(B, N, cpu) for B in (1, 8, 64) for N in (32768, 131072)}
    assert picks == {(1, 32768): 32, (1, 131072): 64, (8, 32768): 32, (8, 131072): 64,
                     (64, 32768): 9, (64, 131072): 9}
    assert t.auto_splits(1, 65536, cpu) == t.MAX_SPLITS == 64 == t.auto_splits(1, 1 << 20, cpu)
    assert t.auto_splits(1, t.MIN_CHUNK, cpu) == 1 and t.auto_splits(528, 131072, cpu) == 1
    assert t.auto_splits(527, 131072, cpu) == 2
    for N in (1, 15, 16, 300, 1025, 2500, 131072, 100003):
        for splits in (1, 2, 3, 7, 16, 1000):
            c = t.chunk_size(N, splits)
            assert c % 16 == 0 and (c < t.BLOCK or c % t.BLOCK == 0)
            assert -(-N // c) <= splits and c * splits >= N


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
    for bad in (0, -3, 2.0, True, "4"):
        with pytest.raises(ValueError, match=f"splits must be an int >= 1 or None, got {bad!r}"):
            topk_triton.select_positions(torch.zeros(2, 8), 4, splits=bad)


@pytest.mark.gpu
def test_compiled_kernel_on_cuda_at_decode_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tests.kernels._topk_triton_cases import expected, main

    from hisparse_ray.kernels import topk_triton

    # (a few of the interpreter's cases only: each new shape compiles every split kernel anew;
    # 60 cases ran past a 120 s limit on the H200, 2026-12-01 night)
    assert main(6, "cuda") == 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, N in [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 131072), (3, 70001)]:
        lengths = torch.randint(N // 2, N + 1, (B,), device="cuda", dtype=torch.int32)
        for s in (torch.randn(B, N, device="cuda", generator=g),
                  torch.relu(torch.randn(B, N, device="cuda", generator=g) - 2.0),  # ~2 % > 0
                  torch.zeros(B, N, device="cuda"),  # one tie wall: the cut by position only
                  torch.where(torch.rand(B, N, device="cuda", generator=g) < 0.5, -0.0, 0.0)):
            want = expected(s, 2048, lengths)
            for splits in (1, 5, None):
                got = topk_triton.select_positions(s, 2048, lengths=lengths, splits=splits)
                assert torch.equal(got, want), (B, N, splits,
                                                topk_triton.auto_splits(B, N, s.device))
    # replayed from a CUDA graph with new scores in the same buffers: one program per row
    # (batch 4 at 8K keys) and split rows (batch 1 at 128K keys: auto splits the row)
    for B, N in [(4, 8192), (1, 131072)]:
        s = torch.randn(B, N, device="cuda")
        lengths = torch.tensor([0, 100, 5000, N][-B:], device="cuda", dtype=torch.int32)
        out = torch.empty(B, 2048, dtype=torch.int32, device="cuda")
        topk_triton.select_positions(s, 2048, lengths=lengths, out=out)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            topk_triton.select_positions(s, 2048, lengths=lengths, out=out)
        for fill in (torch.randn(B, N, device="cuda"), torch.zeros(B, N, device="cuda")):
            s.copy_(fill)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.long(), expected(s, 2048, lengths)), (B, N)
