"""The step channel's four control-plane stages, C hot path (``hisparse_ray.channel._wire``)
against the pure-Python twin, warm and on evicted caches, in one process.

A real decode step runs each stage right after code that evicts the caches (the model's forward on
the ranks, the scheduler on the coordinator); on the H200 that made the Python stages 3-5x slower
than warm. "cold" here evicts before every timed stage: a 16 MB fill plus 100 small torch ops.
Messages are shaped like the actor benchmark's (4 host-tier rows with hot buffers and a backup
each; a report with 4 sampled tokens and per-request hits).

    python benchmarks/bench_wire.py [--steps 300] [--out benchmarks/results/wire.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hisparse_ray.channel.ring import ShmChannel
from hisparse_ray.channel.stepcodec import NATIVE, StepCodec
from hisparse_ray.types import Backup, BatchRow, Rank, RequestId, StepCommand, StepReport

STAGES = ("command send", "command recv", "report send", "report recv")


def command(step: int) -> StepCommand:
    rows = tuple(BatchRow(RequestId(f"req-{i}"), 150 + step, 1000 + i, tuple(range(i, i + 4)))
                 for i in range(4))
    backups = tuple(Backup(step * 4 + i, RequestId(f"req-{i}"), 150 + step, 30 + i,
                           (150 + step) % 8) for i in range(4))
    return StepCommand(step, Rank(0), rows, backups=backups)


def report(step: int) -> StepReport:
    return StepReport(step, Rank(0), enqueued=tuple(range(step * 4, step * 4 + 4)),
                      completed=tuple(range(step * 4 - 4, step * 4)),
                      sampled=tuple((f"req-{i}", 7 + i) for i in range(4)), hot_hits=10,
                      hot_misses=2, hits_by_request=tuple((f"req-{i}", 3, 1) for i in range(4)))


def run(native: bool, cold: bool, steps: int) -> dict[str, float]:
    """Median microseconds per stage."""
    scratch, xs = torch.empty(4 << 20), torch.ones(64)

    def evict() -> None:
        nonlocal xs
        scratch.fill_(1.0)
        for _ in range(100):
            xs = xs * 1.0001 + 1

    chans = []
    for _ in range(2):
        out = ShmChannel.create("sender", codec=StepCodec(native=native))
        inn = ShmChannel.attach(out.spec, codec=StepCodec(native=native))
        if not native:
            out._ring = inn._ring = None
        chans.append((out, inn))
    (cout, cin), (rout, rin) = chans
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    pc = time.perf_counter
    try:
        for s in range(1, steps + 1):
            cmd, rep = command(s), report(s)
            for stage, fn, arg in (("command send", cout.send, cmd), ("command recv", cin.recv, None),
                                   ("report send", rout.send, rep), ("report recv", rin.recv, None)):
                if cold:
                    evict()
                t0 = pc()
                got = fn(arg) if arg is not None else fn()
                times[stage].append(pc() - t0)
                if arg is None:
                    assert got == (cmd if stage == "command recv" else rep)
    finally:
        for out, inn in chans:
            out.close()
            inn.close()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="benchmarks/results/wire.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    impls = ["python"] + (["native"] if NATIVE is not None else [])
    rows = {}
    for impl in impls:
        for cold in (False, True):
            rows[f"{impl} {'cold' if cold else 'warm'}"] = run(impl == "native", cold, args.steps)
    print(f"step channel stages, median us ({args.steps} steps; cold = caches evicted first):")
    print(f"{'impl':<14}" + "".join(f"{s:>14}" for s in STAGES) + f"{'sum':>10}")
    for k, v in rows.items():
        print(f"{k:<14}" + "".join(f"{v[s]:>14.1f}" for s in STAGES) + f"{sum(v.values()):>10.1f}")
    if NATIVE is None:
        print("hisparse_ray.channel._wire is not built: Python only")
    else:
        for c in ("warm", "cold"):
            print(f"C / Python, {c}: {sum(rows[f'native {c}'].values()) / sum(rows[f'python {c}'].values()):.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps,
        "median_us": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
