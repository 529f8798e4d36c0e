"""Model folders: load time and peak host memory per TP rank, and the decode step time of the
loaded layer with fp8 GEMMs vs the same weights dequantized to bf16, same run.

1. Writes a DeepSeek-V3.2 decoder layer at real size (hidden 7168, 128 heads, 256 routed experts +
   1 shared of 2048, fp8 block-quantized random weights, the released format: ~11.5 GB) to
   ``--dir`` (a temp dir by default, removed after). ``--tiny``: a small layer on the CPU.
2. Loads it once per TP rank (``--tp``; and TP 1), each in a fresh process that reports its load
   time and its peak RSS during the load (``VmHWM`` after a reset) against the checkpoint size: a
   rank reads only its slices, one shard mapped at a time.
3. Times decode steps of the loaded layer (``DSAModel.decode``, eager, over a dense KV cache of
   ``--context`` rows per request, MoE on the grouped path) for each ``--batches`` size, fp8
   (weights kept fp8, DeepGEMM) and dequantized bf16 in the same process; on CUDA also the
   layer's MoE alone replayed as a CUDA graph (no launch overhead: what the weights cost).

    python benchmarks/bench_checkpoint.py                 # H200: real-size layer
    python benchmarks/bench_checkpoint.py --tiny          # CPU
Prints tables and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hisparse_ray.kernels import fp8_gemm  # noqa: E402
from hisparse_ray.model.cache import DenseKVCache, IndexerKeyCache  # noqa: E402
from hisparse_ray.model.checkpoint import Checkpoint  # noqa: E402
from hisparse_ray.model.export import deepseek_v32_config, random_items, released_config, write_checkpoint  # noqa: E402
from hisparse_ray.model.fp8 import Fp8Format  # noqa: E402
from hisparse_ray.model.layers import set_moe_path  # noqa: E402
from hisparse_ray.model.sharded_load import load_checkpoint  # noqa: E402

FMT = Fp8Format(block=(128, 128), ue8m0=True)
GB = 1e9


def layer_config(tiny: bool):
    cfg = deepseek_v32_config(num_layers=1, vocab_size=4096)
    if tiny:  # every quantized dim a multiple of 128; TP 2 keeps 128-row blocks whole
        cfg = cfg.with_(hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
                        num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                        v_head_dim=64, index_n_heads=8, index_topk=64, n_routed_experts=16, n_group=4,
                        topk_group=2, num_experts_per_tok=4, vocab_size=1024)
    return cfg


def _rss(key: str = "VmRSS:") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def child_load(args) -> None:
    """One rank's load in this (fresh) process; prints one JSON line."""
    if args.device == "cuda":
        torch.empty(1, device="cuda")  # CUDA context before the baseline
    ckpt = Checkpoint(args.dir)
    from hisparse_ray.model.config import tiny_config
    from hisparse_ray.model.model import DSAModel

    with torch.device("meta"):  # the first meta build imports torch's lazy modules (~0.1 GB)
        DSAModel(tiny_config())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS: the load's own peak follows
    before = _rss()
    t0 = time.perf_counter()
    model = load_checkpoint(ckpt, dtype=torch.bfloat16, device=args.device, rank=args.rank,
                            tp_size=args.tp, fp8=args.fp8)
    if args.device == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    peak = _rss("VmHWM:")
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"rank": args.rank, "tp": args.tp, "fp8": args.fp8, "load_s": load_s,
                      "rss_before": before, "rss_peak": peak, "rss_after": _rss(),
                      "rank_weight_bytes": params, "checkpoint_bytes": ckpt.nbytes,
                      "kept_fp8": bool(model.model.layers[0].mlp.experts.fp8_block)}))


