"""The engine's step pipeline (``EngineConfig.lookahead``): decode ms per step with the host's work
for step N + 1 overlapping the GPU's step N, against the same engine without it, same process.

Not a test: the whole engine loop is timed (coordinator, worker bookkeeping, input fill, the
captured step, reading the tokens), which ``bench_capacity.py``'s TPOT leaves out (it times the
fast step with its input fill only). Per batch size and mode (HiSparse host tier / full-resident):
the same prompts run with lookahead off and on (alternating which goes first); the greedy tokens
must be equal (the script exits 1 otherwise). The model is ``bench_capacity.py``'s DeepSeek-V3.2
attention stack (random weights, small dense MLP); prompts are real prefills of ``--context``
tokens (chunked sparse prefill), so keep the context short: the step's host work does not depend
on it, only the GPU's share does.

    python benchmarks/bench_lookahead.py [--layers 61] [--context 4096] [--batches 1 4 16]
    python benchmarks/bench_lookahead.py --quick     # tiny dims, CPU works: checks the script

Writes ``lookahead.json`` (and prints the table) under ``--out``. On CPU a launched step runs to
the end, so the ratio there is ~1.0 by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_capacity import _compile_glue, stack  # noqa: E402

from hisparse_ray.config import HiSparseConfig, KVLayout, hot_buffer_blocks  # noqa: E402
from hisparse_ray.engine import Engine, EngineConfig  # noqa: E402
from hisparse_ray.fastpath.config import FastPathConfig  # noqa: E402


def engine_config(s, mode: str, B: int, ctx: int, life: int, lookahead: bool, buckets) -> EngineConfig:
    d, cfg, cuda = s.d, s.cfg, s.device.type == "cuda"
    kv = "bf16" if cuda else "auto"
    row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (2 if cuda else 4)
    layout = KVLayout(num_layers=d.layers, page_size=d.page, row_bytes=row_bytes)
    pages = -(-life // d.page)
    host_gib = (B * pages + 4) * layout.block_bytes / (1 << 30)
    hs = HiSparseConfig(top_k=cfg.index_topk, device_buffer_size=d.H, swap_in_block_size=1024,
                        host_pool_gib=host_gib)
    hot = hot_buffer_blocks(d.H, d.page)
    fast = FastPathConfig(max_context=life + 1, buckets=buckets,
                          index_key_dtype="fp8" if cuda else "auto", cuda_graphs=True,
                          compile_glue=_compile_glue(s.device))
    common = dict(hisparse=hs, page_size=d.page, max_batch=max(buckets), device=str(s.device),
                  batch_invariant=False, kv_cache_dtype=kv, fast_path=fast, lookahead=lookahead)
    if mode == "full":
        return EngineConfig(full_resident=True, **common)
    return EngineConfig(num_device_blocks=B * hot, **common)  # hot buffers only: host tier


def timed(s, cfg: EngineConfig, prompts, warm: int, steps: int) -> dict:
    """Land every prompt, run ``warm`` steps, then time ``steps`` engine steps (the engine's
    whole loop; the GPU is synchronized before and after)."""
    sync = torch.cuda.synchronize if s.device.type == "cuda" else (lambda: None)
    with Engine(s.model, cfg) as eng:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, warm + steps + 2)
        for _ in range(warm):
            eng.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        out = eng.run()
        c = eng.core.counters
    return dict(ms=ms, tokens=out, chained=c.chained_rows, steps=c.steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="+", default=["hisparse", "full"], choices=["hisparse", "full"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs per cell (median)")
    ap.add_argument("--quick", action="store_true", help="tiny dims (CPU works): checks the script")
    ap.add_argument("--out", default="bench_lookahead_out")
    a = ap.parse_args()
    if a.quick:
        a.context, a.batches, a.steps, a.warm, a.repeats = 40, [1, 2], 4, 2, 1
    s = stack(a.quick, a.layers, a.steps, a.warm)
    buckets = tuple(sorted({1, 4, *a.batches}))
    life = a.context + a.warm + a.steps + 4
    g = torch.Generator().manual_seed(5)
    rows, failed = [], False
    print(f"device {s.device}, {s.d.layers} layers, context {a.context}, hot buffer {s.d.H}, "
          f"steps {a.steps} (after {a.warm})", flush=True)
    for B in a.batches:
        prompts = [torch.randint(0, s.cfg.vocab_size, (a.context,), generator=g).tolist()
                   for _ in range(B)]
        for mode in a.modes:
            got: dict[bool, list[dict]] = {False: [], True: []}
            for r in range(a.repeats):
                for la in ((False, True) if r % 2 == 0 else (True, False)):
                    cfg = engine_config(s, mode, B, a.context, life, la, buckets)
                    got[la].append(timed(s, cfg, prompts, a.warm, a.steps))
            off = statistics.median(x["ms"] for x in got[False])
            on = statistics.median(x["ms"] for x in got[True])
            same = all(x["tokens"] == got[False][0]["tokens"] for x in got[False] + got[True])
            failed |= not same
            row = dict(batch=B, mode=mode, off_ms=round(off, 3), on_ms=round(on, 3),
                       ratio=round(on / off, 4), chained_rows=got[True][0]["chained"],
                       tokens_equal=same)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu",
                layers=s.d.layers, context=a.context, steps=a.steps, warm=a.warm,
                date=time.strftime("%Y-%m-%d"), torch=torch.__version__)
    with open(os.path.join(a.out, "lookahead.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("\n| batch | mode | lookahead off ms/step | on ms/step | on / off | chained rows | tokens equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | "
              f"{r['ratio']:.3f} | {r['chained_rows']} | {r['tokens_equal']} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
