"""Build a :class:`DSAModel` from HF weights (ring 2): a transformers 5.23.0 model or state dict, or a
safetensors directory with its config.json.

Accepted key layouts: transformers 5.x (packed experts ``mlp.experts.gate_up_proj [E, 2I, D]`` /
``down_proj [E, D, I]``) and the per-expert layout of the original checkpoints
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), which is packed here (gate rows first). Keys of
layers ``>= num_hidden_layers`` (the MTP layer of released checkpoints) and rotary buffers are dropped.
fp8 block-quantized state dicts (``*.weight_scale_inv``) are refused: dequantize them first; a
folder (:func:`from_pretrained_dir`) goes through the folder loader, which dequantizes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from hisparse_ray.errors import ConfigError
from hisparse_ray.model.config import DSAConfig, config_from_hf
from hisparse_ray.model.model import DSAModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def convert_state_dict(cfg: DSAConfig, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF keys -> this model's keys (identical names; experts packed, extra layers dropped)."""
    out: dict[str, Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, Tensor]]] = {}
    for key, t in sd.items():
        if key.endswith("weight_scale_inv"):
            raise ConfigError("checkpoint", key, "fp8 block-quantized weights are not supported; dequantize first")
        if "rotary_emb" in key:
            continue
        m = _LAYER.match(key)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue
        e = _EXPERT.match(key)
        if e:
            per_expert.setdefault(e.group(1), {}).setdefault(int(e.group(2)), {})[e.group(3)] = t
            continue
        out[key] = t
    for prefix, experts in per_expert.items():
        n = cfg.n_routed_experts
        if sorted(experts) != list(range(n)):
            raise ConfigError("checkpoint", prefix, f"needs experts 0..{n - 1}, found {len(experts)}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[i]["gate"], experts[i]["up"]]) for i in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([experts[i]["down"] for i in range(n)])
    if "lm_head.weight" not in out and cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_state_dict(
    cfg: DSAConfig | Mapping[str, Any],
    state_dict: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> DSAModel:
    """``cfg`` is a :class:`DSAConfig` or a HF config dict. ``dtype`` None keeps the embedding's dtype.
    Loading is strict: a missing or unexpected key raises."""
    if not isinstance(cfg, DSAConfig):
        cfg = config_from_hf(dict(cfg))
    sd = convert_state_dict(cfg, state_dict)
    dtype = dtype or sd["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = DSAModel(cfg)
    model.to_empty(device=device)
    model.rope = type(model.rope)(cfg)  # meta construction left its fp32 tables on meta
    model.load_state_dict(sd, strict=True)
    return model.cast_(dtype).eval()


def from_hf_model(hf_model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> DSAModel:
    """From a loaded ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (same device)."""
    sd = hf_model.state_dict()
    device = next(iter(sd.values())).device
    return from_state_dict(hf_model.config.to_dict(), sd, dtype=dtype, device=device)


def from_pretrained_dir(
    path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> DSAModel:
    """From a directory with ``config.json`` and safetensors files (no network): the folder loader
    (:func:`~hisparse_ray.model.sharded_load.load_checkpoint`), so the index decides which files
    count, fp8 weights are dequantized and every problem is a CheckpointError naming file and key
    (was: every ``*.safetensors`` merged, stale ones included, and fp8 folders refused)."""
    from hisparse_ray.model.sharded_load import load_checkpoint

    return load_checkpoint(Path(path), dtype=dtype, device=device, fp8="dequantize")


def save_pretrained_dir(model: DSAModel, path: str | Path) -> None:
    """Write ``config.json`` (HF keys) and one ``model.safetensors`` (HF names, packed experts)."""
    from safetensors.torch import save_file

    from hisparse_ray.model.config import hf_config_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(model.cfg), indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
