"""Deployment options and specs: one set of defaults whether the options come from CLI flags, Serve
options or Python; validation naming the bad option and value before anything starts (pools that
cannot fit included); GPU share resolution; HiSparse config loading; the step channels' wait
policy; the 'landing' model shape (DeepSeek-V3.2's KV bytes per token); the byte tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from dataclasses import fields

from hisparse_ray import cli
from hisparse_ray.config import HiSparseConfig
from hisparse_ray.deploy import (
    DeployOptions, ModelSpec, PrefillSpec, ReplicaSpec, load_config, resolve_gpus_per_rank,
)
from hisparse_ray.errors import ConfigError


def test_one_set_of_defaults_for_every_front_door():
    """CLI flags left unset, an empty Serve option dict and Python's defaults are one options
    object, and its specs are the specs' own defaults."""
    parser = cli.build_parser()
    for command in ("demo", "generate", "serve"):
        assert cli.options(parser.parse_args([command])) == DeployOptions()
    assert DeployOptions.from_dict({}) == DeployOptions()
    assert DeployOptions().specs(gpus=0) == (ReplicaSpec(), PrefillSpec())
    assert DeployOptions().config == HiSparseConfig.tiny() == load_config(None)


def test_cli_serve_options_and_python_build_the_same_options():
    flags = cli.options(cli.build_parser().parse_args(
        ["serve", "--tp", "1", "--device-blocks", "12", "--gpus-per-rank", "0.5",
         "--decode-resources", '{"decode_node": 0.01}', "--config", '{"top_k": 8, '
         '"device_buffer_size": 32, "swap_in_block_size": 64, "host_pool_gib": 0.01}']))
    served = DeployOptions.from_dict({"tp": "1", "device_blocks": 12, "gpus_per_rank": "0.5",
                                      "decode_resources": {"decode_node": 0.01},
                                      "config": {"top_k": 8, "device_buffer_size": 32,
                                                 "swap_in_block_size": 64,
                                                 "host_pool_gib": 0.01}})
    python = DeployOptions(tp=1, device_blocks=12, gpus_per_rank=0.5,
                           decode_resources={"decode_node": 0.01},
                           config=HiSparseConfig(top_k=8, device_buffer_size=32,
                                                 swap_in_block_size=64, host_pool_gib=0.01,
                                                 host_to_device_ratio=4))  # the tiny default
    assert flags == served == python
    replica, prefill = python.specs(gpus=1)
    assert (replica.tp_size, replica.num_device_blocks, replica.gpus_per_rank) == (1, 12, 0.5)
    assert replica.hisparse.device_buffer_size == 32 and prefill.model == replica.model


def test_every_option_is_a_serve_flag_and_demo_takes_the_deployment_ones():
    parser = cli.build_parser()
    serve_args = vars(parser.parse_args(["serve"]))
    demo_args = vars(parser.parse_args(["demo"]))
    for f in fields(DeployOptions):
        assert f.name in serve_args, f.name
        assert (f.name in demo_args) == (f.metadata["group"] != "serve"), f.name


@pytest.mark.parametrize("key, value, match", [
    ("bogus", 1, "bogus=1"), ("tp", 0, "tp=0"), ("tp", "two", "tp='two'"),
    ("device_blocks", 0, "device_blocks=0"), ("staging_blocks", -1, "staging_blocks=-1"),
    ("num_replicas", 0, "num_replicas=0"), ("request_timeout_s", -1, "request_timeout_s"),
    ("max_new_tokens", 50, "max_new_tokens=50"), ("device", "tpu", "device='tpu'"),
    ("dtype", "fp4", "dtype"), ("gpus_per_rank", 1.5, "gpus_per_rank=1.5"),
    ("decode_resources", {"decode_node": 0}, "decode_resources"),
    ("landing_push_with_prefill", "sometimes", "landing_push_with_prefill"),
    ("step_yield_s", 1e-6, "step_yield_s"),
    ("config", '{"top_k": 64, "device_buffer_size": 16}', "top_k"),
    ("model", "llama", "model='llama'"),
])
def test_a_bad_option_is_refused_naming_it(key, value, match):
    with pytest.raises(ConfigError, match=match):
        DeployOptions.from_dict({key: value, "max_new_tokens_limit": 10} if key == "max_new_tokens"
                                else {key: value})


