"""Routed experts: the grouped (throughput) path equals the reference path. On the CPU the grouped
path multiplies each expert's run of rows exactly as the reference does, so the bound is 0
(bitwise), for any batch, routing and dtype; GPU kernels are compared in test_moe_gpu.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.engine import EngineConfig, generate
from hisparse_ray.errors import ConfigError
from hisparse_ray.model.layers import Experts, set_moe_path
from hisparse_ray.model.model import build_tiny_model


def _experts(dtype):
    model = build_tiny_model(seed=2, dtype=dtype)
    return model, model.model.layers[1].mlp


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), seed=st.integers(0, 2**31 - 1), bf16=st.booleans())
def test_grouped_equals_reference_bitwise(n, seed, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    _, moe = _experts(dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, moe.experts.gate_up_proj.shape[2], generator=g).to(dtype)
    weights, experts = moe.gate(x)
    a = moe.experts.forward_reference(x, weights, experts)
    b = moe.experts.forward_grouped(x, weights, experts)
    assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def test_set_moe_path_and_batched_decode_is_unchanged():
    model, _ = _experts(torch.float32)
    prompts = [[(5 * i) % 96 for i in range(60)], list(range(1, 40)), [3, 4, 5]]
    cfg = EngineConfig(num_device_blocks=12, batch_invariant=False)  # batched forwards
    ref = generate(model, prompts, 16, cfg)
    set_moe_path(model, "grouped")
    assert all(m.path == "grouped" for m in model.modules() if isinstance(m, Experts))
    assert generate(model, prompts, 16, cfg) == ref
    with pytest.raises(ConfigError, match="moe_path"):
        set_moe_path(model, "fast")


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_no_shared_experts_builds_and_matches_hf(kind):
    """``n_shared_experts: 0`` (DSAConfig allows it; HF builds a zero-width shared MLP): the seeded
    random build divided by a fan-in of 0 (ZeroDivisionError); now it builds, and its logits equal
    HF's on the same weights."""
    from hisparse_ray.model.config import tiny_config
    from hisparse_ray.model.model import build_random_model

    from ._hf import hf_twin

    model = build_random_model(tiny_config(kind).with_(n_shared_experts=0), seed=3)
    toks = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_twin(model)(input_ids=toks[None]).logits[0]
    torch.testing.assert_close(model.prefill(toks, all_logits=True)[0], ref, atol=1e-5, rtol=0)
