"""Loading HF weights and configs: HF-initialized models, HF save_pretrained directories, the
per-expert checkpoint layout, GLM index-sharing config keys, and refusal of what we do not support."""

from __future__ import annotations

import pytest
import torch
import transformers

from hisparse_ray.errors import ConfigError
from hisparse_ray.model import (
    build_tiny_model,
    config_from_hf,
    from_hf_model,
    from_pretrained_dir,
    from_state_dict,
    hf_config_dict,
    save_pretrained_dir,
    tiny_config,
)
from hisparse_ray.model.config import indexer_types_from_hf

from ._hf import hf_twin


def _hf_model(kind: str, **extra):
    d = hf_config_dict(tiny_config(kind))
    d.pop("model_type")
    d.pop("indexer_types", None)
    d.update(extra)
    torch.manual_seed(0)
    if kind == "deepseek_v32":
        return transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**d)).eval()
    return transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**d)).eval()


def _prefill_close(model, hf, T: int = 24) -> None:
    toks = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=toks[None]).logits[0]
    torch.testing.assert_close(model.prefill(toks, all_logits=True)[0], ref, atol=1e-5, rtol=0)


def test_from_hf_model_with_glm_index_freq():
    """GLM index sharing via HF's ``index_topk_freq``/``index_skip_topk_offset`` kwargs."""
    hf = _hf_model("glm_moe_dsa", index_topk_freq=2, index_skip_topk_offset=1)
    model = from_hf_model(hf)
    assert model.cfg.indexer_types == tuple(hf.config.indexer_types) == ("full", "shared", "full", "shared")
    assert model.model.layers[1].self_attn.indexer is None
    _prefill_close(model, hf)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_hf_save_pretrained_directory_loads(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path)
    model = from_pretrained_dir(tmp_path, dtype=torch.float32)
    _prefill_close(model, hf)


def test_our_directory_round_trip_and_per_expert_layout(tmp_path):
    model = build_tiny_model(seed=4, kind="deepseek_v32")
    save_pretrained_dir(model, tmp_path)
    again = from_pretrained_dir(tmp_path, dtype=torch.float32)
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    # Original-checkpoint layout: one tensor per expert and projection, plus an MTP layer to drop.
    sd = dict(model.state_dict())
    cfg = model.cfg
    for name in [k for k in sd if k.endswith("experts.gate_up_proj")]:
        prefix = name[: -len(".gate_up_proj")]
        gate_up, down = sd.pop(name), sd.pop(f"{prefix}.down_proj")
        for e in range(cfg.n_routed_experts):
            gate, up = gate_up[e].chunk(2)
            sd[f"{prefix}.{e}.gate_proj.weight"], sd[f"{prefix}.{e}.up_proj.weight"] = gate, up
            sd[f"{prefix}.{e}.down_proj.weight"] = down[e]
    sd[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = torch.zeros(2, 2)
    per_expert = from_state_dict(cfg, sd)
    for k, a in model.state_dict().items():
        assert torch.equal(a, per_expert.state_dict()[k]), k


def test_fp8_checkpoint_and_missing_keys_are_refused():
    model = build_tiny_model(seed=4)
    sd = dict(model.state_dict())
    with pytest.raises(ConfigError, match="fp8"):
        from_state_dict(model.cfg, {**sd, "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1)})
    sd.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        from_state_dict(model.cfg, sd)


def test_index_sharing_rules_equal_hf():
    L = 9
    for extra in ({}, {"index_topk_freq": 3}, {"index_topk_freq": 4, "index_skip_topk_offset": 3},
                  {"index_topk_pattern": "FFSSFSFSS"}):
        hf_cfg = transformers.GlmMoeDsaConfig(num_hidden_layers=L, **extra)
        assert indexer_types_from_hf({**extra}, L) == tuple(hf_cfg.indexer_types), extra
    d = hf_config_dict(tiny_config("glm_moe_dsa"))
    assert config_from_hf(d) == tiny_config("glm_moe_dsa")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="kind"):
        tiny_config("llama")
    with pytest.raises(ConfigError, match="indexer_types"):
        tiny_config("glm_moe_dsa").with_(indexer_types=("shared", "full", "full", "full"))
    with pytest.raises(ConfigError, match="model_type"):
        config_from_hf({"model_type": "llama"})


def test_hf_twin_shares_state_dict_names():
    model = build_tiny_model(seed=1, kind="glm_moe_dsa")
    assert set(hf_twin(model).state_dict()) == set(model.state_dict())


def test_from_pretrained_dir_reads_released_folders_through_their_index(tmp_path):
    """An fp8 folder loads dequantized (was refused: 'dequantize first') and a stray
    ``*.safetensors`` the index does not list is ignored (was merged in, its keys refused)."""
    from safetensors.torch import save_file

    from hisparse_ray.model.sharded_load import load_checkpoint

    from ._checkpoint import write_released

    model = build_tiny_model(seed=4, kind="glm_moe_dsa")
    folder = write_released(model, tmp_path / "m", tokenizer=False)
    want = load_checkpoint(folder, dtype=torch.float32).state_dict()
    save_file({"stale.weight": torch.zeros(2)}, str(folder / "consolidated.safetensors"))
    got = from_pretrained_dir(folder, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
