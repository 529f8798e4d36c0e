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
            v = v.contiguous().cpu()
            if v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                v = v.clone()  # the shard owns its tensors: safetensors refuses two keys sharing memory
            shard[k] = v
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


def deepseek_v32_config(num_layers: int = 1, vocab_size: int = 129280, *, dense_layers: int = 0) -> DSAConfig:
    """DeepSeek-V3.2's shapes (hidden 7168, 128 heads, MLA 1536 / 512 + 64, indexer 64 x 128
    top-2048, 256 routed experts + 1 shared of 2048, yarn rope) with ``num_layers`` layers, the
    first ``dense_layers`` dense (the release: 61 and 3). For real-size benchmark layers."""
    from hisparse_ray.model.config import RopeConfig

    return DSAConfig(
        kind="deepseek_v32", vocab_size=vocab_size, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=num_layers, num_attention_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=1e-6, max_position_embeddings=163840,
        mlp_layer_types=("dense",) * dense_layers + ("sparse",) * (num_layers - dense_layers),
        indexer_types=("full",) * num_layers,
        rope=RopeConfig("yarn", 10000.0, factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                        mscale_all_dim=1.0))


def random_items(cfg: DSAConfig, seed: int = 0, device: str | torch.device = "cpu") -> Iterator[tuple[str, Tensor]]:
    """Seeded random weights of a ``cfg`` model under the released keys, generated one tensor at a
    time on ``device`` (a real-size layer never exists whole in memory): ``1/sqrt(fan_in)`` linears,
    unit embeddings, norms near 1 (as :func:`hisparse_ray.model.model.init_random_`)."""
    from hisparse_ray.model.model import DSAModel

    with torch.device("meta"):
        meta = DSAModel(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for key, t in model_items(meta):
        shape = t.shape

        def normal(std: float) -> Tensor:
            return torch.randn(shape, generator=gen, device=device) * std

        if key.endswith(("norm.weight", "layernorm.weight")):
            yield key, 1.0 + normal(0.1)
        elif key.endswith("embed_tokens.weight"):
            yield key, normal(1.0)
        elif key.endswith("e_score_correction_bias"):
            yield key, normal(0.1)
        elif len(shape) >= 2:
            yield key, normal(max(shape[-1], 1) ** -0.5)
        else:
            yield key, normal(0.02)
