"""TPOT with the resolver beside the absorbed query vs in line (not a test): issue #17's TPOT
goal. ``FastPathConfig.overlap_resolve`` runs each layer's resolver on a side stream while the
main stream computes ``q_b_proj`` + ``W_uk``; both modes (full-resident's resolver only looks up
resident rows) gain, HiSparse more (its miss copies hide too).

The same stack and synthetic requests as ``bench_capacity.py`` (61 layers of DeepSeek-V3.2's
attention shapes), 4 requests a setup, batch 1 and 4, in one process: for each context and mode
the step with ``overlap_resolve`` off, then on, on fresh setups over the same top-k traces.

    python benchmarks/bench_overlap.py [--contexts 32768 131072] [--out DIR]
    python benchmarks/bench_overlap.py --quick      # tiny dims, CPU works: checks the script
                                                   # (on CPU there is no side stream: on == off)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_capacity import Setup, _table, make_trace, stack  # noqa: E402

from hisparse_ray.kernels.kvfp8 import KVRowCodec  # noqa: E402

CASES = (("full", "bf16", "random"), ("hisparse", "bf16", "overlap"), ("hisparse", "bf16", "random"),
         ("hisparse", "fp8", "overlap"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_overlap_out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    contexts = [256] if a.quick else a.contexts
    t0 = time.perf_counter()
    st = stack(a.quick, a.layers, a.steps, a.warm)
    device, cfg, d, model = st.device, st.cfg, st.d, st.model
    codecs = {k: KVRowCodec(k, cfg.kv_lora_rank, cfg.qk_rope_head_dim) for k in ("bf16", "fp8")}
    host_rows = -(-(max(contexts) + a.warm + a.steps + d.page + 1) // d.page) * d.page
    host = torch.empty(d.layers * host_rows * codecs["bf16"].row_bytes, dtype=torch.uint8,
                       pin_memory=device.type == "cuda")
    B = 4
    rows = []
    for ctx in contexts:
        traces = {name: make_trace(a.warm + a.steps, d.layers, B, cfg.index_topk, ctx, ov, device, seed)
                  for name, ov, seed in (("random", 0.0, 1), ("overlap", 0.4, 2))}
        for mode, kv, trace in CASES:
            for overlap in (False, True):
                s = Setup(model, mode, codecs[kv], B, ctx, d, host, device, overlap_resolve=overlap)
                for b in (1, B):
                    r = s.run(b, traces[trace], a.warm, a.steps)
                    rows.append(dict(context=ctx, mode=mode, rows=kv, trace=trace, overlap=overlap,
                                     batch=b, **r))
                    print(f"[{time.perf_counter() - t0:6.1f}s] {ctx} {mode} {kv} {trace} overlap={overlap} "
                          f"B={b}: {r['step_ms']:.2f} ms (gpu {r['gpu_ms']:.2f})", flush=True)
                del s
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    summary = []
    for ctx in contexts:
        for b in (1, B):
            def ms(mode, kv, trace, ov):
                return next(r["step_ms"] for r in rows if (r["context"], r["mode"], r["rows"], r["trace"],
                                                            r["overlap"], r["batch"]) == (ctx, mode, kv, trace, ov, b))
            for ov in (False, True):
                full = ms("full", "bf16", "random", ov)
                summary.append(dict(
                    context=ctx, batch=b, overlap=ov, full_ms=full,
                    tpot_ratio=ms("hisparse", "bf16", "overlap", ov) / full,
                    tpot_ratio_random=ms("hisparse", "bf16", "random", ov) / full,
                    tpot_ratio_fp8=ms("hisparse", "fp8", "overlap", ov) / full,
                    full_on_over_off=ms("full", "bf16", "random", True) / ms("full", "bf16", "random", False),
                    hs_on_over_off=ms("hisparse", "bf16", "overlap", True) / ms("hisparse", "bf16", "overlap", False)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), os.path.join(a.out, "bench_overlap.parquet"))
    with open(os.path.join(a.out, "bench_overlap.json"), "w") as f:
        json.dump(dict(rows=rows, summary=summary, device=str(device), layers=d.layers), f, indent=1)
    print(_table(rows, ["context", "mode", "rows", "trace", "overlap", "batch", "step_ms", "gpu_ms", "hit_rate"]))
    print(_table(summary, list(summary[0])))


if __name__ == "__main__":
    main()
