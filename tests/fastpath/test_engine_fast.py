"""The fast decode step through the in-process engine on CPU (torch reference kernels, eager):
fast-path HiSparse equals fast-path full-resident bit-exactly through spills, restores, prefix reuse
and mixed batch sizes; it matches the reference path within fp32 rounding; fp8 KV rows; the
full-resident baseline under a device budget.

Exactness needs each row to run in the same bucket shape in both modes: with one bucket always,
or whenever both modes schedule the same batches (matmul results depend on the batch shape, like
the reference path's ``batch_invariant`` switch). The tiny model here has dense MLPs: an MoE
routes a batch's tokens into per-expert matmuls whose shapes depend on the batch mates.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import CapacityError, InvalidRequestError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model, build_tiny_model
from hisparse_ray.types import LandingTarget, RequestState, SamplingParams

H = 16  # the engine's default hot buffer (top-k 8, page 8)
ONE = FastPathConfig(max_context=256, buckets=(4,))
MANY = FastPathConfig(max_context=256, buckets=(1, 2, 4))


@pytest.fixture(scope="module")
def dense():
    cfg = tiny_config()
    return build_random_model(cfg.with_(mlp_layer_types=("dense",) * cfg.num_hidden_layers), seed=2)


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def fast_cfg(fast, **kw):
    return EngineConfig(fast_path=fast, batch_invariant=False, max_batch=fast.max_batch, **kw)


def run(model, prompts, max_new, cfg, between=None):
    """(tokens, logits per (request, seq_len), coordinator counters, worker counters, batch sizes)."""
    logits, sizes = {}, []
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            sizes.append(len(rows))
            for b, row in enumerate(rows):
                logits[(row.request_id, row.seq_len)] = out[b].detach().clone()
        eng.worker.on_logits = grab
        news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
        for i, (p, n) in enumerate(zip(prompts, news)):
            eng.add_request(f"r{i}", p, n)
        if between is not None:
            between(eng)
        tokens = eng.run()
        eng.core.check_invariants()
        counters, worker = eng.core.counters, dict(eng.worker.counters)
    return tokens, logits, counters, worker, sizes


def assert_same(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_one_bucket_equals_full_resident_through_spills(dense, kv):
    prompts = prompts_of([8 * H + 5, 40, 3, 9 * H], dense.cfg.vocab_size)
    base = run(dense, prompts, 16, fast_cfg(ONE, full_resident=True, kv_cache_dtype=kv))
    hs = run(dense, prompts, 16, fast_cfg(ONE, num_device_blocks=12, kv_cache_dtype=kv))
    assert_same(hs, base)
    assert hs[2].spills > 0 and hs[3]["hot_misses"] > 0 and hs[3]["hot_hits"] > 0
    assert base[3]["hot_misses"] == 0 and base[2].spills == 0
    assert set(hs[4]) != {4}  # the real batch size varied (padded rows in the one bucket)


def test_sampled_and_greedy_rows_in_one_batch_equal_full_resident(dense):
    """Rows sampling with a temperature read their logits back to the host sampler, greedy rows
    take the device's argmax, in the same fast step: with spills and hot-buffer misses HiSparse
    samples the very tokens full-resident does (same seeds, bit-equal logits in one bucket), and
    a seed replays its answer."""
    prompts = prompts_of([8 * H + 5, 40, 9 * H, 3], dense.cfg.vocab_size, seed=5)
    params = [SamplingParams(temperature=0.8, seed=7, top_p=0.9, top_k=5), None,
              SamplingParams(temperature=1.3, seed=11), SamplingParams(temperature=0.5, seed=3)]

    def sampled(cfg):
        with Engine(dense, cfg) as eng:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                eng.add_request(f"r{i}", p, 12, sampling=sp)
            out = eng.run()
            spills = eng.core.counters.spills
        return out, spills

    base, _ = sampled(fast_cfg(ONE, full_resident=True))
    hs, spills = sampled(fast_cfg(ONE, num_device_blocks=12))
    assert hs == base and spills > 0
    assert sampled(fast_cfg(ONE, num_device_blocks=12))[0] == hs  # the seeds replay
    greedy = run(dense, prompts[1:2], 12, fast_cfg(ONE, full_resident=True))[0]["r0"]
    assert hs["r1"] == greedy  # the greedy row is untouched by its sampling neighbours
    assert hs["r0"] != run(dense, prompts[:1], 12, fast_cfg(ONE, full_resident=True))[0]["r0"]


def test_buckets_follow_the_batch_and_stay_exact(dense):
    """Every prompt lands on the host tier (a pool of 4 hot buffers, prompts > 12 pages), so both
    modes schedule the same batches; requests end at different steps: buckets 4, 2 and 1 run."""
    prompts = prompts_of([133, 100, 120, 144], dense.cfg.vocab_size, seed=2)
    news = [3, 6, 9, 12]
    base = run(dense, prompts, news, fast_cfg(MANY, full_resident=True))
    hs = run(dense, prompts, news, fast_cfg(MANY, num_device_blocks=12))
    assert_same(hs, base)
    assert hs[2].conversions_to_host == 0 and hs[3]["hot_misses"] > 0
    assert sorted(set(hs[4])) == [1, 2, 3, 4]


def test_restore_and_prefix_reuse_stay_exact(dense):
    """B lands on the host tier while A fills the pool, is restored to resident pages once A is
    done; C reuses B's published prefix pages."""
    (shared,) = prompts_of([64], dense.cfg.vocab_size, seed=3)
    a, b = prompts_of([150, 30], dense.cfg.vocab_size, seed=4)
    b = shared + b
    c = shared + [5, 6, 7]

    def restore_b(eng):
        assert eng.core.view("r1").tier is LandingTarget.HOST
        for _ in range(200):
            eng.step()
            if eng.core.view("r0").state is RequestState.RELEASED:
                break
        assert eng.core.restore("r1")
        eng.add_request("r2", c, 6)

    cfg = dict(kv_cache_dtype="fp8")
    base = run(dense, [a, b], [3, 12], fast_cfg(ONE, full_resident=True, **cfg), between=lambda e: (
        [e.step() for _ in range(4)], e.add_request("r2", c, 6)))
    # synchronous steps (no lookahead): restore_b needs r1 stable between two steps
    hs = run(dense, [a, b], [3, 12], fast_cfg(ONE, num_device_blocks=24, lookahead=False, **cfg),
             between=restore_b)
    assert_same(hs, base)
    assert hs[2].restores > 0 and hs[2].prefix_hit_pages == 8


