"""Benchmark of the Ray Serve front end (not a test): what ``hisparse_ray.serve`` adds on top of the
decode replica it serves, against that same replica driven directly in the same run.

One Serve app (``build_app``: one prefill worker + one decode replica, TP 2, tiny model) and one
batch of concurrent requests, sent four ways, one after the other, all to the same replica:

  direct   ``Coordinator.submit`` for every request, then ``take_done`` until all are back
           (what a scripted Ray job does; the baseline)
  handle   ``handle.generate.remote`` for every request at once
  http     one thread per request POSTing JSON to the Serve proxy
  stream   ``generate_stream`` for every request at once; also time to the first chunk

Per way: wall time of the batch, median / p90 request latency, and the batch time as a ratio to
``direct``. The decode is the same in every way, so the ratio is the front end's cost. Usage:
``python benchmarks/bench_serve.py [--requests 8] [--context 120] [--new-tokens 16] [--rounds 2]``;
writes ``benchmarks/results/serve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import threading
import time
import urllib.request
import uuid
from pathlib import Path


def _in_threads(fn, items) -> None:
    """``fn(item)`` for every item at once, one thread each; returns when all are done."""
    threads = [threading.Thread(target=fn, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _stats(name: str, wall: float, lat: list[float], extra: dict | None = None) -> dict:
    lat = sorted(lat)
    return {"way": name, "batch_s": wall, "latency_p50_s": statistics.median(lat),
            "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))], **(extra or {})}


def run_direct(coord, prompts, new_tokens) -> dict:
    import ray

    t0 = time.perf_counter()
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        ray.get(coord.submit.remote(rid, p, new_tokens))
    done: dict[str, float] = {}
    while len(done) < len(ids):
        for summary, err in ray.get(coord.take_done.remote(None, 5.0, 4096, prefix)):
            assert err is None, err
            done[summary["request_id"]] = time.perf_counter() - t0
    return _stats("direct", time.perf_counter() - t0, list(done.values()))


def run_handle(handle, prompts, new_tokens) -> dict:
    t0 = time.perf_counter()
    resps = [handle.generate.remote(ids=p, max_new_tokens=new_tokens) for p in prompts]
    lat = []
    for r in resps:  # results in submission order: a latency is bounded by the batch anyway
        r.result(timeout_s=600)
        lat.append(time.perf_counter() - t0)
    return _stats("handle", time.perf_counter() - t0, lat)


def run_http(url, prompts, new_tokens) -> dict:
    lat: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(p):
        req = urllib.request.Request(url, data=json.dumps(
            {"ids": p, "max_new_tokens": new_tokens}).encode())
        with urllib.request.urlopen(req, timeout=600) as resp:
            assert resp.status == 200
            resp.read()
        with lock:
            lat.append(time.perf_counter() - t0)

    _in_threads(one, prompts)
    assert len(lat) == len(prompts), "an HTTP request failed"
    return _stats("http", time.perf_counter() - t0, lat)


def run_stream(handle, prompts, new_tokens) -> dict:
    lat: list[float] = []
    first: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(p):
        gen = handle.options(stream=True).generate_stream.remote(ids=p,
                                                                  max_new_tokens=new_tokens)
        got_first = False
        for chunk in gen:
            if not got_first:
                with lock:
                    first.append(time.perf_counter() - t0)
                got_first = True
            if chunk.get("done"):
                with lock:
                    lat.append(time.perf_counter() - t0)

    _in_threads(one, prompts)
    return _stats("stream", time.perf_counter() - t0, lat,
                  {"first_chunk_p50_s": statistics.median(first)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=120, help="prompt tokens (host landing)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="each way this many times, in turn")
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    args = ap.parse_args()

    import ray
    from ray import serve

    from hisparse_ray.actors.tp import free_port
    from hisparse_ray.serve import build_app

    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING"})
    t0 = time.perf_counter()
    handle = serve.run(build_app({"tp": 2, "device_blocks": 12, "max_new_tokens_limit": 4096}),
                       name="bench", route_prefix="/", logging_config={"log_level": "WARNING"})
    print(f"Serve app up in {time.perf_counter() - t0:.1f}s", flush=True)
    coord = handle.coordinator.remote().result()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 96) for _ in range(args.context)] for _ in range(args.requests)]
    url = f"http://127.0.0.1:{port}/"
    run_handle(handle, prompts[:2], 2)  # warm every path once
    run_http(url, prompts[:2], 2)
    rows = []
    try:
        for r in range(args.rounds):
            for fn, target in ((run_direct, coord), (run_handle, handle), (run_http, url),
                               (run_stream, handle)):
                row = fn(target, prompts, args.new_tokens)
                row["round"] = r
                rows.append(row)
                print(f"  round {r} {row['way']:>6}: batch {row['batch_s']:.2f}s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()

    base = {r["round"]: r["batch_s"] for r in rows if r["way"] == "direct"}
    print(f"\n{args.requests} concurrent requests, {args.context}-token prompts, "
          f"{args.new_tokens} new tokens, TP 2, tiny model on CPU ({platform.node()}):")
    print(f"{'way':>7} {'round':>5} {'batch s':>8} {'p50 s':>7} {'p90 s':>7} {'x direct':>8}"
          f" {'1st chunk s':>11}")
    for r in rows:
        r["ratio_to_direct"] = r["batch_s"] / base[r["round"]]
        fc = f"{r['first_chunk_p50_s']:.2f}" if "first_chunk_p50_s" in r else ""
        print(f"{r['way']:>7} {r['round']:>5} {r['batch_s']:>8.2f} {r['latency_p50_s']:>7.2f} "
              f"{r['latency_p90_s']:>7.2f} {r['ratio_to_direct']:>8.2f} {fc:>11}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": platform.node(),
                               "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
