"""Our DSA model vs HF transformers 5.23.0 on the same weights and the same index trace.

CPU/fp32: prefill logits of every prompt position and batched decode logits at each of 64 steps equal
HF's within 1e-5 (abs, logits are O(1)); greedy tokens identical; our own indexer picks the same
top-k sets as HF's at every anchor layer and step. Contexts: 128 and 141 tokens of prompt, i.e. >= 8x
a device_buffer_size of 16 with top_k 8. The ``gpu`` variants run the same in bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.model import DSAModel, build_tiny_model, tiny_config
from hisparse_ray.model.model import init_random_

from ._hf import Session, hf_twin

KINDS = ["deepseek_v32", "glm_moe_dsa"]
PROMPT_LENS = (128, 141)
STEPS = 64
FP32_TOL = 1e-5


def _prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENS]


def _run(model: DSAModel, seed: int, tol: float) -> Session:
    hf = hf_twin(model)
    prompts = _prompts(model.cfg.vocab_size, seed)
    s = Session(model, hf, prompts, capacity=max(PROMPT_LENS) + STEPS + 1)
    ours, theirs = s.prefill()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    tokens = torch.stack([t[-1].argmax() for t in theirs])
    for step in range(STEPS):
        ours_l, ref_l = s.step(tokens)
        torch.testing.assert_close(ours_l, ref_l, atol=tol, rtol=0, msg=lambda m: f"step {step}: {m}")
        tokens = ref_l.argmax(-1)
        assert torch.equal(ours_l.argmax(-1), tokens), f"greedy token differs at step {step}"
    return s


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_hf_fp32(kind):
    model = build_tiny_model(seed=3, kind=kind)
    s = _run(model, seed=11, tol=FP32_TOL)
    assert s.selections > 0
    assert s.selection_mismatches == 0, f"{s.selection_mismatches}/{s.selections} top-k sets differ from HF"


def test_default_rope_variant_matches_hf():
    """Plain (non-yarn) rope: the attention scale has no mscale correction."""
    model = init_random_(DSAModel(tiny_config("glm_moe_dsa", yarn=False)), 5).eval()
    hf = hf_twin(model)
    toks = _prompts(model.cfg.vocab_size, 2)[0][:40]
    with torch.no_grad():
        ref = hf(input_ids=toks[None]).logits[0]
    # No trace replay: both indexers run on identical [T, T] score tensors and pick the same top-k.
    ours = model.prefill(toks, all_logits=True)[0]
    torch.testing.assert_close(ours, ref, atol=FP32_TOL, rtol=0)


# bf16 on CUDA. With dense MLPs: logits within BF16_TOL absolute of HF's (logits are O(1), up to ~5;
# bf16 has 8 mantissa bits, the absorbed and expanded MLA forms round differently; measured 0.08 with
# CPU bf16), and the greedy token equal wherever HF's top-2 margin exceeds 2 * BF16_TOL. With MoE layers
# a bf16 rounding difference can flip an expert choice (measured logit gaps up to 2.8 on CPU bf16, both
# sides being valid bf16 results), so that variant asserts greedy-token agreement >= 80 % instead
# (measured 93 %; a wrong model agrees ~1 %). Index trace replayed from HF in both.
BF16_TOL = 0.25
BF16_MOE_MIN_AGREEMENT = 0.80


def _run_bf16(model: DSAModel, lens: tuple[int, ...] = PROMPT_LENS) -> tuple[int, int]:
    hf = hf_twin(model)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).cuda() for n in lens]
    s = Session(model, hf, prompts, capacity=max(lens) + STEPS + 1)
    _, theirs = s.prefill()
    tokens = torch.stack([t[-1].argmax() for t in theirs])
    agree = total = 0
    max_diff = 0.0
    for step in range(STEPS):
        ours_l, ref_l = s.step(tokens)
        tokens = ref_l.argmax(-1)
        agree += int((ours_l.argmax(-1) == tokens).sum())
        total += len(tokens)
        max_diff = max(max_diff, float((ours_l - ref_l).abs().max()))
        if model.cfg.mlp_layer_types.count("sparse") == 0:
            torch.testing.assert_close(ours_l, ref_l, atol=BF16_TOL, rtol=0, msg=lambda m: f"step {step}: {m}")
            top2 = ref_l.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * BF16_TOL
            assert torch.equal(ours_l.argmax(-1)[clear], tokens[clear]), f"greedy token differs at step {step}"
    print(f"\n{model.cfg.kind:13s} row_dim {model.cfg.row_dim:4d} top_k {model.cfg.index_topk:4d} prompts {lens} "
          f"steps {STEPS}: max |logit diff| {max_diff:.4f}, greedy agreement {agree}/{total}")
    return agree, total


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_dense_mlp_matches_hf_gpu(kind):
    cfg = tiny_config(kind).with_(mlp_layer_types=("dense",) * 4)
    model = init_random_(DSAModel(cfg), 3).to("cuda").cast_(torch.bfloat16).eval()
    _run_bf16(model)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_moe_greedy_agreement_gpu(kind):
    model = build_tiny_model(seed=3, kind=kind, dtype=torch.bfloat16, device="cuda")
    agree, total = _run_bf16(model)
    assert agree >= BF16_MOE_MIN_AGREEMENT * total, f"greedy agreement {agree}/{total}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_real_attention_dims_gpu(kind):
    """DeepSeek-V3.2 attention shapes (latent 512 + rope 64 = 576-wide rows, 128/128 nope/v head dims,
    64 x 128 indexer heads) with 16 heads, dense MLPs, top-k 256 over prompts of 2048 and 2301 tokens
    (>= 8x a device_buffer_size of 256)."""
    cfg = tiny_config(kind).with_(
        vocab_size=512, hidden_size=1024, intermediate_size=1024, num_attention_heads=16, q_lora_rank=384,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=256, max_position_embeddings=8192, mlp_layer_types=("dense",) * 4,
    )
    model = init_random_(DSAModel(cfg), 3).to("cuda").cast_(torch.bfloat16).eval()
    _run_bf16(model, lens=(2048, 2301))
