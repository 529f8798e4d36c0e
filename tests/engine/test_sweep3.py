"""General-case sweep 3 (``benchmarks/sweep3.py``): HiSparse equals full-resident (tokens and every
step's logits) on configurations the earlier sweeps did not combine.

Found by it: on the reference path a multi-turn follow-up reused pages a decode step wrote also
with lossy KV rows (fp8, or bf16 rows of an fp32 model). A prefill attends over its own unrounded
rows, a decode step over the stored (rounded) ones, so from the second layer on a decode-written
row is not the row a prefill of the same tokens computes: the follow-up decoded other logits (and
with fp8 other tokens) than full-resident's fresh prefill. Decode-written pages are now published
only where the stored rows are exactly the model's (``config.kv_rows_lossless``).

``SWEEP`` keeps five of the sweep's most distinct configurations: ``lookahead`` on and off with a
device pool of one hot buffer, fp8 / bf16 rows, bf16 weights, GLM, pages 1 / 3 / 4 / 8 / 16,
top-k 1 and hot buffers at their minimum, tight host pools, the fast path with one bucket, prompts
around page boundaries, shared prefixes, follow-ups built from a finished answer, arrivals
mid-run, ``max_new_tokens`` 1, eos at various tokens and seeded sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from hisparse_ray.config import GIB, HiSparseConfig, hot_buffer_blocks
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.testing.engine_drive import drive
from hisparse_ray.types import RequestState, SamplingParams

DONE = (RequestState.FINISHED, RequestState.RELEASED)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _follow_up(model, full: bool, kv: str):
    """A donor decodes 24 tokens on a device pool of one hot buffer (its pages backed up to the
    host tier and published as they fill), then a follow-up of its prompt + answer + 2 tokens."""
    logits = {}
    cfg = EngineConfig(full_resident=full, kv_cache_dtype=kv, page_size=4, num_device_blocks=5)
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            logits.update({(r.request_id, r.seq_len): out[i].clone() for i, r in enumerate(rows)})
        eng.worker.on_logits = grab
        eng.add_request("a", [5, 6, 7], 24)
        a = eng.run()["a"]
        eng.add_request("b", [5, 6, 7] + a + [1, 2], 4)
        return eng.run(), logits, eng.core.counters


@pytest.mark.parametrize("kv,dtype,lossless", [
    ("fp8", "fp32", False), ("fp8", "bf16", False), ("bf16", "fp32", False),
    ("bf16", "bf16", True), ("fp32", "bf16", True), ("auto", "fp32", True)])
def test_follow_up_reusing_decoded_pages_with_lossy_rows(kv, dtype, lossless):
    model = build_random_model(tiny_config(), seed=0, dtype=DTYPES[dtype])
    base = _follow_up(model, True, kv)
    hs = _follow_up(model, False, kv)
    assert hs[0] == base[0]
    assert hs[1].keys() == base[1].keys()
    for k in base[1]:
        assert torch.equal(hs[1][k], base[1][k]), k
    assert base[2].prefix_hit_pages == 0
    # prompt + 23 written decode rows: 26 positions, 6 full pages; the prompt's last row (2) is
    # written by the prefill: page 0 only holds prefill rows
    assert hs[2].prefix_hit_pages == (6 if lossless else 0)


def test_replicas_publish_decoded_pages_only_with_lossless_rows():
    """The actor system's replicas decide the same (``ReplicaSpec.core_config``)."""
    from hisparse_ray.deploy import DeployOptions

    def publishes(**kw):
        return DeployOptions(**kw).specs()[0].core_config.publish_decoded

    assert publishes() and publishes(kv_cache_dtype="fp32")
    assert publishes(kv_cache_dtype="bf16", dtype="bfloat16")
    assert publishes(kv_cache_dtype="fp32", dtype="bfloat16")
    assert not publishes(kv_cache_dtype="fp8")
    assert not publishes(kv_cache_dtype="bf16")  # rounded rows of an fp32 model
    assert not publishes(kv_cache_dtype="fp8", dtype="bfloat16")


# -- the sweep's most distinct configurations ------------------------------------------------------
# Each runs four engines (full-resident / HiSparse x lookahead off / on): the same tokens, finish
# reasons and logits of every row whose token is kept, bit for bit (a lookahead run may also run
# the row behind an eos; its token is dropped, and which such rows run depends on the schedule).

@dataclass(frozen=True)
class Req:
    n: int  # prompt tokens (a prefix / follow-up: the tokens after the shared part)
    max_new: int
    at: int = 0  # the step it is added at (a follow-up: once its donor is done)
    eos_at: int | None = None  # stops at the token it generates at this index (a first run's)
    sampling: SamplingParams | None = None
    prefix_of: tuple[int, int] | None = None  # (request, tokens of its prompt) this one starts with
    after: int | None = None  # a follow-up: that request's prompt + answer + n tokens


