"""Ray Serve with two replicas on one node: each Serve replica launches its own HiSparse
deployment (prefill worker + decode replica, TP 1), with its own /dev/shm host pool, channels and
NIXL agents side by side; requests spread over both and every answer equals full-resident
decode. (Its own module: the single-replica app of test_serve.py is gone by then, so the session
cluster's CPUs hold both deployments.)"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

serve = pytest.importorskip("ray.serve")


def test_two_serve_replicas_each_own_a_deployment_and_both_serve_exactly(ray_cluster):
    from hisparse_ray.deploy import DeployOptions
    from hisparse_ray.serve import build_engine_app
    from hisparse_ray.testing.full_resident import full_resident_tokens

    # half a GPU per rank: on a one-GPU node both replicas' ranks fit (at 1.0 the second replica's
    # rank waited for a GPU forever); without GPUs the share is 0 anyway
    options = {"tp": 1, "device_blocks": 12, "num_replicas": 2, "gpus_per_rank": 0.5}
    serve.start(proxy_location="Disabled",
                logging_config={"log_level": "WARNING"})
    try:
        handle = serve.run(build_engine_app(options), name="hisparse-two", route_prefix=None,
                           logging_config={"log_level": "WARNING"})
        coords = set()
        for _ in range(40):  # both replicas answer `actors` (live, routable) before the load
            coords.add(handle.actors.remote().result()["coordinator"])
            if len(coords) == 2:
                break
        assert len(coords) == 2
        rng = random.Random(21)
        model = DeployOptions.from_dict(options).specs()[0].model
        front_ends: set[str] = set()
        for wave in range(3):  # Serve routes by queue length: on a loaded node one wave of 16
            prompts = [[rng.randrange(1, 96) for _ in range(rng.choice([10, 120]))]  # may all
                       for _ in range(16)]                                           # go to one
            outs = [r.result(timeout_s=300) for r in
                    [handle.generate.remote(ids=p, max_new_tokens=4) for p in prompts]]
            expected = full_resident_tokens(model, prompts, 4, [str(i) for i in range(16)])
            for i, out in enumerate(outs):
                assert out["tokens"] == expected[str(i)]
            front_ends |= {o["request_id"].rsplit("-", 1)[0] for o in outs}
            if len(front_ends) == 2:
                break
        assert len(front_ends) == 2, f"3 waves of 16 concurrent requests all went to {front_ends}"
    finally:
        serve.shutdown()
