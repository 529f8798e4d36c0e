"""GPU runs (``gpu`` marker; the lead runs them on the H200): the demo with TP 2 on one GPU
(``num_gpus=0.5`` per rank, gloo TP group, pinned + registered host pool), and a GPU prefill worker
whose host landings go through the decode-side GPU staging pool."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.actors.reference import full_resident_tokens
from hisparse_ray.actors.spec import ModelSpec, PrefillSpec, ReplicaSpec

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def test_demo_tp2_on_one_gpu():
    out = subprocess.run([sys.executable, "-m", "hisparse_ray.cli", "demo", "--device", "gpu",
                          "--requests", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "PASS: HiSparse tokens equal full-resident decode" in out.stdout
    assert "device cuda" in out.stdout


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
