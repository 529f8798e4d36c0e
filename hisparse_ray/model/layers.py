"""Norms, dense MLP and MoE of the DSA model (ring 2). Parameter names mirror HF's state dict.

Facts from transformers 5.23.0:

* RMSNorm computes in fp32 and returns ``weight * normed.to(input_dtype)``. Decoder norms use
  ``rms_norm_eps``; MLA's ``q_a_layernorm``/``kv_a_layernorm`` use HF's default eps 1e-6.
* MLP: ``down(silu(gate(x)) * up(x))``. MoE: shared experts (``moe_intermediate_size * n_shared_experts``)
  plus routed experts stored packed: ``experts.gate_up_proj [E, 2I, D]`` (gate rows first),
  ``experts.down_proj [E, D, I]``.
* Router (noaux_tc): ``logits = x.float() @ W.float().T``; ``s = sigmoid(logits)``; choice scores
  ``s + e_score_correction_bias``; each of ``n_group`` groups is scored by the sum of its top-2 choice
  scores, the best ``topk_group`` groups are kept, the top ``num_experts_per_tok`` experts by choice
  score are chosen; their weights are the uncorrected ``s``, divided by ``sum + 1e-20`` when
  ``norm_topk_prob``, times ``routed_scaling_factor``; weights stay fp32 when multiplied in.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hisparse_ray.errors import ConfigError
from hisparse_ray.model.config import DSAConfig
from hisparse_ray.model.rowmath import RowMath


_FUSED_NORMS: ContextVar[bool] = ContextVar("hisparse_fused_norms", default=False)


def _norm_kernel():
    """``kernels.norm_triton`` where triton imports and ``HISPARSE_TRITON_NORM`` is not 0."""
    from hisparse_ray.kernels import triton_module

    return triton_module("norm_triton", "HISPARSE_TRITON_NORM")


@contextlib.contextmanager
def fused_norms(on: bool = True) -> Iterator[bool]:
    """Within: :class:`RMSNorm` on CUDA tensors runs the one-kernel Triton norm
    (:mod:`hisparse_ray.kernels.norm_triton`) where available. The fast decode step wraps its
    body in it (also while a CUDA graph captures it); prefill and the reference path never do.
    Yields whether the fused norm is in use."""
    on = bool(on) and _norm_kernel() is not None
    token = _FUSED_NORMS.set(on)
    try:
        yield on
    finally:
        _FUSED_NORMS.reset(token)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and _FUSED_NORMS.get():
            return _norm_kernel().rms_norm(x, self.weight, self.eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """Dense SwiGLU MLP, replicated on every TP rank. ``x [..., hidden] -> [..., hidden]``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor, rm: RowMath | None = None) -> Tensor:
        """``rm`` (prefill, ``x [N, hidden]``): its row-mixing matmuls; None = the modules' own."""
        if rm is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate = rm.each(F.silu, rm.linear(x, self.gate_proj.weight))
        return rm.linear(gate * rm.linear(x, self.up_proj.weight), self.down_proj.weight)


