"""The actor system pipelined one step deep (``ReplicaSpec.lookahead`` / ``--lookahead on``):
the coordinator sends command N + 1 before it gathers step N's reports, each rank launches a
command as it arrives and a finisher thread reports the launched steps in order. Real Ray, NIXL
and shared memory on CPU; every rank's finisher sleeps a random time before each step
(``DecodeWorker.set_finish_jitter``), so launches and finishes interleave at random.

* TP 2 on the reference path: greedy tokens equal the full-resident engine's (TP 1), through
  host-tier landings and spills, an eos that a chained row had already followed (its token
  dropped), a request sampling with a temperature (seeded: the same draws, chained like the
  others), and an abort while steps are in flight (its answer a prefix
  of the full one); afterwards no block is in use.
* TP 1 on the fast step: host-tier requests chain with their backups in flight (one rank reads
  its own copies in stream order); the tokens equal the full-resident fast-path engine's.
* TP 2, host-tier requests only: they chain with their backups in flight (the peer waits for
  rank 0's generation of the previous step by step number, ``HostPool.wait_step``); the tokens
  equal the full-resident engine's, which every lookahead-off test equals too.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import DeployOptions, PrefillSpec, ReplicaSpec
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.testing.full_resident import full_resident_tokens, replica_baseline
from hisparse_ray.types import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def _prompt(rng, n):
    return [rng.randrange(1, 96) for _ in range(n)]


@contextlib.contextmanager
def _replica(spec, jitter):
    """The replica with a prefill worker connected, every rank's finisher sleeping a random
    0..``jitter`` s before each step; shut down on exit."""
    rep = launch.launch_replica(spec)
    try:
        launch.connect(rep, launch.launch_prefill(PrefillSpec(name=spec.replica_id)))
        ray.get([r.set_finish_jitter.remote(jitter, seed) for seed, r in enumerate(rep.ranks)])
        yield rep
    finally:
        rep.shutdown()


def _settled(rep, timeout=60.0):
    """The coordinator's counters once every block is back (a finished request's blocks are
    released when nothing of it is in flight)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        c = ray.get(rep.coordinator.metrics.remote())["counters"]
        if (c["device_blocks_used"], c["host_blocks_used"], c["running"]) == (0, 0, 0):
            return c
        assert time.monotonic() < deadline, c
        time.sleep(0.1)


def test_lookahead_option_reaches_the_replica():
    assert DeployOptions(lookahead="on").specs()[0].lookahead
    assert not DeployOptions(lookahead="off", fast_path="on").host_specs()[0].lookahead
    # "auto": on where the ranks run the fast step, off on the reference path; the default
    # stays "off" until the actor path is timed with it on a GPU (the engine's "auto" was)
    assert not DeployOptions().specs()[0].lookahead
    assert not DeployOptions(fast_path="on").host_specs()[0].lookahead
    assert DeployOptions(fast_path="on", lookahead="auto").host_specs()[0].lookahead
    assert not DeployOptions(lookahead="auto").specs()[0].lookahead


