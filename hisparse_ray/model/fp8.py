"""fp8 block-quantized weights of the released DeepSeek-V3.2 / GLM-5 checkpoints (ring 2).

Format (config.json ``quantization_config``): ``quant_method "fp8"``, ``fmt "e4m3"``,
``activation_scheme "dynamic"``, ``weight_block_size [128, 128]``; DeepSeek-V3.2 adds ``scale_fmt
"ue8m0"`` (every scale a power of two). A quantized linear ``X`` stores ``X.weight`` as
``float8_e4m3fn [N, K]`` and ``X.weight_scale_inv`` as ``float32 [ceil(N/128), ceil(K/128)]``; the
real weight is ``weight[i, j] * weight_scale_inv[i // 128, j // 128]`` (despite its name the scale
is the dequantization multiplier). Embeddings, ``lm_head``, norms, the router and the indexer's
``weights_proj`` / ``k_norm`` are not quantized.

Two ways to run such weights: dequantize at load (:func:`dequantize`; CPU, and any GPU), or keep
them fp8 in :class:`Fp8Linear` and multiply with a block-scaled fp8 GEMM
(:mod:`hisparse_ray.kernels.fp8_gemm`, sm90). Activations are then quantized per token and group
of 128 values on the fly, so fp8 logits differ from the dequantized model's within fp8 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hisparse_ray.errors import ConfigError
from hisparse_ray.kernels.kvfp8 import FP8, FP8_MAX, fp8_scale

BLOCK = (128, 128)


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """A checkpoint's fp8 scheme: ``block`` (rows, cols) per scale; ``ue8m0`` scales are powers of 2."""

    block: tuple[int, int] = BLOCK
    ue8m0: bool = False


