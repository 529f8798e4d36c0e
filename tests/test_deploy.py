"""ReplicaSpec / ModelSpec: validation naming the bad value, the step channels' wait policy, and
the 'landing' model shape (DeepSeek-V3.2's KV bytes per token)."""

from __future__ import annotations

import os

import pytest

from hisparse_ray.deploy import ModelSpec, ReplicaSpec
from hisparse_ray.errors import ConfigError


def test_step_wait_policy_default_follows_the_core_count_and_can_be_set():
    auto = ReplicaSpec().wait_policy()
    assert auto.yield_s == (20e-3 if (os.cpu_count() or 1) >= 8 else 1e-3)
    assert ReplicaSpec(step_yield_s=5e-3).wait_policy().yield_s == 5e-3
    with pytest.raises(ConfigError, match="step_yield_s"):
        ReplicaSpec(step_yield_s=1e-6)


def test_landing_shape_has_deepseek_v32_kv_bytes_per_token():
    spec = ModelSpec(dtype="bfloat16", shape="landing")
    layout = spec.kv_layout(64)
    assert (layout.num_layers, layout.row_bytes) == (61, 1152)  # 512 + 64 values of bf16
    assert layout.bytes_per_token == 70_272
    assert spec.dsa_config().index_head_dim == 128
    small = ModelSpec(shape="landing", num_layers=3)
    assert small.kv_layout(8).num_layers == 3
    with pytest.raises(ConfigError, match="shape"):
        ModelSpec(shape="huge")


def test_landing_shape_builds_and_prefills_with_tp2_divisible_heads():
    import torch

    model = ModelSpec(shape="landing", num_layers=2).build()
    _, rows, keys = model.prefill(torch.tensor([1, 5, 9, 2]))
    assert rows.shape == (2, 4, 576) and keys.shape == (2, 4, 128)
    assert model.cfg.num_attention_heads % 2 == 0
