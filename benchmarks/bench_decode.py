"""Decode step time and capacity: HiSparse (host tier, small hot buffer) vs full-resident, same run.

For each (batch, context) the same prompts run through the in-process Engine twice: full-resident
(all KV in device pages) and HiSparse (a device pool that only holds hot buffers, so every request
lands on the host tier). Reports mean decode step time, tokens/s, the ratio HiSparse/full-resident,
device blocks per request (the capacity win) and the hot-buffer hit rate, and checks the generated
tokens are identical. Batched forward (``batch_invariant=False``) for realistic step times.

    python benchmarks/bench_decode.py [--device cuda] [--dtype bfloat16] [--out results/decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks  # noqa: E402
from hisparse_ray.engine import Engine, EngineConfig  # noqa: E402
from hisparse_ray.model.model import build_tiny_model  # noqa: E402


def _run(model, prompts, max_new, cfg):
    with Engine(model, cfg) as eng:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, max_new)
        sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
        eng.step()  # first step: admission + warm-up
        sync()
        t0, steps = time.perf_counter(), 0
        while not eng.done:
            if not eng.step():
                break
            steps += 1
        sync()
        dt = time.perf_counter() - t0
        out = eng.run()
        w, c = eng.worker.counters, eng.core.counters
        looked = w["hot_hits"] + w["hot_misses"]
        return {
            "tokens": out, "step_ms": 1e3 * dt / max(steps, 1), "steps": steps,
            "tok_per_s": len(prompts) * steps / dt if dt else 0.0,
            "hit_rate": w["hot_hits"] / looked if looked else None,
            "device_blocks_total": c.device_blocks_total,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = build_tiny_model(0, "deepseek_v32", dtype=dtype, device=args.device)
    hs = HiSparseConfig(top_k=8, device_buffer_size=32, host_to_device_ratio=4,
                        swap_in_block_size=256, host_pool_gib=0.5)
    page = 16
    hot_blocks = hot_buffer_blocks(hs.device_buffer_size, page)
    rows = []
    print(f"device={args.device} dtype={dtype} model=tiny deepseek_v32 H={hs.device_buffer_size} "
          f"top_k={hs.top_k} page={page}")
    print(f"{'batch':>5} {'ctx':>6} {'full ms':>8} {'hisp ms':>8} {'ratio':>6} {'hit':>6} "
          f"{'blk/req full':>12} {'blk/req hisp':>12} {'exact':>6}")
    for B in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            g = torch.Generator().manual_seed(B * 7919 + ctx)
            prompts = [torch.randint(0, model.cfg.vocab_size, (ctx,), generator=g).tolist()
                       for _ in range(B)]
            common = dict(hisparse=hs, page_size=page, max_batch=B, device=args.device,
                          batch_invariant=False)
            full = _run(model, prompts, args.new, EngineConfig(full_resident=True, **common))
            hisp = _run(model, prompts, args.new,
                        EngineConfig(num_device_blocks=B * hot_blocks, **common))
            life_pages = -(-(ctx + args.new) // page)
            row = {
                "device": args.device, "dtype": str(dtype), "batch": B, "context": ctx,
                "full_step_ms": full["step_ms"], "hisparse_step_ms": hisp["step_ms"],
                "ratio": hisp["step_ms"] / full["step_ms"], "hit_rate": hisp["hit_rate"],
                "blocks_per_request_full": life_pages, "blocks_per_request_hisparse": hot_blocks,
                "tokens_identical": full["tokens"] == hisp["tokens"],
            }
            rows.append(row)
            print(f"{B:>5} {ctx:>6} {full['step_ms']:>8.2f} {hisp['step_ms']:>8.2f} "
                  f"{row['ratio']:>6.2f} {(hisp['hit_rate'] or 0):>6.2f} {life_pages:>12} "
                  f"{hot_blocks:>12} {str(row['tokens_identical']):>6}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
