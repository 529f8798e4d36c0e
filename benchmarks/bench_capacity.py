"""Capacity and decode speed on one GPU, full-resident vs HiSparse (not a test): the benchmark
that proves the product (issue #17). One run, one process, a table printed last; Parquet + PNG.

    python benchmarks/bench_capacity.py [--out DIR] [--contexts 32768 65536 131072] [--quick]

Model: DeepSeek-V3.2's attention stack: 61 layers of real MLA + indexer shapes (hidden 7168, 128
heads, q_lora 1536, kv_lora 512 + rope 64, nope 128, v 128, 64 index heads x 128, top-k 2048),
vocab 129280, random bf16 weights; each layer's MLP is a small dense SwiGLU (intermediate 2048,
88 MB a layer) standing in for the MoE (batch 1 reads ~9 experts: ~4x more). Hot buffer 4096
rows + 1 (65 pages of 64), page 64, index keys fp8 (132 B a token) on the GPU in both modes.

Synthetic prefill: every request's KV is random rows of the right layout landed directly (device
pool for full-resident; host pool for HiSparse) and its index keys random fp8 keys in the GPU
pool. The same GPU memory for both modes: everything free after the weights, minus a reserve
for activations and graphs. Capacity = budget // bytes a request needs on the GPU (full-resident:
its whole KV + keys; HiSparse: its hot buffer + keys + resolver state).

Host RAM (128 GiB on the H200 machine) holds ~12 distinct 128K contexts of bf16 KV (9.2 GB each).
To measure the GPU-bound capacity anyway, every HiSparse request's host page table points at the
SAME synthetic host pages (one context's worth, pinned): the GPU work and the PCIe traffic of a
miss are identical to distinct contexts. Both the GPU-bound capacity and this machine's
host-RAM-bound capacity (distinct contexts that fit its RAM) are reported.

Top-k: the indexer runs every step (DeepGEMM logits + the deterministic top-k over the whole
context), then its selection is replaced by a trace (``FastDecodeStep.topk_override``) so the hit
rate is controlled: "random" (fresh uniform positions every step: the worst case) and "overlap"
(40 % of each layer's previous top-k kept, DeepSeek-V3.2's published 35-50 %).
Times: step wall time including host input work and the token read-back (TPOT); the resolver's
share from a graph of the 61 resolver calls alone, replayed over the same trace. Not included:
the coordinator and the step channel (~70 us a step, BENCHMARKS.md) and the eager backup of each
host-tier request's newest row (61 x 1152 B a step, on a side stream).
On CUDA the fast step runs with ``compile_glue`` (the per-layer torch work through
``torch.compile``; ``HISPARSE_COMPILE_GLUE=0`` runs it eager) and the Triton top-k and RMSNorm
(``HISPARSE_TRITON_TOPK=0`` / ``HISPARSE_TRITON_NORM=0`` switch them off).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from hisparse_ray import kernels
from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig
from hisparse_ray.fastpath.executor import FastExecutor
from hisparse_ray.kernels.kvfp8 import KVRowCodec
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import DSAModel
from hisparse_ray.rank.executor import Row
from hisparse_ray.rank.runtime import HiSparseRuntime
from hisparse_ray.types import RequestId

GIB = 1 << 30
HOST_RAM = 128 * GIB  # the H200 machine
HOST_RESERVE = 16 * GIB  # what the OS, Python and the driver keep


@dataclass(frozen=True)
class Dims:
    layers: int
    H: int  # hot slots
    page: int
    steps: int  # timed steps
    warm: int  # warm-up steps (the first one captures the graph)


def model_config(quick: bool, layers: int):
    t = tiny_config(yarn=False)
    if quick:
        return t.with_(num_hidden_layers=2, mlp_layer_types=("dense",) * 2, indexer_types=("full",) * 2,
                       index_topk=16, max_position_embeddings=4096)
    return t.with_(vocab_size=129280, hidden_size=7168, intermediate_size=2048, num_hidden_layers=layers,
                   num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
                   index_topk=2048, max_position_embeddings=1 << 18, mlp_layer_types=("dense",) * layers,
                   indexer_types=("full",) * layers)


def build_model(cfg, device, dtype) -> DSAModel:
    """Random weights made on the device (std ``fan_in**-0.5``; norms 1): no host copy of 30 GB."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            m = DSAModel(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.fill_(1.0)
    return m.cast_(dtype).eval()


