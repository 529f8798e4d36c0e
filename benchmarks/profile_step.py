"""Where a fast decode step's GPU time goes (not a test): issue #17's "batch-1 step vs its HBM
floor". The same DeepSeek-V3.2 attention stack and synthetic requests as ``bench_capacity.py``;
for each mode, the step's CUDA graph is timed, then the same step is run eagerly under
``torch.profiler`` and its kernels are summed by name and by family. Eager kernels take the time
they take inside the graph; the graph adds no launch cost but keeps the gaps between dependent
kernels, so ``graph ms - kernel ms`` is what fusing kernels could win at most.

    python benchmarks/profile_step.py [--context 32768] [--layers 61] [--batch 1] [--out DIR]
    python benchmarks/profile_step.py --quick        # tiny dims, CPU works: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_capacity import Setup, make_trace, stack  # noqa: E402

from hisparse_ray.kernels.kvfp8 import KVRowCodec  # noqa: E402
from hisparse_ray.rank.executor import Row  # noqa: E402

FAMILIES = (  # first match wins; names as CUDA reports them
    ("flash_mla (sparse attention)", r"flash|mla|sparse_attn"),
    ("indexer logits (deep_gemm)", r"mqa_logits|paged_mqa|deep_gemm|fp8_gemm"),
    ("top-k", r"topk|radix|sort|select"),
    ("resolver", r"resolve|hisparse"),
    ("GEMM (projections, MLP, head)", r"gemm|cutlass|xmma|nvjet|gemv|cublas|splitK"),
    ("norms / rope / softmax", r"norm|rope|rotary|softmax"),
    ("copies / index / scatter", r"copy|index|scatter|gather|fill|memcpy|memset|cat"),
    ("elementwise / reduce", r"elementwise|vectorized|reduce|unrolled"),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, pat in FAMILIES:
        if re.search(pat, low):
            return fam
    return "other"


def device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def profile(s: Setup, B: int, trace: torch.Tensor, steps: int) -> tuple[dict, dict, int]:
    """Eager steps under the profiler -> ({kernel: (us, calls)}, {family: us}, kernels) per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ex, bucket = s.ex, s.ex.cfg.bucket(B)
    use_graphs, ex.step.use_graphs = ex.step.use_graphs, False
    cuda = s.device.type == "cuda"
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def one(i: int) -> None:
        s.trace_buf[:, :B].copy_(trace[i % trace.shape[0], :, :B])
        rows = [ex.row_input(Row(rid, s.ctx + 1 + i, 1, None)) for rid in s.rids[:B]]
        ex.step.inputs.fill(rows, bucket)
        ex.step.run(bucket)
        if cuda:
            torch.cuda.synchronize()

    try:
        one(0)  # eager warm-up (allocator, lazy kernels)
        with torch_profile(activities=acts) as prof:
            for i in range(steps):
                one(i + 1)
    finally:
        ex.step.use_graphs = use_graphs
    kernels, fams, calls = {}, defaultdict(float), 0
    for e in prof.key_averages():
        us = device_us(e) if cuda else float(e.self_cpu_time_total)
        if us <= 0:
            continue
        kernels[e.key] = (us / steps, e.count / steps)
        fams[family(e.key)] += us / steps
        calls += e.count
    return kernels, dict(fams), calls // steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="profiled eager steps")
    ap.add_argument("--modes", nargs="+", default=["full", "hisparse"], choices=("full", "hisparse"))
    ap.add_argument("--top", type=int, default=18, help="kernels listed per mode")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny dims (CPU works)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ctx = 256 if a.quick else a.context
    t0 = time.perf_counter()
    st = stack(a.quick, a.layers, steps=3, warm=2)
    device, cfg, d, model, weight_bytes, hbm = st.device, st.cfg, st.d, st.model, st.weight_bytes, st.hbm
    codec = KVRowCodec("bf16", cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    host_rows = -(-(ctx + d.warm + d.steps + a.steps + 2 + d.page) // d.page) * d.page
    host_bytes = torch.empty(d.layers * host_rows * codec.row_bytes, dtype=torch.uint8,
                             pin_memory=device.type == "cuda")
    K, L, B = cfg.index_topk, d.layers, a.batch
    floor_ms = st.floor_ms(codec.row_bytes, ctx, B)
    print(f"[{time.perf_counter() - t0:6.1f}s] model {weight_bytes / 2**30:.1f} GiB, HBM {hbm:.0f} GB/s, "
          f"context {ctx}, batch {B}, {L} layers: HBM floor {floor_ms:.2f} ms", flush=True)
    results = []
    for mode in a.modes:
        s = Setup(model, mode, codec, max(B, 1), ctx, d, host_bytes, device)
        trace = make_trace(d.warm + d.steps + a.steps + 2, L, B, K, ctx, 0.4, device, 2)
        timed = s.run(B, trace, d.warm, d.steps)
        kernels, fams, calls = profile(s, B, trace, a.steps)
        total = sum(us for us, _ in kernels.values())
        results.append(dict(mode=mode, context=ctx, batch=B, layers=L, step_ms=timed["step_ms"],
                            graph_ms=timed["gpu_ms"], kernel_ms=total / 1e3, kernels_per_step=calls,
                            hbm_floor_ms=floor_ms, families_us=fams,
                            top=sorted(((k, us, n) for k, (us, n) in kernels.items()), key=lambda x: -x[1])[:40]))
        print(f"\n== {mode}: step {timed['step_ms']:.2f} ms wall, graph {timed['gpu_ms']:.2f} ms, "
              f"eager kernels {total / 1e3:.2f} ms in {calls} launches a step "
              f"({calls / L:.0f} a layer), floor {floor_ms:.2f} ms", flush=True)
        print(f"{'family':34s} {'us/step':>10s} {'share':>6s} {'us/layer':>9s}")
        for fam, us in sorted(fams.items(), key=lambda x: -x[1]):
            print(f"{fam:34s} {us:10.0f} {us / max(total, 1e-9):6.1%} {us / L:9.1f}")
        print(f"{'kernel (first 60 chars)':62s} {'us/step':>9s} {'calls':>6s}")
        for k, us, n in results[-1]["top"][: a.top]:
            print(f"{k[:62]:62s} {us:9.0f} {n:6.0f}")
        del s
        if device.type == "cuda":
            torch.cuda.empty_cache()
    path = os.path.join(a.out, "profile_step.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       hbm_gbps=hbm, weight_gib=weight_bytes / 2**30, results=results), f, indent=1)
    print(f"\nwrote {path}; graph / floor: " + ", ".join(
        f"{r['mode']} {r['graph_ms'] / r['hbm_floor_ms']:.2f}x (kernels alone "
        f"{r['kernel_ms'] / r['hbm_floor_ms']:.2f}x)" for r in results))


if __name__ == "__main__":
    main()
