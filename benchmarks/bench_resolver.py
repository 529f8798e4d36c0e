"""Resolver benchmark on one GPU (not a test): DeepSeek-V3.2 shapes, microseconds per call,
achieved GB/s on misses and the ratio to the floor (miss bytes / pinned H2D bandwidth measured in
the same run; for 0 % miss, an empty kernel's launch). Writes a Parquet file and prints a table.

    python benchmarks/bench_resolver.py [--out bench_resolver.parquet] [--quick]
    python benchmarks/bench_resolver.py --clusters [--out clusters.parquet]  # phase A per cluster size
    python benchmarks/bench_resolver.py --phase-a [--out phase_a.parquet]  # default vs fused
    HISPARSE_RESOLVER_PHASE_A=fused python benchmarks/bench_resolver.py --profile  # fused, by stage

Timing: each call is captured in a CUDA graph ITERS times with a different top-k per call (so
host rows are not re-read from L2); with misses, each call is preceded by a restore of the slot
state (elementwise kernels) so every call sees the same miss rate, and the restore-only graph is
timed too and subtracted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hisparse_ray.kernels import cuda as kcuda

K = 2048
PAGE = 64
SEQ = 32768
ITERS = 12
REPS = 5


def time_graph(fn, reps: int = REPS) -> float:
    """Median milliseconds of one replay of a graph capturing ``fn``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def h2d_gbps(pool: torch.Tensor) -> float:
    """Pinned host -> device copy engine bandwidth: the best of 3 medians of 1 GiB copies."""
    n = min(pool.numel(), 1 << 30)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ms = min(time_graph(lambda: dst.copy_(pool[:n], non_blocking=True), reps=7) for _ in range(3))
    return n / ms / 1e6


def launch_floor_us() -> float:
    import cupy

    nop = cupy.RawKernel('extern "C" __global__ void nop() {}', "nop")

    def fn():
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            for _ in range(ITERS):
                nop((1,), (32,), ())

    return time_graph(fn) * 1e3 / ITERS


