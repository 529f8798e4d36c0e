"""Every public config / options / spec class refuses a bad value of every one of its fields with
a ConfigError naming that field (types, ranges, enums; a bool is never an int or a number), and
the helpers of ``hisparse_ray/checks.py`` they are built from. The table covers each key: a test
fails when a class gains a field the table does not name."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hisparse_ray.channel.ring import WaitPolicy
from hisparse_ray.checks import (
    check_bool, check_choice, check_int, check_number, check_optional_number, check_str,
)
from hisparse_ray.config import CoordinatorConfig, HiSparseConfig, KVLayout
from hisparse_ray.deploy import MODEL_KINDS, DeployOptions, ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.engine import EngineConfig
from hisparse_ray.errors import ConfigError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import KINDS, DSAConfig, RopeConfig, tiny_config
from hisparse_ray.model.plan import PrefillPlan
from hisparse_ray.rank.executor import SamplingParams

NAN, INF = float("nan"), float("inf")
TINY = tiny_config()  # 4 layers, 4 heads, index_topk 8, 8 experts in 2 groups (topk_group 1)

# class -> (a valid instance's keyword arguments, {field: [bad values]}). Every field is listed;
# the error must name the field (or, where a spec field comes from a differently named option,
# the option). Values chosen per field: a wrong type (a bool for numbers), out of range, not a
# choice, and the cross-field rules.
TABLE: dict[type, tuple[dict, dict[str, list]]] = {
    HiSparseConfig: ({}, {
        "top_k": [True, 0, 2.5, "8"],
        "device_buffer_size": [True, 0, "16", 1024],  # 1024 < top_k 2048
        "host_to_device_ratio": [True, 0, 1.5],
        "swap_in_block_size": [True, 48, 2048, 100],
        "host_pool_gib": [True, 0, -1.0, "1", INF, NAN],
    }),
    KVLayout: ({}, {
        "num_layers": [True, 0, 2.0],
        "kv_dtype": ["fp16", 1, ["bf16"]],
        "page_size": [True, 0, 8.0],
        "row_bytes": [True, 0, 1.5],
    }),
    CoordinatorConfig: (dict(num_device_blocks=4, num_host_blocks=4, page_size=8,
                             device_buffer_size=16), {
        "num_device_blocks": [True, 0, 2],  # 2 blocks cannot hold a hot buffer of 17 rows
        "num_host_blocks": [True, 0, 1.0],
        "page_size": [True, 0],
        "device_buffer_size": [True, 0],
        "tp_size": [True, 0],
        "max_batch": [True, 0],
        "page_bytes": [True, -1],
        "row_bytes": [True, -1],
        "host_tier": [1, None],
        "publish_decoded": [0, "yes"],
        "index_pages": [0, -1, 2.5, "3"],
        "index_page_tokens": [0, None, 1.5],
    }),
    EngineConfig: ({}, {
        "hisparse": [None, {"top_k": 8}],
        "page_size": [True, 0, 2.5],
        "num_device_blocks": [True, 0, 2],
        "max_batch": [True, 0],
        "full_resident": [1, "yes", None],
        "device": ["tpu", "cuda:x", None, 0],
        "backend": ["tpu", None],
        "batch_invariant": [0, "true"],
        "kv_cache_dtype": ["fp16", None],
        "device_pool_gib": [0, -1.0, True, "1", NAN],
        "fast_path": ["fast", FastPathConfig(buckets=(1, 2))],  # 2 < max_batch 16
        "lookahead": [1, "on", None],
    }),
    FastPathConfig: ({}, {
        "max_context": [0, True],
        "buckets": [(), (2, 1), (0, 4), [1, 2], (1, True)],
        "index_key_dtype": ["fp16"],
        "attention": ["cudnn"],
        "logits": ["torch"],
        "cuda_graphs": [1],
        "index_pages": [0, True],
        "compile_glue": [1, "yes"],
        "overlap_resolve": [0, "on", None],
        "warm_up": [1, "on", None, "always"],
    }),
    SamplingParams: ({}, {
        "temperature": ["0.7", True, -0.1, NAN, INF, None],
        "seed": [True, -1, 1.5, 2**64],
        "top_p": [0.0, 1.5, NAN, "0.9", True],
        "top_k": [-1, 1.5, True, 2**31],
    }),
    ModelSpec: ({}, {
        "kind": ["llama", None],
        "seed": [True, -1, 0.5],
        "dtype": ["fp16", None],
        "shape": ["huge"],
        "num_layers": [True, 0],
        "fp8": ["int4", None],
    }),
    ReplicaSpec: ({}, {
        "model": [None, "tiny"],
        "hisparse": [None, {}],
        "page_size": [2.5, True, 0],
        "num_device_blocks": [True, 0, 2],
        "staging_blocks": [True, -1, 1.0],
        "tp_size": [True, 0, 3],  # 3 does not divide the tiny model's 4 heads
        "max_batch": [True, 0],
        "gpus_per_rank": [True, -1, 2, NAN],
        "cpus_per_rank": [True, -1, "1"],
        "step_timeout_s": [0, True, INF],
        "landing_attempts": [True, 0],
        "landing_timeout_s": [0, "1"],
        "replica_id": ["", "a/b", 5],
        "step_yield_s": [1e-6, "x", True],
        "landing_layer_groups": [0, True],
        "landing_call_timeout_s": [0, -1],
        "landing_push_with_prefill": ["sometimes", 1],
        "host_pool_dir": ["", 5, "a\0b"],
        "kv_cache_dtype": ["fp16", 1, None],
        "fast_path": ["on", "auto"],
        "lookahead": ["on", 1, None],
    }),
    PrefillSpec: ({}, {
        "model": [None],
        "max_prompt_tokens": [0, True],
        "gpus": [-1, 2, True],
        "cpus": [-1, "1"],
        "name": ["", "a/b"],
        "synthetic_kv": [1, "no"],
        "batch_invariant": [0, None],
        "kv_cache_dtype": ["fp16", 1],
    }),
    RopeConfig: ({}, {
        "rope_type": ["ntk", None],
        "theta": [0, True, "1e4"],
        "factor": [0, "2", True],
        "original_max_position_embeddings": [0, 1.5],
        "beta_fast": [0, True],
        "beta_slow": [-1],
        "mscale": ["1", True],
        "mscale_all_dim": ["x"],
        "attention_factor": [0, NAN],
        "truncate": [1, None],
    }),
    WaitPolicy: ({}, {
        "spin_s": [-1, 1.0],  # 1.0 > yield_s
        "yield_s": [-1, True],
        "min_sleep_s": [0, 1.0],  # 1.0 > max_sleep_s
        "max_sleep_s": [0, None],
        "liveness_s": [0],
        "futex": [1, "yes"],
        "futex_slice_s": [0, INF],
    }),
    PrefillPlan: (dict(rows=1, index_queries=1, attn_queries=1), {
        "rows": [0, True],
        "index_queries": [0, 1.0],
        "attn_queries": [-1],
    }),
}

# DSAConfig: built from the tiny config; every int field positive, then the cross-field rules.
_DSA_BAD: dict[str, list] = {key: [0, True, 2.5] for key in (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
    "index_n_heads", "index_topk", "max_position_embeddings")}
_DSA_BAD.update({
    "kind": ["llama"],
    "num_hidden_layers": [0, 3],  # 3: the layer type tuples have 4 entries
    "qk_rope_head_dim": [0, 15],  # odd
    "index_head_dim": [0, 8],  # below qk_rope_head_dim 16
    "n_routed_experts": [0, 7],  # 7 is not a multiple of n_group 2
    "n_shared_experts": [-1, True],
    "num_experts_per_tok": [0, 5],  # topk_group 1 x 4 experts per group
    "n_group": [0, 3],
    "topk_group": [0, 3],  # > n_group
    "routed_scaling_factor": [0, True, NAN],
    "norm_topk_prob": [1],
    "rms_norm_eps": [0, -1e-6, "1e-6"],
    "mlp_layer_types": [("dense",) * 3, ("dense", "moe", "sparse", "sparse"), ["dense"] * 4],
    "indexer_types": [("shared", "full", "full", "full"), ("full",) * 3, ("full", "x") * 2],
    "rope": [None, "yarn"],
    "attention_bias": [0],
    "tie_word_embeddings": ["no"],
})


def _field_rows():
    for cls, (base, bad) in TABLE.items():
        for key, values in bad.items():
            for value in values:
                yield pytest.param(cls, base, key, value, id=f"{cls.__name__}.{key}={value!r}")


@pytest.mark.parametrize("cls, base, key, value", list(_field_rows()))
def test_every_field_refuses_a_bad_value_naming_it(cls, base, key, value):
    with pytest.raises(ConfigError) as ei:
        cls(**{**base, key: value})
    # the spec's ``theta`` is HF's ``rope_theta``; a fast path too small for the batch names its
    # buckets; everything else is named as the field
    assert ei.value.key == {"theta": "rope_theta", "fast_path": "fast_path" if isinstance(
        value, str) else "fast_path.buckets"}.get(key, key)
    assert str(ei.value).startswith(f"invalid config {ei.value.key}=")


@pytest.mark.parametrize("key, value", [pytest.param(k, v, id=f"{k}={v!r}")
                                        for k, vs in _DSA_BAD.items() for v in vs])
def test_every_model_config_field_refuses_a_bad_value_naming_it(key, value):
    with pytest.raises(ConfigError) as ei:
        dataclasses.replace(TINY, **{key: value})
    named = {"num_hidden_layers": ("num_hidden_layers", "mlp_layer_types"),
             "n_routed_experts": ("n_routed_experts", "n_group"),
             "qk_rope_head_dim": ("qk_rope_head_dim", "index_head_dim")}.get(key, (key,))
    assert ei.value.key in named


# DeployOptions: every option, bad values by kind (strings are parsed by from_dict, so the
# Python constructor is the strict one)
_OPTION_BAD: dict[str, list] = {
    "model": ["llama", 1], "seed": [-1, True, 1.5], "dtype": ["fp16"],
    "model_shape": ["huge"], "model_layers": [0, True], "fp8": ["int4", None], "config": [{"top_k": 8}, None, "x"],
    "tp": [0, True, 3], "page_size": [0, 2.5], "device_blocks": [0, 2], "staging_blocks": [-1],
    "max_batch": [0], "device": ["tpu"], "gpus_per_rank": [0.0, 1.5, True, NAN],
    "cpus_per_rank": [-1, NAN, "1"], "step_timeout_s": [0, INF], "step_yield_s": [1e-6, "x"],
    "landing_attempts": [0], "landing_timeout_s": [0, -1.0], "landing_call_timeout_s": [0],
    "landing_layer_groups": [0], "landing_push_with_prefill": ["sometimes"],
    "replica_id": ["", "a/b", 1], "host_pool_dir": ["", 1], "max_prompt_tokens": [0, True],
    "prefill_gpus": [-1, 2, NAN], "prefill_cpus": [-1, True], "max_new_tokens": [0, True],
    "max_new_tokens_limit": [0], "request_timeout_s": [0, NAN], "num_replicas": [0, True],
    "max_ongoing_requests": [0], "health_check_period_s": [0, -1],
    "decode_resources": [{"decode_node": 0}, {"x": NAN}, [1]], "prefill_resources": [{"a": -1}],
    "fast_path": ["yes", True], "kv_cache_dtype": ["fp16", 8], "index_key_dtype": ["int8", None],
    "compile_glue": ["yes", True], "lookahead": ["yes", True],
    "served_model_name": [1], "api_key": [1, None], "max_request_bytes": [0, True],
    "max_queued_requests": [0, -2, 1.5], "deployment_config": [{"bogus": 1}, [1], "x"],
}


@pytest.mark.parametrize("key, value", [pytest.param(k, v, id=f"{k}={v!r}")
                                        for k, vs in _OPTION_BAD.items() for v in vs])
def test_every_deploy_option_refuses_a_bad_value_naming_it(key, value):
    with pytest.raises(ConfigError) as ei:
        DeployOptions(**{key: value})
    assert ei.value.key == key


def test_the_table_names_every_field_of_every_class():
    for cls, (_, bad) in TABLE.items():
        assert set(bad) == {f.name for f in dataclasses.fields(cls)}, cls.__name__
    assert set(_DSA_BAD) == {f.name for f in dataclasses.fields(DSAConfig)}
    assert set(_OPTION_BAD) == {f.name for f in dataclasses.fields(DeployOptions)}


def test_the_defaults_and_the_built_in_models_pass():
    for cls, (base, _) in TABLE.items():
        cls(**base)
    DeployOptions()
    assert MODEL_KINDS == KINDS  # the front door's list without importing torch


def test_helpers_refuse_bools_nans_and_bounds_and_say_the_rule():
    assert check_int("n", 3, lo=1, hi=3) == 3
    for bad in (True, 0, 4, 2.0, "2"):
        with pytest.raises(ConfigError, match=r"invalid config n=.*must be an integer in \[1, 3\]"):
            check_int("n", bad, lo=1, hi=3)
    assert check_number("x", 0.5, lo=0, lo_open=True, hi=1) == 0.5
    for bad in (False, 0, NAN, INF, "0.5", 1.5):
        with pytest.raises(ConfigError, match=r"must be a finite number in \(0, 1\]"):
            check_number("x", bad, lo=0, lo_open=True, hi=1)
    assert check_number("t", INF, lo=0, finite=False) == INF
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        check_number("t", NAN, lo=0, finite=False)
    assert check_optional_number("y", None) is None
    with pytest.raises(ConfigError, match="or None"):
        check_optional_number("y", "1")
    assert check_bool("b", False) is False
    with pytest.raises(ConfigError, match="True or False"):
        check_bool("b", 0)
    assert check_choice("c", "a", ("a", "b")) == "a"
    with pytest.raises(ConfigError, match="one of 1, 2"):
        check_choice("c", True, (1, 2))  # True == 1, but it is not the int 1
    assert check_str("s", "r0", forbid="/") == "r0"
    with pytest.raises(ConfigError, match="non-empty string without '/'"):
        check_str("s", "a/b", forbid="/")
    assert math.isnan(ConfigError("k", NAN, "r").value)  # the value travels as given
