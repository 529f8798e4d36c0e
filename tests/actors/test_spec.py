"""ReplicaSpec / ModelSpec: validation naming the bad value, the step channels' wait policy, and
the 'landing' model shape (DeepSeek-V3.2's KV bytes per token)."""

from __future__ import annotations

import os

import pytest

from hisparse_ray.actors.spec import ModelSpec, ReplicaSpec
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


def test_model_spec_takes_a_model_folder(tmp_path):
    import torch

    from hisparse_ray.errors import CheckpointError
    from hisparse_ray.model.model import build_random_model
    from tests.model._checkpoint import checkpoint_config, write_released

    folder = write_released(build_random_model(checkpoint_config(layers=2), seed=3), tmp_path / "m")
    spec = ModelSpec(kind=str(folder), fp8="dequantize")
    assert spec.kind == str(folder.resolve()) and spec.dsa_config().hidden_size == 256
    assert spec.kv_layout(8).row_bytes == (128 + 64) * 4
    part = spec.build(rank=1, tp_size=2)
    assert part.model.layers[0].self_attn.heads == 2
    whole = spec.build().shard_heads(1, 2)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, part.state_dict()[k]), k
    assert spec.tokenizer().decode(spec.tokenizer().encode("hi there")) == "hi there"
    assert ModelSpec().tokenizer().vocab_size == 96
    with pytest.raises(ConfigError, match="fp8"):
        ModelSpec(fp8="int4")
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model_type"):
        ModelSpec(kind=str(folder))
    with pytest.raises(ConfigError, match="model='no/such/dir'"):
        ModelSpec(kind="no/such/dir")
