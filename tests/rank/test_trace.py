"""Top-k traces: TopkTraceRecorder on a real Engine run -> Parquet -> read back; replay_hit_rate on a
hand-made trace with hand-computed hits, against an independent LRU model of the resolver contract
(docs/architecture.md), monotone in the buffer size, and equal to the worker's own hot_hits counter
for the recorded single-request run; the ``python -m hisparse_ray.rank.trace`` CLI table."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.model.model import build_tiny_model
from hisparse_ray.rank.executor import Row
from hisparse_ray.rank.trace import (
    POLICIES, SCHEMA, TopkTraceRecorder, replay_hit_rate, replay_policies,
)
from hisparse_ray.types import RequestId

H = 16  # EngineConfig's default device_buffer_size (top_k 8, page 8)
KINDS = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module")
def models():
    return {k: build_tiny_model(0, k) for k in KINDS}


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def record(model, prompts, max_new, cfg=None):
    """Run the engine with a recorder as the worker's trace -> (recorder, tokens, worker counters)."""
    rec = TopkTraceRecorder()
    with Engine(model, cfg or EngineConfig(num_device_blocks=12)) as eng:
        eng.worker.trace = rec
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, max_new)
        tokens = eng.run()
        counters = dict(eng.worker.counters)
    return rec, tokens, counters


def anchors_of(model):
    return sorted({model.cfg.anchor_of(l) for l in range(model.cfg.num_hidden_layers)})


def lru_model(rows, buffer_size):
    """Independent model of the resolver's hot buffer (architecture.md, resolution order): per
    (request, layer) H slots, LRU oldest first; short sequences (n <= H) put position p in slot p
    and are not counted; the newest position is never a hot-buffer question; hits are marked
    first, each miss evicts the least-recently-used non-hit slot; new LRU = untouched, filled, hits.
    -> (selected, hits)."""
    Hb = buffer_size
    state: dict = {}
    selected = hits = 0
    for r in sorted(rows, key=lambda r: (r["step"], r["layer"], r["request_id"])):
        pos, lru = state.setdefault((r["request_id"], r["layer"]), ([-1] * Hb, list(range(Hb))))
        n = r["seq_len"]
        if n <= Hb:
            for p in range(n):
                pos[p] = p
            continue
        need = [p for p in r["positions"] if p != n - 1]
        hit_slots = [pos.index(p) for p in need if p in pos]
        missed = [p for p in need if p not in pos]
        victims = [s for s in lru if s not in hit_slots][: len(missed)]
        for s, p in zip(victims, missed):
            pos[s] = p
        lru[:] = [s for s in lru if s not in hit_slots and s not in victims] + victims + hit_slots
        selected += len(need)
        hits += len(hit_slots)
    return selected, hits


# A hand-made trace, driven through the recorder by hand. Request "a" (n = 10..13) on layers 0 and
# 1; request "b" is short (n = 3, 4) and joins steps 1-2. Padding is -1 (dropped by the recorder).
HAND = [
    # step, [(request, seq_len, {layer: positions})]
    (1, [("a", 10, {0: [1, 2, 3], 1: [0, 1, -1]}), ("b", 3, {0: [0, 1, 2], 1: [0, 1, -1]})]),
    (2, [("a", 11, {0: [2, 5, 10], 1: [0, 1, -1]}), ("b", 4, {0: [1, 3, -1], 1: [0, 3, -1]})]),
    (3, [("a", 12, {0: [4, 6, 7], 1: [0, 1, -1]})]),
    (4, [("a", 13, {0: [2, 4, 1], 1: [1, 0, -1]})]),
]
# By hand, buffer 4 (LRU oldest first, initially slots 0..3), a/layer 0:
#   s1 [1,2,3]: 3 misses -> slots {0:1, 1:2, 2:3}, LRU [3,0,1,2]                       hits 0 / 3
#   s2 [2,5] (10 is newest): 2 hits slot 1; 5 evicts slot 3; LRU [0,2,3,1]             hits 1 / 2
#   s3 [4,6,7]: 3 misses evict slots 0,2,3 -> {0:4, 1:2, 2:6, 3:7}, LRU [1,0,2,3]      hits 0 / 3
#   s4 [2,4,1]: 2 (slot 1) and 4 (slot 0) hit; 1 evicts slot 2                          hits 2 / 3
# a/layer 1: [0,1] every step: 2 misses then 3 x 2 hits                                  hits 6 / 8
# b: n <= 4 throughout: short path, not counted. Total: 9 hits of 19.
# Buffer 3, a/layer 0: s1 3 misses {1,2,3}; s2 2 hits, 5 evicts the slot of 1 -> {5,2,3};
#   s3 3 misses fill all -> {4,6,7}; s4 4 hits, 2 and 1 miss: 2 hits / 11. a/layer 1: 6 / 8.
#   b: n = 3 fills slots with 0,1,2 (short path); at n = 4 (> 3) position 1 (layer 0) and
#   position 0 (layer 1) hit, 3 is newest: 2 / 2. Total: 10 hits of 21.
HAND_EXPECTED = {3: (21, 10), 4: (19, 9), 5: (19, 9)}


