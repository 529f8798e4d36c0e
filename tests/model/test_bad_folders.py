"""Bad model folders fail early with a CheckpointError (a ConfigError) naming the file and the key."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from hisparse_ray.errors import CheckpointError, ConfigError
from hisparse_ray.model.checkpoint import Checkpoint
from hisparse_ray.model.model import build_random_model
from hisparse_ray.model.sharded_load import load_checkpoint
from hisparse_ray.model.source import resolve

from ._checkpoint import FP8_FORMAT, checkpoint_config, roundtrip_fp8, write_released


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    model = build_random_model(checkpoint_config(layers=2), seed=1)
    return write_released(model, tmp_path_factory.mktemp("good"), tokenizer=False)


@pytest.fixture
def folder(good, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good, dst)
    return dst


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _rewrite(folder, key, fn):
    """Rewrite the shard holding ``key`` with ``fn(tensors) -> tensors``."""
    from safetensors.torch import load_file, save_file

    f = folder / _index(folder)["weight_map"][key]
    save_file(fn(load_file(str(f))), str(f))


def _load(folder):
    return load_checkpoint(folder, dtype=torch.float32)


def test_missing_shard(folder):
    key, f = next(iter(_index(folder)["weight_map"].items()))
    (folder / f).unlink()
    with pytest.raises(CheckpointError, match=f"its shard {f} is missing") as e:
        _load(folder)
    assert e.value.file == "model.safetensors.index.json" and isinstance(e.value, ConfigError)


def test_model_type_not_dsa(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: model_type: 'llama' is not a DSA model"):
        resolve(folder)


def test_config_key_missing_and_bad_quantization(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quantization_config.quant_method"):
        Checkpoint(folder)
    del cfg["kv_lora_rank"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json: kv_lora_rank: required key missing"):
        Checkpoint(folder)


def test_shape_does_not_match_the_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 384  # the files hold 256-wide weights
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape \[320, 256\] does not match the config's \[320, 384\]") as e:
        _load(folder)
    assert e.value.key == "model.embed_tokens.weight" and e.value.file.startswith("model-")


def test_wrong_dtype(folder):
    key = "model.layers.0.input_layernorm.weight"
    _rewrite(folder, key, lambda t: {**t, key: t[key].to(torch.int32)})
    with pytest.raises(CheckpointError, match="not a floating-point type") as e:
        _load(folder)
    assert e.value.key == key


def test_missing_scale(folder):
    key = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    weight_map = _index(folder)["weight_map"]
    _rewrite(folder, key, lambda t: {k: v for k, v in t.items() if k != key})
    del weight_map[key]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="missing: the scales of fp8 weight") as e:
        _load(folder)
    assert e.value.key == key


def test_missing_tensor_and_index_lies(folder):
    key = "model.norm.weight"
    _rewrite(folder, key, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="listed in model.safetensors.index.json but not in the file"):
        Checkpoint(folder)
    weight_map = _index(folder)["weight_map"]
    del weight_map[key]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.norm.weight: missing from the checkpoint"):
        _load(folder)


def test_corrupt_shard(folder):
    f = next(iter(_index(folder)["weight_map"].values()))
    raw = (folder / f).read_bytes()
    (folder / f).write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    with pytest.raises(CheckpointError, match=f"checkpoint {f}: header: header length"):
        Checkpoint(folder)


def test_unexpected_key(folder):
    key = "model.layers.0.self_attn.q_a_proj.weight"
    _rewrite(folder, key, lambda t: {**t, "model.layers.0.self_attn.q_c_proj.weight": t[key].clone()})
    weight_map = _index(folder)["weight_map"]
    weight_map["model.layers.0.self_attn.q_c_proj.weight"] = weight_map[key]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="q_c_proj.weight: unexpected: this model has no such parameter"):
        _load(folder)


def test_not_a_folder_or_kind(tmp_path):
    with pytest.raises(ConfigError, match="model='nope': a built-in kind"):
        resolve("nope")
    with pytest.raises(CheckpointError, match="config.json.*missing"):
        resolve(tmp_path)


def test_indexer_weights_of_layers_the_config_shares_are_ignored(tmp_path):
    """GLM index sharing set in config.json over a checkpoint whose every layer has its indexer:
    the shared layers' indexer tensors go unused, as transformers ignores them (was refused as
    'unexpected'; fp8, so their scales too); the loaded model is the shared-config model on the
    same weights. (An unknown key is still refused: test_unexpected_key.)"""
    from hisparse_ray.model.config import tiny_config
    from hisparse_ray.model.export import released_config

    full = build_random_model(tiny_config("glm_moe_dsa").with_(indexer_types=("full",) * 4), seed=2)
    folder = write_released(full, tmp_path / "m", tokenizer=False, dtype=torch.float32)
    shared = tiny_config("glm_moe_dsa")  # F S F S
    (folder / "config.json").write_text(json.dumps(released_config(shared, fp8=FP8_FORMAT, num_mtp_layers=1)))
    model = _load(folder)
    assert model.cfg.indexer_types == shared.indexer_types and model.model.layers[1].self_attn.indexer is None
    want = roundtrip_fp8(full).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_rewritten_shard_is_seen_by_the_next_resolve(folder):
    """``resolve`` caches a folder's Checkpoint (its shards' header tables). A shard rewritten in
    place, config.json and the index untouched, must be re-read (was: the stale table, so a
    tensor removed from the shard failed inside safetensors, naming neither file nor cause)."""
    key = "model.norm.weight"
    resolve(folder).load(dtype=torch.float32)  # cached now
    _rewrite(folder, key, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match="model.norm.weight: listed in model.safetensors.index.json "
                                              "but not in the file"):
        resolve(folder).load(dtype=torch.float32)


def test_ue8m0_scales_stored_as_e8m0_load_like_fp32_ones(folder):
    """A folder whose power-of-two ``weight_scale_inv`` are stored as float8_e8m0fnu (1 byte a
    scale) instead of fp32: loads to exactly the same weights (was: 'dtype F8_E8M0 is not
    supported' for the whole folder)."""
    from safetensors.torch import load_file, save_file

    want = _load(folder).state_dict()
    for f in sorted(set(_index(folder)["weight_map"].values())):
        t = load_file(str(folder / f))
        save_file({k: v.to(torch.float8_e8m0fnu) if k.endswith("_scale_inv") else v
                   for k, v in t.items()}, str(folder / f))
    ckpt = Checkpoint(folder)
    assert ckpt.info("model.layers.0.self_attn.q_a_proj.weight_scale_inv").dtype == torch.float8_e8m0fnu
    got = _load(folder).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    kept = load_checkpoint(folder, dtype=torch.float32, fp8="torch")
    assert kept.model.layers[0].self_attn.q_a_proj.weight_scale_inv.dtype == torch.float32
