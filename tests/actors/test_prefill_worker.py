"""The plain PrefillWorker class (no Ray) pushing real NIXL WRITEs into a second agent in this
process: the right rows land in the right blocks, byte for byte, with the notification."""

from __future__ import annotations

import time

import pytest
import torch

from hisparse_ray.actors.prefill_worker import PrefillWorker
from hisparse_ray.deploy import PrefillSpec
from hisparse_ray.errors import CapacityError, StateError, TransferError
from hisparse_ray.transfer import NixlTransferEngine
from hisparse_ray.types import LandingDest, LandingOrder

pytestmark = [pytest.mark.nixl]

PAGE = 4


@pytest.fixture(scope="module")
def peers():
    pw = PrefillWorker(PrefillSpec(max_prompt_tokens=32, name="plain"))
    target = NixlTransferEngine("plain-target")
    layers = [torch.zeros(8 * PAGE, pw.row_bytes, dtype=torch.uint8) for _ in range(pw.num_layers)]
    regions = tuple(target.register(f"host.{l}", t) for l, t in enumerate(layers))
    pw.add_peer(target.agent_metadata())
    target.add_peer(pw.endpoint()[1])
    yield pw, target, layers, regions
    pw.shutdown()
    target.close()


def _notifications(engine, want: int, timeout_s: float = 10.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += [m for _, m in engine.take_notifications()]
        time.sleep(1e-3)
    return got


def test_pushed_pages_hold_the_prefill_rows_in_their_blocks(peers):
    pw, target, layers, regions = peers
    tokens = [5, 9, 2, 77, 31, 8, 8, 40, 1, 3]  # 10 positions: pages 0, 1 full, page 2 holds 2
    res = pw.prefill("a", tokens)
    assert res.num_positions == 10 and res.index_keys.shape[1] == 10
    blocks = {0: 6, 1: 1, 2: 3}
    moved, seconds = pw.push(LandingOrder("a", (LandingDest(0, regions, tuple(blocks.items()),
                                                            b"land:a"),)), PAGE)
    assert moved == 10 * pw.row_bytes * pw.num_layers and seconds >= 0
    assert _notifications(target, 1) == [b"land:a"]
    _, rows, _ = pw.model.prefill(torch.tensor(tokens))
    want = rows.contiguous().view(torch.uint8).reshape(pw.num_layers, 10, pw.row_bytes)
    for l, layer in enumerate(layers):
        for page, block in blocks.items():
            n = min(PAGE, 10 - page * PAGE)
            assert torch.equal(layer[block * PAGE: block * PAGE + n],
                               want[l, page * PAGE: page * PAGE + n])
        untouched = [b for b in range(8) if b not in blocks.values()]
        assert all(not layer[b * PAGE:(b + 1) * PAGE].any() for b in untouched)


def test_push_needs_the_held_request_and_a_known_peer(peers):
    pw, target, _, regions = peers
    pw.prefill("b", [1, 2, 3])
    with pytest.raises(StateError, match="not held"):
        pw.push(LandingOrder("other", (LandingDest(0, regions, ((0, 0),), b"x"),)), PAGE)
    pw.drop("b")
    with pytest.raises(StateError):
        pw.push(LandingOrder("b", (LandingDest(0, regions, ((0, 0),), b"x"),)), PAGE)
    with pytest.raises(CapacityError):
        pw.prefill("c", list(range(1, 40)))
    pw.prefill("d", [4, 4, 4, 4, 4])
    pw.remove_peer(target.name)
    try:
        with pytest.raises(TransferError, match="after 2 attempt"):
            pw.push(LandingOrder("d", (LandingDest(0, regions, ((0, 2),), b"y"),), attempts=2,
                                 timeout_s=2.0), PAGE)
        assert pw.get_stats()["failed_pushes"] == 1
    finally:
        pw.add_peer(target.agent_metadata())


def test_keys_travel_with_the_kv_and_synthetic_prefill_fills_both_buffers():
    """Keys by NIXL: a WRITE with key rows lands the prefill's indexer keys byte for byte next to
    its KV rows, and ``keys_inline=False`` returns none through Ray. ``synthetic_kv`` (benchmarks)
    fills rows and keys with finite values, the same for the same prompt, without the model."""
    pw = PrefillWorker(PrefillSpec(max_prompt_tokens=16, name="keys"))
    syn = PrefillWorker(PrefillSpec(max_prompt_tokens=16, name="syn", synthetic_kv=True))
    target = NixlTransferEngine("keys-target")
    try:
        kv = [torch.zeros(4 * PAGE, pw.row_bytes, dtype=torch.uint8) for _ in range(pw.num_layers)]
        keys = [torch.zeros(4 * PAGE, pw.key_row_bytes, dtype=torch.uint8)
                for _ in range(pw.num_layers)]
        kv_regions = tuple(target.register(f"kv.{l}", t) for l, t in enumerate(kv))
        key_regions = tuple(target.register(f"keys.{l}", t) for l, t in enumerate(keys))
        pw.add_peer(target.agent_metadata())
        tokens = [3, 1, 4, 1, 5, 9, 2]
        assert pw.prefill("k", tokens, keys_inline=False).index_keys is None
        dest = LandingDest(0, kv_regions, ((0, 2), (1, 3)), b"land:k", key_regions, (0, 5, 7))
        moved, _ = pw.push(LandingOrder("k", (dest,)), PAGE)
        assert moved == 7 * pw.num_layers * (pw.row_bytes + pw.key_row_bytes)
        assert _notifications(target, 1) == [b"land:k"]
        _, rows, want_keys = pw.model.prefill(torch.tensor(tokens))
        for l in range(pw.num_layers):
            assert torch.equal(kv[l][2 * PAGE: 2 * PAGE + 7],
                               rows[l].contiguous().view(torch.uint8))
            assert torch.equal(keys[l][5:12], want_keys[l].contiguous().view(torch.uint8))
        got = syn.prefill("s", tokens).index_keys
        assert got.shape == (pw.num_layers, 7, pw.model.cfg.index_head_dim)
        first = syn.send[:, :7].clone()
        assert torch.isfinite(syn.send[:, :7].view(syn.model.dtype)).all() and first.any()
        syn.prefill("s2", tokens)
        assert torch.equal(syn.send[:, :7], first)  # seeded by the prompt
    finally:
        pw.shutdown()
        syn.shutdown()
        target.close()


def test_batched_prefill_knob_fills_the_batched_rows():
    """``PrefillSpec.batch_invariant=False`` (benchmarks, real-size models) fills the send buffer
    with the batched prefill's rows: within fp32 rounding of the exact ones, not always bitwise."""
    fast = PrefillWorker(PrefillSpec(max_prompt_tokens=64, name="batched", batch_invariant=False))
    try:
        tokens = list(range(1, 50))
        fast.prefill("f", tokens)
        got = fast.send[:, :49].view(fast.model.dtype).view(fast.num_layers, 49, -1)
        ids = torch.tensor(tokens)
        assert torch.equal(got, fast.model.prefill(ids, batch_invariant=False)[1])
        torch.testing.assert_close(got, fast.model.prefill(ids)[1], atol=1e-5, rtol=0)
    finally:
        fast.shutdown()


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_send_buffer_holds_rows_in_the_kv_cache_dtype(kv):
    """``PrefillSpec.kv_cache_dtype``: the send buffer holds the KV row codec's bytes (fp8: e4m3
    latent, fp32 scales, bf16 rope), the bytes the replica's pools hold; keys stay in the model
    dtype; synthetic prefill encodes the same way."""
    from hisparse_ray.kernels.kvfp8 import row_codec

    pw = PrefillWorker(PrefillSpec(max_prompt_tokens=16, name=f"rows-{kv}", kv_cache_dtype=kv))
    try:
        codec = row_codec(kv, pw.model.cfg, pw.model.dtype)
        assert pw.row_bytes == pw.kv_row_bytes() == codec.row_bytes < 4 * pw.model.cfg.row_dim
        tokens = [3, 1, 4, 1, 5, 9, 2]
        pw.prefill("k", tokens)
        _, rows, keys = pw.model.prefill(torch.tensor(tokens))
        assert torch.equal(pw.send[:, :7], codec.encode(rows))
        assert torch.equal(pw.send_keys[:, :7].view(torch.float32), keys)
    finally:
        pw.shutdown()
