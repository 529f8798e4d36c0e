"""Per-step control round trip: a StepCommand-sized message from a coordinator actor to every TP
rank actor and their StepReports back, over the shared-memory channel vs plain Ray actor calls,
measured in the same run (target: <= 100 us at TP 2).

One command:  python benchmarks/bench_channel.py            (add --smoke for a quick CPU check)
Prints a table and writes JSON (default benchmarks/results/channel.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import time

import ray

from hisparse_ray.channel import ChannelPair
from hisparse_ray.transfer.codec import WireCodec
from hisparse_ray.types import (
    Backup,
    BatchRow,
    DeviceBlockId,
    HostBlockId,
    PageTransfer,
    Rank,
    RequestId,
    StepCommand,
    StepReport,
    TableDiff,
    TransferId,
    TransferKind,
)


def step_command(step: int, rank: int, batch: int, hot_blocks: int) -> StepCommand:
    """A decode step of ``batch`` host-tier requests with a few table diffs, spills and backups."""
    rows = tuple(BatchRow(RequestId(f"req-{i:05d}"), 40_000 + i, 1000 + i,
                          tuple(DeviceBlockId(i * hot_blocks + j) for j in range(hot_blocks)))
                 for i in range(batch))
    diffs = tuple(TableDiff(RequestId(f"req-{i:05d}"), 625, 9000 + i, -1) for i in range(batch // 4))
    transfers = tuple(PageTransfer(TransferId(step * 100 + i), TransferKind.SPILL,
                                   DeviceBlockId(i), HostBlockId(5000 + i)) for i in range(4))
    backups = tuple(Backup(TransferId(step * 100 + 50 + i), RequestId(f"req-{i:05d}"), 40_000 + i,
                           HostBlockId(7000 + i), i % 64) for i in range(batch))
    return StepCommand(step, Rank(rank), rows, diffs, transfers, backups)


class RankWorker:
    """A TP rank: answers each StepCommand with a StepReport (over the channel or as a Ray call)."""

    def step(self, cmd: StepCommand) -> StepReport:
        return StepReport(cmd.step, cmd.rank, completed=tuple(t.transfer_id for t in cmd.transfers),
                          sampled=((cmd.batch[0].request_id, 7),) if cmd.rank == 0 else ())

    def serve(self, spec, n: int) -> int:
        with ChannelPair.attach(spec) as pair:
            for _ in range(n):
                pair.send(self.step(pair.recv(timeout=60)))
        return n


class Coordinator:
    def __init__(self, tp: int, batch: int, hot_blocks: int, capacity: int):
        self.cmds = [step_command(0, r, batch, hot_blocks) for r in range(tp)]
        self.pairs = [ChannelPair.create(capacity) for _ in range(tp)]

    def specs(self):
        return [p.spec for p in self.pairs]

    def message_bytes(self) -> tuple[int, int]:
        """(wire-codec bytes, plain-pickle bytes) of one StepCommand."""
        return (len(WireCodec().dumps(self.cmds[0])),
                len(pickle.dumps(self.cmds[0], protocol=pickle.HIGHEST_PROTOCOL)))

    def codec_cost(self, n: int) -> list[float]:
        """Seconds of one WireCodec encode + decode of the command, in this process."""
        codec, out = WireCodec(), []
        for _ in range(n):
            t0 = time.perf_counter()
            codec.loads(codec.dumps(self.cmds[0]))
            out.append(time.perf_counter() - t0)
        return out

    def run_channel(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            for pair, cmd in zip(self.pairs, self.cmds):
                pair.send(cmd)
            for pair in self.pairs:
                pair.recv(timeout=60)
            out.append(time.perf_counter() - t0)
        return out

    def run_ray(self, ranks, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            ray.get([r.step.remote(c) for r, c in zip(ranks, self.cmds)])
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        for p in self.pairs:
            p.close()


def _stats(name: str, tp: int, samples: list[float]) -> dict:
    us = sorted(s * 1e6 for s in samples)
    q = lambda f: us[min(len(us) - 1, int(f * len(us)))]  # noqa: E731
    return {"path": name, "tp": tp, "n": len(us), "p50_us": q(0.5), "p90_us": q(0.9),
            "p99_us": q(0.99), "mean_us": statistics.fmean(us)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=32, help="requests per step command")
    ap.add_argument("--hot-blocks", type=int, default=33, help="hot-buffer blocks per request")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--capacity", type=int, default=1 << 20)
    ap.add_argument("--smoke", action="store_true", help="few iterations (CI / quick check)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "channel.json"))
    a = ap.parse_args()
    if a.smoke:
        a.iters, a.warmup = 200, 20
    ray.init(address="local", num_cpus=max(a.tp) + 2, include_dashboard=False, log_to_driver=False)
    RankA, CoordA = ray.remote(num_cpus=0)(RankWorker), ray.remote(num_cpus=0)(Coordinator)
    rows, msg_bytes = [], (0, 0)
    try:
        for tp in a.tp:
            coord = CoordA.remote(tp, a.batch, a.hot_blocks, a.capacity)
            ranks = [RankA.remote() for _ in range(tp)]
            msg_bytes = ray.get(coord.message_bytes.remote())
            total = a.warmup + a.iters
            serving = [r.serve.remote(s, total) for r, s in zip(ranks, ray.get(coord.specs.remote()))]
            chan = ray.get(coord.run_channel.remote(total))[a.warmup:]
            ray.get(serving)
            ray_calls = ray.get(coord.run_ray.remote(ranks, a.warmup + a.iters // 3))[a.warmup:]
            codec = ray.get(coord.codec_cost.remote(a.iters))
            rows += [_stats("shm channel", tp, chan), _stats("ray actor call", tp, ray_calls),
                     _stats("codec enc+dec", tp, codec)]
            ray.get(coord.close.remote())
            for h in [coord, *ranks]:
                ray.kill(h)
    finally:
        ray.shutdown()
    print(f"StepCommand: batch {a.batch}, {a.hot_blocks} hot blocks/request -> {msg_bytes[0]} B "
          f"(wire codec), {msg_bytes[1]} B (pickle)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"{'path':<16}{'tp':>4}{'n':>7}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'mean us':>10}")
    for r in rows:
        print(f"{r['path']:<16}{r['tp']:>4}{r['n']:>7}{r['p50_us']:>10.1f}{r['p90_us']:>10.1f}"
              f"{r['p99_us']:>10.1f}{r['mean_us']:>10.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"bench": "channel", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                   "load_avg": os.getloadavg(), "message_bytes": msg_bytes, "args": vars(a), "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
