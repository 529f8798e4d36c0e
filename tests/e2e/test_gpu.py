"""GPU runs (``gpu`` marker; the lead runs them on the H200): the demo with TP 2 on one GPU
(``num_gpus=0.5`` per rank, gloo TP group, pinned + registered host pool), and a GPU prefill worker
whose host landings go through the decode-side GPU staging pool. ``two_gpus``: the same with one
rank per GPU (NCCL TP group; the one pinned host pool mapped by both devices; rank 0's IPC events
waited on by the other device's streams)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.host.segment import mapped_segments
from hisparse_ray.testing.full_resident import full_resident_tokens

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


@pytest.mark.parametrize("gpus_per_rank", [
    pytest.param("0.5", id="one-gpu"), pytest.param("1", id="gpu-each", marks=pytest.mark.two_gpus)])
def test_demo_tp2(gpus_per_rank):
    out = subprocess.run([sys.executable, "-m", "hisparse_ray.cli", "demo", "--device", "gpu",
                          "--requests", "4", "--gpus-per-rank", gpus_per_rank], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS: HiSparse tokens equal full-resident decode" in out.stdout
    assert f"device cuda ({gpus_per_rank} GPU per rank)" in out.stdout


@pytest.mark.parametrize("gpus_per_rank", [
    pytest.param(0.4, id="one-gpu"), pytest.param(0.8, id="gpu-each", marks=pytest.mark.two_gpus)])
def test_tp2_landings_spills_restores_backups_match_full_resident(ray_cluster, gpus_per_rank):
    """Host and resident landings (staged, from a GPU prefill worker), resident requests that
    outgrow a 12-block device pool (spills), a second wave reusing their published prefixes
    (restores), and backups every step: tokens equal full-resident decode. ``gpu-each`` (0.8 per
    rank: no two ranks fit one GPU, 0.2 left for prefill): the ranks are on different GPUs, the TP
    group is NCCL, and they still share one host pool segment. Rank 0 never waits for its copies
    (issue #16 B2): the peer reads the rows rank 0 spilled or backed up in the steps before only
    after its stream waited on the IPC event of the step that wrote them (by step number:
    ``HostPool.wait_step``, slot ``step % event_ring``; landings between steps record none); a
    stale row there would change the peer's half of every head all-reduce, hence the logits."""
    import os

    model = ModelSpec()
    rid = f"tp2-{int(gpus_per_rank * 10)}"
    spec = ReplicaSpec(model=model, tp_size=2, gpus_per_rank=gpus_per_rank, num_device_blocks=12,
                       staging_blocks=4, replica_id=rid)
    rep = launch.launch_replica(spec)
    try:
        infos = ray.get([r.node_info.remote() for r in rep.ranks])
        assert (infos[0]["gpu"] != infos[1]["gpu"]) == (gpus_per_rank > 0.5), infos
        assert {i["tp_backend"] for i in infos} == {"nccl" if gpus_per_rank > 0.5 else "gloo"}
        assert ray.get([r.check_tp.remote() for r in rep.ranks]) == [3.0, 3.0]
        segs = [{n for n in mapped_segments(i["pid"]) if n.startswith(f"hisparse-pool.{rid}.")}
                for i in infos]
        assert len(segs[0]) == 1 and segs[0] == segs[1], segs  # one host pool for both ranks
        assert not set(os.listdir("/dev/shm")) & segs[0]  # unlinked once both ranks mapped it
        pf = launch.launch_prefill(PrefillSpec(model=model, gpus=0.2, name=rid))
        assert launch.connect(rep, pf, "staged") == "staged"
        rng = random.Random(0)
        first = [(f"g{i}", [rng.randrange(1, 96) for _ in range(n)])
                 for i, n in enumerate((150, 40, 120, 30, 56, 20))]
        second = [("again1", first[1][1] + [7, 8]), ("again4", first[4][1][:48])]
        rows: dict = {}
        for wave, new in ((first, 24), (second, 8)):
            for r, p in wave:
                ray.get(rep.coordinator.submit.remote(r, p, new))
            rows.update({r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
                [r for r, _ in wave], 300))})
        c = ray.get(rep.coordinator.metrics.remote())["counters"]
    finally:
        rep.shutdown()
    for wave, new in ((first, 24), (second, 8)):
        ref = full_resident_tokens(model, [p for _, p in wave], new, [r for r, _ in wave],
                                   device="cuda")
        for r, _ in wave:
            assert rows[r]["error"] is None, rows[r]
            assert rows[r]["tokens"] == ref[r], r
    assert rows["g0"]["target"] == "host" and rows["g1"]["target"] == "resident"
    assert c["spills"] > 0 and c["restores"] > 0 and c["backups"] > 0, c
    print(f"\n{rid}: ranks on {[i['gpu'][-8:] for i in infos]}, counters "
          f"spills {c['spills']} restores {c['restores']} backups {c['backups']}")


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_gpu_prefill_host_landing_matches_full_resident(ray_cluster, path):
    """staged: KV into the GPU staging pool, then D2H into the host pool; direct: KV straight
    into the pinned host pool. Either way the indexer keys go GPU -> every rank's GPU key staging
    (so a direct landing is two WRITEs per rank 0: DRAM rows, then VRAM keys + notification)."""
    model = ModelSpec()
    spec = ReplicaSpec(model=model, tp_size=2, gpus_per_rank=0.4, num_device_blocks=12,
                       staging_blocks=4, replica_id=f"gpu-{path}")
    rep = launch.launch_replica(spec)
    try:
        pf = launch.launch_prefill(PrefillSpec(model=model, gpus=0.2, name=f"gpu-{path}"))
        assert launch.connect(rep, pf, path) == path
        rng = random.Random(0)
        requests = [(f"g{i}", [rng.randrange(1, 96) for _ in range(n)])
                    for i, n in enumerate((150, 20, 120))]
        for rid, p in requests:
            ray.get(rep.coordinator.submit.remote(rid, p, 8))
        rows = {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(None, 300))}
    finally:
        rep.shutdown()
    ref = full_resident_tokens(model, [p for _, p in requests], 8, [r for r, _ in requests],
                               device="cuda")
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid]
    assert rows["g0"]["landing_path"] == path and rows["g1"]["target"] == "resident"
