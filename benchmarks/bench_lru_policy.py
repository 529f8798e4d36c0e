"""Benchmark (not a test): which order should a step's hits take at the hot buffer's LRU tail?
(issue #15 item 13). Hit rates of three policies, replayed by the trace tool
(``hisparse_ray.rank.trace.replay_policies``; its ``topk`` policy is checked equal to the resolver's own
replay, ``replay_hit_rate``, on every trace):

  topk     hits in top-k order (the resolver contract: the best-scoring hit is the oldest hit)
  old      hits in their previous LRU order (SGLang's kernel)
  reverse  hits in reverse top-k order (the best-scoring hit is the most recent)

Everything else is the resolver contract: hits are marked first, each miss takes the least
recently used non-hit slot, the LRU becomes untouched slots (old order), newly filled slots
(top-k order), then the hits. Note what follows from it: with H == K every non-hit slot is
evicted every step (misses = K - hits = H - hits), so the hits' order cannot matter; it can only
decide which of the slots that dropped out of the top-k survive when H > K.

Synthetic traces (one request, one layer, ``--steps`` decode steps from a context of C tokens, top-k
K = 2048 ordered by score, best first, the newest position never included), each generator's knob
calibrated by bisection on a short run to a target consecutive-step overlap |T_t & T_t+1| / K of
35 % and 50 % (DeepSeek-V3.2's published range for layers 20-60):

  uniform  persistence independent of rank: each selected position stays selected with
           probability q (the knob; the overlap is q) whatever its rank; each replacement is,
           with probability 0.5, a position that dropped out 1-16 steps before (not in this
           step), uniformly among those, else a uniformly random unselected position; the
           top-k order is a fresh random permutation.
  ranked   persistence correlated with rank: latent score s_i(t) = mu_i + x_i(t), static
           importance mu_i ~ N(0, 1), x_i an AR(1) process with coefficient rho (the knob) and
           unit stationary variance; the top-k is the K best scores in score order, so the best
           ranks sit far above the cut and persist, while positions near the cut drop out and
           come back.
  windows  drifting windows: 16 windows of half-width K/4 positions, triangular bumps of height
           U(0.5, 1.5), whose centers random-walk v positions per step (the knob, std of the
           step), plus 4 sink positions and the last 128 positions (local attention) always
           favoured, plus N(0, 0.3^2) noise per position and step; top-k by score.

Also the tiny built-in models' real traces (top-k 8, random weights: overlap about k/n, the worst
case), recorded through the in-process engine.

Shapes: K = 2048, H in {2048, 3072, 4096, 6144}, C in {32K, 64K, 128K} (``--quick``: 32K only, one
seed, fewer steps). Per cell: mean hit rate over ``--seeds`` seeds per policy, and each policy's
difference to ``topk`` in percentage points (paired per seed: mean, min, max).

One command:  python benchmarks/bench_lru_policy.py  [--quick] [--out PATH]
Prints a table and writes JSON (default benchmarks/results/lru_policy.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from hisparse_ray.rank.trace import POLICIES, SCHEMA, replay_hit_rate, replay_policies

K = 2048
Trace = list[list[int]]  # top-k positions per step, best score first


# -- generators --------------------------------------------------------------------------------------
def gen_uniform(C: int, S: int, q: float, rng: np.random.Generator,
                back: float = 0.5, window: int = 16) -> Trace:
    cur = rng.choice(C - 1, K, replace=False)
    dropped: dict[int, int] = {}  # position -> step it dropped out
    out: Trace = []
    for t in range(S):
        n = C + t
        if t:
            kept = cur[rng.random(K) < q]
            chosen = set(kept.tolist())
            for p in cur.tolist():
                if p not in chosen:
                    dropped[p] = t
            for p in [p for p, s in dropped.items() if t - s > window]:
                del dropped[p]
            pool = [p for p, s in dropped.items() if s < t]  # not the ones dropping now
            n_back = min(int(rng.binomial(K - len(kept), back)), len(pool))
            for p in (rng.choice(pool, n_back, replace=False).tolist() if n_back else []):
                chosen.add(p)
                del dropped[p]
            while len(chosen) < K:
                chosen.add(int(rng.integers(0, n - 1)))
            cur = np.fromiter(chosen, dtype=np.int64, count=K)
        cur = cur[rng.permutation(K)]
        out.append(cur.tolist())
    return out


def _top(score: np.ndarray) -> list[int]:
    top = np.argpartition(-score, K - 1)[:K]
    return top[np.argsort(-score[top], kind="stable")].tolist()


def gen_ranked(C: int, S: int, rho: float, rng: np.random.Generator) -> Trace:
    mu = rng.standard_normal(C + S)
    x = rng.standard_normal(C + S)
    out: Trace = []
    for t in range(S):
        n = C + t
        x[:n] = rho * x[:n] + np.sqrt(1.0 - rho * rho) * rng.standard_normal(n)
        out.append(_top(mu[: n - 1] + x[: n - 1]))
    return out


def gen_windows(C: int, S: int, v: float, rng: np.random.Generator, m: int = 16,
                sigma: float = 0.3) -> Trace:
    half = K // 4
    centers = rng.uniform(0, C, m)
    height = rng.uniform(0.5, 1.5, m)
    out: Trace = []
    for t in range(S):
        n = C + t
        centers = np.clip(centers + rng.normal(0.0, v, m), 0, n - 2)
        score = np.full(n - 1, -10.0)
        for c, h in zip(centers, height):
            lo, hi = int(max(0, c - half)), int(min(n - 1, c + half + 1))
            idx = np.arange(lo, hi)
            score[lo:hi] = np.maximum(score[lo:hi], h * (1.0 - np.abs(idx - c) / half))
        score[:4] = 5.0
        score[-128:] = np.maximum(score[-128:], 1.0)
        out.append(_top(score + sigma * rng.standard_normal(n - 1)))
    return out


GENERATORS: dict[str, tuple[Callable[..., Trace], float, float]] = {
    # name: (generator, knob low, knob high); overlap rises with q and rho, falls with v
    "uniform": (gen_uniform, 0.0, 1.0),
    "ranked": (gen_ranked, 0.0, 0.999),
    "windows": (gen_windows, 0.0, 2000.0),
}


def overlap(trace: Trace) -> float:
    return statistics.fmean(len(set(a) & set(b)) / K for a, b in zip(trace, trace[1:]))


def calibrate(name: str, C: int, target: float, seed: int = 1234) -> float:
    """Knob value whose short trace has ``target`` mean overlap (bisection, 14 rounds)."""
    gen, lo, hi = GENERATORS[name]
    if name == "uniform":
        return target  # overlap = q by construction
    rising = name != "windows"
    for _ in range(14):
        mid = (lo + hi) / 2
        o = overlap(gen(C, 24, mid, np.random.default_rng(seed)))
        if (o < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def table(trace: Trace, C: int, rid: str = "r0") -> pa.Table:
    return pa.table({"step": list(range(len(trace))), "layer": [0] * len(trace),
                     "request_id": [rid] * len(trace),
                     "seq_len": [C + t for t in range(len(trace))], "positions": trace},
                    schema=SCHEMA)


# -- the tiny model's real traces --------------------------------------------------------------------
def tiny_traces(steps: int) -> dict[str, pa.Table]:
    import torch

    from hisparse_ray.engine import Engine, EngineConfig
    from hisparse_ray.model.model import build_tiny_model
    from hisparse_ray.rank.trace import TopkTraceRecorder

    out = {}
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        model = build_tiny_model(0, kind)
        g = torch.Generator().manual_seed(3)
        rec = TopkTraceRecorder()
        with Engine(model, EngineConfig(num_device_blocks=12)) as eng:
            eng.worker.trace = rec
            for i, n in enumerate((160, 240, 320)):
                eng.add_request(f"r{i}", torch.randint(0, model.cfg.vocab_size, (n,), generator=g)
                                .tolist(), steps)
            eng.run()
        out[kind] = rec.table()
    return out


def table_overlap(t: pa.Table) -> float:
    by: dict[tuple, list] = {}
    for r in sorted(t.to_pylist(), key=lambda r: r["step"]):
        by.setdefault((r["request_id"], r["layer"]), []).append(r["positions"])
    vals = [len(set(a) & set(b)) / len(a) for rows in by.values() for a, b in zip(rows, rows[1:])]
    return statistics.fmean(vals)


# -- main ----------------------------------------------------------------------------------------------
def cell(tables: list[pa.Table], H: int, check: bool) -> dict:
    """Hit rates per policy per seed; ``check``: the model's topk equals the resolver's replay."""
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    for i, t in enumerate(tables):
        got = replay_policies(t, H)
        if check and i == 0:
            ref = replay_hit_rate(t, H)
            assert got["topk"] == ref, (got["topk"], ref)
        for p in POLICIES:
            rates[p].append(100.0 * got[p].rate)
    row = {"H": H, "hit_rate_pct": {p: statistics.fmean(v) for p, v in rates.items()},
           "per_seed_pct": rates}
    for p in POLICIES[1:]:
        d = [a - b for a, b in zip(rates[p], rates["topk"])]
        row[f"{p}_minus_topk_pp"] = {"mean": statistics.fmean(d), "min": min(d), "max": max(d)}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the resolver cross-check (the reference resolver is slow at K 2048)")
    ap.add_argument("--out", default="benchmarks/results/lru_policy.json")
    a = ap.parse_args()
    steps = a.steps or (48 if a.quick else 128)
    seeds = a.seeds or (1 if a.quick else 3)
    contexts = [32768] if a.quick else [32768, 65536, 131072]
    buffers = [2048, 3072, 4096, 6144]
    t0 = time.perf_counter()
    results: dict = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                     "python": platform.python_version(), "K": K, "steps": steps,
                     "seeds": seeds, "synthetic": [], "tiny_model": []}
    head = (f"{'trace':>8} {'C':>6} {'target':>6} {'overlap':>7} {'H':>5} "
            + " ".join(f"{p:>7}" for p in POLICIES) + "   old-topk pp (min..max)   rev-topk pp (min..max)")
    print(head)
    for name in GENERATORS:
        for C in contexts:
            for target in (0.35, 0.50):
                knob = calibrate(name, C, target)
                gen = GENERATORS[name][0]
                traces = [gen(C, steps, knob, np.random.default_rng(100 + s)) for s in range(seeds)]
                tables = [table(tr, C) for tr in traces]
                ov = statistics.fmean(overlap(tr) for tr in traces)
                for H in buffers:
                    row = cell(tables, H, check=not a.no_check)
                    row.update(trace=name, C=C, target_overlap=target, knob=knob,
                               overlap=ov)
                    results["synthetic"].append(row)
                    print_row(name, C, target, ov, row)
    tiny = tiny_traces(steps=24 if a.quick else 48)
    for kind, t in tiny.items():
        ov = table_overlap(t)
        for H in (8, 12, 16, 32):
            row = cell([t], H, check=True)
            row.update(trace=f"tiny {kind}", overlap=ov)
            results["tiny_model"].append(row)
            print_row(kind[:8], 0, 0.0, ov, row)
    results["seconds"] = time.perf_counter() - t0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"{results['seconds']:.0f} s; wrote {out}")
    return 0


def print_row(name: str, C: int, target: float, ov: float, row: dict) -> None:
    rate = row["hit_rate_pct"]
    d_old, d_rev = row["old_minus_topk_pp"], row["reverse_minus_topk_pp"]
    print(f"{name:>8} {C // 1024:>5}K {target:>6.2f} {ov:>7.3f} {row['H']:>5} "
          + " ".join(f"{rate[p]:>7.2f}" for p in POLICIES)
          + f"   {d_old['mean']:+.3f} ({d_old['min']:+.2f}..{d_old['max']:+.2f})"
          + f"   {d_rev['mean']:+.3f} ({d_rev['min']:+.2f}..{d_rev['max']:+.2f})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
