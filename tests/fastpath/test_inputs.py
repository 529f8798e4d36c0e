"""Static step inputs: rows land in their fields, padding is inert, tables are copied only when a
row's request or table version changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_ray.fastpath.inputs import RowInput, RowTables, StepInputs


def tables(key, n_pages=3, hot=5):
    return RowTables(key, np.arange(hot, dtype=np.int32) + 100, np.arange(n_pages, dtype=np.int32),
                     np.arange(n_pages, dtype=np.int32) + 10, np.array([7], dtype=np.int32))


def make():
    return StepInputs(max_batch=4, hot_slots=5, pages=6, index_pages=2, write_sink=99,
                      index_sink=77, device=torch.device("cpu"))


def test_rows_and_padding():
    s = make()
    rows = [RowInput(11, 9, 2, 40, 450, tables(("a", 1))), RowInput(12, 3, 0, 41, 451, tables(("b", 1), 1))]
    s.fill(rows, 4)
    assert s.view("ids", 4)[:, 0].tolist() == [11, 12, 0, 0]
    assert s.view("pos", 4)[:, 0].tolist() == [8, 2, 0, 0]
    assert s.view("seq_lens", 4)[:, 0].tolist() == [9, 3, 0, 0]
    assert s.view("write", 4)[:, 0].tolist() == [40, 41, 99, 99]  # padding writes the sinks
    assert s.view("index_write", 4)[:, 0].tolist() == [450, 451, 77, 77]
    assert s.view("resident", 2).tolist() == [[0, 1, 2, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert s.view("host", 1).tolist() == [[10, 11, 12, -1, -1, -1]]
    assert s.view("slot_rows", 1).tolist() == [[100, 101, 102, 103, 104]]
    assert s.view("index_table", 2).tolist() == [[7, -1], [7, -1]]
    assert s.view("resident", 3).is_contiguous()


def test_tables_copied_only_when_the_key_changes():
    s = make()
    t = tables(("a", 1))
    s.fill([RowInput(1, 4, 0, 1, 1, t)], 1)
    s.view("resident", 1)[0, 0] = 555  # scribble: an unchanged key must not rewrite the row
    s.fill([RowInput(2, 5, 0, 1, 1, t)], 1)
    assert s.view("resident", 1)[0, 0] == 555 and s.view("ids", 1)[0, 0] == 2
    s.fill([RowInput(2, 5, 0, 1, 1, tables(("a", 2)))], 1)  # new version: rewritten
    assert s.view("resident", 1)[0, 0] == 0
    s.fill([RowInput(2, 5, 0, 1, 1, tables(("b", 2), n_pages=2))], 1)  # another request
    assert s.view("host", 1).tolist() == [[10, 11, -1, -1, -1, -1]]


def test_refuses_what_does_not_fit():
    s = make()
    with pytest.raises(ValueError, match="bucket"):
        s.fill([RowInput(1, 4, 0, 1, 1, tables(("a", 1)))] * 3, 2)
    with pytest.raises(ValueError, match="raise max_context"):
        s.fill([RowInput(1, 4, 0, 1, 1, tables(("a", 1), n_pages=7))], 1)
    s.set_sink("index_write", 5)
    s.fill([], 2)
    assert s.view("index_write", 2)[:, 0].tolist() == [5, 5]
