"""``EngineConfig.lookahead``: the engine takes and launches step N + 1 before it applies step N's
tokens (requests chain: a row's input is the token its previous row samples, read where it was
sampled). The promise: the same tokens and the same logits as ``lookahead=False``, on the
reference path and the fast step, through spills, eos, aborts, requests sampling with a
temperature and requests arriving mid-run; nothing leaked at the end.

On CPU a launched step runs to the end, so nothing overlaps here; what these tests pin is that
the pipeline never changes a token (the GPU timing is ``benchmarks/bench_lookahead.py``'s).
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import ConfigError, StateError
from hisparse_ray.testing.engine_drive import drive
from hisparse_ray.types import BatchRow, RequestState, SamplingParams, StepCommand
from tests.fastpath.test_engine_fast import H, ONE, dense, prompts_of  # noqa: F401 (a fixture)


def config(path: str, lookahead: bool, **kw) -> EngineConfig:
    if path == "fast":  # one bucket: every row runs in the same batch shape in both schedules
        return EngineConfig(fast_path=ONE, batch_invariant=False, max_batch=4,
                            lookahead=lookahead, **kw)
    return EngineConfig(lookahead=lookahead, max_batch=4, **kw)  # batch-invariant reference


def run(model, requests, cfg, *, between=None, sampling=None):
    """requests: [(prompt, max_new, eos)] -> (tokens, {(rid, seq_len): logits}, counters,
    finish reasons). ``between(eng, step_index)`` runs before every step."""
    logits = {}
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            for b, row in enumerate(rows):
                key = (row.request_id, row.seq_len)
                assert key not in logits, f"{key} ran twice"
                logits[key] = (row.input_token, out[b].detach().clone())
        eng.worker.on_logits = grab
        for i, (p, n, eos) in enumerate(requests):
            eng.add_request(f"r{i}", p, n, eos_token_id=eos,
                            sampling=(sampling or {}).get(i))
        drive(eng, between)
        out = {r: eng.result(r) for r in eng._known}
        reasons = {r: eng.core.view(r).finish_reason for r in eng._known}
        counters = eng.core.counters
        assert counters.device_blocks_used == 0 and counters.host_blocks_used == 0, counters
        assert eng._inflight is None
    return out, logits, counters, reasons


def same_logits(a, b):
    """Every row of ``a`` ran in ``b`` with the same input token and bitwise the same logits.
    (A lookahead run has extra rows: those after an eos, whose tokens were dropped.)"""
    for key, (tok, x) in a.items():
        assert key in b, key
        assert b[key][0] == tok, (key, tok, b[key][0])
        assert torch.equal(b[key][1], x), key


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_lookahead_gives_the_same_tokens_and_logits_through_spills(dense, path):
    """A device pool too small for the prompts: requests convert to the host tier mid-run."""
    prompts = prompts_of([8 * H + 5, 40, 3, 9 * H], dense.cfg.vocab_size)
    reqs = [(p, n, None) for p, n in zip(prompts, [16, 5, 9, 12])]
    base = run(dense, reqs, config(path, False, num_device_blocks=12))
    la = run(dense, reqs, config(path, True, num_device_blocks=12))
    assert la[0] == base[0]
    assert la[1].keys() == base[1].keys()  # no eos: no extra rows
    same_logits(base[1], la[1])
    assert la[2].spills > 0 and la[2].chained_rows > 0
    assert base[2].chained_rows == 0 and la[2].dropped_rows == 0


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_eos_after_a_chained_row_drops_only_that_row(dense, path):
    """eos is picked from a first run's tokens, so it is sampled mid-run: the chained row behind
    it runs for nothing and its token is dropped; the answers end at the eos, as without
    lookahead."""
    prompts = prompts_of([30, 12, 2 * H + 3], dense.cfg.vocab_size, seed=4)
    free = run(dense, [(p, 12, None) for p in prompts], config(path, False))[0]
    eos = [free[f"r{i}"][3 + i] for i in range(3)]
    reqs = [(p, 12, e) for p, e in zip(prompts, eos)]
    base = run(dense, reqs, config(path, False))
    la = run(dense, reqs, config(path, True))
    assert la[0] == base[0] and la[3] == base[3]
    assert all(base[3][f"r{i}"] == "eos" for i in range(3))
    same_logits(base[1], la[1])
    assert la[2].dropped_rows >= 1 and la[2].chained_rows > 0
    assert len(la[1]) == len(base[1]) + la[2].dropped_rows  # the dropped rows ran, nothing else


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_sampled_requests_chain_like_greedy_ones(dense, path):
    """Seeded requests sampling with a temperature (drawn where the logits are, counter = the
    row's position) chain too: the same draws as without lookahead, no step skipped."""
    prompts = prompts_of([20, 9, 33, 5], dense.cfg.vocab_size, seed=7)
    reqs = [(p, 4 if i % 2 else 10, None) for i, p in enumerate(prompts)]  # sampled ones end first
    sampling = {1: SamplingParams(temperature=0.8, top_k=20, seed=5),
                3: SamplingParams(temperature=1.3, seed=9)}
    for blocks in (8, 64):  # with spills; with none (then the schedules are the same)
        base = run(dense, reqs, config(path, False, num_device_blocks=blocks), sampling=sampling)
        la = run(dense, reqs, config(path, True, num_device_blocks=blocks), sampling=sampling)
        assert la[0] == base[0]
        same_logits(base[1], la[1])
        assert la[2].chained_rows > 0
        if blocks == 64:  # no step skipped
            assert la[2].steps == base[2].steps and base[2].spills == 0


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_aborts_and_arrivals_at_random_steps(dense, path):
    """Random aborts (of running, waiting or chained requests with a step in flight) and new
    requests arriving mid-run: each surviving answer equals its lookahead-off answer, an aborted
    answer is a prefix of it, and every lease comes back."""
    vocab = dense.cfg.vocab_size
    prompts = prompts_of([25, 7, 50, 2 * H, 11, 64, 3], vocab, seed=9)
    reqs = [(p, 6 + 3 * (i % 4), None) for i, p in enumerate(prompts)]
    full = run(dense, reqs, config(path, False, num_device_blocks=10))[0]
    reached = {"aborted": 0, "dropped": 0, "chained": 0}
    for seed in range(4):
        rng = random.Random(seed)
        late = dict(zip(rng.sample(range(1, 9), 3), range(4, 7)))  # step index -> request added
        aborted = set()

        def between(eng, k, rng=rng, late=late, aborted=aborted):
            if k in late:
                i = late[k]
                p, n, _ = reqs[i]
                eng.add_request(f"r{i}", p, n)
            if rng.random() < 0.2:
                live = [r for r in eng._known
                        if eng.core.view(r).state not in (RequestState.FINISHED,
                                                          RequestState.RELEASED)]
                if live:
                    rid = rng.choice(live)
                    eng.abort(rid)
                    aborted.add(rid)

        with Engine(dense, config(path, True, num_device_blocks=10)) as eng:
            for i in range(4):
                p, n, _ = reqs[i]
                eng.add_request(f"r{i}", p, n)
            drive(eng, between, pending=lambda eng=eng: len(eng._known) < len(reqs))
            for rid in eng._known:
                got = eng.result(rid)
                if rid in aborted:
                    assert got == full[rid][: len(got)], rid
                else:
                    assert got == full[rid], rid
            c = eng.core.counters
            assert c.device_blocks_used == 0 and c.host_blocks_used == 0, c
            reached["aborted"] += len(aborted)
            reached["dropped"] += c.dropped_rows  # aborted with a step in flight
            reached["chained"] += c.chained_rows
    assert all(reached.values()), reached


def test_lookahead_is_checked():
    for bad in ("yes", "on", 1, None):
        with pytest.raises(ConfigError, match="lookahead"):
            EngineConfig(lookahead=bad)


def test_lookahead_auto_pipelines_the_fast_path_on_cuda_only():
    """"auto" (the default) pipelines where it pays: the fast step on a CUDA device (0.96-0.99x
    the ms/step on the H100); True / False as given."""
    assert EngineConfig().lookahead == "auto" and not EngineConfig().pipelined
    assert not EngineConfig(fast_path=ONE, max_batch=4).pipelined  # the CPU fast path
    assert EngineConfig(fast_path=ONE, max_batch=4, device="cuda").pipelined
    assert not EngineConfig(device="cuda").pipelined  # the reference path
    assert EngineConfig(lookahead=True).pipelined
    assert not EngineConfig(fast_path=ONE, max_batch=4, device="cuda:0", lookahead=False).pipelined


def test_worker_refuses_a_chained_row_it_cannot_feed(dense):
    """A chained row must follow a step this rank ran with rows: the worker names the step and
    the request instead of decoding a wrong token."""
    with Engine(dense, config("reference", True)) as eng:
        eng.add_request("a", [1, 2, 3], 4)
        eng.add_request("t", [4, 5], 4, sampling=SamplingParams(temperature=1.0, seed=1))
        eng.step()
        eng.step()
        w = eng.worker
        handles = {rid: h for h, rid in w.handles.items()}
        bad = StepCommand(eng.core.step + 5, (BatchRow(handles["a"], 9, 0, None, 0),))
        with pytest.raises(StateError, match="did not run"):
            w.execute(bad)
