"""CUDA resolver vs the torch reference, bit-exact (indices, plan, slot_pos, LRU, every device
byte) over randomized shapes and repeated steps with overlapping top-k; CUDA-graph capture and
replay; replay and backup kernels; debug-mode preconditions. Needs a GPU and cupy."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from hisparse_ray.errors import KernelPreconditionError
from hisparse_ray.kernels import backup, replay, resolve
from tests.kernels.builders import make_case, next_step

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cupy():
    pytest.importorskip("cupy")


def gpu_case(seed, **kw):
    return make_case(random.Random(seed), **kw).to("cuda", pin=True)


def step_both(case_gpu, case_ref, block_threads, cluster=1):
    outs = []
    for case, backend in ((case_gpu, "cuda"), (case_ref, "torch")):
        out = torch.full(case.top_k.shape, -7, dtype=torch.int32, device="cuda")
        plan = torch.full((*case.top_k.shape, 2), -7, dtype=torch.int32, device="cuda")
        resolve(*case.args(out, plan), page_size=case.page_size, block_threads=block_threads,
                backend=backend, cluster=cluster)
        outs.append((out, plan))
    torch.cuda.synchronize()
    (o1, p1), (o2, p2) = outs
    assert torch.equal(o1, o2), "out_rows"
    assert torch.equal(p1, p2), "plan"
    assert torch.equal(case_gpu.slot_pos, case_ref.slot_pos), "slot_pos"
    assert torch.equal(case_gpu.lru, case_ref.lru), "lru"
    assert torch.equal(case_gpu.device_kv, case_ref.device_kv), "device bytes"
    return int((p1[..., 0] >= 0).sum())


SHAPES = [  # batch, K, H, row_bytes, page_size, block_threads, lens dtype, extra length
    (1, 2048, 8192, 1152, 64, 1024, torch.int32, 4000),
    (2, 2048, 2048, 656, 64, 960, torch.int64, 3000),
    (4, 512, 1024, 333, 16, 64, torch.int32, 900),
    (16, 256, 512, 656, 64, 96, torch.int64, 600),
    (128, 64, 128, 1152, 32, 160, torch.int32, 300),
    (3, 1, 1, 7, 1, 512, torch.int32, 10),
    (8, 100, 300, 1152, 8, 256, torch.int64, 250),
]


def _over_steps(shape, cluster, seed_extra=""):
    batch, k, h, rb, ps, threads, lens_dtype, extra = shape
    rng = random.Random(zlib.crc32((repr(shape) + seed_extra).encode()))
    lens = [rng.choice([0, rng.randrange(1, h + 1), h + rng.randrange(1, extra + 2),
                        h + rng.randrange(1, extra + 2)]) for _ in range(batch)]
    lens[0] = h + extra
    case = gpu_case(rng.randrange(1 << 30), batch=batch, k=k, h=h, seq_lens=lens, page_size=ps,
                    row_bytes=rb, hit_frac=rng.random(), resident_frac=0.05, max_len=max(lens) + 16,
                    host_blocks=max(64, 4 * (max(lens) // ps + 1)), lens_dtype=lens_dtype)
    ref = case.clone_state()
    copies = 0
    for _ in range(3):
        copies += step_both(case, ref, threads, cluster)
        next_step(rng, case, overlap=0.45)
        ref.top_k, ref.seq_lens = case.top_k.clone(), case.seq_lens.clone()
        ref.write_newest()
    assert copies > 0 or h == 1


def _random_shapes(seed, clusters, trials=24):
    """``trials`` random small shapes (K and H not multiples of the cluster or the block, rows
    of every path in one batch, slots mostly hits or mostly misses), a cluster size drawn from
    ``clusters`` each, against the reference over steps."""
    rng = random.Random(seed)
    for trial in range(trials):
        h = rng.randrange(1, 700)
        k = rng.randrange(1, h + 1)
        shape = (rng.randrange(1, 40), k, h, rng.choice([7, 16, 656]), rng.choice([1, 4, 16, 64]),
                 rng.choice([64, 96, 128, 256, 1024]), rng.choice([torch.int32, torch.int64]),
                 rng.randrange(1, 3 * h + 2))
        _over_steps(shape, rng.choice(clusters), seed_extra=str(trial))


def _need_clusters():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm90")


SHAPE_IDS = lambda s: "B{}-K{}-H{}-R{}-T{}".format(*s[:4], s[5])  # noqa: E731


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_resolve_matches_reference_over_steps(shape):
    _over_steps(shape, 1)


@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cluster_phase_a_matches_reference_over_steps(shape, cluster):
    """Phase A over a thread-block cluster (sm90): slices of the top-k and of the hot slots per
    block, hits claimed across blocks, victims handed to the block owning each miss."""
    _need_clusters()
    _over_steps(shape, cluster)


def test_cluster_phase_a_random_shapes():
    """Many random small shapes (K and H not multiples of the cluster, rows of every path in
    one batch, slots mostly hits or mostly misses), every cluster size, each against the
    reference: a cross-block ordering bug shows up as one differing entry."""
    _need_clusters()
    _random_shapes(20261205, [2, 4, 8, "auto"])


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fused_phase_a_matches_reference_over_steps(shape, monkeypatch):
    """Phase A's long path in fewer passes (``HISPARSE_RESOLVER_PHASE_A=fused``, -DHS_FUSED=1):
    the same bits as the reference, step after step."""
    monkeypatch.setenv("HISPARSE_RESOLVER_PHASE_A", "fused")
    _over_steps(shape, 1)


def test_fused_phase_a_random_shapes(monkeypatch):
    """Random small shapes (K, H and the block size not multiples of each other, every path
    in one batch): the fused sweep's four entries a thread and packed counts, against the
    reference."""
    monkeypatch.setenv("HISPARSE_RESOLVER_PHASE_A", "fused")
    _random_shapes(20261206, [1])


@pytest.mark.parametrize("cluster,phase_a", [(1, "default"), (4, "default"), (1, "fused")])
def test_cuda_graph_capture_and_replay_match_eager(cluster, phase_a, monkeypatch):
    monkeypatch.setenv("HISPARSE_RESOLVER_PHASE_A", phase_a)
    if cluster > 1:
        _need_clusters()
    case = gpu_case(7, batch=8, k=256, h=1024, seq_lens=[1500] * 7 + [0], page_size=64,
                    row_bytes=656, host_blocks=256)
    ref = case.clone_state()
    start = case.clone_state()
    out = torch.empty(case.top_k.shape, dtype=torch.int32, device="cuda")
    plan = torch.empty((*case.top_k.shape, 2), dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the module outside the capture
        resolve(*case.args(out, plan), page_size=64, backend="cuda", cluster=cluster)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        resolve(*case.args(out, plan), page_size=64, backend="cuda", cluster=cluster)
    for t, s in ((case.slot_pos, start.slot_pos), (case.lru, start.lru), (case.device_kv, start.device_kv)):
        t.copy_(s)
    out.fill_(-7)
    graph.replay()
    ref_out = torch.empty_like(out)
    ref_plan = torch.empty_like(plan)
    resolve(*ref.args(ref_out, ref_plan), page_size=64, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(plan, ref_plan)
    assert torch.equal(case.slot_pos, ref.slot_pos) and torch.equal(case.lru, ref.lru)
    assert torch.equal(case.device_kv, ref.device_kv)


@pytest.mark.parametrize("rb", [656, 1152, 333])
def test_replay_and_backup_match_reference(rb):
    gen = torch.Generator().manual_seed(rb)
    host = torch.randint(0, 256, (5000, rb), generator=gen, dtype=torch.uint8).pin_memory()
    plan = torch.full((4, 300, 2), -1, dtype=torch.int32)
    rows = torch.randperm(5000, generator=gen)[:900].int()
    dst = torch.randperm(3000, generator=gen)[:900].int()
    plan.view(-1, 2)[::1][:1200:4] = torch.stack([rows[:300], dst[:300]], 1)
    plan = plan.cuda()
    dev_a = torch.randint(0, 256, (3000, rb), generator=gen, dtype=torch.uint8).cuda()
    dev_b = dev_a.clone()
    replay(plan, host, dev_a, backend="cuda")
    replay(plan, host, dev_b, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(dev_a, dev_b)
    layers = 5
    dev = torch.randint(0, 256, (layers, 400, rb), generator=gen, dtype=torch.uint8).cuda()
    host_a = torch.zeros((layers, 600, rb), dtype=torch.uint8).pin_memory()
    host_b = host_a.clone()
    src = torch.tensor([3, -1, 399, 0, 17], dtype=torch.int32, device="cuda")
    dst_rows = torch.tensor([599, 5, 0, 1, 300], dtype=torch.int32, device="cuda")
    backup(src, dst_rows, dev, host_a, backend="cuda")
    backup(src, dst_rows, dev, host_b, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(host_a, host_b) and host_a[:, 599].equal(dev[:, 3].cpu())


def test_debug_mode_raises_on_duplicate_positions():
    case = gpu_case(3, batch=2, k=16, h=64, seq_lens=[200, 100], page_size=16, row_bytes=656)
    case.top_k[0, 1] = case.top_k[0, 0] = 5
    out = torch.empty(case.top_k.shape, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelPreconditionError, match="not distinct"):
        resolve(*case.args(out), page_size=16, debug=True, backend="cuda")


def test_unpinned_host_view_is_rejected():
    case = gpu_case(4, batch=1, k=4, h=8, seq_lens=[20], page_size=4, row_bytes=16)
    case.host_kv = case.host_kv.clone()  # pageable copy
    out = torch.empty(case.top_k.shape, dtype=torch.int32, device="cuda")
    with pytest.raises(KernelPreconditionError, match="pinned"):
        resolve(*case.args(out), page_size=4, backend="cuda")
