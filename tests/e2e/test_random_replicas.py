"""The actor system (prefill worker -> NIXL landing -> coordinator + TP ranks) equals full-resident
decode on random deployments the other e2e tests do not use: both model kinds, TP 1 or 2, page
sizes 4-16, hot buffers top-k .. top-k + 8, device pools from one hot buffer up, batch limits 2-8,
and 1-5 requests of 1-200 prompt tokens, some sharing a prefix with the first (prefix reuse
through the coordinator). A 20-deployment sweep of this generator found no difference
(2026-12-01); three run here."""

from __future__ import annotations

import random

import pytest

from hisparse_ray.actors import launch
from hisparse_ray.cli import reference_tokens, run_requests
from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def _deployment(seed: int):
    r = random.Random(seed)
    page, hot = r.choice([4, 8, 16]), 8 + r.choice([0, 3, 8])  # the tiny models' top-k is 8
    hs = HiSparseConfig(top_k=8, device_buffer_size=hot, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.005)
    spec = ReplicaSpec(model=ModelSpec(kind=r.choice(["deepseek_v32", "glm_moe_dsa"]), seed=seed),
                       hisparse=hs, tp_size=r.choice([1, 2]), page_size=page,
                       num_device_blocks=max(hot_buffer_blocks(hot, page), r.choice([3, 6, 12])),
                       max_batch=r.choice([2, 4, 8]))
    prompts: dict[str, list[int]] = {}
    for q in range(r.randint(1, 5)):
        if prompts and r.random() < 0.4:
            first = next(iter(prompts.values()))
            prompts[f"q{q}"] = (first[:r.randint(1, len(first))]
                                + [r.randrange(1, 96) for _ in range(r.randint(0, 10))])
        else:
            prompts[f"q{q}"] = [r.randrange(1, 96) for _ in range(r.randint(1, 200))]
    return spec, prompts, r.randint(1, 10)


@pytest.mark.parametrize("seed", [2, 11, 17])  # TP 2 page 4; TP 2 GLM page 16; TP 2 GLM, 5 prompts
def test_random_deployment_equals_full_resident(ray_cluster, seed):
    spec, prompts, max_new = _deployment(seed)
    requests = list(prompts.items())
    replica = launch.launch_deployment(spec, PrefillSpec(model=spec.model, max_prompt_tokens=512))
    try:
        results = run_requests(replica, requests, max_new, show_progress=False, timeout_s=300)
    finally:
        replica.shutdown()
    expected = reference_tokens(spec, requests, max_new)  # configured like the replica
    assert {r["request_id"]: r["tokens"] for r in results} == expected, spec
