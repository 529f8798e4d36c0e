"""Pool pressure in the in-process engine (issue #15 item 3): random workloads on small pools
always finish, and finish exactly: every request's tokens equal an unconstrained full-resident
run's (cut at its eos; an aborted request's tokens are a prefix of them), with the coordinator's
invariants checked after every step and every block returned at the end."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from hisparse_ray.config import GIB, HiSparseConfig
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import CapacityError
from hisparse_ray.model.model import build_tiny_model
from hisparse_ray.types import RequestState

PS = 8  # EngineConfig's page size
MODEL = build_tiny_model(0)
VOCAB = MODEL.cfg.vocab_size
BLOCK = EngineConfig().layout(MODEL.cfg, MODEL.dtype).block_bytes


def hisparse(host_blocks: int, buffer: int) -> HiSparseConfig:
    return HiSparseConfig(top_k=8, device_buffer_size=buffer, host_to_device_ratio=4,
                          swap_in_block_size=64, host_pool_gib=(host_blocks + 0.5) * BLOCK / GIB)


def test_issue_repro_two_long_host_requests_finish_exactly():
    """The issue's case: two 70-token prompts x 60 new tokens, 20 host blocks, 6 device blocks:
    each life is 17 pages, so the second request waits for the first (was: both admitted, 20/20
    host blocks used, StateError 'engine made no progress')."""
    prompts = {"a": [1] * 70, "b": [2] * 70}
    with Engine(MODEL, EngineConfig(hisparse=hisparse(20, 16), num_device_blocks=6)) as eng:
        for rid, p in prompts.items():
            eng.add_request(rid, p, 60)
        assert eng.core.view("b").state is RequestState.WAITING
        out = eng.run()
        assert eng.core.counters.stalls == 0
    with Engine(MODEL, EngineConfig(full_resident=True)) as base:
        for rid, p in prompts.items():
            base.add_request(rid, p, 60)
        assert out == base.run()


@st.composite
def workloads(draw):
    heads = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=24)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(2, 5))):
        head = draw(st.sampled_from([[], heads[0], heads[1]]))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
        max_new = draw(st.integers(1, 12))
        reqs.append(dict(
            rid=f"r{i}", prompt=head + tail, max_new=max_new,
            arrive=draw(st.integers(0, 6)),  # engine step at which it is added
            eos_at=draw(st.none() | st.integers(0, max_new - 1)),  # its full answer's token there
            abort_at=draw(st.none() | st.integers(0, 12)) if i % 3 == 2 else None,
        ))
    pools = dict(dev=draw(st.integers(0, 5)), host=draw(st.integers(4, 16)),
                 buffer=draw(st.sampled_from([8, 16])))
    return reqs, pools


@settings(max_examples=12, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(case=workloads())
def test_random_workloads_on_small_pools_finish_exactly(case):
    reqs, pools = case
    with Engine(MODEL, EngineConfig(full_resident=True)) as base:
        for r in reqs:
            base.add_request(r["rid"], r["prompt"], r["max_new"])
        full = base.run()
    hot = -(-(pools["buffer"] + 1) // PS)
    cfg = EngineConfig(hisparse=hisparse(pools["host"], pools["buffer"]),
                       num_device_blocks=hot + pools["dev"])
    added, refused, aborted = set(), set(), set()
    idle = 0
    with Engine(MODEL, cfg) as eng:
        core = eng.core
        for step in range(10_000):
            for r in reqs:
                if r["arrive"] == step:
                    eos = None if r["eos_at"] is None else full[r["rid"]][r["eos_at"]]
                    try:
                        eng.add_request(r["rid"], r["prompt"], r["max_new"], eos_token_id=eos)
                    except CapacityError:  # only what fits no empty pool is refused
                        life = -(-(len(r["prompt"]) + r["max_new"] - 1) // PS)
                        assert life > max(core.config.num_device_blocks, core.config.num_host_blocks)
                        refused.add(r["rid"])
                    else:
                        added.add(r["rid"])
                if (r["abort_at"] == step and r["rid"] in added
                        and core.view(r["rid"]).state not in (RequestState.FINISHED,
                                                              RequestState.RELEASED)):
                    eng.abort(r["rid"])
                    aborted.add(r["rid"])
            idle = 0 if eng.step() else idle + 1
            core.check_invariants()
            if step > 6 and eng.done:
                break
            assert step <= 6 or idle <= 3, "no progress with requests left: a deadlock"
        while eng.step():  # drain transfers of finished requests
            core.check_invariants()
        c = core.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.waiting, c.running) == (0, 0, 0, 0)
        assert c.stalls == 0 or c.conversions_to_host > 0  # a stall always converts someone
        for r in reqs:
            rid = r["rid"]
            if rid in refused:
                continue
            got, want = eng.result(rid), full[rid]
            if r["eos_at"] is not None:
                want = want[: want.index(want[r["eos_at"]]) + 1]
            if rid in aborted:
                assert got == want[: len(got)], rid
            else:
                assert got == want, rid
