"""The fast decode step on the GPU: FlashMLA and DeepGEMM against their torch references, CUDA
graph replay against eager, fast-path HiSparse == fast-path full-resident bit-exactly (bf16 and
fp8 rows, spills, restores, prefix reuse, mixed batch sizes), and the fast path against the
reference path within a stated bf16 tolerance with greedy tokens equal over 64 steps, on a small
config (16 heads padded to 64) and on DeepSeek-V3.2's real attention dims (2 layers).

Tolerance (bf16): ``max |dlogit| <= 0.05 * rms(logits)`` against the reference path (bf16 rounding
in different places: FlashMLA accumulates in fp32, the reference softmax rounds probabilities to
bf16; the batched matmuls round differently from per-row ones). Greedy agreement needs greedy
choices that rounding cannot flip: these models' logits are led by the input token (embeddings
4x, ``lm_head`` a scaled permutation of the embeddings), while attention and the MLP still shift
every logit, so the logits comparison carries the numerics.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.config import HiSparseConfig
from hisparse_ray.engine import EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import tiny_config

from .test_engine_fast import assert_same, prompts_of, run

pytestmark = pytest.mark.gpu
TOL = 0.05


def small_cfg():
    t = tiny_config(yarn=False)
    return t.with_(vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=64,
                   qk_rope_head_dim=64, v_head_dim=64, index_n_heads=64, index_head_dim=128,
                   index_topk=128, max_position_embeddings=8192, mlp_layer_types=("dense",) * 2,
                   indexer_types=("full",) * 2)


def real_cfg(layers=2):
    t = tiny_config(yarn=False)
    return t.with_(vocab_size=1024, hidden_size=7168, intermediate_size=2048, num_hidden_layers=layers,
                   num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
                   index_topk=2048, max_position_embeddings=1 << 17,
                   mlp_layer_types=("dense",) * layers, indexer_types=("full",) * layers)


def led_model(cfg, seed=0):
    """bf16 model on the GPU whose greedy choice is led by the input token (see module doc)."""
    from hisparse_ray.model.model import build_random_model

    m = build_random_model(cfg, seed, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        e.mul_(4.0)
        perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
        m.lm_head.weight.copy_(e[perm.to(e.device)] * (2.0 / cfg.hidden_size ** 0.5))
    return m


def hisparse(cfg, H, pool_gib=0.05):
    return HiSparseConfig(top_k=cfg.index_topk, device_buffer_size=H, host_to_device_ratio=4,
                          swap_in_block_size=1024, host_pool_gib=pool_gib)


def fast_engine(fast, hs, **kw):
    return EngineConfig(hisparse=hs, device="cuda", backend="cuda", batch_invariant=False,
                        fast_path=fast, max_batch=fast.max_batch, **kw)


def rel_err(a, b):
    """(max |dlogit| beyond 2 bf16 ulps of the reference logit, rms of the reference logits): the
    stated tolerance is ``|fast - ref| <= TOL * rms + 2**-7 * |ref|`` per logit. The second term is
    bf16 rounding of large logits (the led models' chosen token scores 100-200, where one bf16 ulp
    is 0.5-1.0; on the H200 the small model differed by exactly 1.0 there, 2026-12-01)."""
    keys = list(b[1])
    d = max(((a[1][k] - b[1][k]).abs() - 2.0 ** -7 * b[1][k].abs()).clamp_min(0).max().item()
            for k in keys)
    rms = torch.stack([b[1][k] for k in keys]).pow(2).mean().sqrt().item()
    return d, rms


# -- kernels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 128])
def test_flashmla_matches_reference_attention(rows, heads):
    from hisparse_ray.fastpath.layer import attend_flashmla, attend_reference
    from hisparse_ray.kernels import flashmla
    from hisparse_ray.kernels.kvfp8 import KVRowCodec
    from hisparse_ray.model.model import build_random_model

    cfg = small_cfg().with_(num_attention_heads=heads)
    m = build_random_model(cfg, 1, dtype=torch.bfloat16, device="cuda")
    attn = m.model.layers[0].self_attn
    codec = KVRowCodec(rows, 512, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    N, B, K = 4096, 5, cfg.index_topk
    pool = codec.encode(torch.randn(N, 576, device="cuda", generator=g).to(torch.bfloat16))
    idx = torch.stack([torch.randperm(N, device="cuda", generator=g)[:K] for _ in range(B)]).int()
    idx[1, K // 2:] = -1
    idx[3] = -1  # a padded batch row
    valid = torch.tensor([True, True, True, False, True], device="cuda")
    q = torch.randn(B, heads, 576, device="cuda", generator=g).to(torch.bfloat16)
    meta = flashmla.decode_metadata(B, flashmla.padded_heads(heads), K, q.device) if rows == "fp8" else None
    got = attend_flashmla(attn, q, pool, idx, valid, codec, meta)
    want = attend_reference(attn, q, pool, idx, valid, codec)
    d = (got - want)[valid].float().abs().max().item()
    scale = want[valid].float().abs().max().item()
    print(f"\nflashmla {rows} heads={heads}: max |d| {d:.3g} of max |out| {scale:.3g}")
    assert d <= 0.02 * scale


def test_deepgemm_logits_match_reference_formula():
    from hisparse_ray.fastpath.index_keys import PagedIndexKeys
    from hisparse_ray.fastpath.layer import index_logits
    from hisparse_ray.kernels import deepgemm
    from hisparse_ray.model.model import build_random_model

    cfg = small_cfg()
    m = build_random_model(cfg, 2, dtype=torch.bfloat16, device="cuda")
    ix = m.model.layers[0].self_attn.indexer
    lens = [3000, 64, 1, 0, 2049]
    pool = PagedIndexKeys([0, 1], 128, "fp8", 200, "cuda")
    table = torch.full((len(lens), 48), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    for b, n in enumerate(lens):
        pool.install(b, torch.randn(2, n, 128, generator=g).cuda(), 3072)
        table[b, : len(pool.pages[b])] = torch.as_tensor(pool.pages[b])
    table = table.clamp_min(0).cuda()
    q = torch.randn(len(lens), 64, 128, device="cuda")
    w = torch.randn(len(lens), 64, device="cuda")
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    deepgemm.warm_up(q.device)
    got = index_logits("deepgemm", pool, 1, ix, q, w, table, n, deepgemm.schedule(n))
    want = index_logits("reference", pool, 1, ix, q, w, table, n, None)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    d = (got - want)[fin].abs().max().item()
    print(f"\ndeepgemm logits: max |d| {d:.3g} of max {want[fin].abs().max().item():.3g}")
    assert d <= 1e-3 * want[fin].abs().max().item()


# -- the step through the engine ------------------------------------------------------------------
@pytest.mark.parametrize("rows", ["bf16", "fp8"])
def test_fast_hisparse_equals_full_resident_one_bucket(rows):
    """Spills (a pool of 10 hot buffers' worth), restores and prefix reuse, one bucket of 4."""
    cfg = small_cfg()
    m = led_model(cfg)
    hs = hisparse(cfg, 256)
    fast = FastPathConfig(max_context=2048, buckets=(4,), index_key_dtype="fp8")
    prompts = prompts_of([700, 300, 1000, 90], cfg.vocab_size)
    common = dict(kv_cache_dtype=rows, page_size=16)
    base = run(m, prompts, 24, fast_engine(fast, hs, full_resident=True, **common))
    hsp = run(m, prompts, 24, fast_engine(fast, hs, num_device_blocks=60, **common))
    print(f"\n{rows}: hits {hsp[3]['hot_hits']} misses {hsp[3]['hot_misses']} spills {hsp[2].spills}")
    assert_same(hsp, base)
    assert hsp[2].spills > 0 and hsp[3]["hot_misses"] > 0 and hsp[3]["hot_hits"] > 0


def test_fast_hisparse_equals_full_resident_many_buckets_and_graph_equals_eager():
    """Host-tier landings (same schedules in both modes), batch 4 -> 1 over buckets 1, 2, 4; and
    the same run with graphs off gives the same bits."""
    cfg = small_cfg()
    m = led_model(cfg, 3)
    hs = hisparse(cfg, 256)
    fast = FastPathConfig(max_context=2048, buckets=(1, 2, 4), index_key_dtype="fp8")
    prompts = prompts_of([1100, 1200, 1300, 1400], cfg.vocab_size, seed=2)  # > the pool: host tier
    news = [4, 8, 12, 16]
    hot = -(-(256 + 1) // 16)
    base = run(m, prompts, news, fast_engine(fast, hs, full_resident=True, page_size=16))
    hsp = run(m, prompts, news, fast_engine(fast, hs, num_device_blocks=4 * hot, page_size=16))
    eager = run(m, prompts, news, fast_engine(FastPathConfig(
        max_context=2048, buckets=(1, 2, 4), index_key_dtype="fp8", cuda_graphs=False), hs,
        num_device_blocks=4 * hot, page_size=16))
    assert_same(hsp, base)
    assert_same(eager, hsp)
    assert sorted(set(hsp[4])) == [1, 2, 3, 4] and hsp[2].conversions_to_host == 0


@pytest.mark.parametrize("rows", ["bf16", "fp8"])
def test_fast_matches_reference_small(rows):
    cfg = small_cfg()
    m = led_model(cfg, 5)
    hs = hisparse(cfg, 256)
    prompts = prompts_of([700, 300], cfg.vocab_size, seed=3)
    ref = run(m, prompts, 64, EngineConfig(hisparse=hs, device="cuda", backend="cuda",
                                            full_resident=True, kv_cache_dtype=rows, page_size=16))
    fast = FastPathConfig(max_context=1024, buckets=(1, 2), index_key_dtype="bf16")
    got = run(m, prompts, 64, fast_engine(fast, hs, num_device_blocks=40, kv_cache_dtype=rows, page_size=16))
    d, rms = rel_err(got, ref)
    print(f"\nsmall {rows}: max |dlogit| beyond 2 ulps {d:.4g}, rms logits {rms:.4g}, attention "
          f"hits {got[3]['hot_hits']} misses {got[3]['hot_misses']}")
    assert got[0] == ref[0] and all(len(t) == 64 for t in got[0].values())
    assert d <= TOL * rms


@pytest.mark.slow
def test_fast_matches_reference_real_dims():
    """DeepSeek-V3.2's attention and indexer dims (128 heads, q_lora 1536, 512 + 64, 64 x 128 index
    heads, top-k 2048, hot buffer 4096), 2 layers, contexts past the hot buffer."""
    cfg = real_cfg()
    m = led_model(cfg, 7)
    hs = hisparse(cfg, 4096, pool_gib=0.1)
    prompts = prompts_of([5000, 2100], cfg.vocab_size, seed=4)  # 79 pages: host tier; 33: resident
    ref = run(m, prompts, 64, EngineConfig(hisparse=hs, device="cuda", backend="cuda",
                                            full_resident=True, page_size=64))
    fast = FastPathConfig(max_context=5120, buckets=(1, 2), index_key_dtype="bf16")
    got = run(m, prompts, 64, fast_engine(fast, hs, num_device_blocks=100, page_size=64))  # 5000 on host
    d, rms = rel_err(got, ref)
    print(f"\nreal dims: max |dlogit| beyond 2 ulps {d:.4g}, rms logits {rms:.4g}, hits {got[3]['hot_hits']} "
          f"misses {got[3]['hot_misses']}")
    assert got[0] == ref[0]
    assert d <= TOL * rms


def test_compiled_glue_equals_full_resident_and_matches_reference():
    """``compile_glue``: the per-layer torch work compiled by inductor (Triton on CUDA) inside the
    captured step. HiSparse equals full-resident bit for bit over buckets 1, 2, 4, and the
    compiled step stays within the fast path's tolerance of the reference with equal tokens."""
    cfg = small_cfg()
    m = led_model(cfg, 3)
    hs = hisparse(cfg, 256)
    fast = FastPathConfig(max_context=2048, buckets=(1, 2, 4), index_key_dtype="fp8",
                          compile_glue=True)
    prompts = prompts_of([1100, 1200, 1300, 1400], cfg.vocab_size, seed=2)
    news = [4, 8, 12, 16]
    hot = -(-(256 + 1) // 16)
    base = run(m, prompts, news, fast_engine(fast, hs, full_resident=True, page_size=16))
    hsp = run(m, prompts, news, fast_engine(fast, hs, num_device_blocks=4 * hot, page_size=16))
    assert_same(hsp, base)
    ref = run(m, prompts, news, EngineConfig(hisparse=hs, device="cuda", backend="cuda",
                                              full_resident=True, page_size=16))
    d, rms = rel_err(hsp, ref)
    print(f"\ncompiled glue: max |dlogit| beyond 2 ulps {d:.4g}, rms logits {rms:.4g}")
    assert hsp[0] == ref[0]
    assert d <= TOL * rms


def test_resolver_overlap_is_bit_identical_under_random_schedules():
    """``overlap_resolve`` runs each layer's resolver on a side stream beside the absorbed query.
    The join before attention is what keeps it exact: with the side stream delayed by a random
    0-100 us before every resolve (eager: a new draw each call; graphs: the draws of the capture),
    HiSparse through spills and buckets 1, 2, 4 gives the same bits as the resolver in line."""
    import random

    cfg = small_cfg()
    m = led_model(cfg, 7)
    hs = hisparse(cfg, 256)
    prompts = prompts_of([1100, 700, 1300, 90], cfg.vocab_size, seed=4)
    news = [5, 9, 14, 20]
    hot = -(-(256 + 1) // 16)
    # unpipelined: the schedule of the synchronous loop reaches every bucket (checked below)
    common = dict(num_device_blocks=4 * hot + 6, page_size=16, lookahead=False)

    def fast(overlap, graphs=True):
        # no warm-up: the graphs must be captured with the test's delays in them
        return FastPathConfig(max_context=2048, buckets=(1, 2, 4), index_key_dtype="fp8",
                              overlap_resolve=overlap, cuda_graphs=graphs, warm_up=False)

    def delayed(seed):
        rng = random.Random(seed)

        def hook(eng):
            step = eng.worker.fast.step
            assert step.side is not None
            step.side_delay = lambda: rng.randrange(0, 200_000)
        return hook

    inline = run(m, prompts, news, fast_engine(fast(False), hs, **common))
    for seed, graphs in ((1, True), (2, False), (3, False)):
        got = run(m, prompts, news, fast_engine(fast(True, graphs), hs, **common), between=delayed(seed))
        assert_same(got, inline)
    assert inline[3]["hot_misses"] > 0 and sorted(set(inline[4])) == [1, 2, 3, 4]


def test_lookahead_is_bit_identical_with_the_gpu_lagging():
    """``EngineConfig.lookahead`` launches step N + 1 (its chained rows read step N's tokens on
    the device) before the host reads step N. With the GPU held back by a random 0-400 us sleep
    before every launch, so that the host runs a step ahead: graphs, spills, eos and a host-sampled
    request give the bits of ``lookahead=False`` (one bucket: the schedules may differ)."""
    import random

    from hisparse_ray.types import SamplingParams

    cfg = small_cfg()
    m = led_model(cfg, 5)
    hs = hisparse(cfg, 256)
    fast = FastPathConfig(max_context=2048, buckets=(4,), index_key_dtype="fp8")
    prompts = prompts_of([700, 300, 1000, 90, 40], cfg.vocab_size, seed=6)
    common = dict(kv_cache_dtype="bf16", page_size=16, num_device_blocks=60)
    free = run(m, prompts, 20, fast_engine(fast, hs, **common))
    eos = free[0]["r2"][6]

    def lagging(seed):
        rng = random.Random(seed)

        def hook(eng):
            eng.add_request("s", prompts[4], 9, sampling=SamplingParams(temperature=0.9, seed=3))
            eng.add_request("e", prompts[2], 20, eos_token_id=eos)
            launch = eng.worker.launch

            def slow(cmd):
                torch.cuda._sleep(rng.randrange(0, 800_000))
                return launch(cmd)
            eng.worker.launch = slow
        return hook

    base = run(m, prompts, 20, fast_engine(fast, hs, **common), between=lagging(0))
    for seed in (1, 2):
        got = run(m, prompts, 20, fast_engine(fast, hs, lookahead=True, **common),
                  between=lagging(seed))
        assert got[0] == base[0]
        for k, x in base[1].items():
            assert torch.equal(got[1][k], x), k
        assert got[2].chained_rows > 0 and got[2].spills > 0
    assert base[0]["e"][-1] == eos
