"""The model config (``hisparse_ray/model/config.py``): a HF ``config.json`` whose value is missing,
of the wrong type or out of range is refused by ``config_from_hf`` with a ConfigError naming the
HF key, before any weight is built (each field of ``DSAConfig`` itself: tests/test_checks.py)."""

from __future__ import annotations

import pytest

from hisparse_ray.errors import ConfigError
from hisparse_ray.model.config import config_from_hf, hf_config_dict, tiny_config


def _hf(kind: str = "glm_moe_dsa", **change) -> dict:
    d = hf_config_dict(tiny_config(kind))
    d.pop("indexer_types", None)  # so that index_topk_pattern / index_topk_freq decide
    d.update(change)
    return {k: v for k, v in d.items() if v is not None}


def test_the_tiny_configs_round_trip():
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        d = hf_config_dict(tiny_config(kind))
        assert config_from_hf(d) == tiny_config(kind)
    assert config_from_hf(_hf(index_topk_pattern="FSFS")).indexer_types == \
        ("full", "shared", "full", "shared")


@pytest.mark.parametrize("change, key", [
    ({"n_group": 0}, "n_group"),  # was ZeroDivisionError
    ({"index_topk_pattern": "FFSXSF"}, "index_topk_pattern"),  # was KeyError
    ({"index_topk_pattern": "FSXS"}, "index_topk_pattern"),
    ({"index_topk_pattern": "FSF"}, "index_topk_pattern"),  # 3 letters for 4 layers
    ({"index_topk_pattern": ["full", "shared"]}, "index_topk_pattern"),
    ({"index_topk_pattern": "SFSF"}, "indexer_types"),  # layer 0 must run its indexer
    ({"num_attention_heads": 0}, "num_attention_heads"),  # was accepted, failed at build
    ({"kv_lora_rank": 0}, "kv_lora_rank"),  # likewise
    ({"index_topk": -1}, "index_topk"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 64.5}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),  # missing
    ({"model_type": "llama"}, "model_type"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"index_topk_freq": 0}, "index_topk_freq"),
    ({"first_k_dense_replace": -1, "mlp_layer_types": None}, "first_k_dense_replace"),
    ({"n_routed_experts": None}, "num_local_experts"),  # neither name given
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "x"}}, "factor"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta"),
    ({"rope_parameters": [1]}, "rope_parameters"),
])
def test_config_from_hf_refuses_a_bad_value_naming_the_key(change, key):
    with pytest.raises(ConfigError) as ei:
        config_from_hf(_hf(**change))
    assert ei.value.key == key
    assert str(ei.value).startswith(f"invalid config {key}=")


def test_a_missing_required_key_names_the_model_type():
    d = _hf("deepseek_v32")
    del d["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank=None: a required key of a deepseek_v32"):
        config_from_hf(d)
    with pytest.raises(ConfigError, match="must be a dict"):
        config_from_hf([("model_type", "deepseek_v32")])


_FIELDS = ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
           "norm_topk_prob", "rms_norm_eps", "max_position_embeddings", "attention_bias",
           "tie_word_embeddings")


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("absent", ["n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                                    "norm_topk_prob", "rms_norm_eps", "max_position_embeddings",
                                    "attention_bias", "tie_word_embeddings", "mlp_layer_types"])
def test_an_absent_optional_key_takes_hf_transformers_default(kind, absent):
    """A config.json without a key HF defaults parses to what transformers builds from it (was:
    n_group 1 / topk_group 1 / routed_scaling_factor 1.0 / eps 1e-6 / 4096 positions for both kinds:
    a DeepSeek folder silently routed and scaled its experts unlike the reference model)."""
    import transformers

    d = hf_config_dict(tiny_config(kind).with_(n_routed_experts=32, n_group=8,
                                                   topk_group=1, num_experts_per_tok=2))
    d.update(num_hidden_layers=5, first_k_dense_replace=1)
    d.pop("mlp_layer_types")  # layers from first_k_dense_replace (HF's default when absent: 3)
    d.pop(absent, None)
    if absent == "mlp_layer_types":
        d.pop("first_k_dense_replace")
    d.pop("indexer_types", None)
    ours = config_from_hf(d)
    cls = transformers.DeepseekV32Config if kind == "deepseek_v32" else transformers.GlmMoeDsaConfig
    hf = cls(**{k: v for k, v in d.items() if k != "model_type"})
    for f in _FIELDS:
        assert getattr(ours, f) == getattr(hf, f), f
    assert ours.mlp_layer_types == tuple(hf.mlp_layer_types)
    assert ours.rope.original_max_position_embeddings in (None, hf.rope_parameters["original_max_position_embeddings"])


