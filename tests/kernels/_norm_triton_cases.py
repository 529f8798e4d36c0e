"""Run under ``TRITON_INTERPRET=1`` (``test_norm_triton.py`` starts it in a fresh process): the
Triton RMSNorm against :class:`~hisparse_ray.model.layers.RMSNorm` (eager torch) over widths,
dtypes, leading shapes and a strided input; exits 1 when an output differs by more than
``MAX_ULP`` ulps (of the input dtype, where the normed row is rounded) of its magnitude or in dtype / shape. ``python -m tests.kernels._norm_triton_cases
[device]``."""

from __future__ import annotations

import sys

import torch

from hisparse_ray.kernels.norm_triton import rms_norm
from hisparse_ray.model.layers import RMSNorm

MAX_ULP = 4.0  # two roundings (normed row, weight product) after a reordered fp32 statistic
EPS_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def main(device: str = "cpu") -> int:
    torch.manual_seed(0)
    bad = 0
    for D in (1, 7, 64, 513, 1536, 7168):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for wdt in {dt, torch.float32}:
                norm = RMSNorm(D, 1e-6).to(device=device, dtype=wdt)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(D) * 0.5 + 1)
                x = (torch.randn(2, 3, D + 3) * 4).to(device=device, dtype=dt)[..., 1:D + 1]
                want, got = norm(x), rms_norm(x, norm.weight, norm.eps)
                err = ((got.float() - want.float()).abs()
                       / (want.float().abs() * 2.0 ** -EPS_BITS[dt]).clamp_min(1e-30))
                worst = err.max().item()
                if got.dtype != want.dtype or got.shape != want.shape or worst > MAX_ULP:
                    bad += 1
                    print(f"D {D} x {dt} weight {wdt}: got {got.dtype} {tuple(got.shape)}, "
                          f"want {want.dtype} {tuple(want.shape)}, worst {worst:.2f} ulp")
    empty = rms_norm(torch.zeros(0, 8, device=device), torch.ones(8, device=device), 1e-6)
    bad += empty.shape != (0, 8)
    print(f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
