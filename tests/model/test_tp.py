"""Tensor-parallel head sharding: two gloo processes on CPU give the TP=1 logits.

Both TP runs replay the TP=1 index trace (so a near-tie in the indexer cannot fork the paths); the
only numeric difference is the order of the ``o_proj`` sum (per-rank partial sums + all-reduce).
Tolerance: 1e-5 absolute on logits of magnitude O(1) (fp32; measured max 4.8e-6), over prefill and 12
batched decode steps.
"""

from __future__ import annotations

import socket

import pytest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hisparse_ray.model import DenseKVCache, IndexerKeyCache, build_tiny_model

TP_TOL = 1e-5
STEPS = 12
PROMPTS = (40, 29)


def _run(model, trace: dict | None):
    """Prefill both prompts, then STEPS greedy batched decode steps; records/replays the top-k trace.
    Returns (logits list, trace)."""
    cfg = model.cfg
    recorded: dict = {}
    counter = {"call": 0}

    def hook(layer, topk):
        key = (counter["call"], layer)
        recorded[key] = topk.clone()
        return None if trace is None else trace[key]

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in PROMPTS]
    kv = DenseKVCache(cfg.num_hidden_layers, cfg.row_dim, len(prompts), max(PROMPTS) + STEPS)
    caches, outs, last = [], [], []
    for b, p in enumerate(prompts):
        logits, rows, keys = model.prefill(p, topk_hook=hook, all_logits=True)
        counter["call"] += 1
        kv.load(b, rows)
        caches.append(IndexerKeyCache.from_prefill(keys, max(PROMPTS) + STEPS))
        outs.append(logits)
        last.append(logits[-1].argmax())
    tokens, lengths = torch.stack(last), torch.tensor(PROMPTS)
    for _ in range(STEPS):
        kv.begin_step(torch.arange(len(prompts)), lengths)
        logits = model.decode(tokens, lengths, kv, caches, topk_hook=hook)
        counter["call"] += 1
        outs.append(logits)
        tokens, lengths = logits.argmax(-1), lengths + 1
    return outs, recorded


def _worker(rank: int, world: int, port: int, traces: dict, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for kind, trace in traces.items():
            model = build_tiny_model(seed=9, kind=kind).shard_heads(rank, world)
            heads = model.model.layers[0].self_attn.q_b_proj.weight.shape[0] // model.cfg.qk_head_dim
            assert heads == model.cfg.num_attention_heads // world
            results[kind] = _run(model, trace)[0]
        torch.save(results, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tp2_gloo_equals_tp1(tmp_path):
    refs, traces = {}, {}
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        refs[kind], traces[kind] = _run(build_tiny_model(seed=9, kind=kind), None)
    path = str(tmp_path / "tp")
    mp.start_processes(_worker, args=(2, _free_port(), traces, path), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        got = torch.load(f"{path}.{rank}")
        for kind, ref in refs.items():
            assert len(got[kind]) == len(ref)
            for a, b in zip(got[kind], ref):
                torch.testing.assert_close(a, b, atol=TP_TOL, rtol=0)
