"""The fast decode path on shapes and workloads the other fast-path tests do not use: a handful of
the most distinct configurations of a randomized CPU sweep (bucket sets (1, 3), (2, 5, 7), (9,),
(1) and the default powers of two; page sizes 1, 3, 8 and 128; hot buffers at top-k; top-k 1 to 33;
KV rows fp32 / bf16 / fp8; index keys of every kind; the index-key pool at its minimum; max_context
exactly what the requests need or 4096; DeepSeek-V3.2 and GLM kinds, dense and MoE layers, the
real 512 + 64 MLA rows; requests arriving at different steps, prompts of one token and of exactly a
page, shared prefixes, ``max_new_tokens`` 1, eos on the first token, device-pool pressure).

For each: fast HiSparse equals fast full-resident bit for bit (tokens and every step's logits) where
every row ran in the same bucket in both modes (always with one bucket, or when both modes scheduled
the same batches; otherwise within 1e-5, the documented multi-bucket limit), greedy tokens equal
the reference path's (logits within 1e-4 with fp32 rows and keys), and once every request is done
nothing is held: device and host blocks, index-key pages, the executor's per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks
from hisparse_ray.types import RequestState
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import landing_config, tiny_config
from hisparse_ray.model.model import build_random_model


def _prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@dataclass(frozen=True)
class Case:
    model: object  # DSAConfig
    topk: int
    page: int
    buckets: tuple[int, ...]
    lengths: tuple[int, ...]
    max_new: tuple[int, ...]
    arrive: tuple[int, ...]
    kv: str = "auto"
    index_keys: str = "auto"
    spare_context: int | None = 0  # max_context = need + this; None: 4096
    min_index_pages: bool = False  # then requests run one after another
    pressure: bool = False  # the device pool holds one hot buffer
    prefix_of_first: tuple[int, ...] = ()  # request i's prompt starts with the first's
    eos_first: int | None = None  # this request stops at its first token
    batch_invariant: bool = True
    hot_extra: int = 0
    expect: tuple[str, ...] = ()  # counters HiSparse must show (> 0)


def _dense(cfg, L):
    return cfg.with_(num_hidden_layers=L, mlp_layer_types=("dense",) * L,
                     indexer_types=cfg.indexer_types[:L] if cfg.kind == "glm_moe_dsa" else ("full",) * L)


CASES = {
    # MoE, the hot buffer at top-k, page 3, a pool of one hot buffer: every request decodes from the
    # host tier (its pages backed up as they fill)
    "moe-page3-pressure-fp8rows": Case(
        tiny_config("deepseek_v32"), topk=8, page=3, buckets=(1, 3), lengths=(150, 1, 3, 60, 45),
        max_new=(12, 1, 6, 9, 5), arrive=(0, 0, 0, 2, 4), kv="fp8", pressure=True,
        prefix_of_first=(4,), eos_first=3, expect=("backups",)),
    # GLM (shared indexers), page 1, top-k 33, bf16 rows and keys, odd buckets, max_context tight
    "glm-page1-topk33-bf16": Case(
        tiny_config("glm_moe_dsa", yarn=False), topk=33, page=1, buckets=(2, 5, 7),
        lengths=(40, 70, 1, 9, 120, 33, 64), max_new=(5, 1, 8, 3, 2, 6, 4), arrive=(0, 0, 1, 1, 2, 3, 5),
        kv="bf16", index_keys="bf16", hot_extra=1),
    # the real 512 + 64 MLA rows and 128-dim keys, fp8 rows, 9 requests in the default buckets,
    # max_context far above what they need
    "real-dims-fp8-default-buckets": Case(
        landing_config("deepseek_v32", num_layers=2), topk=8, page=8, buckets=(1, 2, 4, 8, 16, 32, 64),
        lengths=(100, 8, 1, 17, 64, 90, 5, 33, 70), max_new=(4, 2, 1, 3, 5, 2, 1, 4, 3),
        arrive=(0,) * 5 + (1, 2, 2, 3), kv="fp8", spare_context=None),
    # one bucket of 1, page 128 (a prompt of exactly a page), 6 dense layers, 1 attention head,
    # the index-key pool at its minimum (one request's pages): requests one after another
    "one-bucket-page128-min-index-pool": Case(
        _dense(tiny_config("deepseek_v32").with_(num_attention_heads=1), 6), topk=4, page=128,
        buckets=(1,), lengths=(128, 1, 130), max_new=(1, 20, 3), arrive=(0, 0, 0), kv="fp32",
        index_keys="fp32", min_index_pages=True, spare_context=1),
    # top-k 1 (hot buffer of 1), one bucket of 9 holding 9 requests, fp8 index keys, throughput
    # prefill (no shared prefixes, so still exact)
    "topk1-bucket9-fp8keys": Case(
        tiny_config("glm_moe_dsa"), topk=1, page=8, buckets=(9,), lengths=(1, 2, 8, 16, 30, 77, 100, 140, 9),
        max_new=(3, 1, 2, 9, 4, 1, 6, 2, 5), arrive=(0,) * 9, index_keys="fp8", batch_invariant=False,
        pressure=True),
}


def busy(eng) -> bool:
    """A request of ``eng`` still holds something (released ones stay listed until forgotten)."""
    return any(eng.core.view(r).state is not RequestState.RELEASED for r in eng.core.request_ids())


def _run(model, ecfg, requests, sequential):
    """-> (tokens, logits per (request, seq_len), bucket per (request, seq_len), counters)."""
    logits, bucket = {}, {}
    with Engine(model, ecfg) as eng:
        def grab(rows, out):
            b = ecfg.fast_path.bucket(len(rows)) if ecfg.fast_path is not None else len(rows)
            for i, row in enumerate(rows):
                logits[(row.request_id, row.seq_len)] = out[i].detach().clone()
                bucket[(row.request_id, row.seq_len)] = b
        eng.worker.on_logits = grab
        step, todo = 0, sorted(requests, key=lambda r: r[3])
        while todo or not eng.done:
            while todo and todo[0][3] <= step and (not sequential or not busy(eng)):
                rid, prompt, n, _, eos = todo.pop(0)
                eng.add_request(rid, prompt, n, eos_token_id=eos)
            eng.step()
            step += 1
        while eng.step():
            pass
        out = {r: eng.result(r) for r in eng._known}
        eng.core.check_invariants()
        c = eng.core.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.running, c.waiting) == (0, 0, 0, 0)
        w = eng.worker
        assert not w.runtime.requests and not w.index and not w.samplers
        if w.fast is not None:
            assert w.fast.keys.free_pages == w.fast.keys.num_pages and not w.fast.keys.pages
            assert not w.fast._tables
    return out, logits, bucket, c


@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_on_distinct_shapes(name):
    case = CASES[name]
    mcfg = case.model.with_(index_topk=case.topk)
    model = build_random_model(mcfg, seed=3)
    hot = case.topk + case.hot_extra
    hs = HiSparseConfig(top_k=case.topk, device_buffer_size=hot, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.01)
    prompts = _prompts(case.lengths, mcfg.vocab_size, seed=len(name))
    for i in case.prefix_of_first:
        prompts[i] = prompts[0][:len(prompts[i]) - 5] + prompts[i][-5:]
    requests = [[f"r{i}", p, n, a, None] for i, (p, n, a) in
                enumerate(zip(prompts, case.max_new, case.arrive))]
    need = max(len(p) + n for p, n in zip(prompts, case.max_new))
    max_context = 4096 if case.spare_context is None else need + case.spare_context
    ipr = -(-max_context // 64)
    fast = FastPathConfig(max_context=max_context, buckets=case.buckets, index_key_dtype=case.index_keys,
                          index_pages=ipr if case.min_index_pages else None)
    base = dict(hisparse=hs, page_size=case.page, kv_cache_dtype=case.kv, max_batch=case.buckets[-1])
    seq = case.min_index_pages
    ref_cfg = EngineConfig(full_resident=True, **base)
    if case.eos_first is not None:  # stop that request at the token it generates first
        first = _run(model, ref_cfg, requests, seq)[0][f"r{case.eos_first}"][0]
        requests[case.eos_first][4] = first
    ref = _run(model, ref_cfg, requests, seq)
    fcfg = dict(fast_path=fast, batch_invariant=case.batch_invariant, **base)
    full = _run(model, EngineConfig(full_resident=True, **fcfg), requests, seq)
    hb = hot_buffer_blocks(hot, case.page)
    blocks = hb if case.pressure else hb * len(requests) + -(-need // case.page) * len(requests)
    hsr = _run(model, EngineConfig(num_device_blocks=blocks, **fcfg), requests, seq)

    assert hsr[0] == full[0]
    exact_keys = case.index_keys in ("auto", "fp32") or (case.index_keys == "bf16" and model.dtype == torch.bfloat16)
    if exact_keys:  # fp8 / bf16 index keys select from rounded scores: other top-k than the reference's
        assert full[0] == ref[0]
    assert all(len(full[0][r[0]]) == (1 if i == case.eos_first else r[2]) for i, r in enumerate(requests))
    assert hsr[1].keys() == full[1].keys()
    if hsr[2] == full[2]:  # every row in the same bucket in both modes: bit for bit
        for k in full[1]:
            assert torch.equal(hsr[1][k], full[1][k]), k
    else:
        assert max((hsr[1][k] - full[1][k]).abs().max().item() for k in full[1]) < 1e-5
    if model.dtype == torch.float32 and case.kv in ("auto", "fp32") and exact_keys:
        assert max((full[1][k] - ref[1][k]).abs().max().item() for k in ref[1]) < 1e-4
    for key in case.expect:
        assert getattr(hsr[3], key) > 0, (key, hsr[3])
    if case.prefix_of_first:
        assert hsr[3].prefix_hit_pages > 0