def hbm_gbps(device) -> float:
    """Device copy bandwidth (read + write bytes / time) of 2 GiB, best of 5."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        best = max(best, 2 * a.numel() / (e0.elapsed_time(e1) * 1e6))
    del a, b
    return best


@dataclass(frozen=True)
class Stack:
    """The benchmark's model on this machine's device (``stack``): shared with profile_step.py."""
    device: torch.device
    cfg: object
    d: Dims
    model: DSAModel
    weight_bytes: int
    hbm: float  # GB/s (nan on CPU)

    def floor_ms(self, row_bytes: int, ctx: int, B: int) -> float:
        """A step's HBM floor: every weight once, plus per row and layer the top-k KV rows and
        the context's index keys, at the measured bandwidth (nan on CPU)."""
        cfg, L = self.cfg, self.d.layers
        moved = self.weight_bytes + L * (cfg.index_topk * row_bytes + ctx * (cfg.index_head_dim + 4)) * B
        return moved / (self.hbm * 1e6) if self.hbm == self.hbm else float("nan")


def stack(quick: bool, layers: int, steps: int, warm: int) -> Stack:
    """Device (CUDA when there is one; bf16 there, fp32 on CPU), model, dims and HBM bandwidth."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(quick, layers)
    d = Dims(cfg.num_hidden_layers, 32 if quick else 4096, 8 if quick else 64, steps, warm)
    model = build_model(cfg, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Stack(device, cfg, d, model, weight_bytes, hbm_gbps(device))


def request_bytes(mode: str, rows: KVRowCodec, cfg, d: Dims, ctx_rows: int) -> int:
    """GPU bytes one request needs: KV rows (all of them, or the hot buffer) + fp8 index keys +
    resolver slot state (HiSparse) + per-row step activations (logits, top-k keys)."""
    L = d.layers
    keys = L * -(-ctx_rows // INDEX_PAGE) * INDEX_PAGE * (cfg.index_head_dim + 4)
    act = 48 * ctx_rows + (2 << 20)
    if mode == "full":
        return L * ctx_rows * rows.row_bytes + keys + act
    hot_rows = -(-(d.H + 1) // d.page) * d.page
    return L * hot_rows * rows.row_bytes + keys + 2 * L * d.H * 4 + act


def make_trace(steps: int, L: int, B: int, K: int, n: int, overlap: float, device, seed: int):
    """``[steps, L, B, K]`` int32 distinct positions in ``[0, n)``: step 0 uniform; each later step
    keeps ``overlap`` of the previous selection (a random part) and draws the rest uniformly from
    the positions it did not hold ("random": overlap 0, every step fresh)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(steps, L, B, K, dtype=torch.int32, device=device)
    keep = int(round(overlap * K))
    prev = None
    for s in range(steps):
        cur = torch.empty(L * B, K, dtype=torch.int32, device=device)
        for lo in range(0, L * B, 64):  # chunks bound the [rows, n] scratch
            hi = min(L * B, lo + 64)
            score = torch.rand(hi - lo, n, device=device, generator=g)
            if prev is None or keep == 0:
                cur[lo:hi] = score.topk(K, dim=-1).indices.int()
                continue
            p = prev[lo:hi].long()
            kept = p.gather(1, torch.rand(hi - lo, K, device=device, generator=g).argsort(1)[:, :keep])
            score.scatter_(1, p, -1.0)
            cur[lo:hi] = torch.cat([kept, score.topk(K - keep, dim=-1).indices], dim=1).int()
        prev = cur
        out[s] = cur.view(L, B, K)
    return out


def _compile_glue(device: torch.device) -> bool:
    """The stacks' ``FastPathConfig.compile_glue``: on with CUDA (measured faster on the H200,
    2026-12-01: batch-1 32K step 3.54x vs 3.80x its floor), off on CPU (inductor's compile would
    dominate the quick run); ``HISPARSE_COMPILE_GLUE=0`` / ``=1`` forces it."""
    forced = os.environ.get("HISPARSE_COMPILE_GLUE")
    return forced == "1" if forced in ("0", "1") else device.type == "cuda"


