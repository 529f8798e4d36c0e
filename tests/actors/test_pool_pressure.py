"""The actor coordinator inherits the core's admission reservations (issue #15 item 3): on a real
TP-1 replica (real Ray + NIXL over CPU memory + the tiny model) with a 12-block host pool, two
host-tier requests whose prompts fit at once but whose lives do not (8 pages each) both finish
exactly: the second waits for the first instead of both stalling with the pool full, and a
request that fits no empty pool is refused with CapacityError."""

from __future__ import annotations

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.config import GIB, HiSparseConfig
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.errors import CapacityError
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

HOST_BLOCKS = 12
BLOCK = ReplicaSpec(page_size=8).layout.block_bytes  # one page of every layer
SPEC = ReplicaSpec(
    tp_size=1, page_size=8, num_device_blocks=4, staging_blocks=0, replica_id="pressure",
    hisparse=HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4,
                            swap_in_block_size=64,
                            host_pool_gib=(HOST_BLOCKS + 0.5) * BLOCK / GIB))


def test_host_requests_that_fit_alone_but_not_together_finish_exactly(ray_cluster):
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    assert SPEC.num_host_blocks == HOST_BLOCKS
    pspec = PrefillSpec(name="pressure-prefill")
    worker = launch._remote(PrefillWorker, **launch.prefill_options(pspec)).remote(pspec)
    rep = launch.launch_replica(SPEC)
    try:
        ray.get(worker.ready.remote(), timeout=120)
        launch.connect(rep, worker, "auto")
        # 40 + 24 - 1 positions = 8 pages each; prompts: 5 pages each (10 <= 12 blocks)
        prompts = {"a": [(7 * i) % 96 for i in range(40)], "b": [(5 * i + 3) % 96 for i in range(40)]}
        states = [ray.get(rep.coordinator.submit.remote(rid, p, 24)) for rid, p in prompts.items()]
        assert states == ["landing", "waiting"]
        with pytest.raises(CapacityError, match="fits neither the device pool"):
            ray.get(rep.coordinator.submit.remote("huge", [1] * 90, 10))  # 13 pages > 12
        rows = {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(list(prompts), 240))}
        ref = full_resident_tokens(SPEC.model, list(prompts.values()), 24, list(prompts))
        for rid in prompts:
            assert rows[rid]["error"] is None and rows[rid]["target"] == "host"
            assert rows[rid]["tokens"] == ref[rid], rid
        c = ray.get(rep.coordinator.metrics.remote())["counters"]
        assert c["stalls"] == 0 and c["host_blocks_used"] == 0 and c["device_blocks_used"] == 0
    finally:
        rep.shutdown()
        ray.kill(worker)
