"""The fast decode step of one rank (ring 2): a whole decode step of the DSA model as one batch
over static device buffers, captured in one CUDA graph per batch-size bucket.

Per layer: norm + MLA projections, the newest KV row encoded (bf16 or fp8 rows) into its write
row, the indexer's newest key into the paged key pool, the indexer's logits over the pool
(DeepGEMM's fp8 paged logits or the torch reference), the deterministic top-k
(:func:`~hisparse_ray.model.indexer.select_topk`'s set, in position order:
:func:`~hisparse_ray.fastpath.topk.select_topk_positions`, one Triton kernel on CUDA), the
resolver (hot buffer / host misses / resident rows), sparse MLA attention over the resolved rows
(FlashMLA or the torch reference), ``W_uv`` + ``o_proj`` (+ the TP all-reduce), the MLP. Then the
final norm, ``lm_head`` and argmax. Hot-buffer hits and misses are counted on the device.

Static state: :class:`~hisparse_ray.fastpath.inputs.StepInputs` (filled by host work before each
run), per anchor layer the resolver's ``out_rows`` and ``plan``, the outputs ``tokens [Bmax]``,
``logits [Bmax, V]`` fp32, ``hits`` / ``misses [Bmax]``. A bucket's first step runs eagerly (it
also compiles and warms every kernel), the graph is captured right after and replayed from then
on: the resolver, FlashMLA and DeepGEMM are all called once before their capture.
Graphs are used on CUDA when ``cuda_graphs`` is set and TP, if any, runs on NCCL; otherwise the
same body runs eagerly. MoE layers run :func:`~hisparse_ray.fastpath.moe.moe_step` (no host sync:
DeepGEMM's masked grouped GEMMs, or every expert masked), so they are captured too.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from hisparse_ray import kernels
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig
from hisparse_ray.fastpath.glue import Glue
from hisparse_ray.fastpath.index_keys import PagedIndexKeys
from hisparse_ray.fastpath.inputs import StepInputs
from hisparse_ray.fastpath.layer import (
    attend_flashmla, attend_reference, choose_attention, choose_logits, index_logits,
)
from hisparse_ray.kernels import deepgemm, flashmla
from hisparse_ray.kernels.kvfp8 import KVRowCodec
from hisparse_ray.fastpath.topk import select_topk_positions
from hisparse_ray.fastpath.moe import ROWS, moe_step
from hisparse_ray.model.layers import MoE, fused_norms
from hisparse_ray.model.rope import inv_freq_and_scale


class FastDecodeStep:
    """One rank's batched decode step. ``runtime`` is the rank's :class:`HiSparseRuntime` (its
    device pool must have >= 1 spare row: row ``write_sink`` takes padded rows' writes, and whole
    64-row pages for FlashMLA's fp8 view); ``keys`` its :class:`PagedIndexKeys`.

    Use: ``inputs.fill(rows, bucket)`` then ``run(bucket)``; read ``tokens[:B]``, ``logits[:B]``,
    ``hits[:B]``, ``misses[:B]`` (device tensors, valid once the current stream reaches them).
    """

    def __init__(self, model, runtime, keys: PagedIndexKeys, codec: KVRowCodec, cfg: FastPathConfig,
                 *, block_threads: int) -> None:
        self.model, self.rt, self.keys, self.codec, self.cfg = model, runtime, keys, codec, cfg
        m = model.cfg
        dev = self.device = runtime.device
        self.K, self.H, self.page = m.index_topk, runtime.H, runtime.page
        self.block_threads = block_threads
        rows = runtime.device_kv[0].shape[0]
        self.write_sink = rows - 1
        self.pages = -(-cfg.max_context // self.page)
        self.inputs = StepInputs(cfg.max_batch, self.H + 1, self.pages, cfg.index_pages_per_request,
                                 self.write_sink, keys.sink_row, dev)
        Bm = cfg.max_batch
        self.anchors = sorted(set(runtime.anchor_of))
        A = len(self.anchors)
        # one tensor each over the anchor layers, so the step counts hits and misses in one pass
        self.topk_all = torch.full((A, Bm, self.K), -1, dtype=torch.int32, device=dev)
        self.rows_all = torch.full((A, Bm, self.K), -1, dtype=torch.int32, device=dev)
        self.plan_all = torch.full((A, Bm, self.K, 2), -1, dtype=torch.int32, device=dev)
        self.slot_of = {a: i for i, a in enumerate(self.anchors)}
        self.out_rows = {a: self.rows_all[i] for i, a in enumerate(self.anchors)}
        self.plan = {a: self.plan_all[i] for i, a in enumerate(self.anchors)}
        self.tokens = torch.zeros(Bm, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(Bm, m.vocab_size, dtype=torch.float32, device=dev)
        self.hits = torch.zeros(Bm, dtype=torch.int64, device=dev)
        self.misses = torch.zeros(Bm, dtype=torch.int64, device=dev)
        inv, self.rope_factor = inv_freq_and_scale(m)
        self.inv_freq = inv.to(dev)
        self.topk_override: Tensor | None = None  # [L, Bmax, K] int32: benchmarks' top-k traces
        self.glue = Glue.build(cfg.compile_glue)  # the per-layer torch work, compiled or eager
        self.attention = choose_attention(cfg, model, codec, dev)
        self.logits_kind = choose_logits(cfg, model, keys, dev)
        if self.attention == "flashmla" and codec.kind == "fp8" and rows % 64:
            raise ValueError(f"device pool rows {rows} must be whole 64-row pages for FlashMLA fp8")
        self._mla_meta: dict[int, tuple] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._generation = keys.generation
        self.use_graphs = dev.type == "cuda" and cfg.cuda_graphs and self._capturable()
        self.capture_error: str | None = None
        # the resolver's stream when it overlaps the absorbed query (FastPathConfig.overlap_resolve)
        self.side = (torch.cuda.Stream(dev) if dev.type == "cuda" and cfg.overlap_resolve else None)
        self.side_delay: Callable[[], int] | None = None  # tests: GPU cycles to sleep on the side
        # stream before each resolve (random schedules; a graph keeps those of its capture)
        if self.logits_kind == "deepgemm":
            deepgemm.warm_up(dev, m.index_n_heads, m.index_head_dim)

    def _capturable(self) -> bool:
        for layer in self.model.model.layers:
            a = layer.self_attn
            if a.tp_size > 1 and dist.get_backend(a.tp_group) != "nccl":
                return False
        return True

    # -- running ------------------------------------------------------------------------------------
    def run(self, bucket: int) -> None:
        """Run the step for the ``bucket`` rows the inputs were filled for (graph replay once the
        bucket has been captured; its first step runs eagerly and is then captured)."""
        if bucket not in self.cfg.buckets:
            raise ValueError(f"{bucket} is not a bucket of {self.cfg.buckets}")
        if self._generation != self.keys.generation:  # the index pool grew: new addresses
            self.graphs.clear()
            self._generation = self.keys.generation
        g = self.graphs.get(bucket)
        if g is not None:
            g.replay()
            return
        self._body(bucket)
        if self.use_graphs:
            torch.cuda.current_stream(self.device).synchronize()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            try:
                # thread_local: a rank actor's other threads (landings under the executor lock,
                # NIXL's progress thread, stats calls) may use CUDA while its step thread captures
                with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                    self._body(bucket)
            except RuntimeError as e:  # a kernel library that cannot be captured: stay eager
                self.use_graphs, self.capture_error = False, f"{type(e).__name__}: {e}"
                warnings.warn(f"fast step stays eager: CUDA graph capture failed ({self.capture_error})")
                return
            self.graphs[bucket] = g

    def _metadata(self, B: int) -> tuple | None:
        if self.attention != "flashmla" or self.codec.kind != "fp8":
            return None
        meta = self._mla_meta.get(B)
        if meta is None:
            heads = flashmla.padded_heads(self.model.model.layers[0].self_attn.heads)
            meta = self._mla_meta[B] = flashmla.decode_metadata(B, heads, self.K, self.device)
        return meta

    @torch.no_grad()
    def _body(self, B: int) -> None:
        # one Triton kernel per RMSNorm on CUDA, unless the glue is compiled (inductor fuses them)
        with fused_norms(self.device.type == "cuda" and not self.glue.compiled):
            self._layers(B)

    def _layers(self, B: int) -> None:
        model, rt, inp, codec = self.model, self.rt, self.inputs, self.codec
        meta = self._metadata(B)  # outside the captured work: computed on the first (eager) run
        ids = inp.view("ids", B)[:, 0].long()
        src = inp.view("from_row", B)[:, 0].long()  # chained rows: the previous step's tokens
        ids = torch.where(src >= 0, self.tokens.index_select(0, src.clamp_min(0)), ids)
        seq = inp.view("seq_lens", B)[:, 0]
        write = inp.view("write", B)[:, 0].long()
        iwrite = inp.view("index_write", B)[:, 0].long()
        state = inp.view("state", B)[:, 0]
        slot_rows, resident = inp.view("slot_rows", B), inp.view("resident", B)
        host, itable = inp.view("host", B), inp.view("index_table", B)
        valid = seq > 0
        freqs = inp.view("pos", B)[:, 0].float()[:, None] * self.inv_freq
        dt = model.dtype
        cos = (ROWS.each(torch.cos, freqs) * self.rope_factor).to(dt)  # per row on the CPU
        sin = (ROWS.each(torch.sin, freqs) * self.rope_factor).to(dt)
        sched = deepgemm.schedule(seq) if self.logits_kind == "deepgemm" else None
        glue = self.glue
        h = model.model.embed_tokens(ids)
        main = torch.cuda.current_stream(self.device) if self.side is not None else None
        for l, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x, q_resid, row = glue.pre_index(layer, h, cos, sin)
            rt.device_kv[l][write] = codec.encode(row)
            a = rt.anchor_of[l]
            out_rows = self.out_rows[a][:B]
            if a == l:
                ix = attn.indexer
                i = self.keys.slot[l]
                key, q, w = glue.index_inputs(ix, x, q_resid, cos, sin)
                self.keys.write(i, iwrite, key)
                logits = index_logits(self.logits_kind, self.keys, i, ix, q, w, itable, seq, sched)
                topk = self.topk_all[self.slot_of[l], :B]
                select_topk_positions(logits, self.K, lengths=seq, out=topk)
                if self.topk_override is not None:  # timed above, then replaced by the trace
                    topk.copy_(torch.where(valid[:, None], self.topk_override[l][:B], -1))
            if main is not None:  # fork: the resolver beside the absorbed query
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    if self.side_delay is not None:  # tests: a late resolver is still waited for
                        torch.cuda._sleep(self.side_delay())
                    self._resolve(l, a, B, seq, state, slot_rows, resident, host)
                q_full = glue.query(attn, q_resid, cos, sin)
                main.wait_stream(self.side)  # join: attention reads the resolved rows
            else:
                self._resolve(l, a, B, seq, state, slot_rows, resident, host)
                q_full = glue.query(attn, q_resid, cos, sin)
            if self.attention == "flashmla":
                out = attend_flashmla(attn, q_full, rt.device_kv[l], out_rows, valid, codec, meta)
            else:
                out = attend_reference(attn, q_full, rt.device_kv[l], out_rows, valid, codec)
            if isinstance(layer.mlp, MoE):
                h = h + out
                h = h + moe_step(layer.mlp, layer.post_attention_layernorm(h))
            else:
                h = glue.post_attention(layer, h, out)
        logits, tokens = glue.head(model, h)
        self.logits[:B].copy_(logits)
        self.tokens[:B].copy_(tokens)
        self._count(B, seq, resident)

    def _resolve(self, l: int, a: int, B: int, seq: Tensor, state: Tensor, slot_rows: Tensor,
                 resident: Tensor, host: Tensor) -> None:
        """Layer ``l``'s rows on the current stream: the resolver on an anchor layer (its top-k
        is ``topk_all``'s), else the replay of anchor ``a``'s plan."""
        rt = self.rt
        if a == l:
            kernels.resolve(
                top_k=self.topk_all[self.slot_of[l], :B], seq_lens=seq, state_idx=state,
                slot_pos=rt.slot_pos[l], lru=rt.lru[l], slot_rows=slot_rows, resident_table=resident,
                host_table=host, host_kv=rt.host_layers[l], device_kv=rt.device_kv[l],
                out_rows=self.out_rows[a][:B], plan=self.plan[a][:B], page_size=self.page,
                block_threads=self.block_threads, backend=rt.backend)
        else:
            kernels.replay(plan=self.plan[a][:B], host_kv=rt.host_layers[l], device_kv=rt.device_kv[l],
                           backend=rt.backend)

    def _count(self, B: int, seq: Tensor, resident: Tensor) -> None:
        """Hot-buffer hits and misses per row, over every anchor layer, for rows past the short
        path (n > H): misses are the plan's copies; hits the selected positions served by a hot
        slot without a copy (not resident, not the newest). ``HiSparseRuntime.hot_counts``'s
        definition, on the device."""
        tk = self.topk_all[:, :B]
        miss = (self.plan_all[:, :B, :, 0] >= 0).sum((0, 2))
        page = (tk.clamp_min(0) // self.page).long()
        is_res = resident[None].expand(tk.shape[0], -1, -1).gather(2, page) >= 0
        served = ((tk >= 0) & ~is_res & (tk != (seq - 1)[None, :, None])).sum((0, 2))
        long = (seq > self.H).to(torch.int64)
        self.hits[:B].copy_((served - miss) * long)
        self.misses[:B].copy_(miss * long)


def index_pages_for(cfg: FastPathConfig) -> tuple[int, int | None]:
    """``(initial pages, cap)`` of a rank's index-key pool: ``index_pages`` fixed when set, else
    room for one full batch of ``max_context`` requests, grown on demand without a cap."""
    if cfg.index_pages is not None:
        return cfg.index_pages, cfg.index_pages
    return cfg.max_batch * -(-cfg.max_context // INDEX_PAGE), None


def spare_rows_for(rows: int) -> int:
    """Spare device rows to add to a pool of ``rows`` rows: >= 1 (the write sink) and a whole
    number of 64-row pages in total (FlashMLA's fp8 view)."""
    return 64 - rows % 64 if rows % 64 else 64