class Setup:
    """One mode at one context: the device pool, host views, index keys, requests and the fast
    step for up to ``B`` rows (buckets 1, 4, B)."""

    def __init__(self, model, mode: str, rows: KVRowCodec, B: int, ctx: int, d: Dims,
                 host_bytes: torch.Tensor | None, device, overlap_resolve: bool = True) -> None:
        cfg = model.cfg
        self.model, self.mode, self.B, self.ctx, self.d, self.device = model, mode, B, ctx, d, device
        life = ctx + d.warm + d.steps + 1
        pages = -(-life // d.page)
        self.hot_n = -(-(d.H + 1) // d.page)
        layout = KVLayout(num_layers=d.layers, page_size=d.page, row_bytes=rows.row_bytes)
        hs = HiSparseConfig(top_k=cfg.index_topk, device_buffer_size=d.H, swap_in_block_size=1024,
                            host_pool_gib=1.0)
        blocks = B * (pages if mode == "full" else self.hot_n)
        host_rows = pages * d.page
        if mode == "full":
            host = torch.zeros(d.layers, d.page, rows.row_bytes, dtype=torch.uint8,
                               pin_memory=device.type == "cuda")
        else:  # one context of host pages, shared by every request (see the module doc)
            host = host_bytes[: d.layers * host_rows * rows.row_bytes].view(d.layers, host_rows, rows.row_bytes)
        self.host = host
        spare = 64 - (blocks * d.page) % 64 or 64
        self.rt = HiSparseRuntime(hs, layout, blocks, list(host), device=device, max_requests=B,
                                  backend="auto", spare_rows=spare)
        fast = FastPathConfig(max_context=life, buckets=tuple(sorted({1, min(4, B), B})),
                              index_key_dtype="fp8", cuda_graphs=True,
                              compile_glue=_compile_glue(device), overlap_resolve=overlap_resolve)
        self.ex = FastExecutor(model, self.rt, rows, fast, block_threads=1024)
        self._fill(rows, pages, host_rows)
        self.rids = [RequestId(f"q{b}") for b in range(B)]
        for b, rid in enumerate(self.rids):
            self.rt.add(rid)
            st = self.rt.requests[rid]
            if mode == "full":
                st.device_table = list(range(b * pages, (b + 1) * pages))
                st.host_table = [-1] * pages
            else:
                st.device_table = [-1] * pages
                st.host_table = list(range(pages))
                self.rt.set_hot_blocks(rid, tuple(range(b * self.hot_n, (b + 1) * self.hot_n)))
            st.version += 1
            self.ex.install(rid, None, life)
        self.trace_buf = torch.full((d.layers, B, cfg.index_topk), -1, dtype=torch.int32, device=device)
        self.ex.step.topk_override = self.trace_buf

    def _fill(self, rows: KVRowCodec, pages: int, host_rows: int) -> None:
        """Random valid rows (a template page repeated) in the pool that holds the context, and
        random fp8 keys in every index page."""
        g = torch.Generator(device=self.device).manual_seed(11)
        cfg = self.model.cfg
        tmpl = rows.encode(torch.randn(INDEX_PAGE * 16, cfg.row_dim, device=self.device, generator=g)
                           .to(self.model.dtype))  # 1024 rows
        if self.mode == "full":
            for layer in self.rt.device_kv:
                n = layer.shape[0] // tmpl.shape[0]
                layer[: n * tmpl.shape[0]].view(n, *tmpl.shape).copy_(tmpl.expand(n, *tmpl.shape))
        else:
            flat = self.host.view(-1, rows.row_bytes)
            for lo in range(0, flat.shape[0], 1 << 20):
                hi = min(flat.shape[0], lo + (1 << 20))
                idx = torch.arange(lo, hi, device=self.device) % tmpl.shape[0]
                flat[lo:hi].copy_(tmpl[idx], non_blocking=False)
        keys = self.ex.keys
        page = torch.zeros(1, keys.pools[0].shape[1], dtype=torch.uint8, device=self.device)
        scratch = type(keys)([0], keys.dim, "fp8", 1, self.device)
        scratch.write(0, torch.arange(INDEX_PAGE, device=self.device),
                      torch.randn(INDEX_PAGE, keys.dim, device=self.device, generator=g))
        page.copy_(scratch.pools[0][:1])
        for pool in keys.pools:
            pool.copy_(page.expand_as(pool))

    def run(self, B: int, trace: torch.Tensor, warm: int, steps: int) -> dict:
        """Warm-up then timed steps of ``B`` rows over ``trace [>= warm + steps, L, B', K]``; every
        run starts from cold hot buffers at sequence length ``ctx + 1``."""
        ex, bucket = self.ex, self.ex.cfg.bucket(B)
        for rid in self.rids:
            self.rt._reset_state(self.rt.requests[rid].state_row)
        wall, gpu = [], []
        hits = misses = 0
        for s in range(warm + steps):
            n = self.ctx + 1 + s
            self.trace_buf[:, :B].copy_(trace[s % trace.shape[0], :, :B])
            t0 = time.perf_counter()
            rows = [ex.row_input(Row(rid, n, 1, None)) for rid in self.rids[:B]]
            ex.step.inputs.fill(rows, bucket)
            e0, e1 = _events(self.device)
            ex.step.run(bucket)
            _record(e1)
            out = torch.stack([ex.step.tokens[:B], ex.step.hits[:B], ex.step.misses[:B]]).tolist()
            t1 = time.perf_counter()
            if s >= warm:
                wall.append((t1 - t0) * 1e3)
                gpu.append(e0.elapsed_time(e1) if e0 is not None else float("nan"))
                hits, misses = hits + sum(out[1]), misses + sum(out[2])
        return dict(step_ms=statistics.median(wall), gpu_ms=statistics.median(gpu),
                    hit_rate=hits / max(hits + misses, 1), misses_per_step=misses / steps)

    def resolver_ms(self, B: int, trace: torch.Tensor, steps: int) -> float:
        """Median ms of the L resolver calls alone (a graph), replayed over the trace."""
        st, inp, rt = self.ex.step, self.ex.step.inputs, self.rt
        bucket = self.ex.cfg.bucket(B)

        def calls():
            seq = inp.view("seq_lens", bucket)[:, 0]
            for l in range(self.d.layers):
                kernels.resolve(
                    top_k=self.trace_buf[l][:bucket], seq_lens=seq, state_idx=inp.view("state", bucket)[:, 0],
                    slot_pos=rt.slot_pos[l], lru=rt.lru[l], slot_rows=inp.view("slot_rows", bucket),
                    resident_table=inp.view("resident", bucket), host_table=inp.view("host", bucket),
                    host_kv=rt.host_layers[l], device_kv=rt.device_kv[l], out_rows=st.out_rows[l][:bucket],
                    plan=st.plan[l][:bucket], page_size=self.d.page, block_threads=1024, backend="auto")

        if self.device.type != "cuda":
            return float("nan")
        calls()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            calls()
        times = []
        for s in range(steps):
            self.trace_buf[:, :B].copy_(trace[s % trace.shape[0], :, :B])
            e0, e1 = _events(self.device)
            g.replay()
            _record(e1)
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        return statistics.median(times)


def _events(device):
    if device.type != "cuda":
        return None, None
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    return e0, e1


def _record(e):
    if e is not None:
        e.record()


def capacity(budget: int, per_req: int, cap: int) -> int:
    return max(0, min(cap, budget // per_req))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_capacity_out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="GPU memory kept for activations/graphs")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="tiny dims (CPU works): checks the script")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    contexts = [256, 512] if a.quick else a.contexts
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    st = stack(a.quick, a.layers, a.steps, a.warm)
    device, cfg, d, model, weight_bytes, hbm = st.device, st.cfg, st.d, st.model, st.weight_bytes, st.hbm
    if device.type == "cuda":
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
    else:
        free = int(2 * GIB)
    budget = int(free - a.reserve_gib * GIB) if not a.quick else int(0.02 * GIB)
    log(f"model {weight_bytes / GIB:.1f} GiB, HBM {hbm:.0f} GB/s, free {free / GIB:.1f} GiB, "
        f"budget {budget / GIB:.1f} GiB")
    codecs = {"bf16": KVRowCodec("bf16", cfg.kv_lora_rank, cfg.qk_rope_head_dim),
              "fp8": KVRowCodec("fp8", cfg.kv_lora_rank, cfg.qk_rope_head_dim)}
    max_ctx = max(contexts) + a.warm + a.steps + d.page + 1
    host_rows = -(-max_ctx // d.page) * d.page
    host_bytes = torch.empty(d.layers * host_rows * codecs["bf16"].row_bytes, dtype=torch.uint8,
                             pin_memory=device.type == "cuda")
    log(f"pinned host pool {host_bytes.numel() / GIB:.1f} GiB (one context, shared by every request)")
    results = []
    for ctx in contexts:
        for mode, rows in (("full", "bf16"), ("hisparse", "bf16"), ("hisparse", "fp8"), ("full", "fp8")):
            codec = codecs[rows]
            per = request_bytes(mode, codec, cfg, d, ctx + a.warm + a.steps + 1)
            cap = capacity(budget, per, 6 if a.quick else a.max_batch)
            host_cap = (HOST_RAM - HOST_RESERVE) // (d.layers * ctx * codec.row_bytes)
            row = dict(context=ctx, mode=mode, rows=rows, per_request_gb=per / 1e9, capacity_gpu=cap,
                       capacity_host_ram=host_cap if mode == "hisparse" else cap)
            if mode == "full" and rows == "fp8" or cap == 0:
                results.append(row)  # capacity only: its speed is the bf16 baseline's story
                log(f"ctx {ctx} {mode} {rows}: capacity {cap} (per request {per / 1e9:.2f} GB)")
                continue
            s = None
            while cap > 0:
                try:
                    s = Setup(model, mode, codec, cap, ctx, d, host_bytes, device)
                    break
                except torch.cuda.OutOfMemoryError:  # the estimate was short: 10 % fewer, measured
                    s = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    cap = int(cap * 0.9)
            row["capacity_gpu"] = cap
            if s is None:
                results.append(row)
                continue
            log(f"ctx {ctx} {mode} {rows}: capacity {cap} (per request {per / 1e9:.2f} GB), set up")
            K, L = cfg.index_topk, d.layers
            n_trace = a.warm + a.steps
            traces = {"random": make_trace(n_trace, L, cap, K, ctx, 0.0, device, 1)}
            if mode == "hisparse":
                traces["overlap"] = make_trace(n_trace, L, cap, K, ctx, 0.4, device, 2)
            for trace_name, trace in traces.items():
                for B in sorted({1, min(4, cap), cap}):
                    try:
                        r = s.run(B, trace, a.warm, a.steps)
                        res_ms = s.resolver_ms(B, trace, a.steps) if mode == "hisparse" else 0.0
                    except Exception as e:  # keep the other measurements of this one run
                        log(f"  B={B} {trace_name}: FAILED {type(e).__name__}: {e}")
                        traceback.print_exc()
                        results.append(dict(row, batch=B, trace=trace_name, error=f"{type(e).__name__}: {e}"))
                        continue
                    floor_ms = st.floor_ms(codec.row_bytes, ctx, B)
                    results.append(dict(row, batch=B, trace=trace_name, tok_s=B / r["step_ms"] * 1e3,
                                        resolver_ms=res_ms, resolver_share=res_ms / r["gpu_ms"],
                                        hbm_floor_ms=floor_ms, **r))
                    log(f"  B={B:3d} {trace_name:7s} step {r['step_ms']:8.2f} ms (gpu {r['gpu_ms']:8.2f}) "
                        f"{B / r['step_ms'] * 1e3:8.1f} tok/s hit {r['hit_rate']:.3f} resolver {res_ms:.2f} ms")
            del s, traces
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report(results, a.out, dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                hbm_gbps=hbm, weight_gib=weight_bytes / GIB, budget_gib=budget / GIB,
                                layers=d.layers, quick=a.quick))
    log("done")


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w[i]) for i, c in enumerate(cols))]
    lines += ["  ".join(x[i].rjust(w[i]) for i in range(len(cols))) for x in cells]
    return "\n".join(lines)


def _get(rows, ctx, mode, kv, trace=None, batch=None, col="step_ms"):
    for r in rows:
        if (r["context"], r["mode"], r["rows"]) == (ctx, mode, kv) and (trace is None or r.get("trace") == trace) \
                and (batch is None or r.get("batch") == batch):
            return r.get(col, math.nan)
    return math.nan


def summarize(results: list[dict]) -> list[dict]:
    out = []
    for ctx in sorted({r["context"] for r in results}):
        def g(*a, **k):
            return _get(results, ctx, *a, **k)

        cf, ch = g("full", "bf16", col="capacity_gpu"), g("hisparse", "bf16", col="capacity_gpu")
        cf8, ch8 = g("full", "fp8", col="capacity_gpu"), g("hisparse", "fp8", col="capacity_gpu")
        b4h, b4f = min(4, ch), min(4, cf)
        out.append(dict(
            context=ctx, cap_full=cf, cap_hisparse=ch, cap_ratio=ch / max(cf, 1),
            cap_full_fp8=cf8, cap_hisparse_fp8=ch8, cap_ratio_fp8=ch8 / max(cf8, 1),
            cap_host_ram=g("hisparse", "bf16", col="capacity_host_ram"),
            tok_s_full=g("full", "bf16", "random", cf, "tok_s"),
            tok_s_hs_overlap=g("hisparse", "bf16", "overlap", ch, "tok_s"),
            tok_s_hs_random=g("hisparse", "bf16", "random", ch, "tok_s"),
            tok_s_hs_fp8_overlap=g("hisparse", "fp8", "overlap", ch8, "tok_s"),
            tpot1_ms_full=g("full", "bf16", "random", 1),
            tpot1_ratio=g("hisparse", "bf16", "overlap", 1) / g("full", "bf16", "random", 1),
            tpot4_ratio=g("hisparse", "bf16", "overlap", b4h) / g("full", "bf16", "random", b4f),
            b1_over_floor=g("full", "bf16", "random", 1) / g("full", "bf16", "random", 1, "hbm_floor_ms"),
            hs_b1_over_floor=g("hisparse", "bf16", "overlap", 1) / g("hisparse", "bf16", "overlap", 1, "hbm_floor_ms"),
            hit_random=g("hisparse", "bf16", "random", ch, "hit_rate"),
            hit_overlap=g("hisparse", "bf16", "overlap", ch, "hit_rate"),
            resolver_share_b1=g("hisparse", "bf16", "overlap", 1, "resolver_share"),
            resolver_share_max=g("hisparse", "bf16", "overlap", ch, "resolver_share"),
        ))
    return out


def report(results: list[dict], out: str, meta: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = sorted({k for r in results for k in r})
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in results]),
                   os.path.join(out, "bench_capacity.parquet"))
    summary = summarize(results)
    pq.write_table(pa.Table.from_pylist(summary), os.path.join(out, "bench_capacity_summary.parquet"))
    with open(os.path.join(out, "bench_capacity_meta.json"), "w") as f:
        json.dump(meta, f)
    print(json.dumps(meta))
    print(_table(results, ["context", "mode", "rows", "capacity_gpu", "capacity_host_ram", "batch", "trace",
                           "step_ms", "gpu_ms", "tok_s", "hit_rate", "resolver_ms", "resolver_share",
                           "hbm_floor_ms"]))
    print(_table(summary, list(summary[0]) if summary else []))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = list(range(len(summary)))
        labels = [f"{r['context'] // 1024}K" for r in summary]
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        ax[0].bar([i - 0.2 for i in x], [r["cap_full"] for r in summary], 0.4, label="full-resident")
        ax[0].bar([i + 0.2 for i in x], [r["cap_hisparse"] for r in summary], 0.4, label="HiSparse (bf16 rows)")
        ax[0].set_xticks(x, labels)
        ax[0].set_ylabel("max concurrent requests (GPU-bound)")
        ax[0].legend()
        for off, key, lab in ((-0.27, "tok_s_full", "full-resident"), (0.0, "tok_s_hs_overlap", "HiSparse, 40% overlap"),
                              (0.27, "tok_s_hs_random", "HiSparse, random top-k")):
            ax[1].bar([i + off for i in x], [r[key] for r in summary], 0.27, label=lab)
        ax[1].set_xticks(x, labels)
        ax[1].set_ylabel("decode tok/s at each mode's max batch")
        ax[1].legend()
        fig.suptitle(f"{meta['device']}: DeepSeek-V3.2 attention stack, {meta['layers']} layers")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bench_capacity.png"), dpi=120)
    except Exception as e:  # the numbers are in the Parquet files either way
        print(f"plot skipped: {e}")


if __name__ == "__main__":
    main()