def test_num_experts_names_the_routed_experts_as_in_hf():
    d = _hf("deepseek_v32")
    d["num_experts"] = d.pop("n_routed_experts")
    assert config_from_hf(d).n_routed_experts == tiny_config("deepseek_v32").n_routed_experts


def test_rope_scaling_wins_over_rope_parameters_as_in_hf():
    """A config.json carrying both (an edited legacy file): transformers builds its rope from
    ``rope_scaling``; so must we (was: ``rope_parameters``, a default rope where HF ran yarn)."""
    import transformers

    d = _hf("deepseek_v32", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    ours = config_from_hf(d)
    hf = transformers.DeepseekV32Config(**{k: v for k, v in d.items() if k != "model_type"})
    assert ours.rope.rope_type == hf.rope_parameters["rope_type"] == "yarn"
    assert ours.rope.factor == hf.rope_parameters["factor"]
    with pytest.raises(ConfigError) as ei:
        config_from_hf(_hf(rope_scaling=[1]))
    assert ei.value.key == "rope_scaling"


def test_quantization_config_as_transformers_writes_it():
    """``FineGrainedFP8Config`` as saved by transformers (``scale_fmt: "float"``) and one that
    leaves ``weight_block_size`` to its default (128, 128) or capitalizes the activation scheme
    parse as HF reads them (were refused); what HF refuses too still raises naming the key."""
    import json

    import transformers

    from hisparse_ray.model.fp8 import Fp8Format, parse_quantization

    saved = json.loads(transformers.FineGrainedFP8Config().to_json_string())
    assert saved["scale_fmt"] == "float"
    assert parse_quantization(saved) == Fp8Format((128, 128), ue8m0=False)
    assert parse_quantization({"quant_method": "fp8", "activation_scheme": "Dynamic"}) == Fp8Format()
    assert parse_quantization({"quant_method": "fp8", "scale_fmt": "ue8m0",
                               "weight_block_size": [64, 32]}) == Fp8Format((64, 32), ue8m0=True)
    for bad, key in (({"weight_block_size": None}, "weight_block_size"),
                     ({"weight_block_size": [128]}, "weight_block_size"),
                     ({"scale_fmt": "e8m0"}, "scale_fmt"),
                     ({"activation_scheme": "static"}, "activation_scheme")):
        with pytest.raises(ConfigError) as ei:
            parse_quantization({"quant_method": "fp8", **bad})
        assert ei.value.key == f"quantization_config.{key}"


@pytest.mark.parametrize("sharing", [{"indexer_types": ["full", "shared", "full", "shared"]},
                                     {"index_topk_freq": 2}, {"index_topk_pattern": "FSFS"}])
def test_deepseek_ignores_glm_index_sharing_keys_as_hf_does(sharing):
    """transformers' DeepSeek-V3.2 builds an indexer on every layer whatever GLM sharing keys its
    config.json carries (was: we shared top-k on DeepSeek layers, diverging from the reference)."""
    import transformers

    d = _hf("deepseek_v32", **sharing)
    assert config_from_hf(d).indexer_types == ("full",) * 4
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **{k: v for k, v in d.items() if k != "model_type"}))
    assert all(layer.self_attn.indexer is not None for layer in hf.model.layers)
    g = _hf("glm_moe_dsa", **sharing)
    glm = config_from_hf(g).indexer_types
    assert "shared" in glm and glm == tuple(transformers.GlmMoeDsaConfig(
        **{k: v for k, v in g.items() if k != "model_type"}).indexer_types)


@pytest.mark.parametrize("change", [
    {"index_topk_pattern": "FSSFFS"},  # a released pattern, num_hidden_layers lowered to 4
    {"index_topk_pattern": ["full", "shared", "full", "full", "shared"]},
    {"indexer_types": ["full", "full", "shared", "shared", "full", "shared"]},
])
def test_a_sharing_list_longer_than_the_layers_gives_its_first_entries_as_in_hf(change):
    """transformers reads layer i's entry of ``indexer_types`` (from ``index_topk_pattern`` when
    absent) and never checks the length: a longer list works there, so it must here, alike."""
    from transformers import GlmMoeDsaConfig

    d = _hf(**change)
    ours = config_from_hf(d)
    theirs = GlmMoeDsaConfig(**d)
    L = ours.num_hidden_layers
    assert L == 4 and ours.indexer_types == tuple(theirs.indexer_types[:L])
