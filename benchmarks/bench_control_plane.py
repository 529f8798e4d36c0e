"""Benchmark of the actor system's wiring (not a test): per-step control-plane overhead at TP 2 and
prefill -> decode landing GB/s, each against its baseline measured in the same run.

1. control plane: round trip of an empty StepCommand through the coordinator's shared-memory
   channels and both ranks' step executors (``Coordinator.probe_control_plane``), and the
   per-step overhead of real decode steps (coordinator round trip minus the slower rank's execute
   time), against a plain Ray actor call and a Ray-call fan-out to both ranks. Target <= 100 us.
2. landing: host landing GB/s of the data path (NIXL WRITEs until DONE + the staging copy into
   the host pool) for the direct and the staged path, against a plain ``torch`` copy of the same
   bytes in this process; also with the Ray orchestration calls (notification wait, key install).
3. decode during a landing (``--decode-during N``): the step time of N running requests while a
   prompt lands (staged path), against their steps with no landing in flight, same run: what a
   landing costs the requests already decoding (rank 0's staging -> host copy runs outside the
   executor lock on a landing stream since 2026-12-05; before, a device-wide synchronize under
   the lock held the steps out).

Usage: ``python benchmarks/bench_control_plane.py [--probes 2000] [--tokens 2048 8192]
[--page-size 8] [--staging-blocks 256] [--model landing] [--paths staged]``. ``--model landing``
lands DeepSeek-V3.2-sized KV (70 KB per token) instead of the tiny model's 0.4-0.8 KB. Prints a
table per prompt length and writes ``benchmarks/results/control_plane.json`` (``landing`` keyed by
prompt length).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import ray
import torch

from hisparse_ray.actors import launch
from hisparse_ray.actors.prefill_worker import PrefillWorker
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.types import BatchRow, RequestHandle, RequestId, StepCommand, TableDiff


def _us(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs) * 1e6, "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6,
            "n": len(xs)}


def _step_sized_command(rows: int = 16) -> StepCommand:
    """A StepCommand of a realistic size (batch of ``rows`` with hot blocks and table diffs)."""
    batch = tuple(BatchRow(i, 4000 + i, 17, tuple(range(3 * i, 3 * i + 3)))
                  for i in range(rows))
    diffs = tuple(TableDiff(i, 62, 100 + i, -1) for i in range(rows))
    handles = tuple(RequestHandle(i, RequestId(f"req-{i:04d}")) for i in range(rows))
    return StepCommand(1, batch, diffs, handles=handles)


def bench_control_plane(rep, probes: int) -> dict:
    coord, ranks = rep.coordinator, rep.ranks
    ray.get(coord.probe_control_plane.remote(50))  # warm-up
    shm = ray.get(coord.probe_control_plane.remote(probes))
    cmd = _step_sized_command()
    for _ in range(20):
        ray.get(ranks[0].ping.remote(cmd))
    plain, fanout = [], []
    for _ in range(min(probes, 500)):
        t0 = time.perf_counter()
        ray.get(ranks[0].ping.remote(cmd))
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ray.get([r.ping.remote(cmd) for r in ranks])
        fanout.append(time.perf_counter() - t0)
    # real decode steps: run a few host-tier requests, then compare per-step logs
    rng = random.Random(0)
    for i in range(4):
        ray.get(coord.submit.remote(f"cp{i}", [rng.randrange(1, 96) for _ in range(150)], 64))
    ray.get(coord.wait.remote(None, 600))
    coord_log = dict(ray.get(coord.get_step_log.remote()))
    rank_logs = [dict(x) for x in ray.get([r.get_step_log.remote() for r in ranks])]
    overhead = [rt - max(log[s] for log in rank_logs) for s, rt in coord_log.items()
                if all(s in log for log in rank_logs)]
    stages = step_stages(ray.get(coord.get_step_trace.remote()),
                         ray.get([r.get_step_trace.remote() for r in ranks]))
    return {"shm_empty_step_round_trip": _us(shm),
            "real_step_overhead": _us(overhead),
            "ray_call_one_rank": _us(plain), "ray_call_fanout_tp2": _us(fanout),
            "real_step_stages": stages}


def step_stages(coord_trace: list, rank_traces: list[list]) -> dict:
    """Median microseconds of each stage of a real step, per rank, from the coordinator's and the
    ranks' ``perf_counter`` traces (one clock on one host): the coordinator encodes and
    broadcasts the one command (``c_send``), the rank finds it (``r_wake``), decodes it
    (``r_decode``), executes, encodes and writes its report (``r_report``); the coordinator finds
    it (``c_wake``) and decodes it (``c_decode``)."""
    by_step = [{t[0]: t for t in tr} for tr in rank_traces]
    cols: dict[str, list[float]] = collections.defaultdict(list)
    for step, t0, sent, found, decoded in coord_trace:
        if not all(step in b for b in by_step):
            continue
        cols["c_send"].append(sent - t0)
        for r, b in enumerate(by_step):
            _, r_found, r_dec, r_exec, r_sent = b[step]
            cols[f"r{r} r_wake"].append(r_found - sent)
            cols[f"r{r} r_decode"].append(r_dec - r_found)
            cols[f"r{r} execute"].append(r_exec - r_dec)
            cols[f"r{r} r_report"].append(r_sent - r_exec)
            cols[f"r{r} c_wake"].append(found[r] - r_sent)
            cols[f"r{r} c_decode"].append(decoded[r] - found[r])
        cols["round trip"].append(max(decoded) - t0)
    return {k: statistics.median(v) * 1e6 for k, v in cols.items()}


def landing_phases(rids: list[str], lander: list, pushes: list, ranks: list[list]) -> dict:
    """Median milliseconds of each phase of the landings ``rids``, from the lander's, the
    prefill worker's and the ranks' ``perf_counter`` traces (one host, one clock): ``issue``
    (prefill done -> first chunk's calls submitted), ``push start`` (-> the push call runs),
    ``plan`` (-> WRITEs built), ``write`` (-> last WRITE DONE), ``notify`` (-> rank 0 saw its
    first notification; negative when it came before the sender saw DONE), ``copy`` (-> staging
    copied to host), ``rank finish`` (-> rank 0's keys installed, call returned), ``return``
    (-> the lander saw every call end). Multi-chunk landings: first start, last end. With
    ``--push-with-prefill`` the calls go out before prefill (``issue`` is negative) and the push
    runs as prefill ends (``push start`` ~0)."""
    first = lambda rows, rid, k: min(t[k] for t in rows if t[0] == rid)  # noqa: E731
    last = lambda rows, rid, k: max(t[k] for t in rows if t[0] == rid)  # noqa: E731
    cols: dict[str, list[float]] = collections.defaultdict(list)
    for rid in rids:
        if not all(any(t[0] == rid for t in rows) for rows in (lander, pushes, *ranks)):
            continue
        t0, issued, end = first(lander, rid, 1), first(lander, rid, 2), last(lander, rid, 3)
        p_enter, p_plan, p_done = first(pushes, rid, 1), first(pushes, rid, 2), last(pushes, rid, 3)
        r0 = ranks[0]
        notified, copied, r_end = first(r0, rid, 2), last(r0, rid, 3), last(r0, rid, 4)
        all_end = max(last(rows, rid, 4) for rows in ranks)
        for k, v in (("issue", issued - t0), ("push start", p_enter - t0),
                     ("plan", p_plan - p_enter), ("write", p_done - p_plan),
                     ("notify", notified - p_done), ("copy", copied - notified),
                     ("rank finish", r_end - copied), ("return", end - max(all_end, p_done)),
                     ("end to end", end - t0)):
            cols[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in cols.items()}


def bench_landing(rep, tokens: int, repeats: int, paths: list[str], kv_bytes_per_token: int,
                  workers: dict | None = None) -> dict:
    """Median host-landing GB/s per path for prompts of ``tokens`` tokens: end to end after
    prefill (every Ray call, NIXL WRITE, staging copy and key install of the landing: what a
    request waits for) and the data path alone (sum of NIXL WRITE and staging-copy seconds),
    against a plain copy of the same bytes in this process, same run (on a GPU: device -> pinned
    host, the copy engine's limit; on CPU: a host memcpy). GB/s count the KV bytes that land in
    the host pool; the indexer keys (to every rank) ride along and are reported separately."""
    coord = rep.coordinator
    kv = (tokens - 1) * kv_bytes_per_token  # positions 0..T-2 land (decode feeds the last)
    rng = random.Random(f"landing-{tokens}")  # prompts share no prefix across sizes: no reuse
    out = {}
    for path in paths:
        index = {"direct": 0, "staged": 1}[path]
        e2e, data, moved = [], [], 0
        for i in range(repeats + 1):  # the first landing of a size warms up; not counted
            rid = f"land-{path}-{tokens}-{i}"
            ray.get(coord.submit.remote(rid, [rng.randrange(1, 96) for _ in range(tokens)], 1,
                                        None, index))
            (row,) = ray.get(coord.wait.remote([rid], 900))
            assert row["error"] is None and row["landing_path"] == path, row
            print(f"  [{time.strftime('%H:%M:%S')}] {path} {tokens} tokens #{i}: landed "
                  f"{row['landing_bytes'] / 1e6:.1f} MB in {row['landing_s'] * 1e3:.1f} ms "
                  f"(data path {row['landing_data_s'] * 1e3:.1f} ms) "
                  f"(request latency {row['latency_s']:.2f} s)", flush=True)
            if i:
                moved = row["landing_bytes"]
                e2e.append(kv / row["landing_s"] / 1e9)
                data.append(kv / row["landing_data_s"] / 1e9)
        out[path] = {"kv_bytes": kv, "moved_bytes": moved,
                     "e2e_GBps": statistics.median(e2e), "data_path_GBps": statistics.median(data),
                     "e2e_all_GBps": e2e, "runs": len(e2e)}
        if workers and path in workers:
            out[path]["phases_ms"] = phases = landing_phases(
                [f"land-{path}-{tokens}-{i}" for i in range(1, repeats + 1)],
                ray.get(coord.get_landing_trace.remote()),
                ray.get(workers[path].get_landing_trace.remote()),
                ray.get([r.get_landing_trace.remote() for r in rep.ranks]))
            print(f"  {path} {tokens} tokens, phases (median ms): " + "  ".join(
                f"{k}={v:.2f}" for k, v in phases.items()), flush=True)
    nbytes = kv
    if torch.cuda.is_available():
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        what = "device -> pinned host copy_"
    else:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        what = "host memcpy (copy_)"
    dst.copy_(src)  # first touch / warm-up
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["plain_copy"] = {"what": what, "bytes": nbytes,
                         "GBps": nbytes / statistics.median(times) / 1e9}
    return out


def _stats_ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3 if xs else float("nan"),
            "p90_ms": xs[max(0, -(-9 * len(xs) // 10) - 1)] * 1e3 if xs else float("nan"),
            "n": len(xs)}


def bench_decode_during_landing(rep, tokens: int, decoders: int, repeats: int,
                                new_tokens: int, settle_s: float = 1.0) -> dict:
    """Step intervals (consecutive step starts: the running requests' time per token) and step
    round trips of ``decoders`` host-tier requests while ``repeats`` prompts of ``tokens`` tokens
    land one after another on the staged path, against the same requests' steps before, between
    and after the landings (no landing in flight), from the coordinator's step trace and the
    landers' traces (one host clock). A step counts as during a landing when it starts between
    the landing's first calls and its end."""
    coord = rep.coordinator
    rng = random.Random(f"during-{tokens}")
    rids = [f"during-{tokens}-{i}" for i in range(decoders)]
    for rid in rids:  # meant to outlive every landing; aborted at the end
        ray.get(coord.submit.remote(rid, [rng.randrange(1, 96) for _ in range(64)], new_tokens,
                                    None, 1))
    deadline = time.monotonic() + 600
    while not all(ray.get(coord.progress.remote()).get(r, (0,))[0] > 1 for r in rids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"decoders {rids} did not start decoding in 600 s")
        time.sleep(0.05)
    time.sleep(settle_s)
    landed = []
    for i in range(repeats):
        rid = f"during-land-{tokens}-{i}"
        ray.get(coord.submit.remote(rid, [rng.randrange(1, 96) for _ in range(tokens)], 1,
                                    None, 1))
        (row,) = ray.get(coord.wait.remote([rid], 900))
        assert row["error"] is None, row
        landed.append(rid)
        print(f"  [{time.strftime('%H:%M:%S')}] landed {tokens} tokens beside {decoders} "
              f"decoding requests in {row['landing_s'] * 1e3:.1f} ms", flush=True)
        time.sleep(settle_s)
    finished = [r for r in rids if ray.get(coord.progress.remote())[r][2]]
    if finished:
        print(f"  warning: {finished} finished before the last landing ended: raise "
              f"--decode-during-tokens (steps during the landings are undercounted)", flush=True)
    for rid in rids:
        ray.get(coord.abort.remote(rid))
    ray.get(coord.wait.remote(rids, 120))
    windows = [(t[2], t[3]) for t in ray.get(coord.get_landing_trace.remote())
               if t[0] in landed]  # (first calls issued, landing done)
    trace = sorted(ray.get(coord.get_step_trace.remote()), key=lambda t: t[0])
    t_start = min(w[0] for w in windows) - settle_s
    during: dict[str, list[float]] = {"interval": [], "round_trip": []}
    outside: dict[str, list[float]] = {"interval": [], "round_trip": []}
    for prev, cur in zip(trace, trace[1:]):
        if cur[1] < t_start:
            continue
        side = during if any(lo <= cur[1] <= hi for lo, hi in windows) else outside
        side["interval"].append(cur[1] - prev[1])
        side["round_trip"].append(max(cur[4]) - cur[1])
    out = {"tokens": tokens, "decoders": decoders, "landings": len(landed),
           "finished_early": finished,
           "during": {k: _stats_ms(v) for k, v in during.items()},
           "outside": {k: _stats_ms(v) for k, v in outside.items()}}
    out["interval_ratio"] = (out["during"]["interval"]["median_ms"]
                             / out["outside"]["interval"]["median_ms"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--probes", type=int, default=2000)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048],
                    help="prompt lengths of landing runs (one table row set per length)")
    ap.add_argument("--page-size", type=int, default=8, help="replica page size (rows per block)")
    ap.add_argument("--staging-blocks", type=int, default=256,
                    help="decode-side staging pool blocks (a prompt above it lands in chunks)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["control", "landing"], help="run one part")
    ap.add_argument("--model", choices=["tiny", "landing"], default="tiny",
                    help="tiny built-in model, or 'landing': DeepSeek-V3.2's KV bytes per token "
                         "(61 layers of 576-value rows, 128-dim index keys) around a tiny network")
    ap.add_argument("--layers", type=int, default=61, help="layers of the 'landing' model")
    ap.add_argument("--paths", nargs="+", choices=["direct", "staged"],
                    default=["direct", "staged"], help="landing paths to measure")
    ap.add_argument("--layer-groups", type=int, default=1,
                    help="ReplicaSpec.landing_layer_groups: staged WRITEs per chunk by layer "
                         "group, copied to host group by group (overlaps WRITE and D2H)")
    ap.add_argument("--synthetic-prefill", action="store_true",
                    help="prefill workers fill their send buffers with random KV instead of "
                         "running the model (PrefillSpec.synthetic_kv): times landings of "
                         "64K-128K tokens without minutes of dense prefill each")
    ap.add_argument("--direct-max-tokens", type=int, default=None,
                    help="measure the direct path only for prompts up to this length (on a GPU "
                         "host it runs at ~0.4 GB/s: a GB takes longer than a landing attempt)")
    ap.add_argument("--push-with-prefill", nargs="?", const="always", default="never",
                    choices=["never", "auto", "always"],
                    help="ReplicaSpec.landing_push_with_prefill (bare flag: always): one-chunk "
                         "landings push in the prefill call (e2e then counts from the worker's "
                         "prefill end); auto only while the staging pool keeps room for another")
    ap.add_argument("--decode-during", type=int, default=0, metavar="N",
                    help="also time the steps of N decoding requests while each --tokens "
                         "prompt lands (staged), against their steps with no landing in flight")
    ap.add_argument("--decode-during-tokens", type=int, default=1024,
                    help="max_new_tokens of those requests (they must outlive the landings)")
    ap.add_argument("--out", default="benchmarks/results/control_plane.json")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), num_gpus=1 if gpu else 0,
             include_dashboard=False, log_to_driver=False)
    try:
        # on a GPU the prefill workers sit on the GPU too: "direct" is then GPU -> another
        # process's pinned host over UCX, "staged" GPU -> the rank's GPU staging pool + local D2H
        model = ModelSpec(dtype="bfloat16" if gpu else "float32", shape=args.model,
                          num_layers=args.layers)
        max_tokens = max(args.tokens)
        per_token = model.kv_layout(args.page_size).bytes_per_token
        kv_bytes = max_tokens * per_token
        # every landing of the largest size fits at once (no eviction inside a measurement)
        # (and the --decode-during requests' whole lives beside them)
        kv_bytes += args.decode_during * (64 + args.decode_during_tokens) * per_token
        hisparse = dataclasses.replace(ReplicaSpec().hisparse,
                                       host_pool_gib=max(0.01, 2.2 * kv_bytes / 2**30))
        # 256 device rows whatever the page size: the landing prompts go to the host tier
        spec = ReplicaSpec(model=model, hisparse=hisparse, tp_size=2,
                           num_device_blocks=max(4, 256 // args.page_size),
                           staging_blocks=args.staging_blocks, page_size=args.page_size,
                           gpus_per_rank=0.4 if gpu else 0.0, replica_id="bench",
                           landing_layer_groups=args.layer_groups,
                           landing_push_with_prefill=args.push_with_prefill)
        pspecs = [PrefillSpec(model=model, max_prompt_tokens=max(max_tokens, 256),
                              gpus=0.1 if gpu else 0.0, name=name,
                              synthetic_kv=args.synthetic_prefill, batch_invariant=False)
                  for name in ("direct", "staged")]
        workers = [launch._remote(PrefillWorker, **launch.prefill_options(p)).remote(p)
                   for p in pspecs]
        t0 = time.perf_counter()
        rep = launch.launch_replica(spec)
        print(f"  replica up in {time.perf_counter() - t0:.1f} s", flush=True)
        ray.get([w.ready.remote() for w in workers])
        for w, mode in zip(workers, ("direct", "staged")):
            launch.connect(rep, w, mode)
        try:
            cp = bench_control_plane(rep, args.probes) if args.only != "landing" else {}
            land = {str(t): bench_landing(
                rep, t, args.repeats,
                [p for p in args.paths if p != "direct" or args.direct_max_tokens is None
                 or t <= args.direct_max_tokens], per_token,
                dict(zip(("direct", "staged"), workers)))
                for t in args.tokens} if args.only != "control" else {}
            during = {str(t): bench_decode_during_landing(rep, t, args.decode_during,
                                                          max(1, args.repeats),
                                                          args.decode_during_tokens)
                      for t in args.tokens} if args.decode_during else {}
            pushed_with_prefill = ray.get(rep.coordinator.metrics.remote())["pushes_with_prefill"]
            if land:
                print(f"  landings pushed inside the prefill call, per prefill worker: "
                      f"{pushed_with_prefill}")
        finally:
            rep.shutdown()
    finally:
        ray.shutdown()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.node()} {os.cpu_count()} cores, "
                         f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU only'}",
              "page_size": args.page_size, "staging_blocks": args.staging_blocks,
              "landing_layer_groups": args.layer_groups, "model": dataclasses.asdict(model),
              "synthetic_prefill": args.synthetic_prefill,
              "push_with_prefill": args.push_with_prefill,
              "pushes_with_prefill": pushed_with_prefill,
              "kv_bytes_per_token": per_token,
              "control_plane": cp, "landing": land, "decode_during_landing": during}
    if cp:
        _print_control(cp, result["machine"])
    for t, per_path in land.items():
        _print_landing(per_path, int(t), args.page_size, args.staging_blocks)
    for t, d in during.items():
        _print_during(d)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def _print_control(cp: dict, machine: str) -> None:
    print(f"\ncontrol plane at TP 2 ({machine}; one broadcast command per step, msgspec codec):")
    print(f"{'measurement':<32} {'median us':>10} {'p90 us':>10} {'n':>6}")
    for k, v in cp.items():
        if isinstance(v, dict) and "median_us" in v:
            print(f"{k:<32} {v['median_us']:>10.1f} {v['p90_us']:>10.1f} {v['n']:>6}")
    stages = cp.get("real_step_stages", {})
    if stages:
        print("stages of a real step, median us: " + "  ".join(
            f"{k}={v:.1f}" for k, v in stages.items()))
    ratio = cp["ray_call_fanout_tp2"]["median_us"] / cp["shm_empty_step_round_trip"]["median_us"]
    print(f"Ray fan-out to both ranks / shm step round trip: {ratio:.1f}x")


def _print_landing(land: dict, tokens: int, page_size: int, staging_blocks: int) -> None:
    base = land["plain_copy"]
    print(f"\nlanding ({tokens} prompt tokens, page {page_size}, {staging_blocks} staging blocks; "
          f"baseline: {base['what']} of the same bytes, {base['GBps']:.2f} GB/s):")
    print(f"{'path':<8} {'KV MB':>9} {'moved MB':>9} {'e2e GB/s':>9} {'vs copy':>8} "
          f"{'data GB/s':>10}")
    for k, v in land.items():
        if k == "plain_copy":
            continue
        print(f"{k:<8} {v['kv_bytes'] / 1e6:>9.1f} {v['moved_bytes'] / 1e6:>9.1f} "
              f"{v['e2e_GBps']:>9.2f} {v['e2e_GBps'] / base['GBps']:>7.2f}x "
              f"{v['data_path_GBps']:>10.2f}")


def _print_during(d: dict) -> None:
    print(f"\ndecode during landings ({d['decoders']} decoding requests, {d['landings']} "
          f"landings of {d['tokens']} tokens, staged):")
    print(f"{'steps':<9} {'interval ms':>12} {'p90':>8} {'round trip ms':>14} {'p90':>8} "
          f"{'n':>5}")
    for side in ("outside", "during"):
        v = d[side]
        print(f"{side:<9} {v['interval']['median_ms']:>12.2f} {v['interval']['p90_ms']:>8.2f} "
              f"{v['round_trip']['median_ms']:>14.2f} {v['round_trip']['p90_ms']:>8.2f} "
              f"{v['interval']['n']:>5}")
    print(f"step interval during / outside a landing: {d['interval_ratio']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