def time_decode(model, batch: int, context: int, iters: int) -> float:
    """Mean ms of one ``decode`` step of ``batch`` requests with ``context`` cached rows each."""
    cfg, dev, dt = model.cfg, model.device, model.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    L = cfg.num_hidden_layers
    kv = DenseKVCache(L, cfg.row_dim, batch, context + 1, dtype=dt, device=dev)
    rows = torch.randn(L, context, cfg.row_dim, generator=g, device=dev).to(dt)
    keys = torch.randn(L, context, cfg.index_head_dim, generator=g, device=dev).to(dt)
    caches = []
    for b in range(batch):
        kv.load(b, rows)
        caches.append(IndexerKeyCache.from_prefill(keys, context + 1))
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g, device=dev)
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = torch.arange(batch)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        for b in range(batch):
            kv.lengths[b], caches[b].length = context, context
        kv.begin_step(slots, pos)
        model.decode(ids, pos, kv, caches)

    for _ in range(2):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def time_moe_graph(model, batch: int, iters: int) -> float | None:
    """Mean ms of the layer's MoE (router + grouped experts + shared expert) for ``batch`` tokens,
    replayed as a CUDA graph (no launch overhead: what the weights cost). None if not capturable."""
    moe = model.model.layers[0].mlp
    x = torch.randn(batch, model.cfg.hidden_size, device="cuda").to(model.dtype)
    try:
        for _ in range(3):
            moe(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe(x)
    except Exception as err:  # a host sync inside: report, do not fail the benchmark
        print(f"  (MoE CUDA graph not capturable: {type(err).__name__}: {str(err)[:120]})")
        return None
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small layer on the CPU")
    p.add_argument("--dir", help="where to write the folder (default: a temp dir, removed after)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="results/checkpoint.json")
    # child mode (one rank's load in a fresh process)
    p.add_argument("--child-load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fp8", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_load:
        child_load(args)
        return 0
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    kernel = fp8_gemm.supported(device)
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        cfg = layer_config(args.tiny)
        t0 = time.perf_counter()
        write_checkpoint(args.dir, released_config(cfg, fp8=FMT), random_items(cfg, 0, device),
                         fp8=FMT, shard_bytes=(2 << 30) if not args.tiny else (8 << 20))
        write_s = time.perf_counter() - t0
        size = Checkpoint(args.dir).nbytes
        print(f"device {device}, fp8 GEMM {'yes' if kernel else 'no (dequantized)'}; wrote a "
              f"{'tiny' if args.tiny else 'real-size DeepSeek-V3.2'} layer: {size / GB:.2f} GB in {write_s:.1f} s")
        loads = []
        print(f"\n{'rank':>4} {'tp':>3} {'fp8':>10} {'load s':>7} {'RSS before GB':>13} {'peak GB':>8} "
              f"{'peak-before':>11} {'/ ckpt':>7} {'rank weights GB':>15}")
        for tp in sorted({1, args.tp}):
            for rank in range(tp):
                out = subprocess.run(
                    [sys.executable, __file__, "--child-load", "--dir", args.dir, "--rank", str(rank),
                     "--tp", str(tp), "--fp8", "auto", "--device", device],
                    check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                loads.append(r)
                grow = r["rss_peak"] - r["rss_before"]
                print(f"{rank:>4} {tp:>3} {'kept' if r['kept_fp8'] else 'dequant':>10} {r['load_s']:>7.1f} "
                      f"{r['rss_before'] / GB:>13.2f} {r['rss_peak'] / GB:>8.2f} {grow / GB:>11.2f} "
                      f"{grow / size:>7.2f} {r['rank_weight_bytes'] / GB:>15.2f}")
        models = {}
        for mode in (["kernel"] if kernel else []) + ["dequantize"]:
            t0 = time.perf_counter()
            models[mode] = load_checkpoint(args.dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                           device=device, fp8=mode)
            set_moe_path(models[mode], "grouped")
            print(f"loaded ({mode}) in {time.perf_counter() - t0:.1f} s")
        steps = []
        print(f"\n{'batch':>5} {'context':>7} {'fp8 ms':>8} {'bf16 ms':>8} {'fp8/bf16':>8}")
        for B in [int(b) for b in args.batches.split(",")]:
            ms = {m: time_decode(mod, B, args.context, args.iters) for m, mod in models.items()}
            row = {"batch": B, "context": args.context, "fp8_ms": ms.get("kernel"), "bf16_ms": ms["dequantize"]}
            steps.append(row)
            f8 = f"{row['fp8_ms']:.2f}" if row["fp8_ms"] else "-"
            ratio = f"{row['fp8_ms'] / row['bf16_ms']:.2f}" if row["fp8_ms"] else "-"
            print(f"{B:>5} {args.context:>7} {f8:>8} {row['bf16_ms']:>8.2f} {ratio:>8}")
        moe = []
        if device == "cuda":
            print(f"\n{'batch':>5} {'MoE graph fp8 ms':>16} {'bf16 ms':>8} {'fp8/bf16':>8}  (router + "
                  f"grouped experts + shared expert, CUDA graph replay)")
            for B in [int(b) for b in args.batches.split(",")]:
                ms = {m: time_moe_graph(mod, B, 20) for m, mod in models.items()}
                moe.append({"batch": B, "fp8_ms": ms.get("kernel"), "bf16_ms": ms["dequantize"]})
                f8, b16 = ms.get("kernel"), ms["dequantize"]
                print(f"{B:>5} {f8 or float('nan'):>16.3f} {b16 or float('nan'):>8.3f} "
                      f"{(f8 / b16) if f8 and b16 else float('nan'):>8.2f}")
        result = {"device": device, "moe_graph": moe, "torch": torch.__version__, "tiny": args.tiny, "checkpoint_bytes": size,
                  "write_s": write_s, "loads": loads, "decode": steps,
                  "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