def hand_trace():
    rec = TopkTraceRecorder()
    for step, batch in HAND:
        rows = [Row(RequestId(rid), n, 0, None) for rid, n, _ in batch]
        rec.begin_step(step, rows)
        for layer in (0, 1):
            out = rec.hook(layer, torch.tensor([sel[layer] for _, _, sel in batch]))
            assert out is None  # a recorder never replaces the selection
    return rec


def test_hand_made_trace_literal_hits(tmp_path):
    rec = hand_trace()
    assert len(rec) == 2 * (2 + 2 + 1 + 1)
    path = rec.write(tmp_path / "sub" / "hand.parquet")
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA)
    assert table.to_pylist()[:2] == [
        {"step": 1, "layer": 0, "request_id": "a", "seq_len": 10, "positions": [1, 2, 3]},
        {"step": 1, "layer": 0, "request_id": "b", "seq_len": 3, "positions": [0, 1, 2]},
    ]
    rows = table.to_pylist()
    for buf, (selected, hits) in HAND_EXPECTED.items():
        r = replay_hit_rate(path, buf)  # from the file path
        assert (r.buffer_size, r.selected, r.hits) == (buf, selected, hits)
        assert r.rate == pytest.approx(hits / selected)
        assert lru_model(rows, buf) == (selected, hits)
        assert replay_hit_rate(rec.table(), buf) == r  # from the in-memory table
        assert replay_policies(path, buf, ("topk",)) == {"topk": r}
    with pytest.raises(ValueError, match="buffer_size"):
        replay_hit_rate(table, 2)  # 3 positions per row cannot fit 2 slots
    empty = replay_hit_rate(TopkTraceRecorder().table(), 4)
    assert (empty.selected, empty.hits, empty.rate) == (0, 0, 1.0)


