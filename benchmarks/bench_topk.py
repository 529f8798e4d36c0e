"""Benchmark (not a test): the fast step's top-k per indexer layer, ``select_topk`` (one int64 key
per position, an int64 top-k over the row) against ``select_topk_fast`` (a float top-k for the
k-th value, the tie rule among the keys equal to it, int64 keys for the k candidates only;
``hisparse_ray/fastpath/topk.py``) and, on CUDA with triton, the Triton kernel the fast step runs
(``hisparse_ray/kernels/topk_triton.py``: radix select + one compaction pass, the set in position
order, each row scanned to its length only) twice: with its auto splits (the column ``triton``,
the chunks per row in ``splits``) and with one program per row (``splits=1``, the column
``s=1``), same process, same scores, outputs checked equal (as sets in position order for the
kernel).

Scores as the indexer makes them (``--ties``): head-weighted relu sums where a fraction of the
keys scores exactly 0.0 (every head rejected them; the k-th place then falls inside that tie
whenever fewer than k keys score above 0), the rest positive; each row masked (-inf) past its
length (``--fill`` of the context). k = 2048 (DeepSeek-V3.2).

One command:  python benchmarks/bench_topk.py            (CUDA when visible, else CPU)
              python benchmarks/bench_topk.py --smoke    (small shapes, any device)
Prints a table (ms per layer call, the ratio, bytes the int64 path writes) and writes JSON
(default benchmarks/results/topk.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hisparse_ray.fastpath.topk import in_position_order, select_topk_fast
from hisparse_ray.model.indexer import select_topk


def triton_kernel(device: str):
    """``kernels.topk_triton`` on CUDA where triton imports, else None (the column is skipped)."""
    if device != "cuda":
        return None
    try:
        from hisparse_ray.kernels import topk_triton
    except ImportError:
        return None
    return topk_triton


def scores(B: int, N: int, zeros: float, fill: float, device: str,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, N] fp32, -inf past each row's length; lengths [B] int32)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(B, N, generator=g) + 1e-3
    s = torch.where(torch.rand(B, N, generator=g) < zeros, 0.0, s)
    lengths = ((torch.rand(B, generator=g) * (1 - fill) + fill) * N).long()
    s = s.masked_fill(torch.arange(N)[None] >= lengths[:, None], float("-inf"))
    return s.to(device), lengths.to(device=device, dtype=torch.int32)


def timed(fn, repeats: int, device: str) -> float:
    """Seconds of one call after a warm-up: the median of CUDA-event times on CUDA; the minimum
    of wall times on the CPU (a shared CPU's other load only ever adds time)."""
    fn()
    ts = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) if device == "cuda" else min(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ties", type=float, default=0.9, help="fraction of keys scoring exactly 0")
    ap.add_argument("--fill", type=float, default=0.9, help="rows are this full at least")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/topk.json")
    a = ap.parse_args()
    shapes = [(1, 4096), (8, 8192)] if a.smoke else \
        [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 32768), (64, 131072)]
    if a.device == "cpu" and not a.smoke:
        shapes = [s for s in shapes if s[0] * s[1] <= 8 * 131072] + [(64, 32768)]
    rows = []
    print(f"device {a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else platform.processor() or 'cpu'}), "
          f"torch {torch.__version__}, k {a.k}, {a.ties:.0%} tied zeros, threads {torch.get_num_threads()}")
    kern = triton_kernel(a.device)
    print(f"{'batch':>5} {'context':>8} {'select_topk ms':>15} {'fast ms':>9} {'ratio':>6} "
          f"{'triton ms':>10} {'splits':>6} {'s=1 ms':>7} {'vs s=1':>7} {'vs fast':>8} "
          f"{'int64 keys MB':>13}")
    for B, N in shapes:
        s, lengths = scores(B, N, a.ties, a.fill, a.device)
        want, got = select_topk(s, a.k), select_topk_fast(s, a.k)
        if not torch.equal(want, got):
            raise AssertionError(f"outputs differ at batch {B}, context {N}")
        t_ref = timed(lambda: select_topk(s, a.k), a.repeats, a.device)
        t_fast = timed(lambda: select_topk_fast(s, a.k), a.repeats, a.device)
        t_tri = t_one = splits = None
        if kern is not None:
            out = torch.empty(B, a.k, dtype=torch.int32, device=a.device)
            splits = kern.auto_splits(B, N, s.device)
            for sp in (None, 1):
                kern.select_positions(s, a.k, lengths=lengths, out=out, splits=sp)
                if not torch.equal(out.long(), in_position_order(want)):
                    raise AssertionError(f"the Triton kernel (splits={sp}) differs at batch {B}, "
                                         f"context {N}")
            t_tri = timed(lambda: kern.select_positions(s, a.k, lengths=lengths, out=out),
                          a.repeats, a.device)
            t_one = timed(lambda: kern.select_positions(s, a.k, lengths=lengths, out=out,
                                                        splits=1), a.repeats, a.device)
        row = dict(batch=B, context=N, k=a.k, ties=a.ties, device=a.device,
                   select_topk_ms=t_ref * 1e3, fast_ms=t_fast * 1e3, ratio=t_ref / t_fast,
                   triton_ms=None if t_tri is None else t_tri * 1e3, triton_splits=splits,
                   triton_one_ms=None if t_one is None else t_one * 1e3,
                   triton_vs_one=None if t_tri is None else t_one / t_tri,
                   triton_vs_fast=None if t_tri is None else t_fast / t_tri,
                   int64_key_mb=B * N * 8 / 1e6)
        rows.append(row)
        tri, one, vs_one, vs, sp = (["-"] * 5 if t_tri is None else
                                    [f"{row['triton_ms']:.3f}", f"{row['triton_one_ms']:.3f}",
                                     f"{row['triton_vs_one']:.2f}", f"{row['triton_vs_fast']:.2f}",
                                     str(splits)])
        print(f"{B:>5} {N:>8} {row['select_topk_ms']:>15.3f} {row['fast_ms']:>9.3f} "
              f"{row['ratio']:>6.2f} {tri:>10} {sp:>6} {one:>7} {vs_one:>7} {vs:>8} "
              f"{row['int64_key_mb']:>13.1f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
