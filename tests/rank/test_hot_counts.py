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
    counts = HiSparseRuntime.hot_count_tensor(fake)
    assert (counts[:, 0].tolist(), counts[:, 1].tolist()) == reference(step, anchor_rows,
                                                                      anchor_plan, H)


def test_no_step_no_counts():
    fake = SimpleNamespace(_step=None, _anchor_rows={}, _anchor_plan={}, H=4)
    assert HiSparseRuntime.hot_count_tensor(fake) is None


def test_counts_read_every_few_steps_add_up_to_the_per_step_counts():
    """Rank 0 reading its device-side hot counts every 5 steps (and before dropping released
    requests) reports, summed per request, exactly what reading them every step reports."""
    from hisparse_ray.engine import Engine, EngineConfig

    from hisparse_ray.model import build_tiny_model

    m = build_tiny_model(0, "deepseek_v32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, m.cfg.vocab_size, (n,), generator=g).tolist() for n in (90, 60, 12)]
    per_request = []
    for every in (1, 5):
        with Engine(m, EngineConfig(num_device_blocks=8)) as eng:
            eng.worker.hot_counts_every = every
            got: dict[str, list[int]] = {}
            finish = eng.worker.finish  # the engine launches each step, then finishes it

            def spy(step, finish=finish, got=got):
                rep = finish(step)
                for rid, h, mi in rep.hits_by_request:
                    got.setdefault(rid, [0, 0])
                    got[rid][0] += h
                    got[rid][1] += mi
                return rep

            eng.worker.finish = spy
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, 9 + 3 * i)
            eng.run()
            eng.worker._take_hot_counts({})  # nothing may be left unread after the releases
            per_request.append(got)
    assert per_request[0] == per_request[1] and sum(h for h, _ in per_request[0].values()) > 0