def test_pools_that_cannot_fit_are_refused_before_anything_starts():
    # a 16-slot hot buffer (+ 1 newest slot) of 8-row pages needs 3 device blocks
    with pytest.raises(ConfigError, match="config device_blocks=2: must hold one hot buffer"):
        DeployOptions(device_blocks=2)
    with pytest.raises(ConfigError, match="host_pool_gib"):
        DeployOptions(config=HiSparseConfig(top_k=8, device_buffer_size=16,
                                            swap_in_block_size=64, host_pool_gib=1e-9))
    with pytest.raises(ConfigError, match="num_device_blocks"):
        ReplicaSpec(num_device_blocks=2)


def test_gpus_per_rank_default_follows_the_gpu_count_and_bad_values_name_the_option():
    assert resolve_gpus_per_rank(None, 2, 0) == 0.0  # CPU
    assert resolve_gpus_per_rank(None, 2, 1) == 0.5  # both ranks on the one GPU
    assert resolve_gpus_per_rank(None, 2, 2) == 1.0  # a GPU per rank
    assert resolve_gpus_per_rank(None, 2, 8) == 1.0
    assert resolve_gpus_per_rank(0.5, 2, 2) == 0.5  # asked: share one GPU anyway
    assert resolve_gpus_per_rank(0.8, 2, 2) == 0.8
    with pytest.raises(ConfigError, match="gpus_per_rank=1.0: with tp=2 needs 2 GPUs, 1 visible"):
        resolve_gpus_per_rank(1.0, 2, 1)
    with pytest.raises(ConfigError, match="gpus_per_rank=0.0"):
        DeployOptions(gpus_per_rank=0.0)
    with pytest.raises(ConfigError, match="device='gpu': needs a visible CUDA device"):
        DeployOptions(device="gpu").specs(gpus=0)
    gpu_anywhere = DeployOptions(device="gpu").host_specs()[0]  # no GPU resolved: ingress, CLI sizing
    assert gpu_anywhere.gpus_per_rank == 0.0 and gpu_anywhere.model == DeployOptions().specs(gpus=0)[0].model
    assert DeployOptions(device="cpu").specs(gpus=4)[0].gpus_per_rank == 0.0
    assert DeployOptions().specs(gpus=2)[0].gpus_per_rank == 1.0


def test_config_inline_file_dict_and_default(tmp_path):
    inline = '{"top_k": 8, "device_buffer_size": 32, "host_to_device_ratio": 2, ' \
             '"swap_in_block_size": 64, "host_pool_gib": 0.5}'
    assert load_config(inline).device_buffer_size == 32
    path = tmp_path / "hs.json"
    path.write_text(inline)
    assert load_config(str(path)) == load_config(inline) == load_config(json.loads(inline))
    assert load_config(None) == load_config("") == HiSparseConfig.tiny()
    with pytest.raises(ConfigError, match="swap_in_block_size"):
        load_config({**HiSparseConfig.tiny().to_dict(), "swap_in_block_size": 48})
    with pytest.raises(ConfigError, match="hisparse-config"):
        load_config("{not json")


def test_byte_tokenizer_round_trips_printable_ascii_and_marks_the_rest():
    tok = ModelSpec().tokenizer()
    assert tok.encode("Hi ~") == [ord("H") - 31, ord("i") - 31, 1, 95]
    assert tok.decode(tok.encode("sparse attention!")) == "sparse attention!"
    assert tok.encode("é\n") == [0, 0, 0]  # two UTF-8 bytes + newline: outside the vocabulary
    assert max(tok.encode("".join(map(chr, range(32, 127))))) < tok.vocab_size


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


