"""The actor system on the fast decode step on CUDA (``gpu``; the lead runs them on the H200 with
``benchmarks/fast_gpu.sh actors``): decode ranks capture the step in CUDA graphs (TP 1, and TP 2
over NCCL on two GPUs), a GPU prefill worker lands KV rows in the replica's ``kv_cache_dtype``
through rank 0's GPU staging pool, index keys land in the paged fp8 pool.

* TP 1, bf16, 576-value rows (the "landing" shape), bf16 and fp8 rows, one bucket of 4: tokens
  equal the full-resident engine's on the same fast step (``replica_baseline``) bit for bit,
  through host and resident landings, spills and a reused prefix.
* TP 2, fp32 (bf16 tokens of TP 2 differ from TP 1 by the all-reduce order): one GPU (gloo,
  eager) and one GPU per rank (NCCL, graphs with the all-reduce inside); tokens equal TP 1.
* The library kernels in the actor path: a model folder (released format) of FlashMLA /
  DeepGEMM-sized dims (16 heads padded to 64, 512 + 64 rows, 64 x 128 index heads, top-k 128, a
  MoE layer of 16 experts): bf16 weights + bf16 rows (FlashMLA's sparse bf16 kernel), fp8
  weights + fp8 rows + fp8 keys (FlashMLA's fp8 decode, DeepGEMM's paged logits, fp8 GEMMs and
  masked grouped fp8 experts); tokens equal full-resident bit for bit.
"""

from __future__ import annotations

import random

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.testing.full_resident import replica_baseline

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def _prompt(rng, n):
    return [rng.randrange(1, 96) for _ in range(n)]


def _run(rep, waves, max_new):
    rows = {}
    for wave in waves:
        for rid, prompt in wave:
            ray.get(rep.coordinator.submit.remote(rid, prompt, max_new))
        rows.update({r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
            [rid for rid, _ in wave], 300))})
    return rows


def _deploy(spec, prefill_gpus):
    rep = launch.launch_replica(spec)
    try:
        pf = launch.launch_prefill(PrefillSpec(model=spec.model, gpus=prefill_gpus,
                                               kv_cache_dtype=spec.kv_cache_dtype,
                                               name=spec.replica_id))
        launch.connect(rep, pf)
    except BaseException:
        rep.shutdown()
        raise
    return rep


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_tp1_cuda_graph_step_equals_full_resident(ray_cluster, kv):
    model = ModelSpec(dtype="bfloat16", shape="landing", num_layers=4)
    spec = ReplicaSpec(model=model, tp_size=1, gpus_per_rank=0.4, max_batch=4,
                       num_device_blocks=24, staging_blocks=40, page_size=8,
                       replica_id=f"fast-gpu-{kv}", kv_cache_dtype=kv,
                       fast_path=FastPathConfig(max_context=512, buckets=(4,),
                                                index_key_dtype="fp8"))
    rng = random.Random(3)
    first = [(f"g{i}", _prompt(rng, n)) for i, n in enumerate((150, 40, 120, 30, 56, 20))]
    second = [("again1", first[1][1] + [7, 8]), ("again2", first[2][1][:96] + [9])]
    rep = _deploy(spec, 0.2)
    try:
        rows = _run(rep, [first, second], 24)
        stats = ray.get(rep.ranks[0].stats.remote())
        counters = ray.get(rep.coordinator.metrics.remote())["counters"]
    finally:
        rep.shutdown()
    ref = replica_baseline(spec, [p for _, p in first + second], 24, [r for r, _ in first + second])
    for rid, _ in first + second:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    print(f"\n{kv}: {stats}")
    assert stats["fast_steps"] > 0 and stats["hot_misses"] > 0 and stats["error"] is None
    # which requests land on the host tier depends on arrival timing (g0's whole life fits the
    # device pool when it comes first): some row reached the host tier, by landing or by a spill
    host = [r for r, _ in first + second if rows[r]["target"] == "host"]
    assert (host or stats["spills"] > 0) and counters["prefix_hit_pages"] > 0