def test_fast_path_matches_reference_path(dense):
    """fp32 on CPU: logits within 1e-4 of the reference path (measured ~3e-6: the batched matmuls
    and the paged keys' score matmul round differently), greedy tokens equal over 64 steps."""
    prompts = prompts_of([8 * H + 5, 40], dense.cfg.vocab_size, seed=5)
    ref = run(dense, prompts, 64, EngineConfig(full_resident=True))
    fast = run(dense, prompts, 64, fast_cfg(MANY, num_device_blocks=12))
    assert fast[0] == ref[0] and all(len(t) == 64 for t in fast[0].values())
    err = max((fast[1][k] - ref[1][k]).abs().max().item() for k in ref[1])
    assert err < 1e-4


def test_fp8_rows_through_the_reference_path_equal_full_resident():
    m = build_tiny_model(0)
    prompts = prompts_of([8 * H + 5, 3, 9 * H], m.cfg.vocab_size, seed=6)
    base = run(m, prompts, 12, EngineConfig(full_resident=True, kv_cache_dtype="fp8"))
    hs = run(m, prompts, 12, EngineConfig(num_device_blocks=12, kv_cache_dtype="fp8"))
    assert_same(hs, base)
    plain = run(m, prompts, 12, EngineConfig(full_resident=True))
    assert plain[1].keys() == base[1].keys()
    assert any(not torch.equal(plain[1][k], base[1][k]) for k in base[1])  # fp8 rows really used


def test_full_resident_under_a_device_budget_waits_instead_of_offloading(dense):
    """Same GPU budget for both modes: full-resident runs what fits its reserved lifetimes and
    queues the rest (never the host tier); HiSparse runs them all at once."""
    prompts = prompts_of([120] * 4, dense.cfg.vocab_size, seed=7)
    budget = dict(device_pool_gib=40 * 8 * 4 * 192 / 2**30)  # 40 blocks of 8 rows x 4 layers x 192 B
    base = run(dense, prompts, 8, fast_cfg(MANY, full_resident=True, **budget))
    hs = run(dense, prompts, 8, fast_cfg(MANY, **budget))
    assert max(base[4]) == 2 and max(hs[4]) == 4  # 16 pages a life: 2 fit 40 blocks
    assert base[2].conversions_to_host == 0 and base[2].backups == 0 and base[2].waiting == 0
    assert base[0] == hs[0]


