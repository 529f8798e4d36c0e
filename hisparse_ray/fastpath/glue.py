"""The fast step's per-layer glue (ring 2): the pure-torch work between the library kernels, as
five functions the step calls for every layer, optionally ``torch.compile``\\ d.

Between FlashMLA, DeepGEMM and the resolver a decoder layer runs ~150 small eager kernels at
batch 1 (norms, projections' reshapes, rope, concatenations, casts, the MLP's activation): each a
~2 us launch over a few KB, most of a fast step's time above its HBM floor (BENCHMARKS.md, "Where
the batch-1 step goes"). ``FastPathConfig(compile_glue=True)`` compiles these functions with
``torch.compile`` (inductor: fused kernels, GEMMs stay cuBLAS); the functions take the layer
module as an argument, so ONE compiled graph serves every layer of the same structure (dynamo
lifts parameters to inputs: no recompile per layer), and batch sizes are dynamic (one compile for
batch 1, one for the rest). Off (the default), the same functions run eagerly: exactly the
arithmetic of the model's own methods, in the same order.

A bucket's first step runs eagerly before its CUDA graph is captured, so compiling (and any
kernel tuning) happens there, never inside a capture. Both decode modes run the same compiled
code: HiSparse still equals full-resident bit for bit (``tests/fastpath/test_glue.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from hisparse_ray.fastpath.moe import ROWS


def pre_index(layer, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``h [B, hidden]`` -> ``(x, q_resid, row)``: the input norm, MLA's ``q_a`` projection (the
    indexer's query input) and the newest latent KV row: all the resolver's inputs need."""
    x = layer.input_layernorm(h)
    attn = layer.self_attn
    return x, attn.q_lora(x), attn.latent_row(x, cos, sin)


def query(attn, q_resid: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``q_resid`` -> the absorbed query ``q_full [B, heads, R + rope]``
    (``MLAAttention.absorbed_query``): the work the step runs while the resolver runs."""
    return attn.absorbed_query(q_resid, cos, sin)


def index_inputs(indexer, x: Tensor, q_resid: Tensor, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> ``(newest key [B, d], queries [B, H, d] fp32, head weights [B, H] fp32)`` of an anchor
    layer's indexer."""
    q, w = indexer.queries(x, q_resid, cos, sin)
    return indexer.keys(x, cos, sin), q, w


def post_attention(layer, h: Tensor, out: Tensor) -> Tensor:
    """Residual add, post-attention norm and the dense MLP (MoE layers run ``moe_step``); the
    MLP's ``silu`` one row at a time on the CPU (:class:`~hisparse_ray.fastpath.moe.StepRows`)."""
    h = h + out
    return h + layer.mlp(layer.post_attention_layernorm(h), ROWS)


def head(model, h: Tensor) -> tuple[Tensor, Tensor]:
    """Final norm and ``lm_head`` -> ``(logits [B, V] fp32, greedy tokens [B])``."""
    logits = model.lm_head(model.model.norm(h)).float()
    return logits, logits.argmax(-1)


@dataclass(frozen=True)
class Glue:
    """The five functions, compiled or not (``Glue.build``)."""

    pre_index: Callable
    query: Callable
    index_inputs: Callable
    post_attention: Callable
    head: Callable
    compiled: bool

    @classmethod
    def build(cls, compiled: bool) -> "Glue":
        fns = (pre_index, query, index_inputs, post_attention, head)
        if compiled:
            fns = tuple(torch.compile(f, dynamic=True) for f in fns)
        return cls(*fns, compiled=compiled)
