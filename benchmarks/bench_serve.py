"""Benchmark of the OpenAI front end (not a test): client-side time to first token (TTFT) and
inter-token latency (ITL) through the OpenAI endpoint, against driving the same decode replica
directly, and against the decode step time, all in the same run.

One Serve app (``build_openai_app``: one prefill worker + one decode replica, tiny model) and one
batch of concurrent streamed requests, sent three ways, one after the other, to the same replica:

  direct   ``ReplicaCoordinator.submit(stream=True)`` for every request, then the
           ``take_events`` long poll (what the Serve front end itself does; the baseline)
  handle   ``HiSparseServer.generate_stream`` through a Serve handle, one thread per request
  openai   the official ``openai`` client, ``completions.create(stream=True)`` over HTTP (SSE)

Per way: TTFT and ITL p50 / p90 as each client sees token arrivals, and ITL as a ratio to the
median decode step (command out -> last rank's report in, ``get_step_log``) of that way's batch.
A ratio near 1 means every step's tokens reached their streams before the next step, with no poll
period in between. Usage: ``python benchmarks/bench_serve.py [--requests 8] [--context 120]
[--new-tokens 32] [--rounds 2] [--tp 2]``; writes ``benchmarks/results/serve.json``. On a GPU
host add ``--device gpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import threading
import time
import uuid
from pathlib import Path

MODEL = "hisparse-bench"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _row(way: str, arrivals: list[list[float]], t0: float, steps: list[float]) -> dict:
    """arrivals[i]: perf_counter stamps of each token of request i (a chunk's tokens share its
    stamp); TTFT from the batch start, ITL between consecutive tokens."""
    ttft = [a[0] - t0 for a in arrivals if a]
    itl = [b - a for arr in arrivals for a, b in zip(arr, arr[1:])]
    step = statistics.median(steps) if steps else float("nan")
    return {"way": way, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "itl_p50_s": _pct(itl, 0.5), "itl_p90_s": _pct(itl, 0.9),
            "itl_mean_s": statistics.fmean(itl) if itl else float("nan"),
            "step_p50_s": step, "itl_mean_per_step": (statistics.fmean(itl) / step) if itl
            else float("nan"), "tokens": sum(len(a) for a in arrivals)}


def run_direct(coord, prompts, new_tokens) -> tuple[list[list[float]], float]:
    import ray

    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    arrivals: dict[str, list[float]] = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        ray.get(coord.submit.remote(rid, p, new_tokens, stream=True))
    done = 0
    while done < len(ids):
        fresh, finished = ray.get(coord.take_events.remote(prefix, 5.0))
        now = time.perf_counter()
        for rid, toks in fresh.items():
            arrivals[rid] += [now] * len(toks)
        for summary, err in finished:
            assert err is None, err
            rest = len(summary["tokens"]) - len(arrivals[summary["request_id"]])
            arrivals[summary["request_id"]] += [now] * rest
            done += 1
    return list(arrivals.values()), t0


def run_handle(handle, prompts, new_tokens) -> tuple[list[list[float]], float]:
    arrivals: list[list[float]] = [[] for _ in prompts]
    t0 = time.perf_counter()

    def one(i):
        gen = handle.options(stream=True).generate_stream.remote(ids=prompts[i],
                                                                  max_new_tokens=new_tokens)
        for chunk in gen:
            if not chunk.get("done"):
                arrivals[i] += [time.perf_counter()] * len(chunk["tokens"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return arrivals, t0


def run_openai(base_url, prompts, new_tokens) -> tuple[list[list[float]], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    arrivals: list[list[float]] = [[] for _ in prompts]

    async def one(i):
        stream = await client.completions.create(model=MODEL, prompt=prompts[i],
                                                 max_tokens=new_tokens, temperature=0,
                                                 stream=True)
        async for chunk in stream:  # one character per token with the byte tokenizer
            if chunk.choices and chunk.choices[0].text:
                arrivals[i] += [time.perf_counter()] * len(chunk.choices[0].text)

    async def main():
        await asyncio.gather(*[one(i) for i in range(len(prompts))])

    t0 = time.perf_counter()
    asyncio.run(main())
    return arrivals, t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=120, help="prompt tokens (host landing)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="each way this many times, in turn")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"))
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    args = ap.parse_args()

    import ray
    from ray import serve

    from hisparse_ray.actors.tp import free_port
    from hisparse_ray.deploy import visible_gpus
    from hisparse_ray.serve import build_openai_app

    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), num_gpus=visible_gpus(),
             include_dashboard=False, log_to_driver=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING"})
    t0 = time.perf_counter()
    serve.run(build_openai_app({"tp": args.tp, "device_blocks": 12, "device": args.device,
                                "max_new_tokens_limit": 4096, "served_model_name": MODEL}),
              name="bench", route_prefix="/", logging_config={"log_level": "WARNING"})
    handle = serve.get_deployment_handle("HiSparseServer", "bench")
    print(f"Serve app up in {time.perf_counter() - t0:.1f}s", flush=True)
    coord = handle.coordinator.remote().result()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 96) for _ in range(args.context)] for _ in range(args.requests)]
    base_url = f"http://127.0.0.1:{port}/v1"
    run_openai(base_url, prompts[:2], 2)  # warm every path once
    run_handle(handle, prompts[:2], 2)
    rows = []
    try:
        for r in range(args.rounds):
            for way, fn, target in (("direct", run_direct, coord), ("handle", run_handle, handle),
                                    ("openai", run_openai, base_url)):
                n0 = len(ray.get(coord.get_step_log.remote()))
                arrivals, start = fn(target, prompts, args.new_tokens)
                steps = [dt for _, dt in ray.get(coord.get_step_log.remote())[n0:]]
                row = {**_row(way, arrivals, start, steps), "round": r}
                rows.append(row)
                print(f"  round {r} {way:>6}: ITL p50 {row['itl_p50_s'] * 1e3:.1f} ms", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\n{args.requests} concurrent streams, {args.context}-token prompts, "
          f"{args.new_tokens} new tokens, TP {args.tp}, tiny model, {args.device} "
          f"({platform.node()}):")
    print(f"{'way':>7} {'round':>5} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} "
          f"{'ITL p90':>8} {'step p50':>9} {'ITL/step':>8}   (ms)")
    for r in rows:
        print(f"{r['way']:>7} {r['round']:>5} {r['ttft_p50_s'] * 1e3:>9.1f} "
              f"{r['ttft_p90_s'] * 1e3:>9.1f} {r['itl_p50_s'] * 1e3:>8.1f} "
              f"{r['itl_p90_s'] * 1e3:>8.1f} {r['step_p50_s'] * 1e3:>9.1f} "
              f"{r['itl_mean_per_step']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "host": platform.node(),
                               "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
