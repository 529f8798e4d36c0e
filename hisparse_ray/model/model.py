"""The DSA causal LM (ring 2): one-request prefill, batched sparse decode over an AttentionKVCache.

Module tree and parameter names equal HF's ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` state
dict (``model.embed_tokens``, ``model.layers.{i}.self_attn.*``, ``.mlp.*``, ``model.norm``, ``lm_head``),
so a HF state dict loads with ``load_state_dict(strict=True)`` (see :mod:`hisparse_ray.model.loading`).
Decoder layer (HF): ``h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``; logits
``lm_head(norm(h))``. Attention on layer ``i`` uses the top-k of ``anchor_of(i)`` (itself unless GLM
shares indices); the ``topk_hook`` runs only on anchor layers and what it returns is what the
following shared layers reuse.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hisparse_ray.model.attention import MLAAttention
from hisparse_ray.model.cache import AttentionKVCache, IndexerKeyCache
from hisparse_ray.model.config import DSAConfig, tiny_config
from hisparse_ray.model.layers import MLP, MoE, RMSNorm
from hisparse_ray.model.plan import DEFAULT_PREFILL_CHUNK_BYTES, PrefillPlan
from hisparse_ray.model.rope import Rope
from hisparse_ray.model.rowmath import RowMath

TopkHook = Callable[[int, Tensor], "Tensor | None"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer)
        sparse = cfg.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DSABody(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DSAModel(nn.Module):
    """DeepSeek-V3.2 / GLM-5 style model, inference only (``prefill``/``decode`` run under ``no_grad``).

    Dtype: parameters and activations in the parameters' dtype (fp32 on CPU tests, bf16 on GPU);
    indexer scores, router and softmax in fp32. TP: after :meth:`shard_heads` each rank must call
    prefill/decode with identical inputs (collective all-reduce per layer).
    """

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DSABody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = Rope(cfg)
        # Prefill (see prefill): bytes of temporaries per chunk (memory knob), and whether its
        # matmuls go one token row at a time (the exact path; False = batched, for throughput).
        self.prefill_chunk_bytes = DEFAULT_PREFILL_CHUNK_BYTES
        self.batch_invariant = True

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def cast_(self, dtype: torch.dtype) -> "DSAModel":
        """Cast to ``dtype`` (in place; returns self) keeping HF's fp32 islands: the router's
        ``e_score_correction_bias`` and every ``indexer.weights_proj``."""
        self.to(dtype=dtype)
        for name, mod in self.named_modules():
            if name.endswith("indexer.weights_proj"):
                mod.float()
            elif name.endswith("mlp.gate"):
                mod.e_score_correction_bias = mod.e_score_correction_bias.float()
        return self

    def shard_heads(self, rank: int, tp_size: int, group: dist.ProcessGroup | None = None) -> "DSAModel":
        """Keep this rank's attention heads on every layer (in place; returns self). MLP/MoE, embeddings,
        norms, indexers and lm_head stay replicated; the only collective is one all-reduce per layer
        after attention (gloo on CPU, NCCL on GPU: whatever ``group`` / the default group uses)."""
        for layer in self.model.layers:
            layer.self_attn.shard_heads(rank, tp_size, group)
        return self

    def _mlp(self, layer: DecoderLayer, h: Tensor) -> Tensor:
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.no_grad()
    def prefill(
        self, tokens: Tensor, topk_hook: TopkHook | None = None, *, all_logits: bool = False,
        batch_invariant: bool | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One request's prompt ``tokens [T]`` int64 (positions 0..T-1) ->
        ``(logits fp32, kv_rows [L, T, row_dim], index_keys [L, T, index_head_dim])`` in the model dtype;
        ``logits`` is ``[1, V]`` for position ``T-1``, or ``[T, V]`` with ``all_logits``. ``index_keys``
        rows of shared (GLM) layers are zero. ``topk_hook(layer, topk [T, K])`` sees each anchor layer's
        causal selection (-1 padded) and may return a replacement.

        Memory is bounded by ``prefill_chunk_bytes`` per chunk plus ``O(T)`` (see
        :class:`~hisparse_ray.model.plan.PrefillPlan`), never ``T * T``. ``batch_invariant`` (default
        :attr:`batch_invariant`): every row-mixing matmul one token row at a time
        (:class:`~hisparse_ray.model.rowmath.RowMath`), so position ``p``'s rows, keys and logits are
        bitwise what decoding the prompt token by token computes, whatever ``T`` and the chunks.
        Off the CPU that path runs one position per chunk (see the code), so it is slow: it is the
        exact reference for tests and tiny models, not the way to prefill a real model.
        """
        cfg = self.cfg
        T = tokens.shape[0]
        if T == 0:  # a prefill of nothing (a 1-token prompt's positions 0..P-2): empty results
            L, dev = cfg.num_hidden_layers, self.device
            return (torch.empty(0, cfg.vocab_size, device=dev),
                    torch.empty(L, 0, cfg.row_dim, dtype=self.dtype, device=dev),
                    torch.zeros(L, 0, cfg.index_head_dim, dtype=self.dtype, device=dev))
        rm = RowMath(self.batch_invariant if batch_invariant is None else batch_invariant)
        elem = torch.empty((), dtype=self.dtype).element_size()
        heads = self.model.layers[0].self_attn.heads if cfg.num_hidden_layers else cfg.num_attention_heads
        plan = PrefillPlan.of(cfg, heads, T, self.prefill_chunk_bytes, elem)
        if rm.batch_invariant and self.device.type != "cpu":
            # Off the CPU, batched GEMMs and reductions are not shown batch-invariant: one position
            # per chunk runs every operation in the shape the decode step of that position runs it.
            plan = PrefillPlan(1, 1, 1)
        positions = torch.arange(T, device=self.device)
        if rm.batch_invariant:  # cos/sin are transcendental: per position, as decode makes them
            cs = [self.rope.cos_sin(p, self.dtype) for p in positions.split(1)]
            cos, sin = torch.cat([c for c, _ in cs]), torch.cat([s for _, s in cs])
        else:
            cos, sin = self.rope.cos_sin(positions, self.dtype)
        h = self.model.embed_tokens(tokens.to(self.device))
        rows = torch.empty(cfg.num_hidden_layers, T, cfg.row_dim, dtype=self.dtype, device=self.device)
        keys = torch.zeros(cfg.num_hidden_layers, T, cfg.index_head_dim, dtype=self.dtype, device=self.device)
        topk = None
        x = torch.empty_like(h)
        for i, layer in enumerate(self.model.layers):
            for lo in range(0, T, plan.rows):
                x[lo : lo + plan.rows] = layer.input_layernorm(h[lo : lo + plan.rows])
            out, topk, rows[i], k = layer.self_attn.prefill(x, cos, sin, topk, topk_hook, plan, rm)
            if k is not None:
                keys[i] = k
            h += out
            del out
            for lo in range(0, T, plan.rows):
                part = h[lo : lo + plan.rows]
                part += layer.mlp(layer.post_attention_layernorm(part), rm)
        last = h if all_logits else h[-1:]
        logits = torch.cat([rm.linear(self.model.norm(last[lo : lo + plan.rows]), self.lm_head.weight,
                                      self.lm_head.bias).float() for lo in range(0, last.shape[0], plan.rows)])
        return logits, rows, keys

    @torch.no_grad()
    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: AttentionKVCache,
        index_caches: Sequence[IndexerKeyCache],
        topk_hook: TopkHook | None = None,
    ) -> Tensor:
        """One decode step for a batch of requests of different lengths.

        ``input_ids [B]`` int64 (the newest token of each row), ``positions [B]`` int64 (= n - 1, where
        n counts that token); ``kv_cache`` holds rows ``0..n-2`` of each row's request and receives row
        ``n-1`` via ``write_newest`` (the caller has pointed it at this batch, e.g.
        ``DenseKVCache.begin_step``); ``index_caches[b]`` is row b's :class:`IndexerKeyCache` with
        ``length == n - 1`` (advanced by one here). Attention runs over the top-k of positions
        ``[0, n)``. ``topk_hook(layer, topk [B, K])`` as in :meth:`prefill`. Returns ``logits [B, V]`` fp32.
        """
        cfg = self.cfg
        B = input_ids.shape[0]
        if len(index_caches) != B:
            raise ValueError(f"{len(index_caches)} index caches for a batch of {B}")
        positions = positions.to(self.device, torch.int64)
        pos_list = positions.tolist()
        n_max = max(pos_list) + 1
        cos, sin = self.rope.cos_sin(positions, self.dtype)

        def index_keys(layer: int, new: Tensor) -> Tensor:
            out = torch.zeros(B, n_max, cfg.index_head_dim, dtype=new.dtype, device=new.device)
            for b, (cache, p) in enumerate(zip(index_caches, pos_list)):
                cache.write(layer, p, new[b])
                out[b, : p + 1] = cache.view(layer, p + 1)
            return out

        h = self.model.embed_tokens(input_ids.to(self.device))
        topk = None
        for layer in self.model.layers:
            x = layer.input_layernorm(h)
            out, topk = layer.self_attn.decode(x, cos, sin, positions, kv_cache, index_keys, topk, topk_hook)
            h = self._mlp(layer, h + out)
        for cache in index_caches:
            cache.advance()
        return self.lm_head(self.model.norm(h)).float()


