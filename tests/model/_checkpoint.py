"""Test helper: model folders in the released DeepSeek-V3.2 / GLM-5 format, made here (no download).

``write_released(model, path)`` writes ``model``'s weights as the released files do: config.json
with ``quantization_config`` (fp8 e4m3, 128x128 blocks, ue8m0 scales) and
``num_nextn_predict_layers: 1``, weights fp8 with ``weight_scale_inv``, experts one tensor per
expert and projection, an extra MTP layer (``model.layers.{L}``: a full decoder layer plus
``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``) that loaders must skip, several shards with
``model.safetensors.index.json``, and a small real BPE tokenizer (trained here with ``tokenizers``)
with a DeepSeek-style chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hisparse_ray.model.config import RopeConfig, tiny_config
from hisparse_ray.model.export import model_items, released_config, write_checkpoint
from hisparse_ray.model.fp8 import Fp8Format, dequantize, quantize
from hisparse_ray.model.model import DSAModel

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")
CORPUS = [
    "HiSparse keeps the full MLA KV of a request in pinned host memory and a hot buffer on the GPU.",
    "The lightning indexer selects the top-k positions; the resolver maps them to device rows.",
    "Ünïcödé: naïve café, 東京, Ελληνικά, emoji 🙂 and tabs\tand newlines\n.",
    "def decode(step): return step + 1  # code-like text, numbers 0123456789",
] * 4
FP8_FORMAT = Fp8Format(block=(128, 128), ue8m0=True)


def checkpoint_config(kind: str = "deepseek_v32", *, layers: int = 3):
    """A small DSA config whose weight dims are multiples of 128 (kv_a_proj's 192 rows: a partial
    block), 4 heads (TP 2: 2 heads = 256 q_b rows, 128 o_proj columns per rank), 8 experts."""
    return tiny_config(kind).with_(
        vocab_size=320, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, index_n_heads=4, index_head_dim=128,
        mlp_layer_types=("dense",) + ("sparse",) * (layers - 1),
        indexer_types=("full",) * layers if kind == "deepseek_v32"
        else tuple("full" if i % 2 == 0 else "shared" for i in range(layers)),
        rope=RopeConfig("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                        mscale_all_dim=0.707))


def roundtrip_fp8(model: DSAModel) -> DSAModel:
    """``model`` with every weight the released format quantizes replaced by its fp8 dequantization
    (in place), i.e. the weights an fp8 folder of ``model`` represents."""
    from hisparse_ray.model.export import QUANTIZED

    with torch.no_grad():
        for key, p in model.state_dict(keep_vars=True).items():
            if QUANTIZED.search(key) and p.dim() == 2:
                q, s = quantize(p.data, FP8_FORMAT.block, ue8m0=True)
                p.data.copy_(dequantize(q, s, dtype=p.dtype))
            elif key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # per expert (leading dim); gate and up are separate tensors in the files
                parts = p.data.chunk(2, dim=1) if key.endswith("gate_up_proj") else (p.data,)
                deq = [dequantize(*quantize(w, FP8_FORMAT.block, ue8m0=True), dtype=p.dtype) for w in parts]
                p.data.copy_(torch.cat(deq, dim=1))
    return model


def _mtp_items(model: DSAModel):
    """One MTP layer: layer L-1's decoder weights renamed to layer L, plus the MTP-only tensors."""
    L, D = model.cfg.num_hidden_layers, model.cfg.hidden_size
    last = f"model.layers.{L - 1}."
    for key, t in model_items(model):
        if key.startswith(last):
            yield f"model.layers.{L}." + key[len(last):], t
    g = torch.Generator().manual_seed(5)
    yield f"model.layers.{L}.eh_proj.weight", torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5
    for n in ("enorm", "hnorm", "shared_head.norm"):
        yield f"model.layers.{L}.{n}.weight", torch.ones(D)


def write_tokenizer(path: str | Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer trained on :data:`CORPUS` with DeepSeek-style special tokens, a
    BOS post-processor, tokenizer_config.json (chat template) and generation_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS, "special": True},
        "eos_token": {"__type": "AddedToken", "content": EOS, "special": True},
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}))


def write_released(model: DSAModel, path: str | Path, *, fp8: bool = True, shard_bytes: int = 1 << 20,
                   mtp: bool = True, tokenizer: bool = True, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``model`` as a released-format folder (see the module docstring); returns ``path``."""
    path = Path(path)
    fmt = FP8_FORMAT if fp8 else None
    items = list(model_items(model)) + (list(_mtp_items(model)) if mtp else [])
    config = released_config(model.cfg, fp8=fmt, num_mtp_layers=1 if mtp else 0)
    write_checkpoint(path, config, items, fp8=fmt, shard_bytes=shard_bytes, dtype=dtype)
    if tokenizer:
        write_tokenizer(path)
    return path
