"""On the H200: one real-size DeepSeek-V3.2 decoder layer (hidden 7168, 128 heads, 256 routed experts
+ 1 shared of 2048, indexer 64 x 128 top-2048) with random weights, written fp8 block-quantized in
the released format (~11.5 GB), loads from its folder with the weights kept fp8 and decodes through
HiSparse exactly as full-resident decode does; its fp8 GEMMs agree with their torch twin and with
the dequantized bf16 weights within fp8 activation rounding, and the grouped MoE kernel with the
reference path.

Bounds (relative L2 error): fp8 GEMMs quantize each activation group of 128 to e4m3 (3 mantissa
bits: up to 2^-4 per value, ~2.5 % RMS); grouped (masked kernel) vs reference MoE output within
2 % (same fp8 inputs, another kernel and accumulation order)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from hisparse_ray.config import HiSparseConfig
from hisparse_ray.engine import EngineConfig
from hisparse_ray.kernels import fp8_gemm
from hisparse_ray.model.export import deepseek_v32_config, random_items, released_config, write_checkpoint
from hisparse_ray.model.fp8 import Fp8Format, Fp8Linear
from hisparse_ray.model.sharded_load import load_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not fp8_gemm.supported(), reason="needs sm90 and sgl-deep-gemm")]

VOCAB = 4096
FMT = Fp8Format(block=(128, 128), ue8m0=True)


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="dsv32_layer_")
    try:
        cfg = deepseek_v32_config(num_layers=1, vocab_size=VOCAB)
        write_checkpoint(path, released_config(cfg, fp8=FMT), random_items(cfg, seed=0, device="cuda"),
                         fp8=FMT, shard_bytes=2 << 30)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def models(folder):
    fp8 = load_checkpoint(folder, dtype=torch.bfloat16, device="cuda", fp8="kernel")
    bf16 = load_checkpoint(folder, dtype=torch.bfloat16, device="cuda", fp8="dequantize")
    return fp8, bf16


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_layer_loads_fp8(models):
    fp8, bf16 = models
    attn = fp8.model.layers[0].self_attn
    assert isinstance(attn.q_b_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert not isinstance(attn.kv_b_proj, Fp8Linear)  # read as a weight by the absorbed attention
    experts = fp8.model.layers[0].mlp.experts
    assert experts.fp8_block == (128, 128) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj.shape == (256, 4096, 7168)
    assert bf16.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


@torch.no_grad()
def test_fp8_gemms_equal_their_twin_and_the_dequantized_weights(models):
    """Every fp8 linear of a 300-token prefill: the kernel's output vs its torch twin (same fp8
    inputs: accumulation order and bf16 output rounding, < 1 %) and vs the dequantized bf16
    model's product (adds the activations' e4m3 rounding, < 4 %)."""
    fp8, bf16 = models
    deq = dict(bf16.named_modules())
    twin, vs_bf16 = [], []

    def check(name):
        def hook(mod, inp, out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).contiguous()
            o = out.reshape(x.shape[0], -1)
            twin.append(_rel(o, fp8_gemm.linear_reference(x, mod.weight, mod.weight_scale_inv)))
            vs_bf16.append(_rel(o, x @ deq[name].weight.T))
        return hook

    for name, mod in fp8.named_modules():
        if isinstance(mod, Fp8Linear):
            mod.register_forward_hook(check(name))
    tokens = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1)).cuda()
    a = fp8.prefill(tokens)[0]
    b = bf16.prefill(tokens)[0]
    print(f"\nfp8 GEMMs: max rel vs twin {max(twin):.4f}, vs dequantized bf16 {max(vs_bf16):.4f}; "
          f"end-to-end logits vs the bf16 model {_rel(a, b):.4f} (random weights amplify)")
    assert len(twin) == 8 and max(twin) < 1e-2 and max(vs_bf16) < 0.04  # o_proj: no hook (forward_no_bias)


@torch.no_grad()
def test_grouped_moe_kernel_close_to_reference(models):
    fp8, bf16 = models
    for model in (fp8, bf16):
        moe = model.model.layers[0].mlp
        for n in (1, 8, 64):
            x = torch.randn(n, 7168, device="cuda", generator=torch.Generator("cuda").manual_seed(n)).to(torch.bfloat16)
            w, e = moe.gate(x)
            ref = moe.experts.forward_reference(x, w, e)
            got = moe.experts.forward_grouped(x, w, e)
            assert _rel(got, ref) < 0.02, (n, _rel(got, ref))


def test_hisparse_decode_equals_full_resident_on_the_fp8_layer(models):
    from tests.engine.test_engine import assert_same, prompts_of, run

    fp8, _ = models
    hs = HiSparseConfig(top_k=2048, device_buffer_size=2048, host_to_device_ratio=4,
                        swap_in_block_size=256, host_pool_gib=0.05)
    prompts = prompts_of([2200, 2300], VOCAB, seed=4)
    common = dict(hisparse=hs, device="cuda", backend="cuda", page_size=64)
    base = run(fp8, prompts, 6, EngineConfig(full_resident=True, **common))
    # 34 blocks of 64 rows: a 2049-row hot buffer (33 blocks) fits, neither prefix (35, 36 pages)
    # does. (The exact prefill runs one position at a time on the GPU: ~1 min for both runs.)
    hisp = run(fp8, prompts, 6, EngineConfig(num_device_blocks=34, **common))
    assert_same(hisp, base)
    assert hisp[3]["hot_misses"] > 0
