"""General-case sweep 3 (``benchmarks/sweep3.py``): HiSparse equals full-resident (tokens and every
step's logits) on configurations the earlier sweeps did not combine.

Found by it: on the reference path a multi-turn follow-up reused pages a decode step wrote also
with lossy KV rows (fp8, or bf16 rows of an fp32 model). A prefill attends over its own unrounded
rows, a decode step over the stored (rounded) ones, so from the second layer on a decode-written
row is not the row a prefill of the same tokens computes: the follow-up decoded other logits (and
with fp8 other tokens) than full-resident's fresh prefill. Decode-written pages are now published
only where the stored rows are exactly the model's (``config.kv_rows_lossless``).
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _follow_up(model, full: bool, kv: str):
    """A donor decodes 24 tokens on a device pool of one hot buffer (its pages backed up to the
    host tier and published as they fill), then a follow-up of its prompt + answer + 2 tokens."""
    logits = {}
    cfg = EngineConfig(full_resident=full, kv_cache_dtype=kv, page_size=4, num_device_blocks=5)
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            logits.update({(r.request_id, r.seq_len): out[i].clone() for i, r in enumerate(rows)})
        eng.worker.on_logits = grab
        eng.add_request("a", [5, 6, 7], 24)
        a = eng.run()["a"]
        eng.add_request("b", [5, 6, 7] + a + [1, 2], 4)
        return eng.run(), logits, eng.core.counters


@pytest.mark.parametrize("kv,dtype,lossless", [
    ("fp8", "fp32", False), ("fp8", "bf16", False), ("bf16", "fp32", False),
    ("bf16", "bf16", True), ("fp32", "bf16", True), ("auto", "fp32", True)])
def test_follow_up_reusing_decoded_pages_with_lossy_rows(kv, dtype, lossless):
    model = build_random_model(tiny_config(), seed=0, dtype=DTYPES[dtype])
    base = _follow_up(model, True, kv)
    hs = _follow_up(model, False, kv)
    assert hs[0] == base[0]
    assert hs[1].keys() == base[1].keys()
    for k in base[1]:
        assert torch.equal(hs[1][k], base[1][k]), k
    assert base[2].prefix_hit_pages == 0
    # prompt + 23 written decode rows: 26 positions, 6 full pages; the prompt's last row (2) is
    # written by the prefill: page 0 only holds prefill rows
    assert hs[2].prefix_hit_pages == (6 if lossless else 0)


def test_replicas_publish_decoded_pages_only_with_lossless_rows():
    """The actor system's replicas decide the same (``ReplicaSpec.core_config``)."""
    from hisparse_ray.deploy import DeployOptions

    def publishes(**kw):
        return DeployOptions(**kw).specs()[0].core_config.publish_decoded

    assert publishes() and publishes(kv_cache_dtype="fp32")
    assert publishes(kv_cache_dtype="bf16", dtype="bfloat16")
    assert publishes(kv_cache_dtype="fp32", dtype="bfloat16")
    assert not publishes(kv_cache_dtype="fp8")
    assert not publishes(kv_cache_dtype="bf16")  # rounded rows of an fp32 model
    assert not publishes(kv_cache_dtype="fp8", dtype="bfloat16")
