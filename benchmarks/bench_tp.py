"""Benchmark (not a test): decode step time of one replica at TP 1, TP 2 on one GPU and TP 2 with a
GPU per rank, on the same requests in the same process, and the host memory each layout uses.

Every layout runs the same long-context requests (host tier: their contexts are many times the
device pool) through prefill -> NIXL -> the replica, and reports the median decode step (the
coordinator's step wall time: command out, every rank's forward + copies, reports back), tokens/s,
the shared host pool (segments in ``/dev/shm`` and their bytes: one pool per replica whatever its
TP size) and whether the greedy tokens equal TP 1's. Ratios are against TP 1 in this run.

Layouts (``--layouts``): ``tp1`` (one rank, one GPU), ``tp2-one-gpu`` (two ranks at 0.5 GPU, gloo
TP group), ``tp2-gpu-each`` (two ranks at 0.8 GPU: one per GPU, NCCL TP group; needs 2 GPUs).
On CPU every layout runs on CPU (gloo), which measures the actor system only.

Usage: ``python benchmarks/bench_tp.py [--model tiny|landing] [--requests 8] [--context 2048]
[--new-tokens 32] [--out benchmarks/results/tp.json]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import shutil
import subprocess
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
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec

def profile_summary(path: str, top: int = 10) -> list[tuple[float, str]]:
    """Where a rank's step thread spends its samples (``py-spy --format raw``): the ``top``
    frames by inclusive share below 99 % (above: the thread's own call chain), then the ``top``
    innermost frames ("self:")."""
    incl: collections.Counter = collections.Counter()
    inner: collections.Counter = collections.Counter()
    total = 0
    if not Path(path).exists():
        return []
    for line in Path(path).read_text().splitlines():
        if " " not in line:
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        if not any("HiSparseWorker.execute" in f for f in frames):
            continue
        total += int(n)
        inner[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    if not total:
        return []
    body = [(n / total, f) for f, n in incl.most_common() if n / total < 0.99][:top]
    return body + [(n / total, "self: " + f) for f, n in inner.most_common(top)]


LAYOUTS = {"tp1": (1, 0.8), "tp2-one-gpu": (2, 0.4), "tp2-gpu-each": (2, 0.8)}


def shm_segments(replica_id: str, pids: list[int]) -> list[tuple[str, int]]:
    """(name, bytes) of the host pool segments the ranks map (their names leave /dev/shm once
    every rank attached, so the ranks' /proc/<pid>/maps are where they show)."""
    from hisparse_ray.host.segment import mapped_segments

    pre, seen = f"hisparse-pool.{replica_id}.", {}
    for pid in pids:
        for n, b in mapped_segments(pid).items():
            if n.startswith(pre):
                seen[n] = max(seen.get(n, 0), b)
    return sorted(seen.items())


def run_layout(name: str, model: ModelSpec, args, gpu: bool, requests) -> dict:
    tp_size, gpus = LAYOUTS[name]
    rid = f"bench-{name}"
    hisparse = dataclasses.replace(ReplicaSpec().hisparse, host_pool_gib=args.host_pool_gib)
    spec = ReplicaSpec(model=model, hisparse=hisparse, tp_size=tp_size,
                       gpus_per_rank=gpus if gpu else 0.0, num_device_blocks=args.device_blocks,
                       staging_blocks=max(16, args.context // 8 + 1), max_batch=len(requests),
                       replica_id=rid)
    t0 = time.perf_counter()
    rep = launch.launch_replica(spec)
    try:
        infos = ray.get([r.node_info.remote() for r in rep.ranks])
        segs = shm_segments(rid, [i["pid"] for i in infos])
        pf = launch.launch_prefill(PrefillSpec(model=model, gpus=0.2 if gpu else 0.0,
                                               max_prompt_tokens=args.context + 8, name=rid,
                                               batch_invariant=False))
        path = launch.connect(rep, pf, "staged" if gpu else "auto")
        up = time.perf_counter() - t0
        print(f"  {name}: up in {up:.1f} s, ranks on "
              f"{[(i['gpu'] or 'cpu')[-6:] for i in infos]}, TP group "
              f"{infos[0]['tp_backend'] or '-'}, landing {path}", flush=True)
        # warm-up request (allocator, kernels, NCCL communicators), then the measured batch
        ray.get(rep.coordinator.submit.remote("warm", requests[0][1][:64], 4))
        ray.get(rep.coordinator.wait.remote(["warm"], 600))
        steps0 = len(ray.get(rep.coordinator.get_step_log.remote()))
        t1 = time.perf_counter()
        for r, p in requests:
            ray.get(rep.coordinator.submit.remote(r, p, args.new_tokens))
        spies = []
        spy = shutil.which(args.py_spy) if args.profile_s else None
        if args.profile_s and not spy:
            print(f"  no profile: {args.py_spy!r} not found")
        if spy:  # sample every rank while it decodes
            time.sleep(args.profile_delay_s)
            spies = [subprocess.Popen(
                [spy, "record", "-d", str(max(1, round(args.profile_s))), "-r", "250", "-p", str(i["pid"]),
                 "--format", "raw", "-o", f"{args.out}.{name}.r{i['rank']}.prof"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in infos]
        rows = {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
            [r for r, _ in requests], 1200))}
        wall = time.perf_counter() - t1
        for sp in spies:
            _, err = sp.communicate(timeout=args.profile_s + 60)
            if sp.returncode:
                print(f"  py-spy failed ({sp.returncode}): {err.strip()[-300:]}")
        log = ray.get(rep.coordinator.get_step_log.remote())[steps0:]
        measured = {step for step, _ in log}
        rank_exec = [statistics.median([s for step, s in ray.get(r.get_step_log.remote())
                                        if step in measured]) * 1e3 for r in rep.ranks]
        m = ray.get(rep.coordinator.metrics.remote())
    finally:
        rep.shutdown()
    profiles = {}
    for i in infos if spies else ():
        prof = profile_summary(f"{args.out}.{name}.r{i['rank']}.prof")
        profiles[i["rank"]] = prof
        print(f"  {name} rank {i['rank']}: step-thread samples by frame (inclusive)")
        for share, frame in prof:
            print(f"    {share:6.1%} {frame[:110]}")
    errors = {r: v["error"] for r, v in rows.items() if v["error"]}
    if errors:
        raise RuntimeError(f"{name}: requests failed: {errors}")
    # steps with the whole batch decoding (not the ramp while landings trickle in)
    full = [s for _, s in log]
    return {
        "tp_size": tp_size, "gpus_per_rank": gpus if gpu else 0.0,
        "tp_backend": infos[0]["tp_backend"], "rank_gpus": [i["gpu"] for i in infos],
        "steps": len(full), "step_ms_median": statistics.median(full) * 1e3,
        "step_ms_p90": sorted(full)[int(0.9 * (len(full) - 1))] * 1e3,
        "rank_execute_ms_median": rank_exec,
        "tokens": sum(len(v["tokens"]) for v in rows.values()), "wall_s": wall,
        "host_pool_segments": len(segs), "host_pool_bytes": sum(b for _, b in segs),
        "counters": {k: m["counters"][k] for k in ("spills", "restores", "backups")},
        "token_ids": {r: v["tokens"] for r, v in rows.items()},
        "profiles": profiles,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                    help="default: every layout the GPUs allow")
    ap.add_argument("--model", choices=["tiny", "landing"], default="tiny")
    ap.add_argument("--layers", type=int, default=61, help="layers of the 'landing' model")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device-blocks", type=int, default=64)
    ap.add_argument("--host-pool-gib", type=float, default=None,
                    help="default: 2x the requests' KV")
    ap.add_argument("--profile-s", type=float, default=0,
                    help="sample every rank with py-spy for this many seconds while it decodes")
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    ap.add_argument("--profile-delay-s", type=float, default=2.0,
                    help="start sampling this long after the batch was submitted")
    ap.add_argument("--out", default="benchmarks/results/tp.json")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if gpu else 0
    layouts = args.layouts or [k for k in LAYOUTS if k != "tp2-gpu-each" or n_gpus >= 2]
    model = ModelSpec(dtype="bfloat16" if gpu else "float32", shape=args.model,
                      num_layers=args.layers)
    kv = args.requests * (args.context + args.new_tokens) * model.kv_layout(8).bytes_per_token
    if args.host_pool_gib is None:
        args.host_pool_gib = max(0.05, 2 * kv / 2**30)
    rng = random.Random(0)
    requests = [(f"b{i}", [rng.randrange(1, 96) for _ in range(args.context)])
                for i in range(args.requests)]
    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), num_gpus=n_gpus,
             include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for name in layouts:
            results[name] = run_layout(name, model, args, gpu, requests)
    finally:
        ray.shutdown()
    machine = (f"{platform.node()} {os.cpu_count()} cores, "
               + (f"{n_gpus}x {torch.cuda.get_device_name()}" if gpu else "CPU only"))
    base = results.get("tp1") or next(iter(results.values()))
    print(f"\ndecode steps, {args.requests} requests x {args.context} prompt tokens, "
          f"{args.new_tokens} new each, model {args.model} ({machine}):")
    print(f"{'layout':<14} {'group':>5} {'step ms':>8} {'p90 ms':>7} {'exec ms':>7} {'vs tp1':>7} "
          f"{'tok/s':>7} {'pool segs':>9} {'pool MiB':>9} {'same tokens':>11}")
    for name, r in results.items():
        same = r["token_ids"] == base["token_ids"]
        r["same_tokens_as_first"] = same
        print(f"{name:<14} {r['tp_backend'] or '-':>5} {r['step_ms_median']:>8.2f} "
              f"{r['step_ms_p90']:>7.2f} {max(r['rank_execute_ms_median']):>7.2f} "
              f"{r['step_ms_median'] / base['step_ms_median']:>6.2f}x "
              f"{r['tokens'] / r['wall_s']:>7.1f} {r['host_pool_segments']:>9} "
              f"{r['host_pool_bytes'] / 2**20:>9.1f} {str(same):>11}")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
           "args": vars(args),
           "layouts": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"}
                       for k, v in results.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
