"""Page-copy engine throughput: spills (D2H), restores (H2D), backups and fills of the shared host
pool, against the copy-engine limit (a plain large pinned copy) measured in the same run.

One command (on the GPU machine):  python benchmarks/bench_copies.py
Prints a table and writes JSON (default benchmarks/results/copies.json). Runs on CPU too (memcpy
numbers only), which is how CI smoke-tests it: python benchmarks/bench_copies.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.host import copies
from hisparse_ray.host.pool import HostPool


def _timer(device: str, stream):
    """Returns (start, stop) closures measuring seconds of the work enqueued between them."""
    if device == "cuda":
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return (lambda: t0.record(stream)), (lambda: (t1.record(stream), t1.synchronize(),
                                                       t0.elapsed_time(t1) / 1e3)[-1])
    box = [0.0]
    return (lambda: box.__setitem__(0, time.perf_counter())), (lambda: time.perf_counter() - box[0])


def _measure(fn, nbytes: int, device: str, stream, iters: int) -> dict:
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        start, stop = _timer(device, stream)
        start()
        fn()
        best = min(best, stop())
    return {"bytes": nbytes, "ms": best * 1e3, "gbps": nbytes / best / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--row-bytes", type=int, default=1152, help="1152 bf16 MLA, 656 fp8")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--host-blocks", type=int, default=1024)
    ap.add_argument("--device-blocks", type=int, default=512)
    ap.add_argument("--pages", type=int, default=256, help="pages per spill / restore batch")
    ap.add_argument("--rows", type=int, default=256, help="rows per backup / fill batch")
    ap.add_argument("--plain-mib", type=int, default=1024, help="size of the plain pinned copy")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI / CPU check)")
    ap.add_argument("--separate-layers", action="store_true",
                    help="one device allocation per layer (no stacked gather/scatter)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "copies.json"))
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.host_blocks, a.device_blocks, a.pages, a.rows, a.plain_mib = 4, 64, 32, 16, 32, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stream = torch.cuda.Stream() if device == "cuda" else None
    layout = KVLayout(num_layers=a.layers, page_size=a.page_size, row_bytes=a.row_bytes)
    g = torch.Generator().manual_seed(0)
    rows_dev = a.device_blocks * a.page_size
    if a.separate_layers:
        dev_layers = [torch.randint(0, 256, (rows_dev, a.row_bytes), dtype=torch.uint8,
                                    generator=g).to(device) for _ in range(a.layers)]
    else:  # one [L, rows, row_bytes] allocation, as the worker runtime allocates its device pool
        dev_layers = list(torch.randint(0, 256, (a.layers, rows_dev, a.row_bytes), dtype=torch.uint8,
                                        generator=g).to(device).unbind(0))
    results: dict[str, dict] = {}
    with HostPool.create("bench", layout, a.host_blocks) as pool:
        # copy-engine limit: one large copy between a pinned host buffer and device memory
        n = a.plain_mib << 20
        host = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        ctx = torch.cuda.stream(stream) if stream is not None else None

        def plain(dst, src):
            def run():
                if ctx is not None:
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src)
            return run

        results["plain H2D (limit)"] = _measure(plain(dev, host), n, device, stream, a.iters)
        results["plain D2H (limit)"] = _measure(plain(host, dev), n, device, stream, a.iters)
        pool_bytes0 = pool.layer(0).numel()
        m = min(n, pool_bytes0)
        flat0 = pool.layer(0).view(-1)[:m]
        results["pool layer H2D (1 copy)"] = _measure(plain(dev[:m], flat0), m, device, stream, a.iters)
        pages = min(a.pages, a.device_blocks, a.host_blocks)
        pairs = [(i, (i * 7) % a.host_blocks) for i in range(pages)]
        page_bytes = pages * layout.block_bytes
        results[f"spill {pages} x spill_page"] = _measure(
            lambda: [copies.spill_page(dev_layers, pool, d, h, stream) for d, h in pairs],
            page_bytes, device, stream, a.iters)
        results[f"restore {pages} x restore_page"] = _measure(
            lambda: [copies.restore_page(dev_layers, pool, d, h, stream) for d, h in pairs],
            page_bytes, device, stream, a.iters)
        page_modes = [("memcpy", False), ("uva", True)] if pool.device_layer(0) is not None \
            else [("", False)]
        for label, uva in page_modes:
            tag = f" ({label})" if label else ""
            results[f"spill_pages {pages}{tag}"] = _measure(
                lambda: copies.spill_pages(dev_layers, pool, pairs, stream, use_uva=uva),
                page_bytes, device, stream, a.iters)
            results[f"restore_pages {pages}{tag}"] = _measure(
                lambda: copies.restore_pages(dev_layers, pool, pairs, stream, use_uva=uva),
                page_bytes, device, stream, a.iters)
        src = torch.randperm(rows_dev, generator=g)[: a.rows]
        dst = torch.randperm(pool.rows, generator=g)[: a.rows]
        row_bytes = a.rows * a.row_bytes * a.layers
        modes = [("uva", True), ("memcpy", False)] if pool.device_layer(0) is not None else [("", None)]
        for label, uva in modes:
            tag = f" ({label})" if label else ""
            results[f"backup {a.rows} rows{tag}"] = _measure(
                lambda: copies.backup_rows(dev_layers, pool, src, dst, stream, use_uva=uva),
                row_bytes, device, stream, a.iters)
            results[f"fill {a.rows} rows{tag}"] = _measure(
                lambda: copies.fill_rows(dev_layers, pool, dst, src, stream, use_uva=uva),
                row_bytes, device, stream, a.iters)
        registered = pool.registered
    limit = {"H2D": results["plain H2D (limit)"]["gbps"], "D2H": results["plain D2H (limit)"]["gbps"]}
    def direction(k: str) -> str:
        return "D2H" if k.startswith(("spill", "backup", "plain D2H")) else "H2D"

    print(f"device={device} layers={a.layers} row_bytes={a.row_bytes} page={a.page_size} "
          f"registered={registered} stacked_device_layers={not a.separate_layers}")
    print(f"{'op':<32}{'dir':>5}{'MiB':>10}{'ms':>10}{'GB/s':>9}{'% limit':>9}")
    for k, r in results.items():
        d = direction(k)
        r["dir"], r["pct_of_limit"] = d, 100 * r["gbps"] / limit[d]
        print(f"{k:<32}{d:>5}{r['bytes'] / 2**20:>10.1f}{r['ms']:>10.3f}{r['gbps']:>9.2f}"
              f"{r['pct_of_limit']:>8.0f}%")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
            "args": vars(a), "registered": registered, "torch": torch.__version__}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
