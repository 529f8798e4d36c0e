"""Benchmark (not a test): how fast the staging -> host-pool copy of a landing can go on this GPU.

Copies one landing's KV (``--tokens`` x ``--layers`` rows of ``--row-bytes``, laid out per layer as
the staging pool is) from GPU memory into host memory, per layer, in the variants the landing path
could use, each against the copy engine's limit measured in the same run (one large copy_ into a
torch-pinned buffer):

* ``pinned/sync``: per-layer ``copy_`` into a torch pinned buffer (each copy synchronizes);
* ``hostpool/sync``: per-layer ``copy_`` into the shared host pool (``/dev/shm`` segment registered
  with ``cudaHostRegister``), what ``DecodeWorker.unstage_run`` did before;
* ``hostpool/async``: the same with ``non_blocking=True`` and one synchronize at the end (what it
  does now);
* ``pageable/sync``: into ordinary (unregistered) memory, for contrast.

Usage: ``python benchmarks/bench_host_copy.py [--tokens 16384] [--layers 61] [--row-bytes 1152]``.
Needs CUDA. Prints a table and writes ``benchmarks/results/host_copy.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.host.pool import HostPool


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--row-bytes", type=int, default=1152)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/host_copy.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_copy needs CUDA")
    L, T, R = args.layers, args.tokens, args.row_bytes
    nbytes = L * T * R
    src = [torch.randint(0, 255, (T, R), dtype=torch.uint8, device="cuda") for _ in range(L)]
    flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    pinned_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned = [torch.empty(T, R, dtype=torch.uint8, pin_memory=True) for _ in range(L)]
    pageable = [torch.empty(T, R, dtype=torch.uint8) for _ in range(L)]
    for t in pageable:
        t.fill_(1)  # first touch outside the timing
    layout = KVLayout(num_layers=L, page_size=args.page_size, row_bytes=R)
    blocks = -(-T // args.page_size)
    pool = HostPool.create("benchcopy", layout, blocks, register_cuda=True)
    try:
        host = [pool.layer(l)[:T] for l in range(L)]

        def per_layer(dsts, non_blocking: bool):
            def run():
                for s, d in zip(src, dsts):
                    d.copy_(s, non_blocking=non_blocking)
            return run

        base = _time(lambda: pinned_flat.copy_(flat), args.repeats)
        rows = {"one copy_ into pinned (copy-engine limit)": base,
                "pinned/sync": _time(per_layer(pinned, False), args.repeats),
                "hostpool/sync": _time(per_layer(host, False), args.repeats),
                "hostpool/async": _time(per_layer(host, True), args.repeats),
                "pageable/sync": _time(per_layer(pageable, False), args.repeats // 2 or 1)}
        ok = all(torch.equal(h, s.cpu()) for h, s in zip(host, src))
    finally:
        pool.destroy()
    print(f"\nstaging -> host copy of {nbytes / 1e6:.1f} MB ({L} layers x {T} rows x {R} B) "
          f"on {torch.cuda.get_device_name()}; host pool bytes equal after copy: {ok}")
    print(f"{'variant':<44} {'ms':>8} {'GB/s':>8} {'vs limit':>9}")
    result = {}
    for k, sec in rows.items():
        gbps = nbytes / sec / 1e9
        result[k] = {"ms": sec * 1e3, "GBps": gbps, "vs_limit": base / sec}
        print(f"{k:<44} {sec * 1e3:>8.2f} {gbps:>8.2f} {base / sec:>8.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bytes": nbytes, "device": torch.cuda.get_device_name(),
                                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "rows": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
