"""Benchmark (not a test): the per-step hot-buffer hit/miss count, batched (``HiSparseRuntime.
hot_counts``: one GPU -> CPU read per step) against its per-row definition
(``runtime.hot_counts_reference``: two reads per anchor layer and batch row), same process, same
tensors. It runs once per decode step for the metrics, after the forward.

Shapes: DeepSeek-V3.2-like (top-k 2048, hot buffer H, every one of 61 layers its own indexer
anchor) and GLM-5-like (fewer anchors: layers share an anchor's top-k).

One command:  python benchmarks/bench_hot_counts.py   (--smoke: small shapes, CPU is fine)
Prints a table and writes JSON (default benchmarks/results/hot_counts.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hisparse_ray.rank.runtime import HiSparseRuntime, hot_counts_reference


def case(B: int, K: int, H: int, anchors: int, device: str, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    rows_max = 64 * H
    step = SimpleNamespace(
        slot_rows=torch.randint(0, rows_max, (B, H + 1), generator=g, dtype=torch.int32).to(device),
        seq_lens=torch.full((B,), 8 * H, dtype=torch.int32).to(device))
    rows = {a: torch.randint(-1, rows_max, (B, K), generator=g, dtype=torch.int64).to(device)
            for a in range(anchors)}
    plan = {a: torch.randint(-1, 4, (B, K, 2), generator=g, dtype=torch.int32).to(device)
            for a in range(anchors)}
    return SimpleNamespace(_step=step, _anchor_rows=rows, _anchor_plan=plan, H=H,
                           device_kv=[torch.empty(rows_max, 1, device=device)])


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/hot_counts.json")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(4, 64, 32, 4), (16, 64, 32, 4)] if a.smoke else \
        [(4, 2048, 4096, 61), (32, 2048, 4096, 61), (64, 2048, 4096, 61), (64, 2048, 4096, 16)]
    rows = []
    print(f"hot_counts on {device}: per-row definition vs batched, same tensors, median of "
          f"{a.repeats}")
    print(f"{'batch':>5} {'top-k':>6} {'H':>5} {'anchors':>7} {'per-row ms':>11} {'batched ms':>11} "
          f"{'batched/per-row':>16}")
    for B, K, H, anchors in shapes:
        c = case(B, K, H, anchors, device)
        want = hot_counts_reference(c._step, c._anchor_rows, c._anchor_plan, c.H)
        assert HiSparseRuntime.hot_counts(c) == want  # same counts, or the timing means nothing
        old = timed(lambda: hot_counts_reference(c._step, c._anchor_rows, c._anchor_plan, c.H),
                    a.repeats)
        new = timed(lambda: HiSparseRuntime.hot_counts(c), a.repeats)
        rows.append({"batch": B, "topk": K, "H": H, "anchors": anchors, "per_row_ms": old * 1e3,
                     "batched_ms": new * 1e3, "ratio": new / old})
        print(f"{B:>5} {K:>6} {H:>5} {anchors:>7} {old * 1e3:>11.2f} {new * 1e3:>11.2f} "
              f"{new / old:>15.5f}x")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "machine": platform.node(), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
