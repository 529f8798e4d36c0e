"""TP bootstrap between real Ray actors: STRICT_PACK placement, gloo group, shared host pool."""

from __future__ import annotations

import os
import time

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import ReplicaSpec

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    spec = ReplicaSpec(tp_size=2, replica_id="tpboot")
    pg = launch.replica_placement_group(spec)
    handles = launch.start_ranks(spec, pg, build=False)
    yield spec, pg, handles
    ray.get([h.shutdown.remote() for h in handles])
    for h in handles:
        ray.kill(h)
    launch.remove_placement_group(pg)


def test_bundles_put_coordinator_first_and_one_bundle_per_rank():
    spec = ReplicaSpec(tp_size=2, gpus_per_rank=0.5, cpus_per_rank=1)
    assert launch.replica_bundles(spec, {"decode": 0.01}) == [
        {"CPU": launch.COORDINATOR_CPUS, "decode": 0.01},
        {"CPU": 1, "GPU": 0.5},
        {"CPU": 1, "GPU": 0.5},
    ]


def test_ranks_share_a_node_and_form_a_gloo_group(ranks):
    spec, _, handles = ranks
    infos = ray.get([h.node_info.remote() for h in handles])
    assert [i["rank"] for i in infos] == [0, 1]
    assert len({i["node_id"] for i in infos}) == 1  # STRICT_PACK
    assert len({i["pid"] for i in infos}) == 2
    # all-reduce of rank + 1 over the group: 1 + 2 on every rank, several rounds
    for _ in range(3):
        assert ray.get([h.check_tp.remote() for h in handles]) == [3.0, 3.0]


def test_host_pool_is_one_segment_mapped_by_both_ranks(ranks):
    spec, _, handles = ranks
    segs = [n for n in os.listdir("/dev/shm") if n.startswith(f"hisparse-pool.{spec.replica_id}.")]
    assert len(segs) == 1


def test_only_rank0_may_pick_the_rendezvous(ranks):
    _, _, handles = ranks
    with pytest.raises(Exception, match="only rank 0"):
        ray.get(handles[1].rendezvous.remote())


def test_a_replica_that_cannot_start_leaves_nothing_behind(ray_cluster):
    from hisparse_ray.config import HiSparseConfig
    from hisparse_ray.errors import HostPoolError

    huge = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4,
                          swap_in_block_size=64, host_pool_gib=10_000)
    spec = ReplicaSpec(hisparse=huge, replica_id="toolarge")
    before = ray.available_resources().get("CPU")
    with pytest.raises(HostPoolError, match="exceeds"):
        launch.launch_replica(spec)
    assert not [n for n in os.listdir("/dev/shm") if ".toolarge." in n]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != before:  # placement group and actors gone
        assert time.monotonic() < deadline
        time.sleep(0.2)