@torch.no_grad()
def init_random_(model: DSAModel, seed: int) -> DSAModel:
    """Seeded random weights with O(1) activations and logits (``1/sqrt(fan_in)`` linears, unit
    embeddings, norms near 1, small router bias) so top-k and greedy choices are well separated."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> Tensor:
        return torch.randn(shape, generator=gen) * std

    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            new = 1.0 + normal(p.shape, 0.1)
        elif name.endswith("k_norm.bias"):
            new = normal(p.shape, 0.1)
        elif name.endswith("embed_tokens.weight"):
            new = normal(p.shape, 1.0)
        elif p.dim() >= 2:
            new = normal(p.shape, max(p.shape[-1], 1) ** -0.5)  # fan-in 0: n_shared_experts 0
        else:
            new = normal(p.shape, 0.02)
        p.copy_(new.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(normal(b.shape, 0.1))
    return model


def build_tiny_model(
    seed: int = 0, kind: str = "deepseek_v32", *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DSAModel:
    """The embedded default: :func:`tiny_config` of ``kind`` with seeded random weights, no download."""
    return build_random_model(tiny_config(kind), seed, dtype=dtype, device=device)


def build_random_model(
    cfg: DSAConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DSAModel:
    """A model of ``cfg`` with seeded random weights (identical wherever it is built)."""
    model = init_random_(DSAModel(cfg), seed)
    return model.to(device=device).cast_(dtype).eval()
