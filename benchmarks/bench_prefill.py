"""Prefill time and peak GPU memory of long prompts at DeepSeek-V3.2 attention shapes (issue #17 item 1).

The model: DeepSeek-V3.2's MLA and indexer shapes (128 heads, q_lora 1536, kv_lora 512 + rope 64,
nope/v 128, 64 index heads x 128, index top-k 2048, hidden 7168, yarn rope as V3.2's config) in
``--layers`` layers (4) with a small dense MLP (intermediate 2048 instead of V3.2's MoE: the MLP is
per token, linear in T, and not what this measures), vocab 1024, random bf16 weights made on the GPU.
Each length runs one ``DSAModel.prefill`` (batched path, ``batch_invariant=False``; logits of the
last position only) after a 1024-token warm-up, timed with a device synchronize around it; peak
memory is ``torch.cuda.max_memory_allocated`` (weights included), reset per length. The chunked
indexer scores ``T^2 / 2 * 64`` query-head/key pairs per layer in fp32 (the dominant cost: ~2e14
FLOP per layer at 128K); sparse attention reads 2048 rows per query.

    python benchmarks/bench_prefill.py [--lengths 16384 65536 131072] [--chunk-gib 8] --out prefill.json
    python benchmarks/bench_prefill.py --tiny --out /tmp/prefill_tiny.json   # CPU smoke, seconds

``--tiny``: the same structure at toy dims (fp32, CPU unless ``--device``), lengths 64 and 512.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hisparse_ray.model.config import DSAConfig, RopeConfig, tiny_config  # noqa: E402
from hisparse_ray.model.model import DSAModel  # noqa: E402

WARMUP_TOKENS = 1024


def v32_config(layers: int) -> DSAConfig:
    """DeepSeek-V3.2's attention and indexer shapes; dense MLP of intermediate 2048; vocab 1024."""
    rope = RopeConfig("yarn", 10000.0, factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                      mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)
    return DSAConfig(
        kind="deepseek_v32", vocab_size=1024, hidden_size=7168, intermediate_size=2048,
        moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=2048, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=163840, mlp_layer_types=("dense",) * layers,
        indexer_types=("full",) * layers, rope=rope)


def tiny_v32_config(layers: int) -> DSAConfig:
    return tiny_config("deepseek_v32").with_(
        num_hidden_layers=layers, mlp_layer_types=("dense",) * layers, indexer_types=("full",) * layers,
        index_topk=32, max_position_embeddings=4096)


@torch.no_grad()
def build(cfg: DSAConfig, device: str, dtype: torch.dtype, seed: int) -> DSAModel:
    """Random weights drawn on ``device`` (a 1 B-parameter model in seconds): ``1/sqrt(fan_in)``
    linears, unit embeddings, norms near 1, as :func:`hisparse_ray.model.model.init_random_`."""
    with torch.device(device):
        model = DSAModel(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=gen)
        elif p.dim() >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.cast_(dtype).eval()


def prefill_once(model: DSAModel, T: int, seed: int) -> dict:
    dev = model.device
    tokens = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    logits, rows, keys = model.prefill(tokens.to(dev))
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert logits.shape == (1, model.cfg.vocab_size) and rows.shape[1] == T and bool(logits.isfinite().all())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del logits, rows, keys
    return {"tokens": T, "seconds": dt, "tok_per_s": T / dt, "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy dims, fp32, CPU: a smoke run in seconds")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk-gib", type=float, default=8.0, help="model.prefill_chunk_bytes in GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args(argv)

    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and device != "cuda":
        ap.error("real DeepSeek-V3.2 shapes need a CUDA device (use --tiny on CPU)")
    lengths = args.lengths or ([64, 512] if args.tiny else [16384, 65536, 131072])
    cfg = tiny_v32_config(args.layers) if args.tiny else v32_config(args.layers)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    t0 = time.perf_counter()
    model = build(cfg, device, dtype, args.seed)
    model.batch_invariant = False
    model.prefill_chunk_bytes = int(args.chunk_gib * 2**30)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg.num_hidden_layers} layers, {params / 1e9:.2f} B params {dtype} on {device} "
          f"(built in {time.perf_counter() - t0:.1f} s); chunk budget {args.chunk_gib:g} GiB", flush=True)
    prefill_once(model, min(WARMUP_TOKENS, max(lengths)), args.seed + 1)
    results = []
    print(f"{'tokens':>8} {'seconds':>9} {'tok/s':>10} {'peak GiB':>9}", flush=True)
    for i, T in enumerate(lengths):
        r = prefill_once(model, T, args.seed + 2 + i)
        results.append(r)
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{T:>8} {r['seconds']:>9.2f} {r['tok_per_s']:>10.0f} {peak:>9}", flush=True)
    doc = {
        "bench": "prefill", "date": time.strftime("%Y-%m-%d"), "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny, "layers": cfg.num_hidden_layers,
        "params": params, "chunk_bytes": model.prefill_chunk_bytes, "command": " ".join(sys.argv),
        "config": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                                 "index_n_heads", "index_head_dim", "index_topk")},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
