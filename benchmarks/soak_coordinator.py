"""Soak the pure coordinator: 10^6 random protocol operations against the reference worker.

Usage:  python benchmarks/soak_coordinator.py [--ops 1000000] [--seed 0] [--check-every 1]

Random interleavings of admit, poll, landing (and landing failure), take_command, per-rank
out-of-order reports, finish, free, restore and bad input, on small pools (constant pressure:
spills, restores, evictions, stalls). ``check_invariants`` (including "the pools cover every
admission reservation") and the reference worker's content checks run every ``--check-every``
operations. Every ``--ops-per-driver`` operations the driver *settles* (liveness: no more
arrivals, every ack delivered; every open request must finish on its own, no deadlock) and a
fresh coordinator starts. Prints one row per pool configuration and exits 1 if any violation was
seen (the expected count is zero).
"""

from __future__ import annotations

import argparse
import sys
import time

from hisparse_ray.core import CoordinatorConfig
from hisparse_ray.testing.random_driver import RandomDriver

CONFIGS = [  # (device blocks, host blocks, page size, H, tp, max batch)
    (6, 10, 2, 2, 1, 3),
    (8, 16, 4, 3, 2, 4),
    (5, 8, 1, 2, 3, 2),
    (12, 24, 2, 5, 2, 6),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=1)
    ap.add_argument("--ops-per-driver", type=int, default=50_000,
                    help="start a fresh coordinator after this many operations")
    args = ap.parse_args(argv)

    rows = {i: dict(ops=0, steps=0, spills=0, restores=0, backups=0, hits=0, evictions=0,
                    stalls=0, finished=0, settled=0, violations=0) for i in range(len(CONFIGS))}
    first_violations: list[str] = []
    t0 = time.perf_counter()
    done, run = 0, 0
    while done < args.ops:
        ci = run % len(CONFIGS)
        dev, host, ps, h, tp, mb = CONFIGS[ci]
        cfg = CoordinatorConfig(num_device_blocks=dev, num_host_blocks=host, page_size=ps,
                                device_buffer_size=h, tp_size=tp, max_batch=mb)
        d = RandomDriver(cfg, seed=args.seed * 1000 + run)
        n = min(args.ops_per_driver, args.ops - done)
        row = rows[ci]
        for i in range(n):
            try:
                d.random_op()
            except Exception as e:  # noqa: BLE001 - any escape is a violation worth reporting
                bad = [f"op {i}: {type(e).__name__}: {e}"]
            else:
                bad = d.check() if (i + 1) % args.check_every == 0 else []
            if bad:
                row["violations"] += len(bad)
                first_violations.extend(f"config {ci} run {run}: {v}" for v in bad[:3])
                d = RandomDriver(cfg, seed=args.seed * 1000 + run + 10**6 + i)
        try:
            bad = d.settle()
        except Exception as e:  # noqa: BLE001
            bad = [f"settle: {type(e).__name__}: {e}"]
        row["settled"] += not bad
        row["violations"] += len(bad)
        first_violations.extend(f"config {ci} run {run}: {v}" for v in bad[:3])
        c = d.coord.counters
        row["ops"] += n
        for key, attr in (("steps", "steps"), ("spills", "spills"), ("restores", "restores"),
                          ("backups", "backups"), ("hits", "prefix_hit_pages"),
                          ("evictions", "evictions"), ("stalls", "stalls"), ("finished", "finished")):
            row[key] += getattr(c, attr)
        done += n
        run += 1
        print(f"  {done} / {args.ops} operations, violations so far: "
              f"{sum(r['violations'] for r in rows.values())}", file=sys.stderr, flush=True)
    dt = time.perf_counter() - t0

    cols = ["config", "ops", "steps", "spills", "restores", "backups", "hits", "evictions",
            "stalls", "finished", "settled", "violations"]
    print(" | ".join(f"{c:>10}" for c in cols))
    for ci, row in rows.items():
        if row["ops"]:
            name = "d{}h{}p{}H{}tp{}".format(*CONFIGS[ci][:5])
            print(" | ".join(f"{v:>10}" for v in [name] + [row[c] for c in cols[1:]]))
    total = sum(r["violations"] for r in rows.values())
    print(f"{done} operations in {dt:.1f} s ({done / dt:,.0f} ops/s), violations: {total}")
    for v in first_violations[:10]:
        print("  ", v)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
