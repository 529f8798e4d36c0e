"""The MoE of a fast decode step (ring 2: torch): routed experts without a host sync, so a step
with MoE layers is captured in a CUDA graph like a dense one, and a token's result does not depend
on its batch mates (each expert GEMM has the bucket's shape whatever the routing).

Two formulations, same contract as ``MoE.forward`` (``x [B, hidden] -> [B, hidden]``, B = the
bucket's rows, padded rows included):

* **masked grouped GEMMs** (CUDA sm90 with DeepGEMM, bf16 activations, B <=
  ``Experts.MASKED_MAX_TOKENS``): ``Experts``' masked layout (``kernels/fp8_gemm.py``
  ``grouped_linear_masked``), one grouped kernel per projection for every expert at once, expert
  counts computed on the device. The products go back to their (token, expert) rows by a
  permutation and each token adds its experts' outputs in ascending expert id: no ``index_add_``
  (its CUDA atomics add a token's experts in a varying order, so bf16 sums would differ from run
  to run and between HiSparse and full-resident);
* **every expert, masked** (elsewhere: the CPU, GPUs without DeepGEMM): each expert in ascending
  id multiplies all B rows (a static loop of ``[B, hidden]`` GEMMs), rows that did not pick it are
  masked out before the add. That is ``n_routed_experts / num_experts_per_tok`` times the routed
  FLOPs: right for the CPU tests and small models, not for a real-size MoE (which wants the
  kernel). Its arithmetic is the reference ``Experts.forward``'s (the same products, scaled by the
  fp32 weight, added in ascending expert order), only the GEMMs' row counts differ.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hisparse_ray.model.rowmath import RowMath


class StepRows(RowMath):
    """The fast step's row math (a :class:`RowMath` for the model's ``rm`` hooks): GEMMs batched
    over the bucket (one shape whatever the rows hold), transcendental elementwise ops (``sigmoid``,
    ``silu``, rope's ``cos`` / ``sin``) one row at a time on the CPU. torch's CPU kernels run whole
    SIMD vectors and round a tensor's tail in a scalar routine that differs in the last bit, so a
    row's ``sigmoid`` would depend on its place in the batch (row 5 of 7 is in the tail, row 0 is
    not): a request scheduled at another row in HiSparse than in full-resident decode (spills make
    the schedules differ) got other logits in the same bucket. CUDA kernels compute every element
    alike: there the op runs once on the whole tensor."""

    def __init__(self) -> None:
        super().__init__(False)

    def each(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        if x.device.type != "cpu" or x.shape[0] <= 1:
            return fn(x)
        return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


ROWS = StepRows()


def masked_kernel(experts, x: Tensor) -> bool:
    """Whether ``experts`` (``model.layers.Experts``) take ``x`` through their masked grouped
    kernel (sync-free): the condition of ``Experts.forward_grouped``."""
    return (x.is_cuda and x.shape[0] <= experts.MASKED_MAX_TOKENS
            and experts.fp8_backend == "kernel" and experts._masked_kernel(x))


def every_expert(experts, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
    """Routed output ``[B, hidden]`` of ``x [B, hidden]`` with router ``weights [B, k]`` fp32 and
    ``chosen [B, k]`` expert ids: every expert over all rows, masked (see the module doc); ``silu``
    per row on the CPU (:class:`StepRows`)."""
    out = torch.zeros_like(x)
    for e in range(experts.gate_up_proj.shape[0]):
        hit = chosen == e  # an expert is picked at most once per token
        w = torch.where(hit, weights, 0.0).sum(-1, keepdim=True)  # [B, 1] fp32: exact (one term)
        gate, up = experts._mm(x, "gate_up_proj", e).chunk(2, dim=-1)  # fp8 weights: their GEMM
        y = (experts._mm(ROWS.each(F.silu, gate) * up, "down_proj", e) * w).to(out.dtype)
        out += torch.where(hit.any(-1, keepdim=True), y, 0.0)
    return out


def masked_grouped(experts, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
    """Routed output ``[B, hidden]`` by the masked grouped kernels (see the module doc): deterministic,
    no host sync. ``weights [B, k]`` fp32, ``chosen [B, k]`` expert ids."""
    from hisparse_ray.kernels import fp8_gemm

    E, (B, k) = experts.gate_up_proj.shape[0], chosen.shape
    chosen, by_id = chosen.sort(dim=-1)  # each token's experts in ascending id: the add order
    weights = weights.gather(1, by_id)
    flat = chosen.reshape(-1)  # pair r = (token r // k, its (r % k)-th expert)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order within
    ex = flat[order]
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    pos = torch.arange(B * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[ex]
    masked_m, expected = counts.to(torch.int32), max(1, B * k // E)

    def grouped(rows: Tensor, name: str) -> Tensor:  # an expert sees a token at most once: <= B rows
        scale = getattr(experts, f"{name}_scale_inv") if experts.fp8_block is not None else None
        return fp8_gemm.grouped_linear_masked(rows.contiguous(), ex, pos, masked_m, B,
                                              getattr(experts, name), scale, expected_m=expected)

    gate, up = grouped(x[order // k], "gate_up_proj").chunk(2, dim=-1)
    y = x.new_empty(B * k, x.shape[1])
    y[order] = grouped(F.silu(gate) * up, "down_proj")  # back to pair order: a permutation
    y = (y.view(B, k, -1) * weights[..., None]).to(x.dtype)
    out = torch.zeros_like(x)
    for j in range(k):
        out += y[:, j]
    return out


def moe_step(moe, x: Tensor) -> Tensor:
    """``MoE.forward`` of one fast step's rows ``x [B, hidden]``, sync-free (see the module doc);
    a row's result depends on that row alone (:class:`StepRows`)."""
    weights, chosen = moe.gate(x, ROWS)
    ex = moe.experts
    if masked_kernel(ex, x):
        routed = masked_grouped(ex, x, weights, chosen)
    else:
        routed = every_expert(ex, x, weights, chosen)
    return routed + moe.shared_experts(x, ROWS)
