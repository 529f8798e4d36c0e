"""Multi-node run (executed in its own process by test_multinode.py; also runnable by hand:
``python -m tests.e2e.multinode_main``). A ``ray.cluster_utils.Cluster`` with two raylets on this
machine: the decode replica is pinned to the head node, the prefill worker to the second node, and
KV crosses between them with NIXL. It cannot share the pytest session cluster (one ``ray.init`` per
process), hence the subprocess. Prints one JSON line with node ids and per-request outcomes."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import full_resident_tokens


def main() -> int:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"decode_node": 1}})
    cluster.add_node(num_cpus=1, resources={"prefill_node": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        # no staging pool: host landings go direct (CPU) and the indexer keys take the fallback
        # path through Ray's object store (the single-node tests cover keys by NIXL)
        spec = ReplicaSpec(tp_size=2, num_device_blocks=12, staging_blocks=0, replica_id="mn")
        replica = launch.launch_deployment(
            spec, PrefillSpec(), decode_resources={"decode_node": 0.01},
            prefill_resources={"prefill_node": 0.01})
        try:
            ranks = ray.get([r.node_info.remote() for r in replica.ranks])
            prefill_node = ray.get(replica.prefill[0].node_info.remote())
            prompts = [list(range(1, 90)), [7, 3] * 40, list(range(95, 70, -1))]
            rids = [f"mn{i}" for i in range(len(prompts))]
            for rid, p in zip(rids, prompts):
                ray.get(replica.coordinator.submit.remote(rid, p, 6))
            rows = ray.get(replica.coordinator.wait.remote(rids, 300))
        finally:
            replica.shutdown()
        served = _serve_across_nodes(prompts[:2])
    finally:
        ray.shutdown()
        cluster.shutdown()
    ref = full_resident_tokens(spec.model, prompts, 6, rids)
    print(json.dumps({
        "decode_nodes": sorted({r["node_id"] for r in ranks}),
        "prefill_node": prefill_node["node_id"],
        "rows": [{k: r[k] for k in ("request_id", "target", "landing_path", "tokens", "error")}
                 for r in rows],
        "reference": ref,
        "serve": served,
    }))
    return 0


def _serve_across_nodes(prompts: list[list[int]]) -> dict | None:
    """The same split through the Ray Serve front end (None without Ray Serve installed): the
    Serve replica's decode replica on the head node, its prefill worker on the second node."""
    try:
        from ray import serve
    except ImportError:
        return None
    from hisparse_ray.serve import build_engine_app as build_app

    serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on either node
    try:
        handle = serve.run(build_app({
            "tp": 2, "device_blocks": 12, "device": "cpu",
            "decode_resources": {"decode_node": 0.01},
            "prefill_resources": {"prefill_node": 0.01}}), name="mn", route_prefix=None)
        outs = [handle.generate.remote(ids=p, max_new_tokens=6) for p in prompts]
        tokens = [o.result(timeout_s=300)["tokens"] for o in outs]
        actors = handle.actors.remote().result()
        return {"tokens": tokens,
                "decode_nodes": sorted({ray.get(r.node_info.remote())["node_id"]
                                        for r in actors["ranks"]}),
                "prefill_node": ray.get(actors["prefill"][0].node_info.remote())["node_id"]}
    finally:
        serve.shutdown()


if __name__ == "__main__":
    sys.exit(main())