def test_recorder_hook_needs_begin_step():
    with pytest.raises(RuntimeError, match="begin_step"):
        TopkTraceRecorder().hook(0, torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.parametrize("kind", KINDS)
def test_engine_trace_roundtrips_through_parquet(models, kind, tmp_path):
    """One row per (step, anchor layer, request); seq_len grows by one per step; the recorder does
    not change what the engine decodes."""
    m = models[kind]
    prompts = prompts_of([8 * H + 5, 9 * H], m.cfg.vocab_size)
    steps = 24
    rec, tokens, _ = record(m, prompts, steps)
    plain = record(m, prompts, steps)[1] if kind == "deepseek_v32" else None
    if plain is not None:
        assert tokens == plain
    table = pq.read_table(rec.write(tmp_path / "t.parquet"))
    assert table.schema.equals(SCHEMA)
    assert table.column_names == ["step", "layer", "request_id", "seq_len", "positions"]
    anchors = anchors_of(m)
    assert table.num_rows == len(prompts) * steps * len(anchors)
    rows = table.to_pylist()
    keys = [(r["step"], r["layer"], r["request_id"]) for r in rows]
    assert len(set(keys)) == len(keys)
    assert sorted({r["layer"] for r in rows}) == anchors
    K = m.cfg.index_topk
    for i, p in enumerate(prompts):
        mine = [r for r in rows if r["request_id"] == f"r{i}"]
        for layer in anchors:
            per_step = sorted((r for r in mine if r["layer"] == layer), key=lambda r: r["step"])
            assert [r["seq_len"] for r in per_step] == list(range(len(p), len(p) + steps))
        for r in mine:
            assert len(r["positions"]) == K == len(set(r["positions"]))
            assert all(0 <= q < r["seq_len"] for q in r["positions"])


@pytest.mark.parametrize("kind", KINDS)
def test_replay_equals_worker_hot_hits_and_is_monotone(models, kind):
    """Single request on the host tier: replaying its trace with the engine's own buffer size gives
    exactly the worker's hot_hits (and hits + misses = selected); every buffer size agrees with the
    independent LRU model, and a bigger buffer never has fewer hits."""
    m = models[kind]
    (prompt,) = prompts_of([140], m.cfg.vocab_size, seed=2)
    rec, tokens, counters = record(m, [prompt], 40)
    assert len(tokens["r0"]) == 40
    table = rec.table()
    at_h = replay_hit_rate(table, H)
    assert counters["hot_misses"] > 0 and counters["hot_hits"] > 0
    assert at_h.hits == counters["hot_hits"]
    assert at_h.selected == counters["hot_hits"] + counters["hot_misses"]
    rows = table.to_pylist()
    prev = None
    for buf in (8, 12, H, 24, 48, 96, 139):  # every row has n >= 140 > buf: same selected set
        r = at_h if buf == H else replay_hit_rate(table, buf)
        assert (r.selected, r.hits) == lru_model(rows, buf), buf
        assert replay_policies(table, buf)["topk"] == r, buf  # the policy model is the resolver
        assert r.selected == at_h.selected
        if prev is not None:
            assert r.hits >= prev.hits, (buf, r, prev)
        prev = r
    assert prev.hits > at_h.hits  # the sweep is not flat


def test_cli_prints_table(tmp_path):
    path = hand_trace().write(tmp_path / "hand.parquet")
    out = subprocess.run(
        [sys.executable, "-m", "hisparse_ray.rank.trace", str(path), "--buffer", "3",
         "--buffer", "4"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [line.split() for line in out.strip().splitlines()]
    assert lines[0] == ["buffer", "selected", "hits", "hit", "rate"]
    assert lines[1:] == [["3", "21", "10", f"{10 / 21:.3f}"], ["4", "19", "9", f"{9 / 19:.3f}"]]


def test_replay_policies_order_hits_at_the_lru_tail():
    """H = 4, K = 3, n = 100..103. Step 2 hits 10 and 12 (slots 0, 2) in top-k order [12, 10]
    for request a and [10, 12] for b; step 3 evicts two of the non-hit slots oldest first, so the
    hits' order decides whether 10 or 12 survives; step 4 asks for 12.
    a: topk puts 10 last (most recent) -> 12 evicted -> 2 hits at step 4; old (slot order 0, 2)
    and reverse ([10, 12]) keep 12 -> 3 hits. b: topk and old keep 12 -> 3; reverse keeps 10 -> 2.
    Steps 1-3: 0 + 2 + 1 hits each. Totals of 24: topk 11, old 12, reverse 11."""
    rec = TopkTraceRecorder()
    steps = {"a": [[10, 11, 12], [12, 10, 13], [20, 21, 13], [12, 13, 20]],
             "b": [[10, 11, 12], [10, 12, 13], [20, 21, 13], [12, 13, 20]]}
    for t in range(4):
        rec.begin_step(t + 1, [Row(RequestId(r), 100 + t, 0, None) for r in "ab"])
        rec.hook(0, torch.tensor([steps["a"][t], steps["b"][t]]))
    got = replay_policies(rec.table(), 4)
    assert {p: (r.selected, r.hits) for p, r in got.items()} == {
        "topk": (24, 11), "old": (24, 12), "reverse": (24, 11)}
    assert replay_hit_rate(rec.table(), 4) == got["topk"]
    assert {p: replay_policies(rec.table(), 4, (p,))[p].hits for p in POLICIES} == {
        "topk": 11, "old": 12, "reverse": 11}
    one = TopkTraceRecorder()
    for t in range(4):
        one.begin_step(t + 1, [Row(RequestId("a"), 100 + t, 0, None)])
        one.hook(0, torch.tensor([steps["a"][t]]))
    assert {p: r.hits for p, r in replay_policies(one.table(), 4).items()} == {
        "topk": 5, "old": 6, "reverse": 6}
    with pytest.raises(ValueError, match="unknown policies"):
        replay_policies(rec.table(), 4, ("mru",))


def test_cli_replays_policies(tmp_path):
    path = hand_trace().write(tmp_path / "hand.parquet")
    out = subprocess.run(
        [sys.executable, "-m", "hisparse_ray.rank.trace", str(path), "--buffer", "4", "--policy", "topk",
         "--policy", "old"], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [line.split() for line in out.strip().splitlines()]
    assert lines[0] == ["buffer", "policy", "selected", "hits", "hit", "rate"]
    assert lines[1:] == [["4", "topk", "19", "9", f"{9 / 19:.3f}"],
                         ["4", "old", "19", "9", f"{9 / 19:.3f}"]]