@pytest.mark.parametrize("gpus_per_rank", [
    pytest.param(0.4, id="one-gpu"), pytest.param(0.8, id="gpu-each", marks=pytest.mark.two_gpus)])
def test_tp2_fast_step_equals_tp1(ray_cluster, gpus_per_rank):
    spec = ReplicaSpec(tp_size=2, gpus_per_rank=gpus_per_rank, max_batch=4, num_device_blocks=12,
                       staging_blocks=8, page_size=8, replica_id=f"fast-tp2-{gpus_per_rank}",
                       fast_path=FastPathConfig(max_context=256, buckets=(1, 2, 4)))
    rng = random.Random(4)
    requests = [(f"t{i}", _prompt(rng, n)) for i, n in enumerate((150, 12, 120, 60))]
    rep = _deploy(spec, 0.2)
    try:
        infos = ray.get([r.node_info.remote() for r in rep.ranks])
        rows = _run(rep, [requests], 16)
        stats = ray.get([r.stats.remote() for r in rep.ranks])
    finally:
        rep.shutdown()
    assert {i["tp_backend"] for i in infos} == {"nccl" if gpus_per_rank > 0.5 else "gloo"}
    ref = replica_baseline(spec, [p for _, p in requests], 16, [r for r, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    assert all(s["fast_steps"] > 0 and s["error"] is None for s in stats)


def _kernel_folder(tmp_path, fp8: bool):
    import torch

    from hisparse_ray.model.config import tiny_config
    from hisparse_ray.model.model import build_random_model
    from tests.model._checkpoint import write_released

    cfg = tiny_config(yarn=False).with_(
        vocab_size=512, hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, index_n_heads=64,
        index_head_dim=128, index_topk=128, max_position_embeddings=8192, n_routed_experts=16,
        num_experts_per_tok=4, mlp_layer_types=("dense", "sparse"), indexer_types=("full", "full"))
    model = build_random_model(cfg, 5, dtype=torch.bfloat16)
    return write_released(model, tmp_path / ("fp8" if fp8 else "bf16"), fp8=fp8, tokenizer=False,
                          mtp=False)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights-rows", "fp8-weights-rows-keys"])
def test_library_kernels_in_the_actor_path_equal_full_resident(ray_cluster, tmp_path, fp8):
    from hisparse_ray.config import HiSparseConfig

    kv = "fp8" if fp8 else "bf16"
    model = ModelSpec(kind=str(_kernel_folder(tmp_path, fp8)), dtype="bfloat16")
    hs = HiSparseConfig(top_k=128, device_buffer_size=256, host_to_device_ratio=4,
                        swap_in_block_size=1024, host_pool_gib=0.05)
    spec = ReplicaSpec(model=model, hisparse=hs, tp_size=1, gpus_per_rank=0.4, max_batch=4,
                       num_device_blocks=60, staging_blocks=80, page_size=16,
                       replica_id=f"fast-lib-{kv}", kv_cache_dtype=kv,
                       fast_path=FastPathConfig(  # the kernels asked for: a rank that cannot
                           max_context=2048, buckets=(4,),  # run them fails to build, loudly
                           index_key_dtype="fp8" if fp8 else "bf16", attention="flashmla",
                           logits="deepgemm" if fp8 else "reference"))
    rng = random.Random(5)
    first = [(f"k{i}", [rng.randrange(1, 500) for _ in range(n)])
             for i, n in enumerate((700, 300, 1000, 90))]
    second = [("again0", first[0][1][:512] + [3, 4, 5])]
    rep = _deploy(spec, 0.2)
    try:
        rows = _run(rep, [first, second], 24)
        stats = ray.get(rep.ranks[0].stats.remote())
    finally:
        rep.shutdown()
    ref = replica_baseline(spec, [p for _, p in first + second], 24,
                           [r for r, _ in first + second])
    print(f"\n{kv}: {stats}")
    for rid, _ in first + second:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    assert stats["fast_steps"] > 0 and stats["hot_misses"] > 0 and stats["error"] is None
