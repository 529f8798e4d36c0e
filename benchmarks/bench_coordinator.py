"""The coordinator's host work per decode step (``take_command`` + ``apply_report``) against the
number of requests and their context: what the step loop spends before every GPU step.

Not a test. Drives a pure :class:`~hisparse_ray.core.Coordinator` as its ranks would (every
transfer acked completed, every row sampled), with host-tier requests of ``--contexts`` tokens
(pages of 64), then times steady decode steps. The baseline, same process: every request's page
table marked dirty before each step, which is what every step cost before page-table diffs were
tracked per request (a scan of every page of every request: O(requests x pages)).

    python benchmarks/bench_coordinator.py [--requests 8 32 64] [--contexts 32768 131072]

Writes ``coordinator.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from hisparse_ray.core import Coordinator, CoordinatorConfig
from hisparse_ray.types import StepReport

PAGE = 64


def _setup(n: int, ctx: int) -> tuple[Coordinator, dict]:
    pages = ctx // PAGE + 16
    # the first request lands resident (its prompt's pages), the others on the host tier (a hot
    # buffer each); the first converts to the host tier when it needs a page the pool lacks
    c = Coordinator(CoordinatorConfig(num_device_blocks=n * 66 + pages,
                                      num_host_blocks=2 * n * pages, page_size=PAGE,
                                      device_buffer_size=4096, max_batch=n))
    for i in range(n):
        a = c.admit(f"r{i}", list(range(i * ctx, (i + 1) * ctx)), 900)
        if a is not None:
            c.apply_landed(a.request_id)
    names: dict = {}
    for _ in range(400):  # until every request runs (resident ones convert to the host tier)
        if len(_step(c, names, False)) == n:
            break
    return c, names


def _step(c: Coordinator, names: dict, full_scan: bool) -> tuple:
    if full_scan:
        for req in c._requests.values():
            req.mark_table()
    cmd = c.take_command()
    for d in cmd.handles:
        names[d.handle] = d.request_id
    ids = tuple(t.transfer_id for t in cmd.transfers) + tuple(b.transfer_id for b in cmd.backups)
    c.apply_report(StepReport(cmd.step, 0, completed=ids,
                              sampled=tuple((names[r.handle], 1) for r in cmd.batch)))
    for a in c.poll_waiting():
        c.apply_landed(a.request_id)
    return cmd.batch


def _time(c: Coordinator, names: dict, full_scan: bool, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        _step(c, names, full_scan)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    head = ("requests", 8), ("context", 8), ("rows", 5), ("ms/step", 8), ("full scan", 10), ("ratio", 6)
    print(" ".join(f"{name:>{w}}" for name, w in head))
    for ctx in args.contexts:
        for n in args.requests:
            c, names = _setup(n, ctx)
            rows_now = len(_step(c, names, False))
            new = min(_time(c, names, False, args.steps) for _ in range(3))
            old = min(_time(c, names, True, args.steps) for _ in range(3))
            rows.append(dict(requests=n, context=ctx, rows=rows_now, ms_per_step=new,
                             ms_per_step_full_scan=old))
            print(f"{n:>8} {ctx:>8} {rows_now:>5} {new:>8.3f} {old:>10.3f} {old / new:>6.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "coordinator.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