@dataclass(frozen=True)
class Sweep:
    kind: str
    layers: tuple[str, ...]  # "dense" / "sparse" (MoE) per layer
    topk: int
    page: int
    reqs: tuple[Req, ...]
    hot_extra: int = 0
    kv: str = "auto"
    dtype: torch.dtype = torch.float32
    index_heads: int = 2
    pool: int = 0  # device blocks beyond one hot buffer
    max_batch: int = 3
    fast: tuple[int, ...] | None = None  # the fast path's buckets (None: the reference path)
    host_blocks: int | None = None  # a tight host pool (None: roomy)
    expect: tuple[str, ...] = ()  # HiSparse counters that must be > 0


S = SamplingParams
SWEEP = {
    # GLM, MoE, the hot buffer at top-k, a device pool of one hot buffer (every request decodes
    # from the host tier), fp8 rows, prompts of page - 1 / page / page + 1, a shared prefix of a
    # finished request, a follow-up, eos at the first and a middle token, max_new_tokens 1,
    # seeded sampling
    "glm-moe-fp8-min-pool-lookahead": Sweep(
        "glm_moe_dsa", ("dense", "sparse", "sparse"), topk=4, page=3, kv="fp8", reqs=(
            Req(2, 7), Req(3, 5, at=1, eos_at=0), Req(4, 9, at=1, sampling=S(1.0, seed=3)),
            Req(5, 6, at=3, prefix_of=(0, 2)), Req(2, 4, after=2),
            Req(31, 1, at=4), Req(7, 10, at=6, eos_at=4, sampling=S(0.7, 11, 0.8, 5))),
        expect=("backups", "chained_rows")),
    # bf16 weights, page 1, top-k 1 with a hot buffer of 1, one spare device block, a host pool of
    # about one life (requests wait for host blocks), 16 index heads
    "bf16-page1-topk1-tight-host": Sweep(
        "deepseek_v32", ("sparse", "dense"), topk=1, page=1, dtype=torch.bfloat16, index_heads=16,
        pool=1, host_blocks=50, reqs=(
            Req(1, 12), Req(2, 8, sampling=S(1.5, seed=7)), Req(17, 3, at=2, eos_at=1),
            Req(30, 1, at=2), Req(3, 6, after=0), Req(9, 5, at=5, prefix_of=(3, 30))),
        expect=("chained_rows",)),
    # bf16 rows of an fp32 model (lossy: decoded pages are not reused), a follow-up built from a
    # request's answer while the pool spills, hot buffer above top-k
    "bf16-rows-follow-ups-spills": Sweep(
        "deepseek_v32", ("dense", "sparse", "dense", "sparse"), topk=3, page=4, hot_extra=2,
        kv="bf16", pool=3, max_batch=4, reqs=(
            Req(40, 12), Req(4, 9, at=1), Req(5, 3, after=1), Req(8, 2, after=2),
            Req(3, 7, at=2, prefix_of=(0, 16), sampling=S(1.0, seed=1)), Req(15, 12, at=3)),
        expect=("spills", "prefix_hit_pages")),
    # the fast path, one bucket (every row the same batch shape in every schedule), dense layers,
    # fp8 rows, a pool of one hot buffer, page 8, eos, sampling, two shared prefill pages, a
    # follow-up
    "fast-one-bucket-fp8-min-pool": Sweep(
        "deepseek_v32", ("dense", "dense"), topk=8, page=8, kv="fp8", fast=(3,), reqs=(
            Req(20, 9), Req(8, 4, eos_at=2), Req(9, 6, at=1, sampling=S(0.9, seed=4, top_k=10)),
            Req(3, 5, at=2, prefix_of=(0, 17)), Req(4, 3, after=1), Req(64, 1, at=3)),
        expect=("backups", "prefix_hit_pages")),
    # GLM on the fast path with bf16 rows, page 16, hot buffer one above top-k, a roomy pool
    "fast-glm-page16-bf16": Sweep(
        "glm_moe_dsa", ("dense",) * 4, topk=2, page=16, hot_extra=1, kv="bf16", fast=(2,),
        max_batch=2, pool=2, reqs=(
            Req(15, 6), Req(16, 5, at=1, eos_at=3), Req(17, 7, at=1), Req(33, 2, after=0),
            Req(1, 4, at=4, sampling=S(1.2, seed=9)))),
}


