"""Tensor parallelism on the fast step: two gloo ranks on CPU, heads sharded, one all-reduce per
layer, each rank running the same engine commands; rank 0's logits equal TP 1's within fp32
rounding (the only difference: the order of the o_proj sum; measured < 1e-5) and the greedy
tokens are equal."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hisparse_ray.actors.tp import free_port
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model

FAST = FastPathConfig(max_context=256, buckets=(1, 2))
STEPS = 10


def _run(rank: int, world: int) -> tuple[dict, dict]:
    cfg = tiny_config()
    m = build_random_model(cfg.with_(mlp_layer_types=("dense",) * cfg.num_hidden_layers), seed=4)
    if world > 1:
        m.shard_heads(rank, world)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (90, 33)]
    logits = {}
    with Engine(m, EngineConfig(fast_path=FAST, batch_invariant=False, max_batch=2,
                                num_device_blocks=8)) as eng:
        def grab(rows, out):
            for b, row in enumerate(rows):
                logits[(row.request_id, row.seq_len)] = out[b].clone()
        eng.worker.on_logits = grab
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, STEPS)
        tokens = eng.run()
    return tokens, logits


def _worker(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(_run(rank, world), f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_fast_step_equals_tp1(tmp_path):
    tokens1, logits1 = _run(0, 1)
    path = str(tmp_path / "tp")
    mp.start_processes(_worker, args=(2, free_port(), path), nprocs=2, start_method="spawn")
    for rank in range(2):
        tokens2, logits2 = torch.load(f"{path}.{rank}")
        assert tokens2 == tokens1
        assert logits2.keys() == logits1.keys()
        err = max((logits2[k] - logits1[k]).abs().max().item() for k in logits1)
        assert err < 1e-5, err