class Router(nn.Module):
    """Group-limited sigmoid top-k router. ``x [N, hidden] -> (weights [N, k] fp32, experts [N, k] int64)``."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor, rm: RowMath | None = None) -> tuple[Tensor, Tensor]:
        """``rm`` (prefill): the logits' matmul and their ``sigmoid`` per row when batch-invariant
        (everything after works per row already)."""
        cfg = self.cfg
        E, G = cfg.n_routed_experts, cfg.n_group
        if rm is None:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        else:
            scores = rm.each(torch.sigmoid, rm.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias
        per_group = choice.view(-1, G, E // G)
        group_score = per_group.topk(min(2, E // G), dim=-1).values.sum(-1)  # [N, G]
        keep_groups = group_score.topk(cfg.topk_group, dim=-1).indices
        group_keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_keep = group_keep[:, :, None].expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~expert_keep, float("-inf"))
        experts = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts


class Experts(nn.Module):
    """Routed experts, packed. Replicated on every TP rank (no expert parallelism here).

    Weights: ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]`` in the model dtype, or after
    :meth:`to_fp8_` float8_e4m3fn with ``gate_up_proj_scale_inv [E, 2I/128, D/128]`` /
    ``down_proj_scale_inv [E, D/128, I/128]`` (the checkpoint's block scales, fp8 GEMM on sm90).

    Two paths, same result contract ``x [N, D], weights [N, k] fp32, experts [N, k] -> [N, D]``:
    ``path = "reference"`` (default; the exact path): for each selected expert in ascending id, its
    tokens' rows in token order through two matmuls, scaled, ``index_add``-ed. ``"grouped"`` (the
    throughput path): the (token, slot) pairs are sorted by expert once (one host sync instead of
    one per expert); on the CPU, or for many tokens, each expert's run of rows is multiplied
    exactly as the reference does (so the result is bitwise the reference's); on a CUDA device
    the fp8 GEMM supports, with at most :data:`MASKED_MAX_TOKENS` tokens (decode), both matmuls of
    all experts are one grouped kernel call each over a ``[E, N, D]`` masked layout (no host sync),
    equal to the reference within bf16 / fp8 rounding (tests/model/test_moe_gpu.py states the bound).
    """

    MASKED_MAX_TOKENS = 128

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.fp8_block: tuple[int, int] | None = None
        self.fp8_backend = "kernel"  # see hisparse_ray.model.fp8.set_fp8_backend
        self.path = "reference"

    def to_fp8_(self, block: tuple[int, int]) -> "Experts":
        """Replace the weights by empty fp8 ones plus block scales (same device; the loader fills them)."""
        from hisparse_ray.model.fp8 import FP8, scale_shape

        for name in ("gate_up_proj", "down_proj"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device),
                                             requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(
                torch.empty(scale_shape(tuple(old.shape), block), dtype=torch.float32, device=old.device),
                requires_grad=False))
        self.fp8_block = block
        return self

    def _mm(self, x: Tensor, name: str, e: int) -> Tensor:
        """``x [M, in] @ expert e's weight.T`` (``name``: "gate_up_proj" or "down_proj")."""
        w = getattr(self, name)[e]
        if self.fp8_block is None:
            return F.linear(x, w)
        from hisparse_ray.model.fp8 import fp8_matmul

        return fp8_matmul(self.fp8_backend, x.contiguous(), w, getattr(self, f"{name}_scale_inv")[e])

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``x [N, D]``, ``weights [N, k]`` fp32, ``experts [N, k]`` -> ``[N, D]`` in ``x.dtype``."""
        if self.path == "grouped":
            return self.forward_grouped(x, weights, experts)
        return self.forward_reference(x, weights, experts)

    def forward_reference(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            tok, slot = torch.nonzero(experts == e, as_tuple=True)
            gate, up = self._mm(x[tok], "gate_up_proj", e).chunk(2, dim=-1)
            y = self._mm(F.silu(gate) * up, "down_proj", e) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def forward_grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        N, k = experts.shape
        if N == 0:
            return torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert; token order kept within an expert
        tok, slot = order // k, order % k
        if x.is_cuda and N <= self.MASKED_MAX_TOKENS and self.fp8_backend == "kernel" and self._masked_kernel(x):
            return self._grouped_masked(x, weights, flat, order, tok, slot)
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()):
            if c:
                t, s = tok[start:start + c], slot[start:start + c]
                gate, up = self._mm(x[t], "gate_up_proj", e).chunk(2, dim=-1)
                y = self._mm(F.silu(gate) * up, "down_proj", e) * weights[t, s, None]
                out.index_add_(0, t, y.to(out.dtype))
                start += c
        return out

    def _masked_kernel(self, x: Tensor) -> bool:
        from hisparse_ray.kernels import fp8_gemm

        _, two_i, d = self.gate_up_proj.shape
        return x.dtype == torch.bfloat16 and fp8_gemm.supported(x.device) and (
            self.fp8_block is not None or self.gate_up_proj.dtype == torch.bfloat16) and (
            fp8_gemm.masked_shapes_ok(d, two_i) and fp8_gemm.masked_shapes_ok(two_i // 2, d))

    def _grouped_masked(self, x: Tensor, weights: Tensor, flat: Tensor, order: Tensor, tok: Tensor,
                        slot: Tensor) -> Tensor:
        from hisparse_ray.kernels import fp8_gemm

        E, N = self.gate_up_proj.shape[0], x.shape[0]
        ex = flat[order]
        # no host sync (CUDA-graph capturable): bincount would read the max id back
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        pos = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[ex]
        masked_m, expected = counts.to(torch.int32), max(1, flat.numel() // E)

        def grouped(rows: Tensor, name: str) -> Tensor:  # an expert sees a token at most once: <= N rows
            scale = getattr(self, f"{name}_scale_inv") if self.fp8_block is not None else None
            return fp8_gemm.grouped_linear_masked(rows.contiguous(), ex, pos, masked_m, N, getattr(self, name),
                                                  scale, expected_m=expected)

        gate, up = grouped(x[tok], "gate_up_proj").chunk(2, dim=-1)
        y = grouped(F.silu(gate) * up, "down_proj") * weights[tok, slot, None]
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y.to(out.dtype))
        return out

    def forward_rows(self, x: Tensor, weights: Tensor, experts: Tensor, rm: RowMath) -> Tensor:
        """As :meth:`forward`, each (token, expert) product computed with ``rm.linear`` and each
        token's expert outputs added in ascending expert order: with a batch-invariant ``rm`` a
        token's result is bitwise what :meth:`forward` gives that token alone."""
        N, k = experts.shape
        order = experts.argsort(dim=1)
        experts, weights = experts.gather(1, order), weights.gather(1, order)
        flat = experts.reshape(-1).tolist()
        xs = x.repeat_interleave(k, dim=0)  # row t * k + j: token t for its j-th expert
        gu = torch.cat([self._row_mm(rm, xs[i : i + 1], "gate_up_proj", e) for i, e in enumerate(flat)])
        gate, up = gu.chunk(2, dim=-1)
        h = rm.each(F.silu, gate) * up
        y = torch.cat([self._row_mm(rm, h[i : i + 1], "down_proj", e) for i, e in enumerate(flat)])
        y = (y.view(N, k, -1) * weights[..., None]).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(k):
            out += y[:, j]
        return out

    def _row_mm(self, rm: RowMath, x: Tensor, name: str, e: int) -> Tensor:
        """One row's product with expert e (``forward_rows``): ``rm.linear`` for float weights; the
        fp8 GEMM (one row in, so batch-invariant as well) for fp8 ones."""
        if self.fp8_block is None:
            return rm.linear(x, getattr(self, name)[e])
        return self._mm(x, name, e)


def set_moe_path(model: nn.Module, path: str) -> None:
    """Pick every MoE layer's routed-expert path: ``"reference"`` (exact) or ``"grouped"`` (throughput)."""
    if path not in ("reference", "grouped"):
        raise ConfigError("moe_path", path, "one of 'reference', 'grouped'")
    for mod in model.modules():
        if isinstance(mod, Experts):
            mod.path = path

class MoE(nn.Module):
    """Shared + routed experts. ``x [..., hidden] -> [..., hidden]``."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: Tensor, rm: RowMath | None = None) -> Tensor:
        """``rm`` (prefill, ``x [N, hidden]``): its row-mixing matmuls; a batch-invariant one also
        computes each token's experts on their own (:meth:`Experts.forward_rows`)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.gate(flat, rm)
        if rm is not None and rm.batch_invariant:
            routed = self.experts.forward_rows(flat, weights, experts, rm).view(shape)
        else:
            routed = self.experts(flat, weights, experts).view(shape)
        return routed + self.shared_experts(x, rm)