def test_requests_past_max_context_are_refused_before_admission(dense):
    with Engine(dense, fast_cfg(FastPathConfig(max_context=64, buckets=(1,)), full_resident=True)) as eng:
        with pytest.raises(CapacityError, match="max_context"):
            eng.add_request("x", list(range(60)), 5)
        assert eng.core.request_ids() == ()
        eng.add_request("y", list(range(60)), 4)
        assert len(eng.run()["y"]) == 4


@pytest.mark.parametrize("bad", ["3", None, 2.5, -7])
def test_a_bad_max_new_tokens_is_an_invalid_request_on_the_fast_path(dense, bad):
    """The max_context check adds ``max_new_tokens`` to the prompt length: it must run after the
    request is validated (was: TypeError for "3" / None, CapacityError for -7 past max_context)."""
    with Engine(dense, fast_cfg(FastPathConfig(max_context=64, buckets=(1,)))) as eng:
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            eng.add_request("x", list(range(80)) if bad == -7 else [1, 2], bad)
        assert eng.core.request_ids() == ()



def test_a_request_waits_for_index_key_pages_instead_of_failing(dense):
    """index_pages=3 of 2-page requests: "b" finds 1 free page while "a" runs, so admission keeps
    it waiting (CoordinatorConfig.index_pages) and it lands once "a" is released; "c" (1 page)
    waits behind it (FIFO). Every request decodes exactly as full-resident's (was: "b" failed its
    landing with CapacityError although it would fit a step later)."""
    fast = FastPathConfig(max_context=128, buckets=(2,), index_pages=3)
    a, b, c = prompts_of([70, 70, 10], dense.cfg.vocab_size, seed=21)
    with Engine(dense, fast_cfg(fast)) as eng:
        eng.add_request("a", a, 5)
        eng.add_request("b", b, 5)
        eng.add_request("c", c, 5)
        assert [eng.core.view(r).state for r in "bc"] == [RequestState.WAITING] * 2
        seen = []
        while not eng.done:
            assert eng.step()
            eng.core.check_invariants()
            held = sum(len(p) for p in eng.worker.fast.keys.pages.values())
            assert held <= 3
            seen.append(eng.core.view("b").state)
        out = eng.run()
        cnt = eng.core.counters
        assert (cnt.device_blocks_used, cnt.host_blocks_used, cnt.running) == (0, 0, 0)
        assert RequestState.RUNNING in seen
    roomy = FastPathConfig(max_context=128, buckets=(2,))  # one bucket: exact whatever the batches
    base = run(dense, [a, b, c], 5, fast_cfg(roomy, full_resident=True))[0]
    assert out == {"a": base["r0"], "b": base["r1"], "c": base["r2"]}


def test_a_landing_the_index_key_pool_refuses_frees_what_it_held(dense):
    """A landing that fails anyway (here: pages taken behind admission's back) finishes the
    request as ``landing_failed`` with a CapacityError naming the pool, frees its blocks and
    worker state; the others decode exactly and the same prompt lands once pages are free (was:
    the request stayed LANDING with its leases and every later step raised)."""
    fast = FastPathConfig(max_context=128, buckets=(2,), index_pages=3)
    a, b, c = prompts_of([70, 70, 10], dense.cfg.vocab_size, seed=21)
    with Engine(dense, fast_cfg(fast)) as eng:
        eng.add_request("a", a, 5)
        keys = eng.worker.fast.keys
        keys.install("outsider", None, 64)  # one page the coordinator does not know of
        with pytest.raises(CapacityError, match=r"index key pages \(0 free, the rest held by 2 "):
            eng.add_request("c", c, 5)
        assert eng.core.view("c").state is RequestState.RELEASED
        assert eng.core.view("c").finish_reason == "landing_failed"
        keys.free("outsider")
        out = eng.run()
        eng.add_request("c2", c, 5)
        eng.add_request("b", b, 5)
        out.update(eng.run())
        eng.core.check_invariants()
        cnt = eng.core.counters
        assert (cnt.device_blocks_used, cnt.host_blocks_used, cnt.running) == (0, 0, 0)
        assert keys.free_pages == 3 and not eng.worker.index
    roomy = FastPathConfig(max_context=128, buckets=(2,))
    base = run(dense, [a, c, b], 5, fast_cfg(roomy, full_resident=True))[0]
    assert out == {"a": base["r0"], "c": [], "c2": base["r1"], "b": base["r2"]}


