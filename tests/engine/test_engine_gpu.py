"""On the GPU: HiSparse decode through the CUDA resolver equals full-resident decode (bf16).

Both runs are batch-invariant (each row its own forward), so the only difference between them is
where the KV rows come from; the rows are byte-identical copies, so logits are expected to be equal
bitwise, and the test asserts exactly that (tolerance 0) plus identical greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.config import HiSparseConfig
from hisparse_ray.engine import EngineConfig
from hisparse_ray.model.model import build_tiny_model

from .test_engine import assert_same, prompts_of, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_cuda_hisparse_equals_full_resident_bf16(kind):
    m = build_tiny_model(0, kind, dtype=torch.bfloat16, device="cuda")
    hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.01)
    prompts = prompts_of([8 * 16 + 5, 40, 3, 9 * 16], m.cfg.vocab_size)
    common = dict(hisparse=hs, device="cuda", backend="cuda")
    base = run(m, prompts, 64, EngineConfig(full_resident=True, **common))
    hisp = run(m, prompts, 64, EngineConfig(num_device_blocks=12, **common))
    diff = max((base[1][k].float() - hisp[1][k].float()).abs().max().item() for k in base[1])
    print(f"\n[{kind}] cuda bf16 HiSparse vs full-resident: max |dlogit| = {diff}, "
          f"hits={hisp[3]['hot_hits']} misses={hisp[3]['hot_misses']} spills={hisp[2].spills}")
    assert_same(hisp, base)
    assert hisp[3]["hot_misses"] > 0


def test_cuda_resolver_engine_equals_torch_resolver_engine():
    m = build_tiny_model(0, "deepseek_v32", dtype=torch.bfloat16, device="cuda")
    prompts = prompts_of([150, 60], m.cfg.vocab_size, seed=9)
    a = run(m, prompts, 32, EngineConfig(num_device_blocks=8, device="cuda", backend="cuda"))
    b = run(m, prompts, 32, EngineConfig(num_device_blocks=8, device="cuda", backend="torch"))
    assert_same(a, b)
