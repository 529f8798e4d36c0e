"""Issue #15 item 1 through the actor system (real Ray + NIXL, TP 1, one prefill worker): on a model
with 2 index heads (the "landing" shape: 576-value rows, ties of indexer scores in most rows) and
MoE layers, prompts that reuse pages of earlier requests decode exactly the tokens full-resident
decode gives them: a resident landing restoring 8 of a donor's pages, and a multi-turn follow-up
whose 20 reused pages end with pages the donor's decode steps wrote."""

from __future__ import annotations

import random

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

MODEL = ModelSpec(shape="landing", num_layers=2)
SPEC = ReplicaSpec(model=MODEL, tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                   replica_id="prefix-exact")
NEW = 12


def _run(rep, requests):
    for rid, prompt in requests:
        ray.get(rep.coordinator.submit.remote(rid, prompt, NEW))
    return {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
        [rid for rid, _ in requests], 240))}


def test_prefix_reuse_with_two_index_heads_matches_full_resident(ray_cluster):
    assert MODEL.dsa_config().index_n_heads == 2
    rng = random.Random(15)
    a = [rng.randrange(1, 96) for _ in range(150)]
    rep = launch.launch_replica(SPEC)
    try:
        launch.connect(rep, launch.launch_prefill(PrefillSpec(model=MODEL, name="prefix-exact")))
        first = _run(rep, [("a", a)])
        c = a[:64] + [rng.randrange(1, 96) for _ in range(7)]  # 9 pages: fits the device pool
        b = a + first["a"]["tokens"] + [rng.randrange(1, 96) for _ in range(6)]
        before = ray.get(rep.coordinator.metrics.remote())["counters"]
        second = _run(rep, [("c", c), ("b", b)])
        after = ray.get(rep.coordinator.metrics.remote())["counters"]
    finally:
        rep.shutdown()
    rows = {**first, **second}
    ref = full_resident_tokens(MODEL, [a, b, c], NEW, ["a", "b", "c"])
    for rid in ("a", "b", "c"):
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    assert rows["a"]["target"] == rows["b"]["target"] == "host" and rows["c"]["target"] == "resident"
    # c restores 8 pages of a; b reuses 18 pages of a's prompt, a page of both (144..151: 144..148
    # prefilled, 149..151 decoded) and a page a's decode steps wrote (152..159)
    assert after["prefix_hit_pages"] - before["prefix_hit_pages"] == 8 + 20
    assert after["restores"] - before["restores"] == 8
