"""KV landing bandwidth: NIXL WRITE from one actor's region into another actor's region, 64..256 MiB,
as one segment and as page-sized segments landing in shuffled pages, against a plain local copy of the same bytes in the
same run.

One command:  python benchmarks/bench_landing.py               (CPU -> CPU; add --smoke to check)
On a GPU node: --src cuda --dst cpu   (device -> remote pinned host, the path UCX emulates)
               --src cuda --dst cuda  (device -> remote device, CUDA IPC)
Prints a table and writes JSON (default benchmarks/results/landing.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import ray
import torch

from hisparse_ray.transfer import NixlTransferEngine, WriteSegment, wait

MIB = 1 << 20


def _alloc(nbytes: int, device: str, fill: bool) -> torch.Tensor:
    if device == "cuda":
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    if fill:
        g = torch.Generator().manual_seed(1)
        t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    else:
        t.zero_()
    return t


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Side:
    """One actor: a NIXL engine and one registered region of ``nbytes``."""

    def __init__(self, name: str, nbytes: int, device: str, fill: bool):
        self.engine = NixlTransferEngine(name)
        self.device = device
        self.tensor = _alloc(nbytes, device, fill)
        self.desc = self.engine.register("kv", self.tensor)

    def metadata(self):
        return self.engine.agent_metadata(), self.desc

    def add_peer(self, md: bytes) -> str:
        return self.engine.add_peer(md)

    def checksum(self, nbytes: int) -> int:
        return int(self.tensor[:nbytes].sum(dtype=torch.int64))

    def write(self, remote, nbytes: int, segment: int, iters: int) -> list[float]:
        """Seconds from post to DONE of a WRITE of ``nbytes`` split in ``segment``-byte pages,
        landing in shuffled remote pages (scattered host blocks: nothing to coalesce)."""
        seg = segment or nbytes
        offsets = list(range(0, nbytes, seg))
        remote_offsets = offsets[:]
        random.Random(0).shuffle(remote_offsets)
        segs = [WriteSegment("kv", off, seg, remote, roff)
                for off, roff in zip(offsets, remote_offsets)]
        out = []
        for _ in range(iters + 1):  # first one warms the connection / registration caches
            _sync(self.device)
            t0 = time.perf_counter()
            xfer = self.engine.post_write(segs, b"landed")
            wait(self.engine, xfer, timeout_s=120, poll_sleep_s=0.0)
            out.append(time.perf_counter() - t0)
            self.engine.release(xfer)
        return out[1:]

    def local_copy(self, nbytes: int, dst_device: str, iters: int) -> list[float]:
        """Seconds of a plain local copy of ``nbytes`` from this region to a ``dst_device`` buffer."""
        dst = _alloc(nbytes, dst_device, False)
        src = self.tensor[:nbytes]
        out = []
        for _ in range(iters + 1):
            _sync(self.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(self.device if self.device == "cuda" else dst_device)
            out.append(time.perf_counter() - t0)
        return out[1:]


def _row(path: str, nbytes: int, segment: int, secs: list[float]) -> dict:
    best, med = min(secs), statistics.median(secs)
    return {"path": path, "mib": nbytes // MIB, "segment_kib": segment // 1024 if segment else 0,
            "best_ms": best * 1e3, "median_ms": med * 1e3, "best_gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / med / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--segment-kib", type=int, nargs="+", default=[0, 64],
                    help="page size (must divide the sizes); 0 = the whole size as one segment")
    ap.add_argument("--src", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dst", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="small sizes, few iterations")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "landing.json"))
    a = ap.parse_args()
    if a.smoke:
        a.sizes_mib, a.iters = [8, 16], 2
    total = max(a.sizes_mib) * MIB
    gpus = 1 if "cuda" in (a.src, a.dst) else 0
    ray.init(address="local", num_cpus=4, num_gpus=torch.cuda.device_count() if gpus else 0,
             include_dashboard=False, log_to_driver=False)
    try:
        opts = {"num_cpus": 0, "num_gpus": 0.5 if gpus else 0}
        SideA = ray.remote(**opts)(Side)
        src = SideA.remote("landing-src", total, a.src, True)
        dst = SideA.remote("landing-dst", total, a.dst, False)
        (src_md, _), (dst_md, dst_desc) = ray.get([src.metadata.remote(), dst.metadata.remote()])
        ray.get([src.add_peer.remote(dst_md), dst.add_peer.remote(src_md)])
        rows = []
        for mib in a.sizes_mib:
            n = mib * MIB
            for seg_kib in a.segment_kib:
                secs = ray.get(src.write.remote(dst_desc, n, seg_kib * 1024, a.iters))
                if ray.get(dst.checksum.remote(n)) != ray.get(src.checksum.remote(n)):  # order-free
                    raise SystemExit(f"landed bytes differ ({mib} MiB, segment {seg_kib} KiB)")
                rows.append(_row(f"nixl {a.src}->{a.dst}", n, seg_kib * 1024, secs))
            rows.append(_row(f"local copy {a.src}->{a.dst}", n, 0,
                             ray.get(src.local_copy.remote(n, a.dst, a.iters))))
    finally:
        ray.shutdown()
    print(f"{'path':<24}{'MiB':>6}{'seg KiB':>9}{'best ms':>10}{'med ms':>10}{'best GB/s':>11}"
          f"{'med GB/s':>10}")
    for r in rows:
        seg = str(r["segment_kib"]) if r["segment_kib"] else "whole"
        print(f"{r['path']:<24}{r['mib']:>6}{seg:>9}{r['best_ms']:>10.1f}{r['median_ms']:>10.1f}"
              f"{r['best_gbps']:>11.2f}{r['median_gbps']:>10.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"bench": "landing", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                   "load_avg": os.getloadavg(), "args": vars(a), "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
