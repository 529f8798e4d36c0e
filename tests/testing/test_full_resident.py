"""``replica_baseline``: the full-resident engine configured like a decode replica (model, KV-cache
dtype, page size, fast-path buckets); ``honest=True`` gives it only the replica's device pool bytes
(no host tier: requests wait while their lives do not fit), which changes when requests run, not
what they decode (one bucket: every row runs in the same shape)."""

from __future__ import annotations

import random

from hisparse_ray.deploy import ReplicaSpec
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.testing.full_resident import replica_baseline


def test_honest_baseline_decodes_the_same_tokens_under_the_replica_budget():
    spec = ReplicaSpec(tp_size=1, max_batch=4, num_device_blocks=40, kv_cache_dtype="fp8",
                       fast_path=FastPathConfig(max_context=256, buckets=(4,)))
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 96) for _ in range(120)] for _ in range(4)]  # 16 pages a life
    grown = replica_baseline(spec, prompts, 8)
    honest = replica_baseline(spec, prompts, 8, honest=True)  # 40 blocks: 2 lives at a time
    assert honest == grown and all(len(t) == 8 for t in grown.values())
