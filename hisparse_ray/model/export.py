"""Write model folders in the released checkpoints' format (ring 2): config.json, safetensors
shards named ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, experts
one tensor per expert and projection, and optionally fp8 block-quantized weights with their
``weight_scale_inv`` (the weights the released DeepSeek-V3.2 / GLM-5 files quantize: every linear
of attention, indexer ``wq_b`` / ``wk``, dense and shared MLPs, routed experts and the MTP layer's
``eh_proj``; never embeddings, ``lm_head``, norms, the router or ``weights_proj``).

Tensors stream through :func:`write_checkpoint` one at a time and a shard is written as soon as it
is full, so a layer far larger than memory can be generated and saved (benchmarks do).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from hisparse_ray.model.config import DSAConfig, hf_config_dict
from hisparse_ray.model.fp8 import Fp8Format, quantization_config, quantize

QUANTIZED = re.compile(
    r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|wq_b|wk|gate_proj|up_proj|down_proj|eh_proj)\.weight$")


def is_quantized(key: str, t: Tensor) -> bool:
    """Whether the released format stores ``key`` as fp8 with block scales."""
    return t.dim() == 2 and bool(QUANTIZED.search(key))


def model_items(model: Any) -> Iterator[tuple[str, Tensor]]:
    """A :class:`DSAModel`'s tensors under the released checkpoints' keys: experts split per expert
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``), everything else by its own (HF) name."""
    for key, t in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            yield key, t


def released_config(cfg: DSAConfig, *, fp8: Fp8Format | None = None, num_mtp_layers: int = 0,
                    **extra: Any) -> dict[str, Any]:
    """config.json of ``cfg`` as the released files write it (architectures, MTP count, quant)."""
    d = hf_config_dict(cfg)
    d["architectures"] = ["DeepseekV32ForCausalLM" if cfg.kind == "deepseek_v32" else "GlmMoeDsaForCausalLM"]
    d["num_nextn_predict_layers"] = num_mtp_layers
    if fp8 is not None:
        d["quantization_config"] = quantization_config(fp8)
    d.update(extra)
    return d


def write_checkpoint(path: str | Path, config: dict[str, Any], items: Iterable[tuple[str, Tensor]], *,
                     fp8: Fp8Format | None = None, shard_bytes: int = 1 << 30,
                     dtype: torch.dtype | None = torch.bfloat16) -> dict[str, str]:
    """Stream ``items`` (key, tensor) into shards of about ``shard_bytes`` under ``path`` and write
    config.json and the index. Floating tensors are stored in ``dtype`` (None: as given) except
    fp32 islands (``e_score_correction_bias``, ``weights_proj``) and, with ``fp8``, the weights
    :func:`is_quantized` names (fp8 + fp32 ``weight_scale_inv``, same shard). Returns the weight map."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, Tensor] = {}
    size = 0
    names: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"part-{len(names):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            names.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for key, t in items:
        t = t.detach()
        if fp8 is not None and is_quantized(key, t):
            q, s = quantize(t, fp8.block, ue8m0=fp8.ue8m0)
            out = {key: q, key + "_scale_inv": s}
        elif t.is_floating_point() and dtype is not None and not key.endswith(
                ("e_score_correction_bias", "weights_proj.weight")):
            out = {key: t.to(dtype)}
        else:
            out = {key: t}
        for k, v in out.items():
            shard[k] = v.contiguous().cpu()
            n = v.numel() * v.element_size()
            size += n
            total += n
        if size >= shard_bytes:
            flush()
    flush()
    final = {old: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, old in enumerate(names)}
    for old, new in final.items():
        (path / old).rename(path / new)
    weight_map = {k: final[v] for k, v in weight_map.items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return weight_map
