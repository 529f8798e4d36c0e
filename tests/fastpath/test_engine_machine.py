"""A hypothesis state machine over the single-process ``Engine`` on the CPU fast path: random
interleavings of add_request (greedy, eos, seeded sampling, prompts sharing a head, multi-turn
follow-ups of earlier requests), aborts (of any request, or of a live one: waiting, running,
mid-spill), restores of host-tier requests, single steps, "add as one finishes" and runs to
completion, on engines drawn at initialize: page size 1 / 3 / 8, a hot buffer at top-k or a bit
above, 1..4 rows a step in one bucket, the powers of two or every batch size (batches shrink and
grow across buckets), a device pool of one hot buffer or a roomy one, a host pool smaller than
the longest request's life (refusals, requests waiting for host blocks, spills held back), about
one life or roomy, an index-key pool capped at exactly ``max_batch`` requests' pages or uncapped,
fp32 or fp8 KV rows, the step pipeline (``EngineConfig.lookahead``: chained rows, the token
behind an eos or an abort dropped) on or off.

After every step the engine's rows are replayed on a full-resident twin in lockstep
(``tests/fastpath/_twin.py``: the same rows in the same bucket), and the step's logits and
tokens must equal the twin's bit for bit. After every rule: the coordinator's invariants (the
pools cover every reservation: admission never over-commits); every running request holds its
index keys; the worker holds per-request state only for requests not RELEASED or whose release it
has not been told yet; index-key pages free + held == the pool, and a capped pool never refuses
a landing (admission counts its pages: a request waits for them); a request refused at
admission only when its life
fits neither empty pool; when every request is released, no device or host block is in use. At
the end: everything runs to completion, nothing is held by the engine or the twin, and with one
bucket each request's tokens equal a full-resident engine's for it alone (an aborted one's are a
prefix of them).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hisparse_ray.config import GIB, HiSparseConfig, hot_buffer_blocks
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import CapacityError, StateError, UnknownRequestError
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig, default_buckets
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.types import LandingTarget, RequestState, SamplingParams
from tests.fastpath._twin import LockstepTwin, worker_rids

_cfg = tiny_config()
MODEL = build_random_model(_cfg.with_(mlp_layer_types=("dense",) * _cfg.num_hidden_layers), seed=2)
VOCAB, TOPK = MODEL.cfg.vocab_size, MODEL.cfg.index_topk
DONE = (RequestState.FINISHED, RequestState.RELEASED)
MAX_NEW = 12
SAMPLING = st.sampled_from([0.0, 0.0, 0.7, 1.3])


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """What a request stops at: its tokens up to and with the first ``eos``."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


