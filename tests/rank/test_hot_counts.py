"""HiSparseRuntime.hot_counts: the batched count (one read-back per step) equals the per-row
definition on random steps: padding rows, rows outside the hot buffer, misses, short sequences."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.rank.runtime import HiSparseRuntime, hot_counts_reference as reference


@given(st.integers(0, 5), st.integers(1, 6), st.integers(1, 8), st.integers(0, 3),
       st.integers(0, 2**31 - 1))
@settings(max_examples=150, deadline=None)
def test_batched_hot_counts_equal_the_per_row_definition(B, H, K, anchors, seed):
    g = torch.Generator().manual_seed(seed)
    rows_max = 4 * H + 4
    slot_rows = torch.randint(-1, rows_max, (B, H + 1), generator=g, dtype=torch.int32)
    seq_lens = torch.randint(1, 2 * H + 2, (B,), generator=g, dtype=torch.int32)
    anchor_rows, anchor_plan = {}, {}
    for a in range(anchors):
        rows = torch.randint(-1, rows_max, (B, K), generator=g, dtype=torch.int64)
        anchor_rows[a * 3] = rows
        anchor_plan[a * 3] = torch.randint(-1, 3, (B, K, 2), generator=g, dtype=torch.int32)
    step = SimpleNamespace(slot_rows=slot_rows, seq_lens=seq_lens)
    fake = SimpleNamespace(_step=step, _anchor_rows=anchor_rows, _anchor_plan=anchor_plan, H=H,
                           device_kv=[torch.empty(rows_max, 1)])
    assert HiSparseRuntime.hot_counts(fake) == reference(step, anchor_rows, anchor_plan, H)


def test_no_step_no_counts():
    fake = SimpleNamespace(_step=None, _anchor_rows={}, _anchor_plan={}, H=4)
    assert HiSparseRuntime.hot_counts(fake) == ([], [])
