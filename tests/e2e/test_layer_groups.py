"""Staged landing written in layer groups (``ReplicaSpec.landing_layer_groups``): each group is its
own NIXL WRITE with its own notification and rank 0 copies group g to the host pool while later
groups are in flight. Real Ray + NIXL (UCX on CPU memory), TP 2, chunked landings (a 4-block
staging pool), prefix reuse and concurrent submitters, on the GLM-5 kind (shared indexer layers);
every token checked against full-resident decode, and every lease back at the end."""

from __future__ import annotations

import random
import threading

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

# the tiny GLM-5 kind (4 layers, indexer on layers 0 and 2, shared on 1 and 3: the keys landed
# by NIXL include the zero rows of the shared layers); 3 layer groups of 2, 1, 1 layers
MODEL = ModelSpec(kind="glm_moe_dsa")
SPEC = ReplicaSpec(model=MODEL, tp_size=2, num_device_blocks=12, staging_blocks=4, page_size=8,
                   replica_id="groups", landing_layer_groups=3)


def test_staged_landing_in_layer_groups_matches_full_resident(ray_cluster):
    rep = launch.launch_replica(SPEC)
    try:
        pf = launch.launch_prefill(PrefillSpec(model=MODEL, name="groups"))
        assert launch.connect(rep, pf, "staged") == "staged"
        rng = random.Random(11)
        shared = [rng.randrange(1, 96) for _ in range(64)]
        requests = [(f"lg{i}", (shared if i % 2 else []) + [rng.randrange(1, 96)
                                                             for _ in range(rng.randint(20, 90))])
                    for i in range(6)]
        errors: list[BaseException] = []

        def submit(batch):
            try:
                for rid, prompt in batch:
                    ray.get(rep.coordinator.submit.remote(rid, prompt, 6))
            except BaseException as err:  # surfaced below
                errors.append(err)

        threads = [threading.Thread(target=submit, args=(requests[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        rows = {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
            [rid for rid, _ in requests], 240))}
        m = ray.get(rep.coordinator.metrics.remote())
    finally:
        rep.shutdown()
    ref = full_resident_tokens(SPEC.model, [p for _, p in requests], 6,
                               [rid for rid, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    host = [rid for rid in rows if rows[rid]["target"] == "host"]
    assert host and all(rows[rid]["landing_path"] == "staged" for rid in host)
    assert m["staging_free_blocks"] == SPEC.staging_blocks
