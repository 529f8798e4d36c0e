"""Resolver benchmark on one GPU (not a test): DeepSeek-V3.2 shapes, microseconds per call,
achieved GB/s on misses and the ratio to the floor (miss bytes / pinned H2D bandwidth measured in
the same run; for 0 % miss, an empty kernel's launch). Writes a Parquet file and prints a table.

    python benchmarks/bench_resolver.py [--out bench_resolver.parquet] [--quick]

Timing: each call is captured in a CUDA graph ITERS times, each preceded by a restore of the
slot state (so every call sees the same miss rate) and with a different top-k per call (so host
rows are not re-read from L2); the restore-only graph is timed too and subtracted.
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
    n = min(pool.numel(), 1 << 30)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ms = time_graph(lambda: dst.copy_(pool[:n], non_blocking=True))
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

    def __init__(self, h: int, rb: int, batch: int, pool: torch.Tensor, threads: int):
        dev = "cuda"
        self.h, self.rb, self.batch, self.threads = h, rb, batch, threads
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
        self.slot_pos.copy_(self.slot_pos0)
        self.lru.copy_(self.lru0)

    def run(self, miss: float) -> float:
        """Microseconds per resolve call."""
        tks = self.top_ks(miss)

        def calls():
            for i in range(ITERS):
                self.restore()
                kcuda.resolve(tks[i], self.seq_lens, self.state_idx, self.slot_pos, self.lru,
                              self.slot_rows, self.resident, self.host_table, self.host,
                              self.device_kv, self.out, self.plan, page_size=PAGE,
                              block_threads=self.threads)

        def restores():
            for _ in range(ITERS):
                self.restore()

        t_all = time_graph(calls)
        t_restore = time_graph(restores)
        misses = int((self.plan[..., 0] >= 0).sum())
        assert misses == int(round(miss * K)) * self.batch, (misses, miss)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_resolver.parquet")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64 only, H 4096")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=512)
    args = ap.parse_args()
    pool = torch.empty(int(args.pool_gib * (1 << 30)), dtype=torch.uint8, pin_memory=True)
    pool.fill_(0x5A)
    bw = h2d_gbps(pool)
    floor_launch = launch_floor_us()
    print(f"device {torch.cuda.get_device_name()}  pinned H2D {bw:.1f} GB/s  "
          f"empty-kernel launch in a graph {floor_launch:.2f} us  pool {args.pool_gib} GiB")
    rows = []
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
                    floor = miss_bytes / bw / 1e3 if miss_bytes else floor_launch
                    rows.append(dict(H=h, row_bytes=rb, batch=batch, miss=miss, us=us,
                                     miss_gbps=miss_bytes / us / 1e3 if miss_bytes else 0.0,
                                     floor_us=floor, ratio=us / floor, h2d_gbps=bw,
                                     threads=args.threads))
                    r = rows[-1]
                    print(f"H={h:5d} R={rb:5d} B={batch:4d} miss={int(miss * 100):3d}%  "
                          f"{us:9.1f} us  {r['miss_gbps']:6.1f} GB/s  floor {floor:8.1f} us  "
                          f"x{r['ratio']:.2f}", flush=True)
        del bench
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