class EngineMachine(RuleBasedStateMachine):
    eng: Engine | None = None

    @initialize(ps=st.sampled_from([1, 3, 8]), hot_extra=st.sampled_from([0, 1, 3]),
                mb=st.integers(1, 4), buckets=st.sampled_from(["one", "powers", "every"]),
                pool=st.sampled_from(["one", "tight", "life", "roomy"]),
                host=st.sampled_from(["small", "life", "roomy"]), capped=st.booleans(),
                kv=st.sampled_from(["fp32", "fp8"]), max_context=st.sampled_from([64, 128]),
                first=st.integers(1, 64), first_new=st.integers(1, MAX_NEW),
                lookahead=st.booleans())
    def setup(self, ps, hot_extra, mb, buckets, pool, host, capped, kv, max_context, first,
              first_new, lookahead):
        self.H, self.mb = TOPK + hot_extra, mb
        self.max_prompt = self.H + 3 * ps
        hot = hot_buffer_blocks(self.H, ps)
        life = -(-(self.max_prompt + MAX_NEW - 1) // ps)  # the longest request's pages
        roomy = HiSparseConfig(top_k=TOPK, device_buffer_size=self.H, host_to_device_ratio=4,
                               swap_in_block_size=64, host_pool_gib=0.01)
        block = EngineConfig(hisparse=roomy, page_size=ps, kv_cache_dtype=kv,
                             num_device_blocks=hot).layout(MODEL.cfg, MODEL.dtype).block_bytes
        host_blocks = {"small": max(1, life // 2), "life": life + 1, "roomy": None}[host]
        hs = roomy if host_blocks is None else HiSparseConfig(**{
            **{k: getattr(roomy, k) for k in ("top_k", "device_buffer_size",
                                              "host_to_device_ratio", "swap_in_block_size")},
            "host_pool_gib": (host_blocks + 0.5) * block / GIB})
        self.buckets = {"one": (mb,), "powers": default_buckets(mb),
                        "every": tuple(range(1, mb + 1))}[buckets]
        per_request = -(-max_context // INDEX_PAGE)
        self.fast = FastPathConfig(max_context=max_context, buckets=self.buckets,
                                   index_pages=mb * per_request if capped else None)
        blocks = {"one": hot, "tight": hot + 2, "life": hot + life,  # "life": restores fit
                  "roomy": mb * (hot + life)}[pool]
        base = dict(page_size=ps, kv_cache_dtype=kv, max_batch=mb)
        self.eng = Engine(MODEL, EngineConfig(num_device_blocks=blocks, hisparse=hs,
                                              fast_path=self.fast, lookahead=lookahead, **base))
        # the alone oracle (eos ids; one bucket: every request's tokens): a roomy host pool
        self.ref = Engine(MODEL, EngineConfig(full_resident=True, hisparse=roomy, fast_path=(
            FastPathConfig(max_context=max_context, buckets=(mb,))), **base))
        self.twin = LockstepTwin(MODEL, EngineConfig(num_device_blocks=blocks, hisparse=hs,
                                                     fast_path=self.fast, **base))
        self.eng.worker.on_logits = lambda rows, out: self.seen.append((list(rows), out.clone()))
        self.seen: list = []
        self.ref_memo: dict = {}
        self.requests: dict[str, dict] = {}  # rid -> what it was added with (admitted ones)
        self.refused: set[str] = set()  # refused at admission: fit no empty pool
        self.aborted: set[str] = set()
        self.rids = iter(f"r{i}" for i in range(10**6))
        self.heads = [torch.randint(0, VOCAB, (self.H + ps,),
                                    generator=torch.Generator().manual_seed(ps * 7 + mb)).tolist()]
        self.add(first, first_new, False, None, 0.0, first)  # a run without requests tests nothing

    def teardown(self):
        try:
            if self.eng is not None:
                self.finish_all()
        finally:
            for e in (self.eng, getattr(self, "ref", None), getattr(self, "twin", None)):
                if e is not None:
                    e.close()

    # -- oracles ----------------------------------------------------------------------------------
    def alone(self, prompt, max_new, sampling) -> list[int]:
        """The request's tokens (no eos) on the full-resident fast-path engine with nothing else
        running, in the largest bucket (one engine per machine, one request at a time)."""
        key = (tuple(prompt), max_new, sampling)
        if key not in self.ref_memo:
            rid = f"ref{len(self.ref_memo)}"
            self.ref.add_request(rid, prompt, max_new, sampling=sampling)
            self.ref_memo[key] = self.ref.run()[rid]
        return self.ref_memo[key]

    def lockstep(self) -> None:
        """The rows of the step just run, on the twin: the same logits and tokens, bit for bit."""
        while self.seen:
            rows, logits = self.seen.pop(0)
            assert 1 <= len(rows) <= self.mb, len(rows)
            eng = self.eng
            tokens, want = self.twin.step(rows, self.requests.__getitem__,
                                          lambda r: eng.core.view(r).state in DONE)
            assert torch.equal(logits, want), [(r.request_id, r.seq_len) for r in rows]
            for r, t in zip(rows, tokens):
                v = eng.core.view(r.request_id)
                if len(v.tokens) > r.seq_len:
                    assert v.tokens[r.seq_len] == t, (r, v.tokens[r.seq_len], t)
                else:  # dropped: it finished (eos, abort) while this row was in flight
                    assert eng.config.lookahead or r.request_id in self.aborted, r
                    assert v.state in DONE, (r, v.state)

    # -- rules ------------------------------------------------------------------------------------
    def live(self, *states) -> list[str]:
        return [r for r in self.requests if self.eng.core.view(r).state in states]

    @precondition(lambda self: self.eng is not None)
    @rule(n=st.integers(1, 64), max_new=st.integers(1, MAX_NEW), shared=st.booleans(),
          eos_at=st.none() | st.integers(0, MAX_NEW - 1), temp=SAMPLING, seed=st.integers(0, 2**20))
    def add(self, n, max_new, shared, eos_at, temp, seed):
        n = 1 + (n - 1) % self.max_prompt
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        if shared and n > 2:  # a prompt starting with a common head: prefix reuse
            head = self.heads[0]
            prompt = head[: n - 2] + prompt[-2:]
        self.submit(prompt, max_new, eos_at, temp, seed)

    @precondition(lambda self: self.eng is not None and self.requests)
    @rule(pick=st.integers(0, 40), keep=st.integers(0, MAX_NEW), extra=st.integers(1, 6),
          max_new=st.integers(1, MAX_NEW), temp=SAMPLING, seed=st.integers(0, 2**20))
    def follow_up(self, pick, keep, extra, max_new, temp, seed):
        """A multi-turn follow-up: an earlier request's prompt, what it generated so far (up to
        ``keep`` tokens) and a new turn: reuses its published pages (prefill-written only)."""
        rid = list(self.requests)[pick % len(self.requests)]
        turn = torch.randint(0, VOCAB, (extra,), generator=torch.Generator().manual_seed(seed))
        prompt = self.requests[rid]["prompt"] + self.eng.result(rid)[:keep] + turn.tolist()
        self.submit(prompt[: self.max_prompt], max_new, None, temp, seed)

    def submit(self, prompt, max_new, eos_at, temp, seed) -> None:
        sampling = SamplingParams(temperature=temp, seed=seed) if temp else None
        eos = None
        if eos_at is not None and eos_at < max_new:
            eos = self.alone(prompt, max_new, sampling)[eos_at]
        rid = next(self.rids)
        eng = self.eng
        try:
            eng.add_request(rid, prompt, max_new, eos_token_id=eos, sampling=sampling)
        except CapacityError as e:
            if "fits neither" in str(e):  # refused at admission: nothing recorded
                life = -(-(len(prompt) + max_new - 1) // eng.config.page_size)
                cfg = eng.core.config
                assert life > cfg.num_device_blocks and life > cfg.num_host_blocks, (e, life)
                with pytest.raises(UnknownRequestError):
                    eng.core.view(rid)
                self.refused.add(rid)
                return
            raise  # a landing is never refused: admission waits for index-key pages
        self.requests[rid] = dict(prompt=prompt, max_new=max_new, eos=eos, sampling=sampling)

    @precondition(lambda self: self.eng is not None and any(
        self.eng.core.view(r).state not in DONE for r in self.requests))
    @rule(n=st.integers(1, 64), max_new=st.integers(1, MAX_NEW), shared=st.booleans(),
          eos_at=st.none() | st.integers(0, MAX_NEW - 1), temp=SAMPLING, seed=st.integers(0, 2**20))
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
        if unknown or not self.requests:  # a refused request was never admitted: unknown too
            with pytest.raises(UnknownRequestError):
                eng.abort(min(self.refused) if self.refused else "nobody")
            return
        self.abort_one(list(self.requests)[pick % len(self.requests)])

    @precondition(lambda self: self.eng is not None and self.live(
        RequestState.WAITING, RequestState.RUNNING))
    @rule(pick=st.integers(0, 40), converting=st.booleans())
    def abort_live(self, pick, converting):
        """Abort a waiting or running request; with ``converting``, one whose spill or restore is
        still in flight when there is one (its blocks go back once the transfers are done)."""
        live = self.live(RequestState.WAITING, RequestState.RUNNING)
        if converting:
            core = self.eng.core._requests
            live = [r for r in live if core[r].conversion or core[r].in_flight] or live
        self.abort_one(live[pick % len(live)])

    def abort_one(self, rid):
        eng = self.eng
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

    @precondition(lambda self: self.eng is not None and self.live(RequestState.RUNNING))
    @rule(pick=st.integers(0, 40), wait=st.booleans())
    def restore(self, pick, wait):
        """Restore a running request to resident pages: a stable host-tier one is restored when
        the unreserved device room holds its pages (else nothing changes); anything else is
        refused with StateError and nothing changes. With ``wait``, while a host-tier request
        runs, step until one of them is restored (other requests finishing make the room)."""
        if not wait:
            self.try_restore(pick)
            return
        for _ in range(60):
            if not self.host_tier_running() or self.try_restore(pick) or not self.step_once():
                return

    def try_restore(self, pick) -> bool:
        eng = self.eng
        running = self.live(RequestState.RUNNING)
        if not running:
            return False
        host = self.host_tier_running()
        rid = (host or running)[pick % len(host or running)]
        req = eng.core._requests[rid]
        before = (eng.core.counters, eng.core.view(rid))
        stable_host = (req.tier is LandingTarget.HOST and not req.conversion and not req.in_flight
                       and not req.awaiting)  # lookahead: a step may be in flight
        if not stable_host:
            with pytest.raises(StateError, match="not a stable host-tier request"):
                eng.core.restore(rid)
            assert (eng.core.counters, eng.core.view(rid)) == before
            return False
        if eng.core.restore(rid):
            assert eng.core.counters.device_blocks_used > before[0].device_blocks_used
            return True
        assert (eng.core.counters, eng.core.view(rid)) == before
        return False

    def host_tier_running(self) -> list[str]:
        return [r for r in self.live(RequestState.RUNNING)
                if self.eng.core.view(r).tier is LandingTarget.HOST]

    @precondition(lambda self: self.eng is not None)
    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.step_once()

    def step_once(self) -> bool:
        stepped = self.eng.step()  # a landing is never refused (no CapacityError here)
        self.lockstep()
        return stepped

    @precondition(lambda self: self.eng is not None)
    @rule()
    def run_to_completion(self):
        self.finish_all()

    def finish_all(self):
        """Every admitted request finishes when the engine keeps stepping; then nothing is held."""
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
        self.twin.release_finished(lambda r: True)
        assert not self.twin.handles
        for w in (eng.worker, self.twin.worker):
            assert worker_rids(w) == set(), worker_rids(w)
            keys = w.fast.keys
            assert keys.free_pages == keys.num_pages and not keys.pages
        if len(self.buckets) > 1:  # the twin compared every row; alone runs use other buckets
            return
        for rid, r in self.requests.items():
            got = eng.result(rid)
            want = until_eos(self.alone(r["prompt"], r["max_new"], r["sampling"]), r["eos"])
            if rid in self.aborted:
                assert got == want[: len(got)], (rid, got, want)
            else:
                assert got == want, (rid, r, got, want)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def check(self):
        eng = self.eng
        if eng is None:
            return
        eng.core.check_invariants()  # reservations within the pools: no over-commit
        assert not self.seen, "a step's rows were not compared with the twin"
        told = set(eng.worker.handles.values())  # what the worker has not been told is released
        for rid in worker_rids(eng.worker):
            v = eng.core.view(rid)
            assert v.state is not RequestState.RELEASED or rid in told, \
                (rid, v.state, v.finish_reason)
        states = {r: eng.core.view(r).state for r in self.requests}
        for rid, s in states.items():
            assert s is not RequestState.LANDING, rid  # in process a landing ends in its call
            if s is RequestState.RUNNING:  # admitted and landed: its keys have their pages
                assert eng.worker.has_index_keys(rid), rid
        keys = eng.worker.fast.keys
        held = [int(p) for pages in keys.pages.values() for p in pages]
        assert len(set(held)) == len(held)
        assert keys.free_pages + len(held) == keys.num_pages
        if self.fast.index_pages is not None:
            assert keys.num_pages <= self.fast.index_pages
        if all(s is RequestState.RELEASED for s in states.values()):  # nothing leaked
            c = eng.core.counters
            assert (c.device_blocks_used, c.host_blocks_used, c.running, c.waiting) == (0, 0, 0, 0)
            assert not eng.core.book.pending


EngineMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, database=None, derandomize=True,
    suppress_health_check=list(HealthCheck))
test_engine_machine = EngineMachine.TestCase
