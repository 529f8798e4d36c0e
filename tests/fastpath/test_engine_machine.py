"""A hypothesis state machine over the single-process ``Engine`` on the CPU fast path: random
interleavings of add_request (greedy, eos, seeded sampling, shared prefixes), abort of any known
request, single steps and runs to completion, on engines drawn at initialize (page size 1 / 3 / 8,
a hot buffer at top-k or a bit above, one bucket of 1..4 rows, a device pool of one hot buffer or
a roomy one, an index-key pool capped at exactly ``max_batch`` requests' pages or uncapped, fp32
or fp8 KV rows).

After every rule: the coordinator's invariants; the worker holds per-request state (runtime rows,
index keys, samplers, paged keys, cached tables) only for requests that are not RELEASED, or
whose release the worker has not been told yet (its handle still names it: the next command
carries the release); index-key pages free + held == the pool; a landing refused for index-key
pages only when the live requests really hold them. At the end: everything runs to completion,
each request's tokens equal a full-resident engine's for that request run alone (one bucket:
bit-exact whatever the batch mates), an aborted one's are a prefix of them, and nothing is held.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import CapacityError, StateError, UnknownRequestError
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.types import RequestState, SamplingParams

_cfg = tiny_config()
MODEL = build_random_model(_cfg.with_(mlp_layer_types=("dense",) * _cfg.num_hidden_layers), seed=2)
VOCAB, TOPK = MODEL.cfg.vocab_size, MODEL.cfg.index_topk
DONE = (RequestState.FINISHED, RequestState.RELEASED)


def worker_rids(eng) -> set:
    """Every request some per-request state of the worker names."""
    w = eng.worker
    out = set(w.runtime.requests) | set(w.index) | set(w.samplers)
    if w.fast is not None:
        out |= set(w.fast.keys.pages) | set(w.fast._tables)
    return out


def index_pages_of(n_positions: int) -> int:
    return -(-max(n_positions, 1) // INDEX_PAGE)


class EngineMachine(RuleBasedStateMachine):
    eng: Engine | None = None

    @initialize(ps=st.sampled_from([1, 3, 8]), hot_extra=st.sampled_from([0, 1, 3]),
                mb=st.integers(1, 4), pool=st.sampled_from(["one", "tight", "roomy"]),
                capped=st.booleans(), kv=st.sampled_from(["fp32", "fp8"]),
                max_context=st.sampled_from([64, 128]), first=st.integers(1, 64),
                first_new=st.integers(1, 12))
    def setup(self, ps, hot_extra, mb, pool, capped, kv, max_context, first, first_new):
        self.H = TOPK + hot_extra
        hs = HiSparseConfig(top_k=TOPK, device_buffer_size=self.H, host_to_device_ratio=4,
                            swap_in_block_size=64, host_pool_gib=0.01)
        per_request = -(-max_context // INDEX_PAGE)
        self.fast = FastPathConfig(max_context=max_context, buckets=(mb,),
                                   index_pages=mb * per_request if capped else None)
        self.max_prompt = self.H + 3 * ps
        hot = hot_buffer_blocks(self.H, ps)
        life = -(-(self.max_prompt + 12) // ps)
        blocks = {"one": hot, "tight": hot + 2, "roomy": mb * (hot + life)}[pool]
        self.base = dict(hisparse=hs, page_size=ps, kv_cache_dtype=kv, max_batch=mb,
                         fast_path=self.fast)
        self.ref_cfg = EngineConfig(full_resident=True, **{
            **self.base, "fast_path": FastPathConfig(max_context=max_context, buckets=(mb,))})
        self.eng = Engine(MODEL, EngineConfig(num_device_blocks=blocks, **self.base))
        self.ref = Engine(MODEL, self.ref_cfg)
        self.ref_memo: dict = {}
        self.requests: dict[str, dict] = {}  # rid -> what it was added with
        self.aborted: set[str] = set()
        self.failed: set[str] = set()  # landings the index-key pool refused
        self.heads = [torch.randint(0, VOCAB, (self.H + ps,),
                                    generator=torch.Generator().manual_seed(ps * 7 + mb)).tolist()]
        self.add(first, first_new, False, None, 0.0, first)  # a run without requests tests nothing

    def teardown(self):
        try:
            if self.eng is not None:
                self.finish_all()
        finally:
            for e in (self.eng, getattr(self, "ref", None)):
                if e is not None:
                    e.close()

    # -- the oracle -------------------------------------------------------------------------------
    def alone(self, prompt, max_new, eos, sampling) -> list[int]:
        """The request's tokens on the full-resident fast-path engine with nothing else running
        (one engine per machine; each request runs to completion before the next is added)."""
        key = (tuple(prompt), max_new, eos, sampling)
        if key not in self.ref_memo:
            rid = f"ref{len(self.ref_memo)}"
            self.ref.add_request(rid, prompt, max_new, eos_token_id=eos, sampling=sampling)
            self.ref_memo[key] = self.ref.run()[rid]
        return self.ref_memo[key]

    # -- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: self.eng is not None)
    @rule(n=st.integers(1, 64), max_new=st.integers(1, 12), shared=st.booleans(),
          eos_at=st.none() | st.integers(0, 11), temp=st.sampled_from([0.0, 0.0, 0.7, 1.3]),
          seed=st.integers(0, 2**20))
    def add(self, n, max_new, shared, eos_at, temp, seed):
        n = 1 + (n - 1) % self.max_prompt
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        if shared and n > 2:  # a prompt starting with a common head: prefix reuse
            head = self.heads[0]
            prompt = head[: n - 2] + prompt[-2:]
        sampling = SamplingParams(temperature=temp, seed=seed) if temp else None
        eos = None
        if eos_at is not None and eos_at < max_new:
            eos = self.alone(prompt, max_new, None, sampling)[eos_at]
        rid = f"r{len(self.requests)}"
        eng = self.eng
        live_pages = sum(len(p) for r, p in eng.worker.fast.keys.pages.items()
                         if eng.core.view(r).state is not RequestState.RELEASED)
        try:
            eng.add_request(rid, prompt, max_new, eos_token_id=eos, sampling=sampling)
        except CapacityError as e:
            self.landing_refused(rid, e, live_pages, n + max_new + 1)
        self.requests[rid] = dict(prompt=prompt, max_new=max_new, eos=eos, sampling=sampling)

    def landing_refused(self, rid, error, live_pages, positions):
        """Only the capped index-key pool may refuse a landing, and only when the requests that
        still live hold too many of its pages for this one."""
        assert "index key pages" in str(error), error
        assert self.fast.index_pages is not None, error
        assert live_pages + index_pages_of(positions) > self.fast.index_pages, \
            (error, live_pages, positions)
        v = self.eng.core.view(rid)
        assert v.state is RequestState.RELEASED and v.finish_reason == "landing_failed"
        self.failed.add(rid)

    @precondition(lambda self: self.eng is not None and any(
        self.eng.core.view(r).state not in DONE for r in self.requests))
    @rule(n=st.integers(1, 64), max_new=st.integers(1, 12), shared=st.booleans(),
          eos_at=st.none() | st.integers(0, 11), temp=st.sampled_from([0.0, 0.0, 0.7, 1.3]),
          seed=st.integers(0, 2**20))
    def add_as_one_finishes(self, n, max_new, shared, eos_at, temp, seed):
        """Step until some request finishes, then add one at once: before any command told the
        worker of the release (the lag that once left a capped index-key pool full)."""
        eng = self.eng
        before = sum(eng.core.view(r).state in DONE for r in self.requests)
        for _ in range(40):
            if not self.step_once() or sum(
                    eng.core.view(r).state in DONE for r in self.requests) > before:
                break
        self.add(n, max_new, shared, eos_at, temp, seed)

    @precondition(lambda self: self.eng is not None)
    @rule(pick=st.integers(0, 40), unknown=st.booleans())
    def abort(self, pick, unknown):
        eng = self.eng
        if unknown or not self.requests:
            with pytest.raises(UnknownRequestError):
                eng.abort("nobody")
            return
        rid = list(self.requests)[pick % len(self.requests)]
        before = eng.core.view(rid)
        if before.state in DONE:  # abort promises waiting or running requests only
            with pytest.raises(StateError, match="already finished"):
                eng.abort(rid)
            assert eng.core.view(rid) == before
            return
        got = eng.abort(rid)
        assert got == list(before.tokens[before.prompt_len:])
        assert eng.core.view(rid).state in DONE
        self.aborted.add(rid)

    @precondition(lambda self: self.eng is not None)
    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.step_once()

    def step_once(self) -> bool:
        eng = self.eng
        waiting = [r for r in self.requests if eng.core.view(r).state is RequestState.WAITING]
        live_pages = sum(len(p) for r, p in eng.worker.fast.keys.pages.items()
                         if eng.core.view(r).state is not RequestState.RELEASED)
        try:
            return eng.step()
        except CapacityError as e:  # a waiting request's landing
            failed = [r for r in waiting if eng.core.view(r).finish_reason == "landing_failed"]
            assert failed, e
            r = self.requests[failed[0]]
            self.landing_refused(failed[0], e, live_pages, len(r["prompt"]) + r["max_new"] + 1)
            self.failed.update(failed)
            return True

    @precondition(lambda self: self.eng is not None)
    @rule()
    def run_to_completion(self):
        self.finish_all()

    def finish_all(self):
        """Every request that fits the pools finishes when the engine keeps stepping."""
        eng, idle = self.eng, 0
        for _ in range(5000):
            if eng.done:
                break
            idle = 0 if self.step_once() else idle + 1
            assert idle <= 3, "no progress with requests left: " + repr(
                {r: eng.core.view(r).state for r in self.requests})
            self.check()
        assert eng.done
        while self.step_once():  # the last releases reach the worker
            self.check()
        self.check()
        c = eng.core.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.running, c.waiting) == (0, 0, 0, 0)
        assert worker_rids(eng) == set(), worker_rids(eng)
        keys = eng.worker.fast.keys
        assert keys.free_pages == keys.num_pages and not keys.pages
        for rid, r in self.requests.items():
            got = eng.result(rid)
            want = self.alone(r["prompt"], r["max_new"], r["eos"], r["sampling"])
            if rid in self.failed:
                assert got == [], rid
            elif rid in self.aborted:
                assert got == want[: len(got)], (rid, got, want)
            else:
                assert got == want, (rid, r, got, want)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def check(self):
        eng = self.eng
        if eng is None:
            return
        eng.core.check_invariants()
        told = set(eng.worker.handles.values())  # what the worker has not been told is released
        for rid in worker_rids(eng):
            v = eng.core.view(rid)
            assert v.state is not RequestState.RELEASED or rid in told, \
                (rid, v.state, v.finish_reason)
        keys = eng.worker.fast.keys
        held = [int(p) for pages in keys.pages.values() for p in pages]
        assert len(set(held)) == len(held)
        assert keys.free_pages + len(held) == keys.num_pages
        if self.fast.index_pages is not None:
            assert keys.num_pages <= self.fast.index_pages


EngineMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, database=None, derandomize=True,
    suppress_health_check=list(HealthCheck))
test_engine_machine = EngineMachine.TestCase
