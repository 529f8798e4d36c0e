"""The Triton top-k's split-row shape, chunks per row swept, replayed from a CUDA graph as the
fast step runs it (not a test; CUDA only).

For each (batch, context) and each ``splits`` (1 = one program per row, then powers of two,
then ``auto``: :func:`~hisparse_ray.kernels.topk_triton.auto_splits`), one CUDA graph of
``--calls`` back-to-back ``select_positions`` calls (k 2048, int32 out, per-row lengths) is
replayed; the table gives microseconds per call and the ratio to ``splits=1``. Every variant's
output is checked equal to ``splits=1``'s first. Scores: standard normal (the real-dims step's
indexer logits have no ties) or ``--ties`` of them set to 0.0.

    python benchmarks/bench_topk_splits.py --out results/topk_splits.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_resolver import time_graph  # noqa: E402


def graph_us(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph (median of
    ``repeats`` replays; ``bench_resolver.time_graph`` does the capture and timing)."""
    fn()  # compile outside the capture

    def many() -> None:
        for _ in range(calls):
            fn()

    return time_graph(many, repeats) * 1e3 / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--ties", type=float, default=0.0)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/topk_splits.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_topk_splits: needs CUDA (the kernel runs interpreted on CPU only in tests)")
        return 0
    from hisparse_ray.kernels import topk_triton as kern

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, k {a.k}, {a.ties:.0%} tied zeros, "
          f"{a.calls} calls a graph; us per call (ratio to splits=1)")
    rows = []
    for N in a.contexts:
        for B in a.batches:
            g = torch.Generator(device=dev).manual_seed(B * 7 + N)
            s = torch.randn(B, N, device=dev, generator=g)
            if a.ties:
                s[torch.rand(B, N, device=dev, generator=g) < a.ties] = 0.0
            lengths = torch.full((B,), N, dtype=torch.int32, device=dev)
            lengths[B // 2:] = N - N // 8  # rows of two lengths, as a mixed batch has
            out = torch.empty(B, a.k, dtype=torch.int32, device=dev)
            kern.select_positions(s, a.k, lengths=lengths, out=out, splits=1)
            want = out.clone()
            auto = kern.auto_splits(B, N, dev)
            cells = []
            for sp in [*a.splits, None]:
                kern.select_positions(s, a.k, lengths=lengths, out=out, splits=sp)
                if not torch.equal(out, want):
                    raise AssertionError(f"splits={sp} differs from splits=1 at batch {B}, "
                                         f"context {N}")
                us = graph_us(lambda: kern.select_positions(s, a.k, lengths=lengths, out=out,
                                                            splits=sp), a.calls, a.repeats)
                chunks = -(-N // kern.chunk_size(N, auto if sp is None else sp))
                rows.append(dict(batch=B, context=N, splits="auto" if sp is None else sp,
                                 chunks=chunks, us=us))
                cells.append((("auto" if sp is None else str(sp)) + f"({chunks})", us))
            base = cells[0][1]
            best = min(cells[:-1], key=lambda c: c[1])
            print(f"B {B:>3} N {N:>6}: " + "  ".join(f"{n} {u:.1f} ({base / u:.2f}x)"
                                                      for n, u in cells)
                  + f"   best {best[0]}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), k=a.k, ties=a.ties,
                                   calls=a.calls, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
