"""The per-step wire's four control-plane stages at TP ``--tp``, warm and on evicted caches, in one
process: the coordinator encodes and writes ONE command (``command send``), each rank reads and
decodes it from the broadcast ring (``command recv``, per rank), a rank encodes and writes its
report (``report send``), the coordinator reads and decodes it (``report recv``). The step codec
(``msgspec``, typed, stateless) against plain pickle (the baseline), both through the Python
rings.

A real decode step runs each stage right after code that evicts the caches (the model's forward on
the ranks, the scheduler on the coordinator); on the H200 that made Python stages 3-5x slower than
warm. "cold" evicts before every timed stage: a 16 MB fill plus 100 small torch ops. Messages are
shaped like a real step's (``--rows`` host-tier rows with a backup each, handles known, hot
buffers unchanged; every 16th step defines a new request; a report with sampled tokens and
per-request hits).

    python benchmarks/bench_wire.py [--steps 300] [--tp 2] [--out benchmarks/results/wire.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hisparse_ray.channel.codec import PickleCodec, StepCodec
from hisparse_ray.channel.ring import ShmRing
from hisparse_ray.types import (
    Backup, BatchRow, Rank, RequestHandle, RequestId, StepCommand, StepReport,
)

STAGES = ("command send", "command recv", "report send", "report recv")


def command(step: int, rows: int) -> StepCommand:
    new = step % 16 == 0
    batch = tuple(BatchRow(i, 150 + step, 1000 + i, tuple(range(i, i + 4)) if new and i == 0
                           else None) for i in range(rows))
    backups = tuple(Backup(step * rows + i, i, 150 + step, 30 + i, (150 + step) % 8)
                    for i in range(rows))
    handles = (RequestHandle(0, RequestId(f"req-{step}")),) if new else ()
    return StepCommand(step, batch, backups=backups, handles=handles, host_seq=step - 1)


def report(step: int, rows: int) -> StepReport:
    return StepReport(step, Rank(0), enqueued=tuple(range(step * rows, step * rows + rows)),
                      completed=tuple(range(step * rows - rows, step * rows)),
                      sampled=tuple((f"req-{i}", 7 + i) for i in range(rows)), hot_hits=10,
                      hot_misses=2, hits_by_request=tuple((f"req-{i}", 3, 1) for i in range(rows)),
                      published=step)


def run(codec, cold: bool, steps: int, tp: int, rows: int) -> dict[str, float]:
    """Median microseconds per stage (``command recv``: each rank's, pooled)."""
    scratch, xs = torch.empty(4 << 20), torch.ones(64)

    def evict() -> None:
        nonlocal xs
        scratch.fill_(1.0)
        for _ in range(100):
            xs = xs * 1.0001 + 1

    cmd_out = ShmRing.create("writer", readers=tp, codec=codec)
    cmd_in = [ShmRing.attach(cmd_out.spec_for(r), codec=codec) for r in range(tp)]
    rep_in = ShmRing.create("reader", codec=codec)
    rep_out = ShmRing.attach(rep_in.spec, codec=codec)
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    pc = time.perf_counter
    try:
        for s in range(1, steps + 1):
            cmd, rep = command(s, rows), report(s, rows)
            plan = [("command send", cmd_out.send, cmd)]
            plan += [("command recv", ring.recv, None) for ring in cmd_in]
            plan += [("report send", rep_out.send, rep), ("report recv", rep_in.recv, None)]
            for stage, fn, arg in plan:
                if cold:
                    evict()
                t0 = pc()
                got = fn(arg) if arg is not None else fn()
                times[stage].append(pc() - t0)
                if arg is None:
                    assert got == (cmd if stage == "command recv" else rep)
    finally:
        for ring in (cmd_out, *cmd_in, rep_in, rep_out):
            ring.close()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tp", type=int, default=2, help="readers of the command broadcast")
    ap.add_argument("--rows", type=int, default=4, help="batch rows (host tier, one backup each)")
    ap.add_argument("--out", default="benchmarks/results/wire.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = {"command bytes": len(StepCodec().dumps(command(1, args.rows))),
             "report bytes": len(StepCodec().dumps(report(1, args.rows)))}
    impls = [("msgspec+py", StepCodec()), ("pickle+py", PickleCodec())]
    rows = {}
    for name, codec in impls:
        for cold in (False, True):
            rows[f"{name} {'cold' if cold else 'warm'}"] = run(codec, cold, args.steps, args.tp,
                                                               args.rows)
    # the step's critical path: one command send, the slower rank's recv, one report each way
    crit = {k: sum(v.values()) for k, v in rows.items()}
    print(f"per-step wire stages at TP {args.tp}, median us ({args.steps} steps, {args.rows} rows; "
          f"cold = caches evicted first; {sizes['command bytes']} B command, "
          f"{sizes['report bytes']} B report):")
    print(f"{'impl (+ring)':<16}" + "".join(f"{s:>14}" for s in STAGES) + f"{'sum':>10}")
    for k, v in rows.items():
        print(f"{k:<16}" + "".join(f"{v[s]:>14.1f}" for s in STAGES) + f"{crit[k]:>10.1f}")
    for c in ("warm", "cold"):
        for name, _ in impls[:-1]:
            print(f"{name} / pickle+py, {c}: {crit[f'{name} {c}'] / crit[f'pickle+py {c}']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps,
        "tp": args.tp, "rows": args.rows, **sizes,
        "median_us": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