def parse_quantization(q: Any) -> Fp8Format | None:
    """config.json's ``quantization_config`` -> :class:`Fp8Format` (None without one). Anything but
    the released fp8 block scheme raises :class:`ConfigError` naming the key."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError("quantization_config", q, "a JSON object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError("quantization_config.quant_method", method,
                          "only 'fp8' (block-quantized e4m3, as released) is supported")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError("quantization_config.fmt", q.get("fmt"), "only 'e4m3'")
    scheme = q.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":  # HF lower-cases it
        raise ConfigError("quantization_config.activation_scheme", scheme,
                          "only 'dynamic' (activation scales computed per token at run time)")
    # absent: transformers' FineGrainedFP8Config default (128, 128); null would mean per-tensor scales
    block = q.get("weight_block_size", list(BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError("quantization_config.weight_block_size", block, "two positive integers")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0", "float", "float32"):  # "float": what transformers writes
        raise ConfigError("quantization_config.scale_fmt", scale_fmt,
                          "absent, 'ue8m0', 'float' or 'float32'")
    return Fp8Format(block=(block[0], block[1]), ue8m0=scale_fmt == "ue8m0")


def quantization_config(fmt: Fp8Format) -> dict[str, Any]:
    """The config.json entry describing ``fmt`` (inverse of :func:`parse_quantization`)."""
    d: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": list(fmt.block)}
    if fmt.ue8m0:
        d["scale_fmt"] = "ue8m0"
    return d


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` (``[..., N, K]``)."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def expand_scales(scale_inv: Tensor, n: int, k: int, block: tuple[int, int] = BLOCK,
                  row0: int = 0, col0: int = 0) -> Tensor:
    """Per-element multipliers ``[..., n, k]`` for rows ``row0..row0+n`` and columns ``col0..`` of
    a weight, from the scales of the block grid that starts at block ``(row0 // bm, col0 // bn)``
    (``scale_inv`` covers at least those blocks)."""
    bm, bn = block
    s = scale_inv.float().repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    r, c = row0 % bm, col0 % bn
    return s[..., r:r + n, c:c + k]


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = BLOCK, *,
               dtype: torch.dtype = torch.bfloat16, row0: int = 0, col0: int = 0) -> Tensor:
    """``weight`` fp8 ``[..., n, k]`` (possibly a slice starting at row ``row0``, column ``col0`` of
    the full tensor) times its block scales -> ``dtype``. Computed in fp32, rounded once."""
    n, k = weight.shape[-2:]
    bm, bn = block
    if row0 % bm == 0 and col0 % bn == 0 and n % bm == 0 and k % bn == 0:  # whole blocks: broadcast
        lead = weight.shape[:-2]
        w = weight.float().view(*lead, n // bm, bm, k // bn, bn)
        s = scale_inv.float()[..., : n // bm, None, : k // bn, None]
        return (w * s).view(*lead, n, k).to(dtype)
    return (weight.float() * expand_scales(scale_inv, n, k, block, row0, col0)).to(dtype)


def quantize(w: Tensor, block: tuple[int, int] = BLOCK, *, ue8m0: bool = True) -> tuple[Tensor, Tensor]:
    """Block-quantize ``w [..., N, K]`` the released way -> ``(fp8 [..., N, K], scale_inv fp32)``.
    ``ue8m0`` rounds each scale up to a power of two (then every dequantized value is exactly
    representable in bf16)."""
    *lead, n, k = w.shape
    bm, bn = block
    pn, pk = -(-n // bm) * bm, -(-k // bn) * bn
    padded = torch.zeros(*lead, pn, pk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, pn // bm, bm, pk // bn, bn)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = fp8_scale(amax)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, pn, pk)[..., :n, :k].contiguous(), scale.contiguous()


def fp8_matmul(backend: str, x: Tensor, weight: Tensor, scale_inv: Tensor) -> Tensor:
    """``x [M, K] @ dequant(weight).T`` through the fp8 GEMM (``"kernel"``) or its torch twin."""
    from hisparse_ray.kernels import fp8_gemm

    fn = fp8_gemm.linear if backend == "kernel" else fp8_gemm.linear_reference
    return fn(x, weight, scale_inv)


def set_fp8_backend(model: nn.Module, backend: str) -> None:
    """Run every fp8 weight of ``model`` through the GEMM kernel (``"kernel"``, the default) or its
    torch twin (``"torch"``: quantizes activations identically, multiplies dequantized weights in
    fp32; any device), e.g. to separate kernel error from quantization error."""
    if backend not in ("kernel", "torch"):
        raise ConfigError("fp8_backend", backend, "one of 'kernel', 'torch'")
    for mod in model.modules():
        if hasattr(mod, "fp8_backend"):
            mod.fp8_backend = backend


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays fp8: ``weight`` float8_e4m3fn ``[out, in]`` and
    ``weight_scale_inv`` fp32 ``[ceil(out/128), in/128]`` (the checkpoint's names, so its state
    dict mirrors the checkpoint). ``forward(x [..., in] bf16) -> [..., out] bf16`` on a CUDA device
    the block-scaled fp8 GEMM supports (:func:`hisparse_ray.kernels.fp8_gemm.supported`); the loader
    only builds it there. Do not cast it with ``.to(dtype)``: that would dequantize nothing and
    break the scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: tuple[int, int] = BLOCK) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_shape((out_features, in_features), block), dtype=torch.float32),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight.fp8_linear = self  # RowMath.linear(x, this weight) finds its GEMM through it

    def _apply(self, fn, recurse=True):  # device moves may replace the Parameter: tag it again
        out = super()._apply(fn, recurse)
        self.weight.fp8_linear = self
        return out

    fp8_backend = "kernel"  # or "torch": the kernel's torch twin (same quantization; tests, CPU)

    def forward_no_bias(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = fp8_matmul(self.fp8_backend, x.reshape(-1, shape[-1]).contiguous(), self.weight,
                         self.weight_scale_inv)
        return out.view(*shape[:-1], self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        out = self.forward_no_bias(x)
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block, dtype=dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


def linear_no_bias(module: nn.Module, x: Tensor) -> Tensor:
    """``x @ module.weight.T`` without the bias, for a ``nn.Linear`` or an :class:`Fp8Linear`
    (attention adds ``o_proj``'s bias after the TP all-reduce)."""
    if isinstance(module, Fp8Linear):
        return module.forward_no_bias(x)
    return nn.functional.linear(x, module.weight)
