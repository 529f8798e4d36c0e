"""The MoE of a fast decode step (ring 2: torch): routed experts without a host sync, so a step
with MoE layers is captured in a CUDA graph like a dense one, and a token's result does not depend
on its batch mates (each expert GEMM has the bucket's shape whatever the routing).

Two formulations, same contract as ``MoE.forward`` (``x [B, hidden] -> [B, hidden]``, B = the
bucket's rows, padded rows included):

* **masked grouped GEMMs** (CUDA sm90 with DeepGEMM, bf16 activations, B <=
  ``Experts.MASKED_MAX_TOKENS``): ``Experts``' own masked layout, one grouped kernel per
  projection for every expert at once, expert counts computed on the device;
* **every expert, masked** (elsewhere: the CPU, GPUs without DeepGEMM): each expert in ascending
  id multiplies all B rows (a static loop of ``[B, hidden]`` GEMMs), rows that did not pick it are
  masked out before the add. That is ``n_routed_experts / num_experts_per_tok`` times the routed
  FLOPs: right for the CPU tests and small models, not for a real-size MoE (which wants the
  kernel). Its arithmetic is the reference ``Experts.forward``'s (the same products, scaled by the
  fp32 weight, added in ascending expert order), only the GEMMs' row counts differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _expert_mm(experts, x: Tensor, name: str, e: int) -> Tensor:
    """``x @ expert e's weight.T`` (the experts' own product: fp8 block weights through theirs)."""
    mm = getattr(experts, "_mm", None)
    if mm is not None:
        return mm(x, name, e)
    return F.linear(x, getattr(experts, name)[e])


def masked_kernel(experts, x: Tensor) -> bool:
    """Whether ``experts`` take ``x`` through their masked grouped kernel (sync-free)."""
    check = getattr(experts, "_masked_kernel", None)
    return (check is not None and x.is_cuda and x.shape[0] <= experts.MASKED_MAX_TOKENS
            and getattr(experts, "fp8_backend", "kernel") == "kernel" and check(x))


def every_expert(experts, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
    """Routed output ``[B, hidden]`` of ``x [B, hidden]`` with router ``weights [B, k]`` fp32 and
    ``chosen [B, k]`` expert ids: every expert over all rows, masked (see the module doc)."""
    out = torch.zeros_like(x)
    for e in range(experts.gate_up_proj.shape[0]):
        hit = chosen == e  # an expert is picked at most once per token
        w = torch.where(hit, weights, 0.0).sum(-1, keepdim=True)  # [B, 1] fp32: exact (one term)
        gate, up = _expert_mm(experts, x, "gate_up_proj", e).chunk(2, dim=-1)
        y = (_expert_mm(experts, F.silu(gate) * up, "down_proj", e) * w).to(out.dtype)
        out += torch.where(hit.any(-1, keepdim=True), y, 0.0)
    return out


def moe_step(moe, x: Tensor) -> Tensor:
    """``MoE.forward`` of one fast step's rows ``x [B, hidden]``, sync-free (see the module doc)."""
    weights, chosen = moe.gate(x)
    ex = moe.experts
    if masked_kernel(ex, x):
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        k = chosen.shape[1]
        routed = ex._grouped_masked(x, weights, flat, order, order // k, order % k)
    else:
        routed = every_expert(ex, x, weights, chosen)
    return routed + moe.shared_experts(x)
