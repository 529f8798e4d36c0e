"""Per-step control-plane overhead, old vs new, in the same run: a baseline channel (plain pickle,
sleeping waits) against the current one (StepCodec, futex wake-ups), for realistic decode steps
(batch rows with hot-buffer block lists, a few table diffs/transfers, one backup per row; the
rank's StepReport with acks, sampled tokens and hits_by_request). Target: <= 100 us at TP 2.

Part 1, codec alone (one process): encode / decode of a command and of a report, per call.
Part 2, round trip through real channels: this process is the coordinator, each TP rank a spawned
process that decodes the command, builds its report (timed as "execute", plus an optional
emulated ``--exec-us`` of work, slept) and sends it back. ``overhead`` = round trip minus the
slower rank's execute time (the BENCHMARKS.md metric); exec 0 shows back-to-back cost, a
millisecond-scale exec shows the wake-up cost of a waiter that went to sleep.

One command:  python benchmarks/bench_channel.py          (--smoke: a quick CPU check)
Prints two tables and writes JSON (default benchmarks/results/channel.json). ``--configs old codec
new`` adds the new codec with the old sleeping waits (splits the gain between codec and futex).
The runs recorded in BENCHMARKS.md before 2026-12 used the flattening ``WireCodec`` (since
removed) as "old"; plain pickle is slower than it was.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

from hisparse_ray.channel.codec import PickleCodec
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import WaitPolicy, futex_available
from hisparse_ray.channel.stepcodec import _MEMO, StepCodec
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

# name -> (codec factory, wait policy): "old" is a channel without StepCodec and futex waits,
# "codec" the new codec with the old sleeping waits (--configs old codec new: attribution),
# "yield" the new channel whose waiters yield instead of blocking for up to 20 ms
ALL_CONFIGS = {
    "old": (PickleCodec, WaitPolicy(futex=False)),
    "codec": (StepCodec, WaitPolicy(futex=False)),
    "new": (StepCodec, WaitPolicy()),
    # the new channel with waiters that keep yielding (not blocking) for 20 ms: a core each
    "yield": (StepCodec, WaitPolicy(yield_s=20e-3)),
}
CONFIGS = dict(ALL_CONFIGS)


_HOT: dict[tuple[int, int], list[list[int]]] = {}


def step_commands(step: int, tp: int, batch: int, hot_blocks: int) -> list[StepCommand]:
    """One decode step of ``batch`` host-tier requests for every rank, built the way the core
    builds it: ``tuple(req.hot)`` of a per-request list each step (a fresh tuple of the same int
    objects), hot buffers unchanged, the same row objects for all ranks."""
    hot = _HOT.setdefault((batch, hot_blocks), [
        [DeviceBlockId(i * hot_blocks + j) for j in range(hot_blocks)] for i in range(batch)])
    rows = [BatchRow(RequestId(f"req-{i:05d}"), 40_000 + step + i, 1000 + (step * 7 + i) % 5000,
                     tuple(hot[i])) for i in range(batch)]
    diffs = [TableDiff(RequestId(f"req-{(step + i) % batch:05d}"), 625 + step // 64, 9000 + i, -1)
             for i in range(max(1, batch // 16))]
    transfers = [PageTransfer(TransferId(step * 1000 + i), TransferKind.SPILL, DeviceBlockId(i),
                              HostBlockId(5000 + i)) for i in range(2)]
    backups = [Backup(TransferId(step * 1000 + 100 + i), r.request_id, r.seq_len - 1,
                      HostBlockId(7000 + i), (r.seq_len - 1) % 64) for i, r in enumerate(rows)]
    return [StepCommand(step, Rank(r), tuple(rows), tuple(diffs), tuple(transfers),
                        tuple(backups)) for r in range(tp)]


def make_report(cmd: StepCommand) -> StepReport:
    """What a rank answers (rank 0 carries sampled tokens and per-request hits)."""
    acks = tuple(t.transfer_id for t in cmd.transfers) + tuple(b.transfer_id for b in cmd.backups)
    lead = cmd.rank == 0
    return StepReport(
        cmd.step, cmd.rank, enqueued=acks, completed=acks,
        sampled=tuple((r.request_id, r.input_token + 1) for r in cmd.batch) if lead else (),
        hot_hits=3 * len(cmd.batch), hot_misses=len(cmd.batch),
        hits_by_request=tuple((r.request_id, 3, 1) for r in cmd.batch) if lead else ())


_SCRATCH: dict[int, tuple[bytearray, bytearray]] = {}


def thrash(nbytes: int) -> None:
    """Copy ``nbytes`` between two buffers: evicts this core's caches the way a model forward
    does (the stand-in for "right after execute" when no GPU is at hand; 0 = nothing)."""
    if nbytes:
        src, dst = _SCRATCH.setdefault(nbytes, (bytearray(b"\x01") * nbytes, bytearray(nbytes)))
        memoryview(dst)[:] = src


def rank_main(ctrl, results) -> None:
    """A TP rank process: for each session on ``ctrl`` (config, spec, steps, exec_us, thrash
    bytes), serve that many steps and put the per-step execute seconds on ``results``."""
    while True:
        job = ctrl.get()
        if job is None:
            return
        config, spec, n, exec_s, thrash_bytes = job
        factory, policy = ALL_CONFIGS[config]
        execs = []
        with ChannelPair.attach(spec, policy=policy, codec=factory()) as pair:
            for _ in range(n):
                cmd = pair.recv(timeout=120)
                t0 = time.perf_counter()
                report = make_report(cmd)
                if exec_s:
                    time.sleep(exec_s)
                thrash(thrash_bytes)
                execs.append(time.perf_counter() - t0)
                pair.send(report, timeout=120)
        results.put(execs)


def _q(samples_us: list[float]) -> dict:
    us = sorted(samples_us)
    pick = lambda f: us[min(len(us) - 1, int(f * len(us)))]  # noqa: E731
    return {"n": len(us), "p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99),
            "mean_us": statistics.fmean(us)}


def codec_costs(batch: int, hot_blocks: int, steps: int) -> list[dict]:
    """Per-call encode/decode microseconds of a stateful stream of ``steps`` distinct steps;
    old and new interleaved step by step so load on the machine hits both alike."""
    _MEMO.clear()  # every measurement starts without shared encodings
    codec_configs = {"old": ALL_CONFIGS["old"], "new": ALL_CONFIGS["new"]}
    cmds = [step_commands(s, 1, batch, hot_blocks)[0] for s in range(steps)]
    reps = [make_report(c) for c in cmds]
    pc = time.perf_counter
    out = {name: {k: [] for k in ("cmd_enc", "cmd_dec", "rep_enc", "rep_dec", "coord_tp2", "bytes")}
           for name in codec_configs}
    codecs = {name: (f(), f()) for name, (f, _) in codec_configs.items()}
    for cmd, rep in zip(cmds, reps):
        for name, (enc, dec) in codecs.items():
            acc = out[name]
            for msg, ek, dk in ((cmd, "cmd_enc", "cmd_dec"), (rep, "rep_enc", "rep_dec")):
                t0 = pc()
                data = enc.dumps(msg)
                t1 = pc()
                back = dec.loads(data)
                t2 = pc()
                assert back == msg
                acc[ek].append((t1 - t0) * 1e6)
                acc[dk].append((t2 - t1) * 1e6)
            acc["bytes"].append(len(data))
    # the coordinator's serial share of a TP 2 step: encode for both ranks (one channel codec
    # each), decode both reports
    _MEMO.clear()  # no encodings shared with the single-rank pass above
    tp2 = [step_commands(s, 2, batch, hot_blocks) for s in range(steps)]
    group = {name: [(f(), f(), f()) for _ in range(2)] for name, (f, _) in codec_configs.items()}
    for pair in tp2:
        for name, ends in group.items():
            reps2 = [e_rank.dumps(make_report(c)) for c, (_, e_rank, _) in zip(pair, ends)]
            t0 = pc()
            sent = [enc.dumps(c) for c, (enc, _, _) in zip(pair, ends)]
            for data, (_, _, dec) in zip(reps2, ends):
                dec.loads(data)
            out[name]["coord_tp2"].append((pc() - t0) * 1e6)
            for data, (_, e_rank, _) in zip(sent, ends):
                e_rank.loads(data)  # the rank's decoder keeps up with the stream
    warm = max(1, steps // 10)
    rows = []
    for name, acc in out.items():
        row = {"batch": batch, "codec": name, "cmd_bytes": len(codecs[name][0].dumps(cmds[-1]))}
        for k in ("cmd_enc", "cmd_dec", "rep_enc", "rep_dec", "coord_tp2"):
            row[k + "_p50_us"] = statistics.median(acc[k][warm:])
        rows.append(row)
    return rows


def channel_run(config: str, tp: int, batch: int, hot_blocks: int, exec_us: float, n: int,
                warmup: int, ranks: list, thrash_bytes: int = 0
                ) -> tuple[list[float], list[float]]:
    factory, policy = CONFIGS[config]
    _MEMO.clear()  # an earlier run's encodings of equal steps would make this one look cheap
    total = warmup + n
    cycle = [step_commands(s, tp, batch, hot_blocks) for s in range(min(total, 256))]
    pairs = [ChannelPair.create(1 << 20, policy=policy, codec=factory()) for _ in range(tp)]
    try:
        for (ctrl, _), pair in zip(ranks, pairs):
            ctrl.put((config, pair.spec, total, exec_us * 1e-6, thrash_bytes))
        rts = []
        for i in range(total):
            cmds = cycle[i % len(cycle)]
            if i >= len(cycle):  # keep steps distinct and increasing (a stream, as in a run)
                cmds = [StepCommand(i, c.rank, c.batch, c.table_diffs, c.transfers, c.backups)
                        for c in cmds]
            thrash(thrash_bytes)  # the coordinator's own work between steps, not timed
            t0 = time.perf_counter()
            for pair, cmd in zip(pairs, cmds):
                pair.send(cmd, 120)
            for pair in pairs:
                pair.recv(120)
            rts.append(time.perf_counter() - t0)
        execs = [res.get(timeout=120) for _, res in ranks]
    finally:
        for p in pairs:
            p.close()
    slowest = [max(e[i] for e in execs) for i in range(total)]
    return [rt * 1e6 for rt in rts[warmup:]], [(rt - ex) * 1e6 for rt, ex in
                                                 zip(rts[warmup:], slowest[warmup:])]


def channel_rows(tp: int, batch: int, a, exec_us: float, ranks: list, thrash_mb: float = 0
                 ) -> list[dict]:
    """Old and new alternate in ``a.rounds`` rounds (a load change on the machine hits both)."""
    samples = {c: ([], []) for c in CONFIGS}
    for _ in range(a.rounds):
        for config in CONFIGS:
            rts, over = channel_run(config, tp, batch, a.hot_blocks, exec_us,
                                    max(1, a.iters // a.rounds), a.warmup, ranks,
                                    int(thrash_mb * 2**20))
            samples[config][0].extend(rts)
            samples[config][1].extend(over)
    rows = []
    for config, (rts, over) in samples.items():
        row = {"config": config, "tp": tp, "batch": batch, "exec_us": exec_us,
               "thrash_mb": thrash_mb,
               "round_trip_p50_us": statistics.median(rts)}
        row.update({"overhead_" + k: v for k, v in _q(over).items()})
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--hot-blocks", type=int, default=33, help="hot-buffer blocks per request")
    ap.add_argument("--exec-us", type=float, nargs="+", default=[0.0, 2000.0],
                    help="emulated execute time per step on each rank (slept)")
    ap.add_argument("--thrash-mb", type=float, nargs="+", default=[0.0],
                    help="MB each rank copies in its execute and the coordinator between steps: "
                         "cold caches, as after a model forward (H200 actor run: each codec "
                         "stage 3-5x its warm cost)")
    ap.add_argument("--iters", type=int, default=450)
    ap.add_argument("--configs", nargs="+", default=["old", "new"], choices=list(ALL_CONFIGS))
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="old/new alternations per cell")
    ap.add_argument("--codec-steps", type=int, default=600)
    ap.add_argument("--smoke", action="store_true", help="few iterations (CI / quick check)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "channel.json"))
    a = ap.parse_args()
    CONFIGS.clear()
    CONFIGS.update((c, ALL_CONFIGS[c]) for c in a.configs)
    if a.smoke:
        a.iters, a.warmup, a.codec_steps, a.rounds = 100, 10, 100, 2
    codec_rows = [r for b in a.batch for r in codec_costs(b, a.hot_blocks, a.codec_steps)]
    ctx = mp.get_context("spawn")
    ranks = [(ctx.Queue(), ctx.Queue()) for _ in range(max(a.tp))]
    procs = [ctx.Process(target=rank_main, args=q, daemon=True) for q in ranks]
    for p in procs:
        p.start()
    chan_rows = []
    try:
        for thrash_mb in a.thrash_mb:
            for exec_us in a.exec_us:
                for tp in a.tp:
                    for batch in a.batch:
                        chan_rows += channel_rows(tp, batch, a, exec_us, ranks[:tp], thrash_mb)
    finally:
        for ctrl, _ in ranks:
            ctrl.put(None)
        for p in procs:
            p.join(10)
    _print(a, codec_rows, chan_rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"bench": "channel", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                   "python": sys.version.split()[0], "futex": futex_available(),
                   "load_avg": os.getloadavg(), "args": vars(a), "codec": codec_rows,
                   "channel": chan_rows}, f, indent=1)
    print(f"wrote {a.out}")


def _print(a, codec_rows: list[dict], chan_rows: list[dict]) -> None:
    print(f"hot blocks/request {a.hot_blocks}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cpus; futex {futex_available()}")
    print("\ncodec alone, p50 us per call (stateful stream of distinct steps)")
    print("(sum: one rank's command and report both ways; coord tp2: the coordinator's encodes "
          "for 2 ranks + 2 report decodes)")
    print(f"{'batch':>5} {'codec':>5} {'cmd B':>7} {'cmd enc':>8} {'cmd dec':>8} {'rep enc':>8} "
          f"{'rep dec':>8} {'sum':>8} {'coord tp2':>10} {'new/old':>8}")
    old = {}
    for r in codec_rows:
        s = r["cmd_enc_p50_us"] + r["cmd_dec_p50_us"] + r["rep_enc_p50_us"] + r["rep_dec_p50_us"]
        ratio = ""
        if r["codec"] == "old":
            old[r["batch"]] = s
        elif r["batch"] in old:
            ratio = f"{s / old[r['batch']]:.2f}"
        print(f"{r['batch']:>5} {r['codec']:>5} {r['cmd_bytes']:>7} {r['cmd_enc_p50_us']:>8.1f} "
              f"{r['cmd_dec_p50_us']:>8.1f} {r['rep_enc_p50_us']:>8.1f} "
              f"{r['rep_dec_p50_us']:>8.1f} "
              f"{s:>8.1f} {r['coord_tp2_p50_us']:>10.1f} {ratio:>8}")
    print("\nstep round trip through real channels; overhead = round trip - slower rank's execute")
    print(f"{'thrash MB':>9} {'exec us':>7} {'tp':>3} {'batch':>5} {'cfg':>5} {'rt p50':>8} "
          f"{'ovh p50':>8} {'ovh p90':>8} {'ovh p99':>9} {'new/old p50':>12}")
    old = {}
    for r in chan_rows:
        key = (r["thrash_mb"], r["exec_us"], r["tp"], r["batch"])
        ratio = ""
        if r["config"] == "old":
            old[key] = r["overhead_p50_us"]
        elif key in old:
            ratio = f"{r['overhead_p50_us'] / old[key]:.2f}"
        print(f"{r['thrash_mb']:>9g} {r['exec_us']:>7.0f} {r['tp']:>3} {r['batch']:>5} {r['config']:>5} "
              f"{r['round_trip_p50_us']:>8.1f} {r['overhead_p50_us']:>8.1f} "
              f"{r['overhead_p90_us']:>8.1f} {r['overhead_p99_us']:>9.1f} {ratio:>12}")


if __name__ == "__main__":
    main()
