"""The paged GPU index-key pool: its reference logits select what the dense per-request path
selects (fp32 / bf16 keys), fp8 keys follow DeepGEMM's formula over the same bytes, pages are
allocated, grown and freed without moving a request's keys."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.errors import CapacityError, DuplicateRequestError, UnknownRequestError
from hisparse_ray.fastpath.index_keys import PagedIndexKeys, fp8_scores, quantize_queries
from hisparse_ray.fastpath.layer import index_logits
from hisparse_ray.kernels.kvfp8 import dequantize_fp8, quantize_fp8
from hisparse_ray.model.indexer import select_topk
from hisparse_ray.model.model import build_random_model
from hisparse_ray.model.config import tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config().with_(index_topk=24)
    return build_random_model(cfg, seed=3)


def batch(model, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    B, N = len(lengths), max(lengths)
    x = torch.randn(B, cfg.hidden_size, generator=g)
    q_resid = torch.randn(B, cfg.q_lora_rank, generator=g)
    keys = [torch.randn(n, cfg.index_head_dim, generator=g).to(dtype) for n in lengths]
    pos = torch.tensor(lengths) - 1
    cos, sin = model.rope.cos_sin(pos, torch.float32)
    return x, q_resid, cos, sin, keys


def install_all(pool, keys, L):
    table = torch.full((len(keys), 4), -1, dtype=torch.int32)
    for b, k in enumerate(keys):
        per_layer = torch.zeros(L, *k.shape, dtype=k.dtype)
        per_layer[0] = k
        pool.install(f"r{b}", per_layer, 200)
        pages = pool.pages[f"r{b}"]
        table[b, : len(pages)] = torch.as_tensor(pages)
    return table


@pytest.mark.parametrize("kind,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_paged_reference_topk_equals_dense_path(model, kind, dtype):
    ix = model.model.layers[0].self_attn.indexer
    lengths = [150, 7, 64, 129]
    x, q_resid, cos, sin, keys = batch(model, lengths, dtype)
    n = torch.tensor(lengths)
    dense = torch.zeros(len(lengths), max(lengths), model.cfg.index_head_dim, dtype=dtype)
    for b, k in enumerate(keys):
        dense[b, : len(k)] = k
    want = ix.decode_topk(x, q_resid, cos, sin, dense, n)
    pool = PagedIndexKeys(model.cfg.indexer_layers, model.cfg.index_head_dim, kind, 8)
    table = install_all(pool, keys, model.cfg.num_hidden_layers)
    q, w = ix.queries(x, q_resid, cos, sin)
    logits = index_logits("reference", pool, 0, ix, q, w, table, n.to(torch.int32), None)
    assert logits.shape == (4, 256)
    got = select_topk(logits, model.cfg.index_topk)
    assert torch.equal(got, want)
    assert (got[1, 7:] == -1).all()  # a 7-key row pads with -1


def test_fp8_pool_matches_deepgemm_formula_on_dequantized_keys(model):
    ix = model.model.layers[0].self_attn.indexer
    D = model.cfg.index_head_dim
    lengths = [100, 33]
    x, q_resid, cos, sin, keys = batch(model, lengths, torch.float32, seed=1)
    pool = PagedIndexKeys(model.cfg.indexer_layers, D, "fp8", 4)
    table = install_all(pool, keys, model.cfg.num_hidden_layers)
    q, w = ix.queries(x, q_resid, cos, sin)
    n = torch.tensor(lengths, dtype=torch.int32)
    got = index_logits("reference", pool, 0, ix, q, w, table, n, None)
    # the same formula on a dense copy of what the pool stores (paging is transparent)
    q8, wq = quantize_queries(q, w)
    for b, k in enumerate(keys):
        k8, ks = quantize_fp8(k, D)
        want = fp8_scores(q8[b: b + 1], wq[b: b + 1], k8[None], ks[None, :, 0])[0]
        # a batch of 2 vs 1 row: the matmul's blocking may round differently (AVX-512: 1 ulp)
        torch.testing.assert_close(got[b, : len(k)], want, rtol=1e-6, atol=1e-6)
        assert (got[b, len(k):] == float("-inf")).all()
    # and it approximates the exact indexer scores (fp8 keys and queries: a few percent)
    exact = ix.scores(q[:, None], w[:, None], torch.stack([torch.nn.functional.pad(
        k, (0, 0, 0, 100 - len(k))) for k in keys]))[:, 0]
    for b, k in enumerate(keys):
        err = (got[b, : len(k)] - exact[b, : len(k)]).abs().max()
        assert err <= 0.1 * exact[b, : len(k)].abs().max()
    # the stored bytes dequantize to the keys within e4m3 precision
    d = pool.dense(0, table)
    assert torch.allclose(d[0, :100], dequantize_fp8(*quantize_fp8(keys[0], D), D))


def test_pages_install_grow_free():
    pool = PagedIndexKeys([0, 2], 4, "bf16", 2)
    k = torch.arange(3 * 70 * 4, dtype=torch.float32).view(3, 70, 4)
    pool.install("a", k, 100)  # 2 pages: the pool is full
    assert pool.pages["a"].tolist() == [0, 1] and pool.free_pages == 0
    before = pool.dense(1, torch.tensor([[0, 1]], dtype=torch.int32))[0, :70]
    gen = pool.generation
    pool.install("b", None, 130)  # 3 pages: grows (doubles or more), keeps "a"'s keys
    assert pool.generation == gen + 1 and pool.num_pages >= 5
    assert pool.sink_row == pool.num_pages * 64
    assert torch.equal(pool.dense(1, torch.tensor([[0, 1]], dtype=torch.int32))[0, :70], before)
    assert torch.equal(before, k[2].to(torch.bfloat16).float())  # layer 2 is pool 1
    rows = pool.rows_of("b", torch.tensor([0, 63, 64, 129]))
    p = pool.pages["b"]
    assert rows.tolist() == [p[0] * 64, p[0] * 64 + 63, p[1] * 64, p[2] * 64 + 1]
    with pytest.raises(DuplicateRequestError):
        pool.install("a", None, 1)
    pool.free("a")
    with pytest.raises(UnknownRequestError):
        pool.free("a")
    capped = PagedIndexKeys([0], 4, "fp32", 2, max_pages=2)
    with pytest.raises(CapacityError, match="index key pages"):
        capped.install("x", None, 200)
    assert capped.pages == {} and capped.free_pages == 2
