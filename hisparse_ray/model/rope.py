"""Rotary embeddings of the DSA model (ring 2): default and yarn frequencies, two rotation layouts.

Facts from transformers 5.23.0:

* Frequencies cover only ``qk_rope_head_dim`` (HF points ``head_dim`` at it). ``cos``/``sin`` are
  ``cat(freqs, freqs)`` multiplied by yarn's ``attention_factor`` (1.0 for default rope), cast to the
  activation dtype.
* Main MLA attention (both models) rotates **interleaved** pairs ``(x0, x1), (x2, x3), ...`` and writes the
  result de-interleaved: ``cat(x_even*cos - x_odd*sin, x_odd*cos + x_even*sin)``. So the rope part of a
  cached KV row is in "half" layout after rotation; q and k get the same permutation, dot products hold.
* The indexer rotates the **first** ``qk_rope_head_dim`` dims of its q/k (rope first, then pass-through;
  the MLA head is nope first, then rope). DeepSeek-V3.2's indexer uses **half-split** (non-interleaved)
  rope ``x*cos + rotate_half(x)*sin``; GLM-MoE-DSA's indexer uses the interleaved form.
* Yarn: ``inv_freq`` blends interpolation (``1/(factor*theta^(2i/d))``) and extrapolation with a linear
  ramp between the correction dims of ``beta_fast``/``beta_slow`` (floored/ceiled when ``truncate``);
  ``attention_factor`` defaults to ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both
  are set, else ``mscale(factor)``, with ``mscale(s, m) = 0.1*m*ln(s) + 1`` (1 for s <= 1). The MLA
  softmax scale is ``qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2`` when ``mscale_all_dim`` is
  set and rope is not default; the indexer's scale is not corrected.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hisparse_ray.model.config import DSAConfig, RopeConfig


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_factor(rope: RopeConfig, max_pos: int) -> float:
    if rope.factor is not None:
        return float(rope.factor)
    return max_pos / float(rope.original_max_position_embeddings or max_pos)


def inv_freq_and_scale(cfg: DSAConfig) -> tuple[Tensor, float]:
    """``(inv_freq [rope_dim/2] fp32, attention_factor)`` for ``cfg.rope``."""
    rope, dim = cfg.rope, cfg.qk_rope_head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "default":
        return 1.0 / (rope.theta**exps), 1.0
    factor = _yarn_factor(rope, cfg.max_position_embeddings)
    orig = rope.original_max_position_embeddings or cfg.max_position_embeddings
    if rope.attention_factor is not None:
        att = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        att = float(_mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim))
    else:
        att = _mscale(factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = rope.theta**exps
    extrap, interp = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp  # weight of extrapolation
    return interp * (1 - keep) + extrap * keep, att


def softmax_scale(cfg: DSAConfig) -> float:
    """MLA softmax scale (with yarn's ``mscale_all_dim`` correction squared, as HF)."""
    scale = cfg.qk_head_dim**-0.5
    rope = cfg.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _mscale(_yarn_factor(rope, cfg.max_position_embeddings), rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class Rope:
    """Precomputed ``cos``/``sin`` lookup: ``cos_sin(positions [...]) -> (cos, sin) [..., rope_dim/2]``
    (the half of HF's ``cat(freqs, freqs)`` that both layouts need), in fp32 then cast by the caller."""

    def __init__(self, cfg: DSAConfig) -> None:
        self.inv_freq, self.attention_factor = inv_freq_and_scale(cfg)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved-pair rotation, output de-interleaved (HF ``apply_rotary_pos_emb_interleave``).
    ``x [..., d]``; ``cos``/``sin`` broadcastable to ``[..., d/2]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half_split(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split rotation ``x*cos + rotate_half(x)*sin`` with ``cos = cat(c, c)`` (HF ``apply_rotary_pos_emb``)."""
    h = x.shape[-1] // 2
    c2, s2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * c2 + rot * s2
