"""The FlashMLA and DeepGEMM adapters state and check their layouts before touching the libraries
(which CI does not have): wrong shapes, dtypes and devices are KernelPreconditionErrors naming
the argument; without CUDA both report themselves unavailable and the fast step picks the torch
references (an explicit library choice is refused)."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.errors import KernelPreconditionError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.fastpath.index_keys import PagedIndexKeys
from hisparse_ray.fastpath.layer import choose_attention, choose_logits
from hisparse_ray.kernels import deepgemm, flashmla
from hisparse_ray.kernels.kvfp8 import KVRowCodec
from hisparse_ray.model.model import build_tiny_model


def test_padded_heads():
    assert [flashmla.padded_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(KernelPreconditionError, match="at most 128"):
        flashmla.padded_heads(129)


@pytest.mark.parametrize("q,idx,pool,match", [
    (torch.zeros(2, 64, 576), torch.zeros(2, 64, dtype=torch.int32), torch.zeros(64, 656, dtype=torch.uint8), "bf16"),
    (torch.zeros(2, 32, 576, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32),
     torch.zeros(64, 656, dtype=torch.uint8), "64 or 128 heads"),
    (torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int64),
     torch.zeros(64, 656, dtype=torch.uint8), "int32"),
    (torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 100, dtype=torch.int32),
     torch.zeros(64, 656, dtype=torch.uint8), "multiple of 64"),
    (torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32),
     torch.zeros(64, 1152, dtype=torch.uint8), r"\[rows, 656\]"),
    (torch.zeros(2, 64, 576, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32),
     torch.zeros(64, 656, dtype=torch.uint8), "contiguous on"),
])
def test_flashmla_checks_before_calling(q, idx, pool, match):
    with pytest.raises(KernelPreconditionError, match=match):
        flashmla.sparse_decode_fp8(q, pool, idx, (None, None, torch.zeros(2), None), 0.1)


def test_deepgemm_checks_before_calling():
    q8 = torch.zeros(2, 64, 128).to(torch.float8_e4m3fn)
    w = torch.zeros(2, 64)
    kv = torch.zeros(3, 64, 1, 132, dtype=torch.uint8)
    lens = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(KernelPreconditionError, match="q8"):
        deepgemm.paged_mqa_logits(q8.float(), w, kv, lens, table, None)
    with pytest.raises(KernelPreconditionError, match="weights"):
        deepgemm.paged_mqa_logits(q8, w.double(), kv, lens, table, None)
    with pytest.raises(KernelPreconditionError, match=r"kv must be \[pages, 64, 1, 132\]"):
        deepgemm.paged_mqa_logits(q8, w, kv[..., :128], lens, table, None)
    with pytest.raises(KernelPreconditionError, match="context_lens"):
        deepgemm.paged_mqa_logits(q8, w, kv, lens.long(), table, None)
    with pytest.raises(KernelPreconditionError, match="q8 must be on"):
        deepgemm.paged_mqa_logits(q8, w, kv, lens, table, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_without_cuda_the_step_uses_the_references():
    assert not flashmla.available() and not deepgemm.available()
    m = build_tiny_model(0)
    codec = KVRowCodec("fp32", 32, 16)
    keys = PagedIndexKeys([0], 32, "fp8", 1)
    cpu = torch.device("cpu")
    assert choose_attention(FastPathConfig(), m, codec, cpu) == "reference"
    assert choose_logits(FastPathConfig(), m, keys, cpu) == "reference"
    with pytest.raises(KernelPreconditionError, match="attention='flashmla' needs a CUDA device"):
        choose_attention(FastPathConfig(attention="flashmla"), m, codec, cpu)
    with pytest.raises(KernelPreconditionError, match="logits='deepgemm' needs a CUDA device"):
        choose_logits(FastPathConfig(logits="deepgemm"), m, keys, cpu)