def test_fast_path_and_kv_cache_dtype_options_reach_every_spec():
    """``fast_path`` / ``kv_cache_dtype`` / ``index_key_dtype``: validated before anything starts,
    resolved by ``specs()`` (auto: off without a GPU or without FlashMLA, as here), and the KV
    dtype sizes the replica's rows and the prefill worker's (the same bytes by construction)."""
    from hisparse_ray.fastpath.config import FastPathConfig, default_buckets

    for key in ("fast_path", "kv_cache_dtype", "index_key_dtype", "compile_glue"):
        with pytest.raises(ConfigError, match=key):
            DeployOptions.from_dict({key: "fp4"})
    assert DeployOptions().specs()[0].fast_path is None
    assert DeployOptions().specs(gpus=1)[0].fast_path is None  # no sm90 FlashMLA in this process
    replica, prefill = DeployOptions(fast_path="on", kv_cache_dtype="fp8", index_key_dtype="fp8",
                                     max_batch=12, max_prompt_tokens=1000,
                                     max_new_tokens_limit=24).specs()
    assert replica.fast_path == FastPathConfig(max_context=1024, buckets=(1, 2, 4, 8, 12),
                                               index_key_dtype="fp8")
    assert DeployOptions(fast_path="on", compile_glue="on").specs()[0].fast_path.compile_glue
    # the fast step's decode rows are not a prefill's: its replicas publish prefill pages only
    assert not replica.core_config.publish_decoded
    assert DeployOptions().specs()[0].core_config.publish_decoded
    assert default_buckets(1) == (1,) and default_buckets(16) == (1, 2, 4, 8, 16)
    assert replica.kv_cache_dtype == prefill.kv_cache_dtype == "fp8"
    assert replica.layout.row_bytes == 68  # tiny: 32 e4m3 + one fp32 scale + 16 bf16 rope values
    assert ModelSpec(dtype="bfloat16", shape="landing").kv_layout(64, "fp8").row_bytes == 656
    assert ModelSpec(dtype="bfloat16").kv_layout(8, "fp32").row_bytes == 48 * 4
    with pytest.raises(ConfigError, match="fast_path.buckets"):
        ReplicaSpec(max_batch=4, fast_path=FastPathConfig(buckets=(1, 2)))
    with pytest.raises(ConfigError, match="fast_path"):
        ReplicaSpec(fast_path="on")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        PrefillSpec(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ReplicaSpec(kv_cache_dtype="int4")
    args = cli.build_parser().parse_args(["demo", "--fast-path", "on", "--kv-cache-dtype", "fp8"])
    assert cli.options(args).specs()[0].layout.row_bytes == 68


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
    (folder / "tokenizer.json").unlink()
    assert ModelSpec(kind=str(folder)).tokenizer() is None  # Serve then asks for 'ids'
    with pytest.raises(ConfigError, match="fp8"):
        ModelSpec(fp8="int4")
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model_type"):
        ModelSpec(kind=str(folder))
    with pytest.raises(ConfigError, match="model='no/such/dir'"):
        DeployOptions(model="no/such/dir")


def test_a_config_that_does_not_fit_the_model_is_refused_by_every_front_door():
    """Issue 15 item 4: ``ReplicaSpec`` accepted top_k 4 with a 6-slot hot buffer on a model
    that selects 8 positions; the ranks then failed mid-step. Every spec and option refuses it,
    naming top_k, before anything starts."""
    small = HiSparseConfig(top_k=4, device_buffer_size=6, host_to_device_ratio=4,
                           swap_in_block_size=64, host_pool_gib=0.01)
    wide = HiSparseConfig(top_k=16, device_buffer_size=16, host_to_device_ratio=4,
                          swap_in_block_size=64, host_pool_gib=0.01)
    for make in (lambda: ReplicaSpec(hisparse=small),
                 lambda: ReplicaSpec(hisparse=wide, model=ModelSpec(kind="glm_moe_dsa")),
                 lambda: ReplicaSpec(hisparse=small, model=ModelSpec(shape="landing",
                                                                      num_layers=2)),
                 lambda: DeployOptions(config=small),
                 lambda: DeployOptions.from_dict({"config": {"top_k": 4,
                                                             "device_buffer_size": 6}})):
        with pytest.raises(ConfigError) as ei:
            make()
        assert ei.value.key == "top_k" and "index_topk (8)" in str(ei.value)


def test_keys_left_out_take_the_built_in_defaults_not_sglangs():
    """Issue 15 item 6: the front doors fill a partial config from ``HiSparseConfig.tiny()`` (the
    built-in models' sizes); ``HiSparseConfig.from_json`` itself keeps SGLang's defaults."""
    partial = '{"top_k": 8, "device_buffer_size": 16}'
    assert load_config(partial) == load_config(json.loads(partial)) == HiSparseConfig.tiny()
    assert DeployOptions.from_dict({"config": partial}).config.host_pool_gib == 0.01
    assert HiSparseConfig.from_json(partial).host_pool_gib == 4.0  # SGLang's production default
    base = HiSparseConfig(top_k=2048, device_buffer_size=4096)
    assert load_config('{"host_pool_gib": 8}', base) == HiSparseConfig(host_pool_gib=8)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config("[1, 2]")
    with pytest.raises(ConfigError, match="must be a HiSparseConfig, a dict"):
        load_config(7)


def test_spec_errors_name_the_option_the_user_gave():
    with pytest.raises(ConfigError, match="^invalid config tp=3: must divide"):
        DeployOptions(tp=3)
    with pytest.raises(ConfigError, match="^invalid config model_layers=0"):
        DeployOptions(model_layers=0)
    with pytest.raises(ConfigError, match="^invalid config tp_size=3"):
        ReplicaSpec(tp_size=3)
