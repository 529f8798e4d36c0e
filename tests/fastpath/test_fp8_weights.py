"""The fast decode step with fp8 weights kept (``Fp8Linear``, the GEMM's torch twin on the CPU):
every projection of the step goes through the module's fp8 GEMM (``o_proj`` included: the step's
attention tail once multiplied the raw fp8 weight), HiSparse equals full-resident bit-exactly and
both match the (batched) reference path's tokens and logits.

On the H100 the same model through DeepGEMM is ``tests/e2e/test_fast_actors_gpu.py``'s
``fp8-weights-rows-keys`` case."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.engine import EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.fp8 import Fp8Linear
from hisparse_ray.model.model import build_random_model
from hisparse_ray.model.sharded_load import load_checkpoint
from tests.model._checkpoint import checkpoint_config, write_released

from .test_engine_fast import H, assert_same, fast_cfg, prompts_of, run

FAST = FastPathConfig(max_context=512, buckets=(4,))  # one shape: both modes batch alike


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    cfg = checkpoint_config("deepseek_v32", layers=2)
    cfg = cfg.with_(mlp_layer_types=("dense",) * 2)  # MoE routing depends on batch mates
    folder = write_released(build_random_model(cfg, seed=11), tmp_path_factory.mktemp("fp8"),
                            tokenizer=False, mtp=False)
    model = load_checkpoint(folder, dtype=torch.float32, fp8="torch")
    kept = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert any(n.endswith("o_proj") for n in kept), kept
    return model


def test_fast_step_with_fp8_weights_equals_full_resident_and_matches_reference(fp8_model):
    m = fp8_model
    prompts = prompts_of([8 * H + 5, 40, 3, 9 * H], m.cfg.vocab_size, seed=8)
    base = run(m, prompts, 64, fast_cfg(FAST, full_resident=True))
    hs = run(m, prompts, 64, fast_cfg(FAST, num_device_blocks=12))
    assert_same(hs, base)
    assert hs[3]["hot_misses"] > 0 and hs[3]["fast_steps"] > 0
    # The GEMMs quantize their activations to e4m3 per 128 values, so fp32 rounding that depends
    # on the batch shape moves some across a rounding boundary (2**-4 relative each): against the
    # batch-invariant reference (one row at a time) a near-tie of this random model picked another
    # token after 37 steps. The batched reference (batch_invariant=False) runs the same GEMMs on
    # batches: tokens agree over 64 steps, logits within 0.011 at a logit scale of 4.2 (measured).
    ref = run(m, prompts, 64, EngineConfig(full_resident=True, batch_invariant=False))
    assert ref[0] == hs[0] and all(len(t) == 64 for t in hs[0].values())
    err = max((hs[1][k] - ref[1][k]).abs().max().item() for k in ref[1])
    scale = max(ref[1][k].abs().max().item() for k in ref[1])
    print(f"fp8 weights: max |dlogit| {err:.3g} vs the batched reference, logit scale {scale:.3g}")
    assert err < 0.01 * scale, (err, scale)

def test_the_flashmla_tail_is_attends_tail_with_fp8_weights(fp8_model):
    """``layer.finish`` (W_uv, o_proj, bias after FlashMLA's softmax-weighted latent) runs the same
    arithmetic as ``MLAAttention.attend``'s tail, o_proj through its fp8 GEMM."""
    from hisparse_ray.fastpath.layer import finish

    attn = fp8_model.model.layers[0].self_attn
    cfg = attn.cfg
    g = torch.Generator().manual_seed(4)
    B, S, R = 3, 10, cfg.kv_lora_rank
    q = torch.randn(B, 1, attn.heads, R + cfg.qk_rope_head_dim, generator=g)
    rows = torch.randn(B, S, R + cfg.qk_rope_head_dim, generator=g)
    allowed = torch.rand(B, 1, S, generator=g) < 0.7
    allowed[:, :, 0] = True
    want = attn.attend(q, rows, allowed)[:, 0]
    s = torch.matmul(q, rows[:, None].transpose(-1, -2)) * attn.scale
    p = torch.softmax(s.masked_fill(~allowed[:, :, None, :], float("-inf")), dim=-1)
    ctx = torch.matmul(p, rows[:, None, :, :R])[:, 0]
    torch.testing.assert_close(finish(attn, ctx), want, rtol=1e-5, atol=1e-5)