class Bench:
    """One (H, row_bytes, batch) state; top-k sets for each miss rate."""

    def __init__(self, h: int, rb: int, batch: int, pool: torch.Tensor, threads: int,
                 cluster: int | str = 1, phase_a: str | None = None):
        dev = "cuda"
        self.h, self.rb, self.batch, self.threads = h, rb, batch, threads
        self.cluster, self.phase_a = cluster, phase_a
        self.host = pool[: (pool.numel() // rb) * rb].view(-1, rb)
        host_blocks = self.host.shape[0] // PAGE
        pages = SEQ // PAGE
        self.host_table = torch.randint(0, host_blocks, (batch, pages), dtype=torch.int32, device=dev)
        self.resident = torch.full((batch, pages), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((batch,), SEQ, dtype=torch.int32, device=dev)
        self.state_idx = torch.arange(batch, dtype=torch.int32, device=dev)
        self.slot_rows = torch.arange(batch * (h + 1), dtype=torch.int32, device=dev).view(batch, h + 1)
        self.device_kv = torch.empty((batch * (h + 1), rb), dtype=torch.uint8, device=dev)
        self.slot_pos0 = torch.empty((batch, h), dtype=torch.int32, device=dev)
        self.lru0 = torch.empty((batch, h), dtype=torch.int32, device=dev)
        self.hot, self.cold = [], []
        for b in range(batch):
            perm = torch.randperm(SEQ - 1, device=dev).int()
            self.slot_pos0[b] = perm[:h]
            self.lru0[b] = torch.randperm(h, device=dev).int()
            self.hot.append(perm[:h])
            self.cold.append(perm[h:])
        self.slot_pos, self.lru = self.slot_pos0.clone(), self.lru0.clone()
        self.out = torch.empty((batch, K), dtype=torch.int32, device=dev)
        self.plan = torch.empty((batch, K, 2), dtype=torch.int32, device=dev)

    def top_ks(self, miss: float) -> torch.Tensor:
        m = int(round(miss * K))
        tk = torch.empty((ITERS, self.batch, K), dtype=torch.int32, device="cuda")
        for i in range(ITERS):
            for b in range(self.batch):
                hot = self.hot[b][torch.randperm(self.h, device="cuda")[: K - m]]
                cold = self.cold[b][i * m:(i + 1) * m]
                row = torch.cat([hot, cold])
                tk[i, b] = row[torch.randperm(K, device="cuda")]
        return tk

    def restore(self):
        # elementwise kernels, not memcpy nodes: keeps the graph on the SMs (no copy-engine hops)
        torch.add(self.slot_pos0, 0, out=self.slot_pos)
        torch.add(self.lru0, 0, out=self.lru)

    def run(self, miss: float, check: bool = True) -> float:
        """Microseconds per resolve call."""
        tks = self.top_ks(miss)

        restore = miss > 0  # at 0 % miss the state after a call still gives 0 % miss

        def calls():
            for i in range(ITERS):
                if restore:
                    self.restore()
                kcuda.resolve(tks[i], self.seq_lens, self.state_idx, self.slot_pos, self.lru,
                              self.slot_rows, self.resident, self.host_table, self.host,
                              self.device_kv, self.out, self.plan, page_size=PAGE,
                              block_threads=self.threads, cluster=self.cluster,
                              phase_a=self.phase_a)

        def restores():
            for _ in range(ITERS):
                self.restore()

        t_all = time_graph(calls)
        t_restore = time_graph(restores) if restore else 0.0
        misses = int((self.plan[..., 0] >= 0).sum())
        assert not check or misses == int(round(miss * K)) * self.batch, (misses, miss)
        return (t_all - t_restore) * 1e3 / ITERS


def eager_overhead_us(bench: Bench) -> float:
    tks = bench.top_ks(0.0)
    args = (tks[0], bench.seq_lens, bench.state_idx, bench.slot_pos, bench.lru, bench.slot_rows,
            bench.resident, bench.host_table, bench.host, bench.device_kv, bench.out, bench.plan)
    for _ in range(10):
        kcuda.resolve(*args, page_size=PAGE, block_threads=bench.threads)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        kcuda.resolve(*args, page_size=PAGE, block_threads=bench.threads)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 200 * 1e6


def thp_pool(nbytes: int):
    """Pinned pool on transparent huge pages (mmap + MADV_HUGEPAGE + cudaHostRegister), or None."""
    import mmap

    try:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        t.fill_(0x5A)
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0 or not t.is_pinned():
            print(f"THP pool: cudaHostRegister -> {err}, pinned={t.is_pinned()}")
            return None
        return t, mm
    except Exception as e:  # an experiment: report and go on
        print(f"THP pool unavailable: {e!r}")
        return None


def anon_huge_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


def profile(pool: torch.Tensor, threads: int) -> None:
    """Kernel durations (CUPTI via torch.profiler) and how phase A scales with K and H."""
    global K
    from torch.profiler import ProfilerActivity, profile as tprofile

    for batch in (1, 64):
        bench = Bench(4096, 1152, batch, pool, threads)
        tks = bench.top_ks(0.1)
        args = (bench.seq_lens, bench.state_idx, bench.slot_pos, bench.lru, bench.slot_rows,
                bench.resident, bench.host_table, bench.host, bench.device_kv, bench.out, bench.plan)
        kcuda.resolve(tks[0], *args, page_size=PAGE, block_threads=threads)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(ITERS):
                bench.restore()
                kcuda.resolve(tks[i], *args, page_size=PAGE, block_threads=threads)
            torch.cuda.synchronize()
        print(f"B={batch} 10% miss, H=4096, 1152 B rows:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
    for batch in (1, 64):
        for stop in (0, 1, 2, 3, 4, 5, 6, 7, 99):
            kcuda._DEFINES = (f"-DHS_STOP={stop}",)
            bench = Bench(4096, 1152, batch, pool, threads)
            print(f"B={batch} 0% miss K=2048 H=4096, phase A returns after stage {stop}: "
                  f"{bench.run(0.0, check=False):.1f} us per call", flush=True)
    kcuda._DEFINES = ()
    k0 = K
    for k, h in ((256, 512), (256, 4096), (2048, 4096), (2048, 8192)):
        K = k
        bench = Bench(h, 1152, 1, pool, threads)
        print(f"B=1 0% miss K={k} H={h}: {bench.run(0.0):.1f} us per call")
    K = k0


def variant_sweep(pool: torch.Tensor, out: str, variants: list[tuple[str, int | str, str]],
                  threads_list: tuple[int, ...] = (1024, 512, 256)) -> None:
    """Phase A variants ``(label, cluster, phase_a)`` against the first one at 1024 threads, same
    process: us per resolve call (H 4096, K 2048, 1152 B rows) and the ratio (``vs_first``)."""
    rows = []
    for batch in (1, 4, 16, 64):
        for threads in threads_list:
            bench = Bench(4096, 1152, batch, pool, threads)
            for miss in (0.0, 0.6):  # 0.6: a 40 % consecutive-step overlap, every overlap a hit
                for label, cluster, phase_a in variants:
                    bench.cluster, bench.phase_a = cluster, phase_a
                    rows.append(dict(batch=batch, miss=miss, variant=label,
                                     size=kcuda.cluster_size(cluster, batch, 0), threads=threads,
                                     us=bench.run(miss), H=4096, row_bytes=1152))
        for r in rows:
            if r["batch"] == batch:
                r["vs_first"] = r["us"] / next(
                    q["us"] for q in rows if q["batch"] == batch and q["miss"] == r["miss"]
                    and q["variant"] == variants[0][0] and q["threads"] == 1024)
    print(f"phase A variants (H 4096, K 2048, 1152 B rows; vs_first: / {variants[0][0]} at "
          "1024 threads, same run)")
    print(f"{'batch':>5} {'miss':>5} {'variant':>9} {'size':>4} {'threads':>7} {'us':>8} "
          f"{'vs_first':>8}")
    for r in rows:
        print(f"{r['batch']:5d} {r['miss']:5.1f} {r['variant']:>9} {r['size']:4d} "
              f"{r['threads']:7d} {r['us']:8.1f} {r['vs_first']:8.2f}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_resolver.parquet")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64 only, H 4096")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1024)
    ap.add_argument("--thp", action="store_true", help="also time a transparent-huge-page pool")
    ap.add_argument("--profile", action="store_true", help="kernel durations only, then exit")
    ap.add_argument("--clusters", action="store_true",
                    help="phase A per thread-block cluster size only, then exit")
    ap.add_argument("--phase-a", action="store_true",
                    help="phase A's default vs fused long path only (HS_FUSED), then exit")
    args = ap.parse_args()
    pool = torch.empty(int(args.pool_gib * (1 << 30)), dtype=torch.uint8, pin_memory=True)
    pool.fill_(0x5A)
    bw = h2d_gbps(pool)
    floor_launch = launch_floor_us()
    print(f"device {torch.cuda.get_device_name()}  pinned H2D {bw:.1f} GB/s  "
          f"empty-kernel launch in a graph {floor_launch:.2f} us  pool {args.pool_gib} GiB")
    if args.profile:
        profile(pool, args.threads)
        return
    if args.clusters:
        variant_sweep(pool, args.out, [(f"c{c}", c, "default") for c in (1, 2, 4, 8, "auto")])
        return
    if args.phase_a:
        variant_sweep(pool, args.out, [("default", 1, "default"), ("fused", 1, "fused")],
                      threads_list=(1024, 512))
        return
    rows = []
    sweep = {}
    for threads in (256, 512, 1024):
        bench = Bench(4096, 1152, 64, pool, threads)
        sweep[threads] = bench.run(0.0)
        b1 = Bench(4096, 1152, 1, pool, threads)
        print(f"threads {threads:4d}: B=64 0% miss {sweep[threads]:.1f} us, "
              f"B=1 100% miss {b1.run(1.0):.1f} us", flush=True)
    args.threads = min(sweep, key=sweep.get)
    print(f"phase-A threads for the table: {args.threads}")
    hs = [4096] if args.quick else [4096, 6144]
    batches = [1, 64] if args.quick else [1, 16, 64, 128]
    for h in hs:
        for rb in (656, 1152):
            for batch in batches:
                bench = Bench(h, rb, batch, pool, args.threads)
                if h == 4096 and rb == 1152 and batch == 64:
                    print(f"eager call (python + 2 launches, B=64, 0% miss): {eager_overhead_us(bench):.1f} us")
                for miss in (0.0, 0.1, 0.5, 1.0):
                    us = bench.run(miss)
                    miss_bytes = int(round(miss * K)) * batch * rb
                    rows.append(dict(H=h, row_bytes=rb, batch=batch, miss=miss, us=us,
                                     miss_bytes=miss_bytes,
                                     miss_gbps=miss_bytes / us / 1e3 if miss_bytes else 0.0,
                                     threads=args.threads, pool="pinned"))
    bw = max(bw, h2d_gbps(pool))  # measured again after the table; the best one is the floor
    print(f"pinned H2D (best of start and end) {bw:.1f} GB/s")
    for r in rows:
        floor = r["miss_bytes"] / bw / 1e3 if r["miss_bytes"] else floor_launch
        r.update(floor_us=floor, ratio=r["us"] / floor, h2d_gbps=bw)
        print(f"H={r['H']:5d} R={r['row_bytes']:5d} B={r['batch']:4d} miss={int(r['miss'] * 100):3d}%  "
              f"{r['us']:9.1f} us  {r['miss_gbps']:6.1f} GB/s  floor {floor:8.1f} us  "
              f"x{r['ratio']:.2f}", flush=True)
    thp = None if args.quick or not args.thp else thp_pool(int(args.pool_gib * (1 << 30)))
    if thp is not None:
        del pool
        print(f"THP pool registered; AnonHugePages {anon_huge_kib()} kB")
        for rb in (656, 1152):
            for batch in (16, 128):
                bench = Bench(4096, rb, batch, thp[0], args.threads)
                for miss in (0.1, 1.0):
                    us = bench.run(miss)
                    miss_bytes = int(round(miss * K)) * batch * rb
                    rows.append(dict(H=4096, row_bytes=rb, batch=batch, miss=miss, us=us,
                                     miss_gbps=miss_bytes / us / 1e3, floor_us=miss_bytes / bw / 1e3,
                                     ratio=us / (miss_bytes / bw / 1e3), h2d_gbps=bw,
                                     threads=args.threads, pool="thp"))
                    print(f"THP H=4096 R={rb:5d} B={batch:4d} miss={int(miss * 100):3d}%  {us:9.1f} us  "
                          f"{rows[-1]['miss_gbps']:6.1f} GB/s  x{rows[-1]['ratio']:.2f}", flush=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
