"""The actor system on the fast decode step (real Ray + NIXL + the tiny MoE model, CPU: the step
runs through its torch fallbacks, eager). Issue #17 items 2 and 4: every rank runs the same fast
step, the KV rows carry the replica's ``kv_cache_dtype`` end to end (prefill worker send buffer,
NIXL WRITE, host pool, staging pool, hot buffer, resolver) and landed index keys go into each
rank's paged key pool.

* TP 1, fp8 656-B-layout rows, one bucket of 4: HiSparse tokens equal the full-resident engine's
  bit for bit (same fast step, same bucket, same row bytes: ``replica_baseline``), through direct
  host landings, resident landings and a reused prefix; requests past ``max_context`` are refused
  at submit; a prefill worker sending other row bytes is refused.
* TP 2 (gloo), fp32 rows, buckets 1-2-4, staged (chunked) host landings: heads sharded, one
  all-reduce per layer; greedy tokens equal TP 1 full-resident (the all-reduce sums heads in
  another order: within fp32 rounding).
"""

from __future__ import annotations

import random

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.errors import CapacityError, ConfigError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.testing.full_resident import replica_baseline

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def _prompt(rng, n):
    return [rng.randrange(1, 96) for _ in range(n)]


def _run(rep, requests, max_new, prefill=None):
    for rid, prompt in requests:
        ray.get(rep.coordinator.submit.remote(rid, prompt, max_new, None, prefill))
    return {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
        [rid for rid, _ in requests], 300))}


def _check(spec, rows, requests, max_new):
    ref = replica_baseline(spec, [p for _, p in requests], max_new, [r for r, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid


def test_tp1_fp8_rows_fast_step_equals_full_resident(ray_cluster):
    spec = ReplicaSpec(tp_size=1, max_batch=4, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="fast-tp1", kv_cache_dtype="fp8",
                       fast_path=FastPathConfig(max_context=256, buckets=(4,)))
    assert spec.layout.bytes_per_token_layer == 68  # 32 e4m3 + 1 fp32 scale + 16 bf16 rope
    rep = launch.launch_replica(spec)
    try:
        pf = launch.launch_prefill(PrefillSpec(name="fp8-rows", kv_cache_dtype="fp8"))
        assert launch.connect(rep, pf) == "direct"
        wrong = launch.launch_prefill(PrefillSpec(name="fp32-rows"))
        try:
            with pytest.raises(ConfigError, match="kv_cache_dtype"):
                launch.connect(rep, wrong)
        finally:
            ray.kill(wrong, no_restart=True)
        with pytest.raises(CapacityError, match="max_context"):
            ray.get(rep.coordinator.submit.remote("long", [1] * 250, 10))
        rng = random.Random(7)
        shared = _prompt(rng, 64)
        first = [("h0", _prompt(rng, 150)), ("r0", _prompt(rng, 12)), ("h1", shared + _prompt(rng, 70)),
                 ("r1", [5])]
        second = [("h2", _prompt(rng, 101)), ("h3", shared + _prompt(rng, 40)),  # reuses 8 pages
                  ("edge", _prompt(rng, 256 - 12))]  # prompt + new tokens == max_context
        rows = {**_run(rep, first, 12), **_run(rep, second, 12)}
        stats = ray.get(rep.ranks[0].stats.remote())
        counters = ray.get(rep.coordinator.metrics.remote())["counters"]
    finally:
        rep.shutdown()
    _check(spec, rows, first + second, 12)
    assert stats["fast_steps"] > 0 and stats["error"] is None  # (steps without a batch: not)
    assert {rows[r]["target"] for r in ("h0", "h1", "h2", "h3", "edge")} == {"host"}
    assert rows["r0"]["target"] == "resident"
    assert counters["prefix_hit_pages"] >= 8 and counters["backups"] > 0
    # 149 positions x 4 layers x 68 B rows, plus the keys (fp32, 32 values) into the one rank
    assert rows["h0"]["landing_bytes"] == 149 * 4 * (68 + 32 * 4)


def test_tp2_gloo_fast_step_equals_tp1(ray_cluster):
    spec = ReplicaSpec(tp_size=2, max_batch=4, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="fast-tp2",  # warm-up on: both ranks' padding steps pair up
                       fast_path=FastPathConfig(max_context=256, buckets=(1, 2, 4), warm_up=True))
    rep = launch.launch_replica(spec)
    try:
        assert launch.connect(rep, launch.launch_prefill(PrefillSpec(name="tp2")), "staged") == "staged"
        rng = random.Random(8)
        requests = [("a", _prompt(rng, 140)), ("b", _prompt(rng, 9)), ("c", _prompt(rng, 120)),
                    ("d", _prompt(rng, 60))]
        rows = _run(rep, requests, 16)
        stats = ray.get([r.stats.remote() for r in rep.ranks])
    finally:
        rep.shutdown()
    _check(spec, rows, requests, 16)
    assert all(s["fast_steps"] > 0 and s["error"] is None for s in stats)
    assert [s["warm_up_steps"] for s in stats] == [3, 3]  # one per bucket on each rank
    assert {rows[r]["landing_path"] for r in ("a", "c")} == {"staged"}  # 15-18 pages: 4-block chunks
    assert stats[0]["hot_misses"] == stats[1]["hot_misses"] > 0  # one selection on both ranks