def test_a_request_added_right_after_another_finished_gets_its_index_key_pages(dense):
    """A pool of exactly one request's index-key pages: "b", added in the same breath as "a"
    finishes (before any step tells the worker "a" is released), lands on the pages "a" held
    (was: CapacityError "0 free, the rest held by 1 requests" for a pool nothing else used)."""
    fast = FastPathConfig(max_context=128, buckets=(1,), index_pages=2)
    a, b = prompts_of([70, 40], dense.cfg.vocab_size, seed=22)
    with Engine(dense, fast_cfg(fast)) as eng:
        eng.add_request("a", a, 5)
        while eng.core.view("a").state not in (RequestState.FINISHED, RequestState.RELEASED):
            assert eng.step()
        eng.add_request("b", b, 5)
        out = eng.run()
        assert eng.worker.fast.keys.free_pages == 2 and not eng.worker.fast.keys.pages
    base = run(dense, [a, b], 5, fast_cfg(FastPathConfig(max_context=128, buckets=(1,)),
                                          full_resident=True))[0]
    assert out == {"a": base["r0"], "b": base["r1"]}


def test_device_hit_counts_follow_the_runtime_definition(dense):
    """The step's on-device hits / misses equal ``hot_counts_reference`` (the definition the
    reference path reports) on the step's own resolved rows and plans, every step."""
    from types import SimpleNamespace

    from hisparse_ray.rank.runtime import hot_counts_reference

    prompts = prompts_of([8 * H + 5, 40, 9 * H], dense.cfg.vocab_size, seed=8)
    checked = []
    with Engine(dense, fast_cfg(MANY, num_device_blocks=12)) as eng:
        step = eng.worker.fast.step

        def check(batch, _logits):
            B = len(batch)
            inp = step.inputs
            view = SimpleNamespace(slot_rows=inp.view("slot_rows", B), seq_lens=inp.view("seq_lens", B)[:, 0])
            rows = {a: step.out_rows[a][:B].long() for a in step.anchors}
            plans = {a: step.plan[a][:B] for a in step.anchors}
            want = hot_counts_reference(view, rows, plans, H)
            got = (step.hits[:B].tolist(), step.misses[:B].tolist())
            assert got == want, (len(checked), got, want)
            checked.append(sum(want[0]) + sum(want[1]))
        eng.worker.on_logits = check
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, 12)
        eng.run()
    assert len(checked) >= 12 and sum(checked) > 0


@pytest.mark.parametrize("page", [1, 8])
def test_a_follow_up_reuses_only_pages_the_prefill_wrote(dense, page):
    """A multi-turn follow-up (the first request's prompt, part of its answer, a new turn) after
    the first ran on the host tier. The fast step's decode rows are not bitwise what a prefill of
    the same tokens computes (other kernels, batch shapes), so a follow-up that reused the pages
    they fill decoded from other KV than full-resident's fresh prefill (was: 4 of 8 steps'
    logits differed at page 8, every step's at page 1; tokens happened to agree). Only pages
    whose every row a prefill wrote are reused now: the first prompt's positions 0..P-2."""
    (a,) = prompts_of([40], dense.cfg.vocab_size, seed=31)
    fast = FastPathConfig(max_context=128, buckets=(2,))

    def follow_up(cfg):
        logits = {}
        with Engine(dense, cfg) as eng:
            eng.worker.on_logits = lambda rows, out: logits.update(
                {(r.request_id, r.seq_len): out[i].clone() for i, r in enumerate(rows)})
            eng.add_request("a", a, 8)
            first = eng.run()["a"]
            eng.add_request("b", a + first[:3] + [5, 6, 7], 8)
            out = eng.run()
            eng.core.check_invariants()
            return out, logits, eng.core.counters

    hot = -(-(H + 1) // page)  # a device pool of one hot buffer: "a" lands on the host tier
    hs = follow_up(fast_cfg(fast, page_size=page, num_device_blocks=hot))
    base = follow_up(fast_cfg(fast, page_size=page, full_resident=True))
    assert hs[0] == base[0]
    assert hs[1].keys() == base[1].keys()
    for k in base[1]:
        assert torch.equal(hs[1][k], base[1][k]), k
    assert hs[2].prefix_hit_pages == (len(a) - 1) // page and base[2].prefix_hit_pages == 0
