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

    options = {"tp": 1, "device_blocks": 12, "num_replicas": 2}
    serve.start(proxy_location="Disabled",
                logging_config={"log_level": "WARNING"})
    try:
        handle = serve.run(build_engine_app(options), name="hisparse-two", route_prefix=None,
                           logging_config={"log_level": "WARNING"})
        rng = random.Random(21)
        prompts = [[rng.randrange(1, 96) for _ in range(rng.choice([10, 120]))]
                   for _ in range(16)]
        outs = [r.result(timeout_s=300) for r in
                [handle.generate.remote(ids=p, max_new_tokens=4) for p in prompts]]
        front_ends = {o["request_id"].rsplit("-", 1)[0] for o in outs}
        assert len(front_ends) == 2, f"16 concurrent requests all went to {front_ends}"
        model = DeployOptions.from_dict(options).specs()[0].model
        expected = full_resident_tokens(model, prompts, 4, [str(i) for i in range(16)])
        for i, out in enumerate(outs):
            assert out["tokens"] == expected[str(i)]
        coords = set()
        for _ in range(20):  # both replicas answer `actors`: two distinct coordinators
            coords.add(handle.actors.remote().result()["coordinator"])
            if len(coords) == 2:
                break
        assert len(coords) == 2
    finally:
        serve.shutdown()
