"""Per-layer pieces of the fast decode step (ring 2): which kernels a rank can run, sparse MLA
attention over resolved rows, the indexer's logits over the paged keys.

Every function takes static-shaped tensors and neither syncs with the host nor allocates host
memory, so the step that calls them can be captured in a CUDA graph. The reference variants are
plain torch (any device); they are the oracle of the library kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.fastpath.index_keys import PagedIndexKeys, quantize_queries
from hisparse_ray.kernels import deepgemm, flashmla
from hisparse_ray.kernels.kvfp8 import KVRowCodec
from hisparse_ray.model.fp8 import linear_no_bias


def choose_attention(cfg: FastPathConfig, model, codec: KVRowCodec, device: torch.device) -> str:
    """"flashmla" when FlashMLA runs this shape here (CUDA sm90, bf16 model, 512 + 64 rows stored
    bf16 or fp8, <= 128 local heads, top-k a multiple of 64, library present), else "reference";
    an explicit "flashmla" that cannot run raises KernelPreconditionError."""
    m = model.cfg
    heads = model.model.layers[0].self_attn.heads
    why = None
    if device.type != "cuda":
        why = "needs a CUDA device"
    elif model.dtype != torch.bfloat16:
        why = f"needs a bf16 model, got {model.dtype}"
    elif (m.kv_lora_rank, m.qk_rope_head_dim) != (flashmla.LATENT, flashmla.ROPE):
        why = f"needs 512 + 64 rows, got {m.kv_lora_rank} + {m.qk_rope_head_dim}"
    elif codec.kind not in ("bf16", "fp8"):
        why = f"needs bf16 or fp8 rows, got {codec.kind}"
    elif heads > 128 or m.index_topk % 64:
        why = f"needs <= 128 heads per rank and top-k % 64 == 0 (got {heads}, {m.index_topk})"
    elif not flashmla.available():
        why = "sglang-kernel (FlashMLA) is not importable on an sm90 device"
    if cfg.attention == "reference" or (cfg.attention == "auto" and why):
        return "reference"
    if why:
        from hisparse_ray.errors import KernelPreconditionError

        raise KernelPreconditionError(f"attention='flashmla' {why}")
    return "flashmla"


def choose_logits(cfg: FastPathConfig, model, keys: PagedIndexKeys, device: torch.device) -> str:
    """"deepgemm" for fp8 keys of 64 heads x 128 on CUDA sm90 with the library, else "reference"."""
    m = model.cfg
    why = None
    if device.type != "cuda":
        why = "needs a CUDA device"
    elif keys.kind != "fp8":
        why = f"reads fp8 index keys, got {keys.kind}"
    elif (m.index_n_heads, m.index_head_dim) != (64, 128):
        why = f"runs 64 x 128 index heads, got {m.index_n_heads} x {m.index_head_dim}"
    elif not deepgemm.available():
        why = "sgl-deep-gemm is not importable on an sm90 device"
    if cfg.logits == "reference" or (cfg.logits == "auto" and why):
        return "reference"
    if why:
        from hisparse_ray.errors import KernelPreconditionError

        raise KernelPreconditionError(f"logits='deepgemm' {why}")
    return "deepgemm"


def finish(attn, ctx: Tensor) -> Tensor:
    """``ctx [B, heads, R]`` (softmax-weighted latent) -> ``[B, hidden]``: ``W_uv``, ``o_proj``, the TP
    all-reduce, ``o_proj``'s bias; the same arithmetic as the tail of ``MLAAttention.attend``."""
    cfg = attn.cfg
    B = ctx.shape[0]
    w = attn.kv_b_proj.weight.view(attn.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    o = torch.einsum("bhr,hvr->bhv", ctx, w[:, cfg.qk_nope_head_dim:])
    out = linear_no_bias(attn.o_proj, o.reshape(B, attn.heads * cfg.v_head_dim))  # fp8 weights: their GEMM
    if attn.tp_size > 1:
        dist.all_reduce(out, group=attn.tp_group)
    if attn.o_proj.bias is not None:
        out = out + attn.o_proj.bias
    return out


def attend_reference(attn, q_full: Tensor, pool: Tensor, rows: Tensor, valid: Tensor,
                     codec: KVRowCodec) -> Tensor:
    """Gather (and decode) the resolved ``rows [B, K]`` int32 of ``pool [rows, row_bytes]`` and run
    the model's own attention -> ``[B, hidden]``. Padded batch rows (``valid`` False) attend to
    whatever row 0 holds (finite; discarded)."""
    kv = codec.decode(pool[rows.clamp_min(0).long()], q_full.dtype)  # [B, K, row_dim]
    allowed = (rows >= 0) | ~valid[:, None]
    return attn.attend(q_full[:, None], kv, allowed[:, None, :])[:, 0]


def attend_flashmla(attn, q_full: Tensor, pool: Tensor, rows: Tensor, valid: Tensor,
                    codec: KVRowCodec, metadata: tuple | None) -> Tensor:
    """FlashMLA over the resolved rows (heads zero-padded to 64/128) -> ``[B, hidden]``."""
    B, heads, D = q_full.shape
    Hp = flashmla.padded_heads(heads)
    q = q_full if Hp == heads else torch.cat([q_full, q_full.new_zeros(B, Hp - heads, D)], dim=1)
    if codec.kind == "fp8":
        ctx = flashmla.sparse_decode_fp8(q.contiguous(), pool, rows, metadata, attn.scale)
    else:
        ctx = flashmla.sparse_prefill_bf16(q.contiguous(), pool, rows, attn.scale)
    ctx = torch.where(valid[:, None, None], ctx[:, :heads], 0).to(q_full.dtype)
    return finish(attn, ctx)


def index_logits(kind: str, keys: PagedIndexKeys, i: int, indexer, q: Tensor, w: Tensor,
                 table: Tensor, seq_lens: Tensor, sched: Tensor | None) -> Tensor:
    """Indexer logits ``[B, Pi * 64]`` fp32 of pool ``i`` for queries ``q [B, H, D]`` and weights
    ``w [B, H]``, -inf at and past each row's length (padded rows: all -inf)."""
    if kind == "deepgemm":
        q8, wq = quantize_queries(q, w)
        logits = deepgemm.paged_mqa_logits(q8, wq, keys.deepgemm_view(i), seq_lens, table, sched)
    else:
        logits = keys.logits_reference(i, indexer, q, w, table)
    N = table.shape[1] * 64
    pos = torch.arange(N, device=logits.device)
    return logits[:, :N].masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
