"""The dense prefill the model used before issue #17 (test reference only): the indexer scores all
``[T, index_heads, T]`` at once, and attention scores every query against every row with the top-k
scattered as a mask. Quadratic in ``T``; the chunked sparse prefill must agree with it (the same
top-k sets; outputs within fp32 rounding)."""

from __future__ import annotations

import torch
from torch import Tensor

from hisparse_ray.model import DSAModel
from hisparse_ray.model.indexer import Indexer, select_topk


def dense_topk(ix: Indexer, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``x [T, hidden]`` -> ``(topk [T, K] causal, -1 padded; keys [T, D])`` from dense scores."""
    T = x.shape[0]
    keys = ix.keys(x, cos, sin)
    q, w = ix.queries(x, q_resid, cos, sin)
    s = ix.scores(q[None], w[None], keys[None])[0]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return select_topk(s.masked_fill(~causal, float("-inf")), ix.cfg.index_topk), keys


def scatter_mask(topk: Tensor, n: int) -> Tensor:
    """``topk [Q, K]`` (-1 padded) -> bool ``[Q, n]``, True at selected positions."""
    mask = torch.zeros(topk.shape[0], n + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(1, torch.where(topk < 0, n, topk), True)
    return mask[:, :n]


@torch.no_grad()
def dense_prefill(model: DSAModel, tokens: Tensor, topk_hook=None) -> tuple[Tensor, Tensor, Tensor, list]:
    """-> ``(logits [T, V], rows [L, T, row_dim], keys [L, T, d], topk per layer)``."""
    cfg = model.cfg
    T = tokens.shape[0]
    cos, sin = model.rope.cos_sin(torch.arange(T, device=model.device), model.dtype)
    h = model.model.embed_tokens(tokens.to(model.device))
    rows = torch.empty(cfg.num_hidden_layers, T, cfg.row_dim, dtype=model.dtype, device=model.device)
    keys = torch.zeros(cfg.num_hidden_layers, T, cfg.index_head_dim, dtype=model.dtype, device=model.device)
    topk, per_layer = None, []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q_full, q_resid, row = attn.project(x, cos, sin)
        if attn.indexer is not None:
            topk, keys[i] = dense_topk(attn.indexer, x, q_resid, cos, sin)
            if topk_hook is not None:
                new = topk_hook(i, topk)
                topk = topk if new is None else new
        per_layer.append(topk)
        out = attn.attend(q_full[None], row[None], scatter_mask(topk, T)[None])[0]
        rows[i] = row
        h = model._mlp(layer, h + out)
    return model.lm_head(model.model.norm(h)).float(), rows, keys, per_layer
