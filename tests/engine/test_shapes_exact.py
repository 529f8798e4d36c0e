"""HiSparse decode equals full-resident decode on model shapes and workloads the other tests do
not use: random DSA configs (both kinds, 1-4 layers, 2-8 attention heads, 1-16 index heads so
that indexer ties are common, top-k 4-16, latent 16-48, rope 8-16, dense / MoE layers, GLM's
shared indexers, yarn or plain rope), random hot buffers (exactly top-k up to top-k + 20), page
sizes 4-16, device pools from one hot buffer to plenty, tiny and larger host pools, and 1-5
requests of 1-150 prompt tokens, some sharing a prefix with the first. Tokens must be identical.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model


def _case(seed: int):
    r = random.Random(seed)
    kind = r.choice(["deepseek_v32", "glm_moe_dsa"])
    L, topk = r.choice([1, 2, 3, 4]), r.choice([4, 8, 12, 16])
    indexers = (("full",) + tuple(r.choice(["full", "shared"]) for _ in range(L - 1))
                if kind == "glm_moe_dsa" else ("full",) * L)
    cfg = tiny_config(kind, yarn=r.random() < 0.5).with_(
        index_topk=topk, index_n_heads=r.choice([1, 2, 4, 16]), num_hidden_layers=L,
        num_attention_heads=r.choice([2, 4, 8]), kv_lora_rank=r.choice([16, 32, 48]),
        qk_rope_head_dim=r.choice([8, 16]),
        mlp_layer_types=tuple(r.choice(["dense", "sparse"]) for _ in range(L)),
        indexer_types=indexers)
    page, hot = r.choice([4, 8, 16]), topk + r.choice([0, 1, 3, 8, 20])
    hs = HiSparseConfig(top_k=topk, device_buffer_size=hot, host_to_device_ratio=r.choice([2, 4, 8]),
                        swap_in_block_size=64, host_pool_gib=r.choice([0.002, 0.01]))
    requests = []
    for q in range(r.randint(1, 5)):
        if requests and r.random() < 0.4:  # a prefix of the first request, maybe extended
            first = requests[0][1]
            prompt = first[:r.randint(1, len(first))] + [r.randrange(96) for _ in range(r.randint(0, 20))]
        else:
            prompt = [r.randrange(96) for _ in range(r.randint(1, 150))]
        requests.append((f"r{q}", prompt, r.randint(1, 12)))
    blocks = r.choice([None, 3, 6, 12, 40])
    extra = {} if blocks is None else {"num_device_blocks": max(blocks, hot_buffer_blocks(hot, page))}
    return cfg, EngineConfig(hisparse=hs, page_size=page, **extra), requests


@pytest.mark.parametrize("seed", range(16))
def test_random_shapes_hisparse_equals_full_resident(seed):
    cfg, hisparse, requests = _case(1000 + seed)
    model = build_random_model(cfg, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for mode, ecfg in (("hisparse", hisparse),
                           ("full", EngineConfig(hisparse=hisparse.hisparse, full_resident=True,
                                                 page_size=hisparse.page_size))):
            with Engine(model, ecfg) as eng:
                for rid, prompt, max_new in requests:
                    eng.add_request(rid, prompt, max_new)
                out[mode] = {k: list(v) for k, v in eng.run().items()}
    finally:
        torch.set_num_threads(threads)
    assert out["hisparse"] == out["full"], (cfg, hisparse, [(len(p), m) for _, p, m in requests])
    assert all(len(out["full"][rid]) == max_new for rid, _, max_new in requests)
