"""The fast step's per-layer glue compiled (``FastPathConfig(compile_glue=True)``), on CPU with
inductor's C++ backend (the same tracing the CUDA build runs): HiSparse equals full-resident bit
for bit through spills and varying buckets, the compiled step matches the eager one within fp32
rounding with greedy tokens equal, one compiled graph serves every layer, and the eager functions
are the model's own arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hisparse_ray.errors import ConfigError
from hisparse_ray.fastpath import glue
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.fastpath.moe import ROWS

from .test_engine_fast import H, MANY, assert_same, dense, fast_cfg, prompts_of, run  # noqa: F401

COMPILED = dataclasses.replace(MANY, compile_glue=True)


def test_eager_glue_is_the_models_own_arithmetic(dense):  # noqa: F811
    layer = dense.model.layers[0]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, dense.cfg.hidden_size, generator=g)
    cos = torch.randn(3, dense.cfg.qk_rope_head_dim // 2, generator=g)
    sin = torch.randn(3, dense.cfg.qk_rope_head_dim // 2, generator=g)
    x, q_resid, row = glue.pre_index(layer, h, cos, sin)
    q_full = glue.query(layer.self_attn, q_resid, cos, sin)
    want_x = layer.input_layernorm(h)
    want = layer.self_attn.project(want_x, cos, sin)
    assert torch.equal(x, want_x) and all(torch.equal(a, b) for a, b in zip((q_full, q_resid, row), want))
    out = torch.randn(3, dense.cfg.hidden_size, generator=g)
    mid = h + out
    assert torch.equal(glue.post_attention(layer, h, out),
                       mid + layer.mlp(layer.post_attention_layernorm(mid), ROWS))


def test_compiled_glue_equals_full_resident_and_tracks_the_eager_step(dense):  # noqa: F811
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    prompts = prompts_of([133, 100, 120, 144], dense.cfg.vocab_size, seed=2)
    news = [3, 6, 9, 12]
    base = run(dense, prompts, news, fast_cfg(COMPILED, full_resident=True))
    hs = run(dense, prompts, news, fast_cfg(COMPILED, num_device_blocks=12))
    assert_same(hs, base)  # same compiled kernels in both modes: bit for bit
    assert sorted(set(hs[4])) == [1, 2, 3, 4] and hs[3]["hot_misses"] > 0
    eager = run(dense, prompts, news, fast_cfg(MANY, num_device_blocks=12))
    assert eager[0] == hs[0]  # greedy tokens
    err = max((eager[1][k] - hs[1][k]).abs().max().item() for k in eager[1])
    assert err < 1e-4
    # five functions, each compiled at most once per bucket (on the CPU the MLP's per-row silu
    # fixes the batch size), never once per layer
    assert counters["stats"]["unique_graphs"] <= 5 * len(MANY.buckets), dict(counters["stats"])


def test_compile_glue_must_be_a_bool():
    with pytest.raises(ConfigError, match="compile_glue"):
        FastPathConfig(compile_glue="yes")
