"""Helpers for comparing our DSA model with HF transformers 5.23.0 (the external reference).

HF's indexer returns the top-k as ``int32 [B, S, min(index_topk, T)]`` (sorted by score); in prefill,
rows with fewer than ``index_topk`` visible keys also hold masked (future) positions. We hook the
indexer by replacing its module's ``forward`` with a wrapper that records (or replaces) that output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from torch import Tensor

from hisparse_ray.model import DSAModel, DenseKVCache, IndexerKeyCache, hf_config_dict


def hf_twin(model: DSAModel) -> torch.nn.Module:
    """A HF ``*ForCausalLM`` with exactly ``model``'s weights (strict load), same dtype and device."""
    d = hf_config_dict(model.cfg)
    kind = d.pop("model_type")
    if kind == "deepseek_v32":
        cfg_cls, model_cls = transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM
    else:
        cfg_cls, model_cls = transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
    with torch.device(model.device):
        hf = model_cls(cfg_cls(**d)).to(model.dtype)
    # HF's from_pretrained keeps these fp32 (_keep_in_fp32_modules); a plain .to(dtype) would not.
    for name, mod in hf.named_modules():
        if name.endswith("indexer.weights_proj"):
            mod.float()
        elif hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    hf.load_state_dict(model.state_dict(), strict=True)
    hf.eval()
    return hf


@dataclass
class IndexerTap:
    """Records every HF indexer call's output per layer; ``replace[layer]`` (if set) is returned
    instead of the indexer's own selection."""

    calls: dict[int, list[Tensor]] = field(default_factory=dict)
    replace: dict[int, Tensor] = field(default_factory=dict)

    def install(self, hf: torch.nn.Module) -> "IndexerTap":
        for i, layer in enumerate(hf.model.layers):
            ix = layer.self_attn.indexer
            if ix is None:
                continue
            orig = ix.forward

            def forward(*args, _orig=orig, _i=i, **kwargs):
                out = _orig(*args, **kwargs)
                self.calls.setdefault(_i, []).append(out)
                return self.replace.pop(_i, out)

            ix.forward = forward
        return self

    def last(self, layer: int) -> Tensor:
        return self.calls[layer][-1]


def hf_to_ours(idx: Tensor, k: int, *, query_pos: Tensor) -> Tensor:
    """HF top-k ``[S, k']`` (int32) -> ours ``[S, k]`` int64: positions after the query are -1, padded."""
    idx = idx.long()
    idx = torch.where(idx > query_pos[:, None], torch.full_like(idx, -1), idx)
    if idx.shape[1] < k:
        idx = torch.nn.functional.pad(idx, (0, k - idx.shape[1]), value=-1)
    return idx


def as_sets(topk: Tensor) -> list[set[int]]:
    return [set(v for v in row.tolist() if v >= 0) for row in topk]


@dataclass
class Session:
    """Our model serving B requests from a DenseKVCache, next to one HF DynamicCache per request."""

    model: DSAModel
    hf: torch.nn.Module
    prompts: list[Tensor]
    capacity: int

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        self.tap = IndexerTap().install(self.hf)
        self.kv = DenseKVCache(cfg.num_hidden_layers, cfg.row_dim, len(self.prompts), self.capacity,
                               dtype=self.model.dtype, device=self.model.device)
        self.index_caches: list[IndexerKeyCache] = []
        self.hf_caches: list[object] = []
        self.lengths = [len(p) for p in self.prompts]
        self.selection_mismatches = 0
        self.selections = 0

    def _hook_from_hf(self, per_layer: dict[int, Tensor]):
        def hook(layer: int, ours: Tensor) -> Tensor:
            ref = per_layer[layer]
            self.selections += len(ours)
            self.selection_mismatches += sum(a != b for a, b in zip(as_sets(ours), as_sets(ref)))
            return ref

        return hook

    def prefill(self) -> tuple[list[Tensor], list[Tensor]]:
        """Prefill every prompt in both models (ours replays HF's top-k). Returns (ours, HF) logits."""
        ours, theirs = [], []
        K = self.model.cfg.index_topk
        for b, p in enumerate(self.prompts):
            cache = transformers.DynamicCache(config=self.hf.config)
            with torch.no_grad():
                ref = self.hf(input_ids=p[None].to(self.model.device), past_key_values=cache, use_cache=True).logits[0]
            q = torch.arange(len(p), device=self.model.device)
            per_layer = {i: hf_to_ours(c[-1][0], K, query_pos=q) for i, c in self.tap.calls.items()}
            logits, rows, keys = self.model.prefill(p, topk_hook=self._hook_from_hf(per_layer), all_logits=True)
            self.kv.load(b, rows)
            self.index_caches.append(IndexerKeyCache.from_prefill(keys, self.capacity))
            self.hf_caches.append(cache)
            ours.append(logits)
            theirs.append(ref.float())
        return ours, theirs

    def step(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Feed ``tokens [B]`` to every request: HF per request, ours as one batch. -> (ours, HF) ``[B, V]``."""
        K = self.model.cfg.index_topk
        B = len(self.prompts)
        refs, per_layer_rows = [], []
        for b in range(B):
            with torch.no_grad():
                out = self.hf(input_ids=tokens[b].view(1, 1), past_key_values=self.hf_caches[b], use_cache=True)
            refs.append(out.logits[0, -1].float())
            q = torch.tensor([self.lengths[b]], device=self.model.device)
            per_layer_rows.append({i: hf_to_ours(c[-1][0], K, query_pos=q)[0] for i, c in self.tap.calls.items()})
        per_layer = {i: torch.stack([r[i] for r in per_layer_rows]) for i in per_layer_rows[0]}
        positions = torch.tensor(self.lengths, device=self.model.device)
        self.kv.begin_step(torch.arange(B), positions)
        logits = self.model.decode(tokens, positions, self.kv, self.index_caches, topk_hook=self._hook_from_hf(per_layer))
        self.lengths = [n + 1 for n in self.lengths]
        return logits, torch.stack(refs)
