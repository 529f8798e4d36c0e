"""``ReplicaSpec.landing_push_with_prefill`` (real Ray + NIXL, TP 2, CPU): one-chunk landings plan
their WRITEs before prefill and the prefill worker pushes in the same call. Tokens must equal
full-resident decode for host and resident targets on both host paths; landings that need
several chunks, or have nothing to prefill, take the usual path; a prefill that fails inside the
combined call fails its request typed and returns every lease and the staging run."""

from __future__ import annotations

import random

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

# 32 staging blocks of 8 rows: prompts up to 256 positions land in one chunk
SPEC = ReplicaSpec(tp_size=2, num_device_blocks=12, staging_blocks=32, page_size=8,
                   replica_id="pwp", landing_push_with_prefill=True)


def test_push_with_prefill_lands_exactly_and_fails_cleanly(ray_cluster):
    rng = random.Random(4)
    prompt = lambda n: [rng.randrange(1, 96) for _ in range(n)]  # noqa: E731
    specs = [PrefillSpec(name="pwp-direct"), PrefillSpec(name="pwp-staged"),
             PrefillSpec(name="pwp-small", max_prompt_tokens=64)]
    workers = [launch.launch_prefill(p) for p in specs]
    rep = launch.launch_replica(SPEC)
    try:
        paths = [launch.connect(rep, w, mode) for w, mode in zip(workers, ("auto", "staged", "auto"))]
        assert paths == ["direct", "staged", "direct"]
        requests = [  # (id, prompt, prefill worker)
            ("host-direct", prompt(150), 0), ("res-direct", prompt(12), 0),
            ("host-staged", prompt(140), 1), ("res-staged", prompt(20), 1),
            ("one-token", [7], 1),  # nothing to prefill: the usual path
            ("two-chunks", prompt(300), 1),  # 38 pages > 32 staging blocks: the usual path
        ]
        for rid, p, w in requests:
            ray.get(rep.coordinator.submit.remote(rid, p, 6, None, w))
        # 100 positions fit one chunk, but not worker 2's 64-position send buffer: the prefill
        # inside the combined call raises, after the run was leased and the ranks wait
        ray.get(rep.coordinator.submit.remote("too-long", prompt(101), 6, None, 2))
        rows = {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(None, 300))}
        stats = ray.get([w.get_stats.remote() for w in workers])
        m = ray.get(rep.coordinator.metrics.remote())
    finally:
        rep.shutdown()
        for w in workers:
            ray.kill(w)
    ref = full_resident_tokens(SPEC.model, [p for _, p, _ in requests], 6,
                               [rid for rid, _, _ in requests])
    for rid, _, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
        assert rows[rid]["landing_s"] > 0
    assert rows["host-staged"]["landing_path"] == "staged" and rows["res-direct"]["target"] \
        == "resident"
    # the combined call ran for the one-chunk landings only (2 per worker; 1 that failed)
    assert [s["pushes_with_prefill"] for s in stats] == [2, 2, 1], stats
    assert rows["too-long"]["error_type"] == "CapacityError", rows["too-long"]
    c = m["counters"]
    assert c["device_blocks_used"] == 0 and c["host_blocks_used"] == 0, c
    assert m["staging_free_blocks"] == SPEC.staging_blocks


def test_auto_pushes_with_prefill_only_while_another_landing_fits(ray_cluster):
    """The default, ``"auto"``: a landing takes the combined call only when its staging run
    leaves room for another landing of its size; a bigger one takes the usual path. Both exact."""
    spec = ReplicaSpec(tp_size=2, num_device_blocks=12, staging_blocks=32, page_size=8,
                       replica_id="pwp-auto")
    assert spec.landing_push_with_prefill == "auto"
    rng = random.Random(5)
    requests = [("small", [rng.randrange(1, 96) for _ in range(100)]),    # 13 pages: 19 stay free
                ("big", [rng.randrange(1, 96) for _ in range(200)])]      # 25 pages: 7 stay free
    worker = launch.launch_prefill(PrefillSpec(name="pwp-auto"))
    rep = launch.launch_replica(spec)
    try:
        launch.connect(rep, worker, "staged")
        rows = {}
        for rid, p in requests:  # one at a time: the pool is otherwise empty
            ray.get(rep.coordinator.submit.remote(rid, p, 4, None, 0))
            rows.update((r["request_id"], r) for r in ray.get(rep.coordinator.wait.remote([rid], 300)))
        stats = ray.get(worker.get_stats.remote())
        m = ray.get(rep.coordinator.metrics.remote())
    finally:
        rep.shutdown()
        ray.kill(worker)
    ref = full_resident_tokens(spec.model, [p for _, p in requests], 4, [rid for rid, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    assert stats["pushes_with_prefill"] == 1 and m["pushes_with_prefill"] == [1], (stats, m)
    assert m["staging_free_blocks"] == spec.staging_blocks


@pytest.mark.parametrize("value", ["sometimes", 1, None])
def test_push_with_prefill_refuses_unknown_values(value):
    with pytest.raises(ValueError, match="landing_push_with_prefill"):
        ReplicaSpec(landing_push_with_prefill=value)
    assert ReplicaSpec(landing_push_with_prefill=True).landing_push_with_prefill == "always"