def _build(case: Sweep):
    L = len(case.layers)
    base = tiny_config(case.kind, yarn=False)
    cfg = base.with_(index_topk=case.topk, index_n_heads=case.index_heads, num_hidden_layers=L,
                     mlp_layer_types=case.layers, indexer_types=base.indexer_types[:L])
    return build_random_model(cfg, seed=L, dtype=case.dtype)


def _config(case: Sweep, model, full: bool, lookahead: bool, fast: bool = True) -> EngineConfig:
    hot = case.topk + case.hot_extra
    hs = HiSparseConfig(top_k=case.topk, device_buffer_size=hot, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.01)
    fp = None if case.fast is None else FastPathConfig(max_context=128, buckets=case.fast)
    kw = dict(page_size=case.page, kv_cache_dtype=case.kv, max_batch=case.max_batch,
              num_device_blocks=hot_buffer_blocks(hot, case.page) + case.pool, fast_path=fp,
              full_resident=full, lookahead=lookahead)
    if case.host_blocks is not None:
        block = EngineConfig(hisparse=hs, **kw).layout(model.cfg, model.dtype).block_bytes
        hs = replace(hs, host_pool_gib=(case.host_blocks + 0.5) * block / GIB)
    return EngineConfig(hisparse=hs, **kw)


def _drive(model, cfg: EngineConfig, case: Sweep, eos: dict) -> dict:
    g = torch.Generator().manual_seed(len(case.reqs))
    vocab = model.cfg.vocab_size
    fresh = [torch.randint(0, vocab, (r.n,), generator=g).tolist() for r in case.reqs]
    prompts: dict[int, list[int]] = {}
    logits: dict = {}
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            for b, row in enumerate(rows):
                key = (str(row.request_id), row.seq_len)
                assert key not in logits, key
                logits[key] = (row.input_token, out[b].detach().clone())
        eng.worker.on_logits = grab

        def add_due(step):
            for i, r in enumerate(case.reqs):
                if i in prompts:
                    continue
                if r.after is not None:
                    donor = f"r{r.after}"
                    if (r.after not in prompts or eng._inflight is not None
                            or eng.core.state(donor) not in DONE):
                        continue
                    prompts[i] = prompts[r.after] + eng.result(donor) + fresh[i]
                elif r.at > step:
                    continue
                elif r.prefix_of is not None:
                    j, n = r.prefix_of
                    prompts[i] = prompts[j][:n] + fresh[i]
                else:
                    prompts[i] = fresh[i]
                eng.add_request(f"r{i}", prompts[i], r.max_new, sampling=r.sampling,
                                eos_token_id=eos.get(i))
        drive(eng, lambda eng, k: add_due(k), pending=lambda: len(prompts) < len(case.reqs))
        tokens = {i: eng.result(f"r{i}") for i in prompts}
        reasons = {i: eng.core.view(f"r{i}").finish_reason for i in prompts}
        c = eng.core.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.running, c.waiting) == (0, 0, 0, 0)
        w = eng.worker
        assert not w.runtime.requests and not w.index and not w.samplers
    kept = {(f"r{i}", s) for i in prompts for s in
            range(len(prompts[i]), len(prompts[i]) + len(tokens[i]) - 1)}
    return dict(tokens=tokens, reasons=reasons, counters=c, prompts=prompts,
                logits={k: v for k, v in logits.items() if k in kept}, kept=kept)


def _same(a: dict, b: dict) -> None:
    assert a["prompts"] == b["prompts"]
    assert a["tokens"] == b["tokens"]
    assert a["reasons"] == b["reasons"]
    assert a["logits"].keys() == a["kept"] == b["logits"].keys()
    for k, (tok, x) in a["logits"].items():
        assert b["logits"][k][0] == tok, k
        assert torch.equal(b["logits"][k][1], x), k


@pytest.mark.parametrize("name", list(SWEEP))
def test_sweep3_hisparse_and_lookahead_equal_full_resident(name):
    case = SWEEP[name]
    model = _build(case)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = _drive(model, _config(case, model, True, False), case, {})
        eos = {i: first["tokens"][i][r.eos_at] for i, r in enumerate(case.reqs)
               if r.eos_at is not None}
        runs = {(full, la): _drive(model, _config(case, model, full, la), case, eos)
                for full in (True, False) for la in (False, True)}
    finally:
        torch.set_num_threads(threads)
    base = runs[(True, False)]
    for key, run in runs.items():
        _same(run, base)
    assert all(base["reasons"][i] == "eos" for i in eos)
    assert all(len(base["tokens"][i]) == r.max_new for i, r in enumerate(case.reqs)
               if i not in eos)
    for full in (True, False):
        assert runs[(full, True)]["counters"].chained_rows > 0
    for key in case.expect:
        assert max(getattr(runs[(False, la)]["counters"], key) for la in (False, True)) > 0, key