def test_tp2_reference_path_lookahead_equals_full_resident(ray_cluster):
    spec = ReplicaSpec(tp_size=2, max_batch=4, num_device_blocks=10, staging_blocks=4, page_size=8,
                       replica_id="la-tp2", lookahead=True)
    rng = random.Random(11)
    greedy = [("d", _prompt(rng, 20)), ("a", _prompt(rng, 70)), ("b", _prompt(rng, 9)),
              ("c", _prompt(rng, 45)), ("x", _prompt(rng, 33))]  # d first: resident, chains
    max_new = 14
    ref = replica_baseline(spec, [p for _, p in greedy], max_new, [r for r, _ in greedy])
    eos = ref["d"][5]  # d stops at its first eos
    want_d = ref["d"][: ref["d"].index(eos) + 1]
    temp = SamplingParams(temperature=0.9, top_k=30, seed=4)
    t_prompt = _prompt(rng, 30)
    want_t = full_resident_tokens(spec.model, [t_prompt], 10, ["t"], sampling=temp)["t"]
    with _replica(spec, 0.004) as rep:
        co = rep.coordinator
        for rid, p in greedy:
            ray.get(co.submit.remote(rid, p, max_new, eos if rid == "d" else None))
        ray.get(co.wait.remote(["d"], 300))  # then a sampled request (it chains too)
        ray.get(co.submit.remote("t", t_prompt, 10, sampling=temp))
        ray.get(co.wait.remote(["b"], 300))
        got_x = ray.get(co.abort.remote("x"))  # mid-run, steps in flight
        rows = {r["request_id"]: r for r in ray.get(co.wait.remote(["a", "b", "c", "d", "t"], 300))}
        counters = _settled(rep)
        stats = ray.get([r.stats.remote() for r in rep.ranks])
    for rid in ("a", "b", "c"):
        assert rows[rid]["error"] is None and rows[rid]["tokens"] == ref[rid], rid
    assert rows["d"]["tokens"] == want_d and rows["d"]["finish_reason"] == "eos"
    assert rows["t"]["tokens"] == want_t
    assert got_x == ref["x"][: len(got_x)] and len(got_x) < max_new
    assert counters["chained_rows"] > 0 and counters["dropped_rows"] >= 1, counters
    assert counters["spills"] + counters["backups"] > 0, counters  # host tier on the way
    assert all(s["error"] is None and s["steps"] > 0 for s in stats), stats


def _greedy_run(spec, requests, jitter, max_new=16):
    """Submit greedy ``requests`` (``[(rid, prompt)]``) to the replica under finisher ``jitter``
    and wait for them: ``(rows by id, settled counters, every rank's stats)``; every request's
    tokens equal the full-resident engine's (``replica_baseline``)."""
    ref = replica_baseline(spec, [p for _, p in requests], max_new, [r for r, _ in requests])
    with _replica(spec, jitter) as rep:
        co = rep.coordinator
        for rid, p in requests:
            ray.get(co.submit.remote(rid, p, max_new))
        rows = {r["request_id"]: r for r in ray.get(co.wait.remote([r for r, _ in requests], 300))}
        counters = _settled(rep)
        stats = ray.get([r.stats.remote() for r in rep.ranks])
    for rid, _ in requests:
        assert rows[rid]["error"] is None and rows[rid]["tokens"] == ref[rid], rid
    return rows, counters, stats


def test_tp1_fast_step_lookahead_host_tier_chains(ray_cluster):
    spec = ReplicaSpec(tp_size=1, max_batch=4, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="la-fast", lookahead=True,
                       fast_path=FastPathConfig(max_context=256, buckets=(4,)))
    rng = random.Random(12)
    requests = [("h0", _prompt(rng, 150)), ("r0", _prompt(rng, 12)), ("h1", _prompt(rng, 90)),
                ("r1", [5])]
    rows, counters, stats = _greedy_run(spec, requests, 0.003)
    assert {rows[r]["target"] for r in ("h0", "h1")} == {"host"}
    assert counters["chained_rows"] > 0 and counters["backups"] > 0, counters
    assert stats[0]["fast_steps"] > 0 and stats[0]["error"] is None


def test_tp2_host_tier_requests_chain(ray_cluster):
    """Failed before the pool's step ring: at TP 2 a host-tier request never chained (the
    coordinator waited for its backup's report), so ``chained_rows`` stayed 0 here."""
    spec = ReplicaSpec(tp_size=2, max_batch=4, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="la-tp2-host", lookahead=True)
    rng = random.Random(13)
    requests = [("h0", _prompt(rng, 150)), ("h1", _prompt(rng, 90)), ("h2", _prompt(rng, 120))]
    rows, counters, stats = _greedy_run(spec, requests, 0.004)
    assert {rows[r]["target"] for r, _ in requests} == {"host"}
    assert counters["chained_rows"] > 0 and counters["backups"] > 0, counters
    assert all(s["error"] is None and s["steps"] > 0 for s in stats), stats
