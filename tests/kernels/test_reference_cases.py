"""Hand-computed resolver cases for the torch reference (CPU): literal out rows, plans, slot maps,
LRU orders and copied bytes. H = 4 hot slots, page_size 4, 4-byte rows; host row r holds bytes
[r, r+100, r+200 mod 256, 7]; position p of the request lives in host row p (host_table = [0,1,2])."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.errors import KernelPreconditionError
from hisparse_ray.kernels import backup, reference, replay, resolve

I32 = torch.int32


def host_rows(count: int = 12) -> torch.Tensor:
    r = torch.arange(count)
    return torch.stack([r, r + 100, (r + 200) % 256, torch.full_like(r, 7)], 1).to(torch.uint8)


def run(top_k, n, slot_pos, lru, resident=(-1, -1, -1), lens_dtype=I32):
    """One request (state row 0); device rows 20..24 are slots 0..3 + newest; 48 device rows."""
    state = {
        "slot_pos": torch.tensor([slot_pos], dtype=I32),
        "lru": torch.tensor([lru], dtype=I32),
        "device_kv": torch.full((48, 4), 0xEE, dtype=torch.uint8),
        "out": torch.full((1, len(top_k)), -7, dtype=I32),
        "plan": torch.full((1, len(top_k), 2), -7, dtype=I32),
    }
    resolve(
        torch.tensor([top_k], dtype=I32), torch.tensor([n], dtype=lens_dtype), torch.tensor([0], dtype=I32),
        state["slot_pos"], state["lru"], torch.tensor([[20, 21, 22, 23, 24]], dtype=I32),
        torch.tensor([resident], dtype=I32), torch.tensor([[0, 1, 2]], dtype=I32), host_rows(),
        state["device_kv"], state["out"], state["plan"], page_size=4, backend="torch",
    )
    return state


def copied(device_kv: torch.Tensor) -> dict[int, list[int]]:
    """Device rows whose bytes changed from the 0xEE fill."""
    return {r: device_kv[r].tolist() for r in range(device_kv.shape[0]) if device_kv[r].ne(0xEE).any()}


NONE = [-1, -1]


def test_hits_and_newest():
    s = run([5, 9, 2], 10, [2, 5, 7, -1], [3, 0, 1, 2])
    assert s["out"].tolist() == [[21, 24, 20]]
    assert s["slot_pos"].tolist() == [[2, 5, 7, -1]]
    assert s["lru"].tolist() == [[3, 2, 1, 0]]  # untouched (old order), then hits in top-k order
    assert s["plan"].tolist() == [[NONE, NONE, NONE]]
    assert copied(s["device_kv"]) == {}


def test_single_miss_takes_oldest_non_hit_slot():
    s = run([6, 5, -1], 10, [2, 5, 7, -1], [3, 0, 1, 2], lens_dtype=torch.int64)
    assert s["out"].tolist() == [[23, 21, -1]]
    assert s["slot_pos"].tolist() == [[2, 5, 7, 6]]
    assert s["lru"].tolist() == [[0, 2, 3, 1]]
    assert s["plan"].tolist() == [[[6, 23], NONE, NONE]]
    assert copied(s["device_kv"]) == {23: [6, 106, 206, 7]}


def test_mixed_hits_marked_before_eviction():
    # slot 1 (holding 5) is older than slot 2 (holding 7) in the LRU, but 7 is a hit: the two
    # misses take slots 3 and 0, never the hit slot 2.
    s = run([0, 7, 3, 9], 10, [2, 5, 7, -1], [3, 0, 1, 2])
    assert s["out"].tolist() == [[23, 22, 20, 24]]
    assert s["slot_pos"].tolist() == [[3, 5, 7, 0]]
    assert s["lru"].tolist() == [[1, 3, 0, 2]]
    assert s["plan"].tolist() == [[[0, 23], NONE, [3, 20], NONE]]
    assert copied(s["device_kv"]) == {23: [0, 100, 200, 7], 20: [3, 103, 203, 7]}


def test_all_miss():
    s = run([8, 1, 4, 0], 10, [2, 5, 7, -1], [3, 0, 1, 2])
    assert s["out"].tolist() == [[23, 20, 21, 22]]
    assert s["slot_pos"].tolist() == [[1, 4, 0, 8]]
    assert s["lru"].tolist() == [[3, 0, 1, 2]]
    assert s["plan"].tolist() == [[[8, 23], [1, 20], [4, 21], [0, 22]]]
    assert copied(s["device_kv"]) == {
        23: [8, 108, 208, 7], 20: [1, 101, 201, 7], 21: [4, 104, 204, 7], 22: [0, 100, 200, 7]}


def test_short_sequence_is_lookup_only():
    s = run([2, 0, -1], 3, [0, 1, -1, -1], [2, 3, 0, 1])
    assert s["out"].tolist() == [[22, 20, -1]]  # newest n-1 = 2 lives in slot 2
    assert s["slot_pos"].tolist() == [[0, 1, 2, -1]]
    assert s["lru"].tolist() == [[2, 3, 0, 1]]
    assert s["plan"].tolist() == [[NONE, NONE, NONE]]
    assert copied(s["device_kv"]) == {}


def test_resident_rows_win_and_leave_lru_alone():
    # page 1 (positions 4..7) is resident in device block 10 (rows 40..43): position 5 is also
    # in hot slot 1, but the resident row wins and slot 1 is not a hit (so it can be evicted).
    s = run([5, 7, 0, 1], 10, [2, 5, 7, -1], [1, 3, 0, 2], resident=(-1, 10, -1))
    assert s["out"].tolist() == [[41, 43, 21, 23]]
    assert s["slot_pos"].tolist() == [[2, 0, 7, 1]]
    assert s["lru"].tolist() == [[0, 2, 1, 3]]
    assert s["plan"].tolist() == [[NONE, NONE, [0, 21], [1, 23]]]
    assert copied(s["device_kv"]) == {21: [0, 100, 200, 7], 23: [1, 101, 201, 7]}


def test_newest_in_resident_page_uses_resident_row():
    s = run([7, 2], 8, [2, 5, -1, -1], [0, 1, 2, 3], resident=(-1, 10, -1))
    assert s["out"].tolist() == [[43, 20]]
    assert s["lru"].tolist() == [[1, 2, 3, 0]]


def test_padded_rows_change_nothing():
    lru = torch.tensor([[3, 0, 1, 2], [0, 1, 2, 3]], dtype=I32)
    slot_pos = torch.tensor([[2, 5, 7, -1], [9, 8, 7, 6]], dtype=I32)
    dev = torch.full((48, 4), 0xEE, dtype=torch.uint8)
    out = torch.full((2, 2), -7, dtype=I32)
    plan = torch.full((2, 2, 2), -7, dtype=I32)
    resolve(
        torch.tensor([[6, -1], [3, 4]], dtype=I32), torch.tensor([10, 0], dtype=I32),
        torch.tensor([0, 1], dtype=I32), slot_pos, lru,
        torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]], dtype=I32),
        torch.full((2, 3), -1, dtype=I32), torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=I32),
        host_rows(), dev, out, plan, page_size=4, backend="torch",
    )
    assert out.tolist() == [[23, -1], [-1, -1]]
    assert plan.tolist() == [[[6, 23], NONE], [NONE, NONE]]
    assert slot_pos.tolist() == [[2, 5, 7, 6], [9, 8, 7, 6]]
    assert lru.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert copied(dev) == {23: [6, 106, 206, 7]}


def test_plan_replay_on_skip_layer_equals_full_resolve():
    anchor = run([0, 7, 3, 9], 10, [2, 5, 7, -1], [3, 0, 1, 2])
    skip_host = host_rows() ^ 0x5A  # another layer: other bytes, same slot state
    skip_dev = torch.full((48, 4), 0xEE, dtype=torch.uint8)
    replay(anchor["plan"], skip_host, skip_dev, backend="torch")
    full_dev = torch.full((48, 4), 0xEE, dtype=torch.uint8)
    out = torch.empty((1, 4), dtype=I32)
    resolve(
        torch.tensor([[0, 7, 3, 9]], dtype=I32), torch.tensor([10], dtype=I32), torch.tensor([0], dtype=I32),
        torch.tensor([[2, 5, 7, -1]], dtype=I32), torch.tensor([[3, 0, 1, 2]], dtype=I32),
        torch.tensor([[20, 21, 22, 23, 24]], dtype=I32), torch.full((1, 3), -1, dtype=I32),
        torch.tensor([[0, 1, 2]], dtype=I32), skip_host, full_dev, out, page_size=4, backend="torch",
    )
    assert torch.equal(skip_dev, full_dev)
    assert out.tolist() == anchor["out"].tolist()
    assert copied(skip_dev) == {23: [0 ^ 0x5A, 100 ^ 0x5A, 200 ^ 0x5A, 7 ^ 0x5A],
                                20: [3 ^ 0x5A, 103 ^ 0x5A, 203 ^ 0x5A, 7 ^ 0x5A]}


def test_backup_copies_newest_rows_of_every_layer():
    dev = torch.arange(2 * 6 * 3, dtype=torch.uint8).view(2, 6, 3)
    host = torch.zeros((2, 4, 3), dtype=torch.uint8)
    backup(torch.tensor([5, -1, 1], dtype=I32), torch.tensor([0, 3, 2], dtype=I32), dev, host,
           backend="torch")
    assert host.tolist() == [
        [[15, 16, 17], [0, 0, 0], [3, 4, 5], [0, 0, 0]],
        [[33, 34, 35], [0, 0, 0], [21, 22, 23], [0, 0, 0]],
    ]


@pytest.mark.parametrize(
    ("top_k", "n", "slot_pos", "lru", "match"),
    [
        ([5, 5, 2], 10, [2, 5, 7, -1], [3, 0, 1, 2], "not distinct"),
        ([5, 10, 2], 10, [2, 5, 7, -1], [3, 0, 1, 2], "outside"),
        ([5, -2, 2], 10, [2, 5, 7, -1], [3, 0, 1, 2], "outside"),
        ([5, 1, 2], 10, [2, 5, 7, -1], [3, 0, 0, 2], "permutation"),
        ([5, 1, 2], 10, [2, 5, 5, -1], [3, 0, 1, 2], "duplicates"),
        ([5, 1, 2], 13, [2, 5, 7, -1], [3, 0, 1, 2], "pages"),
        ([5, 1, 2, 3, 4], 10, [2, 5, 7, -1], [3, 0, 1, 2], "exceeds"),
    ],
)
def test_preconditions_raise(top_k, n, slot_pos, lru, match):
    with pytest.raises(KernelPreconditionError, match=match):
        run(top_k, n, slot_pos, lru)


def test_missing_host_block_raises():
    out = torch.empty((1, 1), dtype=I32)
    with pytest.raises(KernelPreconditionError, match="neither resident nor on host"):
        reference.resolve(
            torch.tensor([[1]], dtype=I32), torch.tensor([10], dtype=I32), torch.tensor([0], dtype=I32),
            torch.tensor([[2, 5, 7, -1]], dtype=I32), torch.tensor([[3, 0, 1, 2]], dtype=I32),
            torch.tensor([[20, 21, 22, 23, 24]], dtype=I32), torch.full((1, 3), -1, dtype=I32),
            torch.tensor([[-1, 1, 2]], dtype=I32), host_rows(), torch.zeros((48, 4), dtype=torch.uint8),
            out, page_size=4,
        )


@pytest.mark.parametrize("threads", [0, 32, 48, 100, 1056, 2048])
def test_block_threads_outside_config_range_raise(threads):
    with pytest.raises(KernelPreconditionError, match="block_threads"):
        reference.resolve(
            torch.tensor([[1]], dtype=I32), torch.tensor([10], dtype=I32), torch.tensor([0], dtype=I32),
            torch.tensor([[2, 5, 7, -1]], dtype=I32), torch.tensor([[3, 0, 1, 2]], dtype=I32),
            torch.tensor([[20, 21, 22, 23, 24]], dtype=I32), torch.full((1, 3), -1, dtype=I32),
            torch.tensor([[0, 1, 2]], dtype=I32), host_rows(), torch.zeros((48, 4), dtype=torch.uint8),
            torch.empty((1, 1), dtype=I32), page_size=4, block_threads=threads,
        )


def test_shape_dtype_and_contiguity_checks():
    base = dict(
        top_k=torch.tensor([[1]], dtype=I32), seq_lens=torch.tensor([10], dtype=I32),
        state_idx=torch.tensor([0], dtype=I32), slot_pos=torch.tensor([[2, 5, 7, -1]], dtype=I32),
        lru=torch.tensor([[3, 0, 1, 2]], dtype=I32), slot_rows=torch.tensor([[20, 21, 22, 23, 24]], dtype=I32),
        resident_table=torch.full((1, 3), -1, dtype=I32), host_table=torch.tensor([[0, 1, 2]], dtype=I32),
        host_kv=host_rows(), device_kv=torch.zeros((48, 4), dtype=torch.uint8),
        out_rows=torch.empty((1, 1), dtype=I32),
    )
    bad = [
        ("top_k", torch.tensor([[1]], dtype=torch.int64), "dtype"),
        ("slot_rows", torch.tensor([[20, 21, 22, 23]], dtype=I32), "slot_rows"),
        ("device_kv", torch.zeros((48, 5), dtype=torch.uint8), "differ"),
        ("host_kv", torch.zeros((4, 24), dtype=torch.uint8)[:, ::6], "contiguous"),
        ("out_rows", torch.empty((1, 2), dtype=I32), "out_rows"),
    ]
    for name, value, match in bad:
        with pytest.raises(KernelPreconditionError, match=match):
            reference.resolve(**{**base, name: value}, page_size=4)
    reference.resolve(**base, page_size=4)
    assert base["out_rows"].tolist() == [[23]]


def test_tables_naming_rows_outside_the_views_raise():
    with pytest.raises(KernelPreconditionError, match="host_table names block 3"):
        reference.resolve(
            torch.tensor([[1]], dtype=I32), torch.tensor([10], dtype=I32), torch.tensor([0], dtype=I32),
            torch.tensor([[2, 5, 7, -1]], dtype=I32), torch.tensor([[3, 0, 1, 2]], dtype=I32),
            torch.tensor([[20, 21, 22, 23, 24]], dtype=I32), torch.full((1, 3), -1, dtype=I32),
            torch.tensor([[0, 3, 2]], dtype=I32), host_rows(), torch.zeros((48, 4), dtype=torch.uint8),
            torch.empty((1, 1), dtype=I32), page_size=4,
        )
    with pytest.raises(KernelPreconditionError, match="slot_rows"):
        reference.resolve(
            torch.tensor([[1]], dtype=I32), torch.tensor([10], dtype=I32), torch.tensor([0], dtype=I32),
            torch.tensor([[2, 5, 7, -1]], dtype=I32), torch.tensor([[3, 0, 1, 2]], dtype=I32),
            torch.tensor([[20, 21, 22, 23, 48]], dtype=I32), torch.full((1, 3), -1, dtype=I32),
            torch.tensor([[0, 1, 2]], dtype=I32), host_rows(), torch.zeros((48, 4), dtype=torch.uint8),
            torch.empty((1, 1), dtype=I32), page_size=4,
        )


def test_empty_batch_is_a_no_op():
    slot_pos = torch.tensor([[2, 5, 7, -1]], dtype=I32)
    reference.resolve(
        torch.empty((0, 2), dtype=I32), torch.empty(0, dtype=I32), torch.empty(0, dtype=I32),
        slot_pos, torch.tensor([[3, 0, 1, 2]], dtype=I32), torch.empty((0, 5), dtype=I32),
        torch.empty((0, 3), dtype=I32), torch.empty((0, 3), dtype=I32), host_rows(),
        torch.zeros((48, 4), dtype=torch.uint8), torch.empty((0, 2), dtype=I32), page_size=4,
    )
    assert slot_pos.tolist() == [[2, 5, 7, -1]]
