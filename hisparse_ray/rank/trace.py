"""Top-k trace recording to Parquet and a replay tool for hot-buffer hit rates (ring 2).

A trace has one row per (step, layer, request): the positions the indexer selected (in top-k
order, best score first) and the sequence length. ``replay_hit_rate`` runs a trace through the
resolver (any backend) with a fresh hot buffer of ``device_buffer_size`` slots per (request,
layer) and reports how many selected positions hit. ``replay_policies`` replays it through a model
of the resolver's hot buffer that differs only in the order of a step's hits at the LRU tail (the
LRU policy question of issue #15 item 13; ``benchmarks/bench_lru_policy.py``). Usable as
``python -m hisparse_ray.rank.trace TRACE.parquet --buffer 4096 [--policy topk --policy old ...]``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor

from hisparse_ray import kernels

SCHEMA = pa.schema([
    ("step", pa.int32()),
    ("layer", pa.int32()),
    ("request_id", pa.string()),
    ("seq_len", pa.int32()),
    ("positions", pa.list_(pa.int32())),
])


class TopkTraceRecorder:
    """Collects top-k selections. Set it as ``HiSparseWorker.trace`` (the worker calls
    ``begin_step(step, rows)`` before each forward and passes ``hook`` as the model's
    ``topk_hook``), or drive it by hand with rows naming ``request_id`` and ``seq_len`` (the
    executor's ``Row``)."""

    def __init__(self) -> None:
        self._cols: dict[str, list] = {name: [] for name in SCHEMA.names}
        self._batch: tuple[int, list[str], list[int]] | None = None

    def begin_step(self, step: int, rows) -> None:
        self._batch = (step, [r.request_id for r in rows], [r.seq_len for r in rows])

    def hook(self, layer: int, topk: Tensor) -> None:
        if self._batch is None:
            raise RuntimeError("TopkTraceRecorder.hook called before begin_step")
        step, rids, lens = self._batch
        for b, row in enumerate(topk.detach().cpu().tolist()):
            self._cols["step"].append(step)
            self._cols["layer"].append(layer)
            self._cols["request_id"].append(rids[b])
            self._cols["seq_len"].append(lens[b])
            self._cols["positions"].append([p for p in row if p >= 0])
        return None

    def __len__(self) -> int:
        return len(self._cols["step"])

    def table(self) -> pa.Table:
        return pa.table(self._cols, schema=SCHEMA)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(self.table(), path)
        return path


@dataclass(frozen=True)
class HitRate:
    buffer_size: int
    selected: int  # positions that needed the hot buffer (not newest, long sequences)
    hits: int

    @property
    def rate(self) -> float:
        return self.hits / self.selected if self.selected else 1.0


def replay_hit_rate(trace: pa.Table | str | Path, buffer_size: int, *, backend: str = "torch") -> HitRate:
    """Replay a trace through the resolver with ``buffer_size`` hot slots per (request, layer)."""
    if not isinstance(trace, pa.Table):
        trace = pq.read_table(trace)
    rows = trace.to_pylist()
    rows.sort(key=lambda r: (r["step"], r["layer"], r["request_id"]))
    H = buffer_size
    keys = sorted({(r["request_id"], r["layer"]) for r in rows})
    state_of = {k: i for i, k in enumerate(keys)}
    S = len(keys)
    slot_pos = torch.full((S, H), -1, dtype=torch.int32)
    lru = torch.arange(H, dtype=torch.int32).repeat(S, 1).contiguous()
    max_len = max((r["seq_len"] for r in rows), default=1)
    # One host block covering every position; device rows: slot s of state i -> row i*(H+1)+s.
    host_kv = torch.zeros(max_len, 1, dtype=torch.uint8)
    device_kv = torch.zeros(S * (H + 1), 1, dtype=torch.uint8)
    selected = hits = 0
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["step"], r["layer"])].append(r)
    for (_step, layer), batch in sorted(groups.items()):
        K = max(1, max(len(r["positions"]) for r in batch))
        if K > H:
            raise ValueError(f"trace has {K} positions per row, more than buffer_size {H}")
        B = len(batch)
        topk = torch.full((B, K), -1, dtype=torch.int32)
        for b, r in enumerate(batch):
            topk[b, : len(r["positions"])] = torch.tensor(r["positions"], dtype=torch.int32)
        idx = [state_of[(r["request_id"], layer)] for r in batch]
        seq = torch.tensor([r["seq_len"] for r in batch], dtype=torch.int32)
        slot_rows = torch.tensor([[i * (H + 1) + s for s in range(H + 1)] for i in idx], dtype=torch.int32)
        out = torch.empty(B, K, dtype=torch.int32)
        plan = torch.empty(B, K, 2, dtype=torch.int32)
        kernels.resolve(
            top_k=topk, seq_lens=seq, state_idx=torch.tensor(idx, dtype=torch.int32),
            slot_pos=slot_pos, lru=lru, slot_rows=slot_rows,
            resident_table=torch.full((B, 1), -1, dtype=torch.int32),
            host_table=torch.zeros((B, 1), dtype=torch.int32),
            host_kv=host_kv, device_kv=device_kv, page_size=max_len,
            out_rows=out, plan=plan, backend=backend,
        )
        for b, r in enumerate(batch):
            n = r["seq_len"]
            if n <= H:
                continue  # short sequences resolve without the LRU: not a hot-buffer question
            need = sum(1 for p in r["positions"] if p != n - 1)
            misses = int((plan[b, :, 0] >= 0).sum())
            selected += need
            hits += need - misses
    return HitRate(buffer_size, selected, hits)


POLICIES = ("topk", "old", "reverse")
"""Orders of a step's hits at the LRU tail (most recent last): ``topk`` = top-k order, the
resolver's contract (the best-scoring hit is the oldest of them); ``old`` = their previous LRU
order (SGLang's kernel); ``reverse`` = reverse top-k order (the best-scoring hit most recent)."""


def replay_policies(trace: pa.Table | str | Path, buffer_size: int,
                    policies: tuple[str, ...] = POLICIES) -> dict[str, HitRate]:
    """Replay ``trace`` through a model of the resolver's hot buffer once per hit-order policy.

    The model is the resolver contract (docs/architecture.md) on traces without resident pages:
    per (request, layer) ``buffer_size`` slots and an LRU (oldest first, initially slot order);
    n <= H: slot p holds position p, nothing counted; else the newest position is not counted,
    hits are marked first, each miss (in top-k order) takes the least-recently-used non-hit slot,
    and the LRU becomes untouched slots (old order), newly filled (top-k order), then the hits in
    the policy's order. With ``"topk"`` it counts exactly what :func:`replay_hit_rate` counts
    (tested); it is a separate model because the resolver implements one policy only. The LRU is
    kept as one int64 stamp per slot (a bigger stamp = more recent), so a step costs O(H) in
    numpy plus O(K) in Python.
    """
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}; known: {POLICIES}")
    if not isinstance(trace, pa.Table):
        trace = pq.read_table(trace)
    rows = trace.to_pylist()
    rows.sort(key=lambda r: (r["step"], r["layer"], r["request_id"]))
    H = buffer_size
    out = {}
    for policy in policies:
        states: dict[tuple[str, int], tuple[list[int], dict[int, int], np.ndarray]] = {}
        clock = selected = hits = 0
        for r in rows:
            n, positions = r["seq_len"], r["positions"]
            if len(positions) > H:
                raise ValueError(f"trace has {len(positions)} positions per row, more than "
                                 f"buffer_size {H}")
            key = (r["request_id"], r["layer"])
            if key not in states:
                states[key] = ([-1] * H, {}, np.arange(-H, 0, dtype=np.int64))
            slot_pos, where, stamp = states[key]
            if n <= H:  # short path: slot p holds position p; the LRU is not touched
                for q in range(n):
                    if slot_pos[q] != q:
                        where.pop(slot_pos[q], None)
                        slot_pos[q] = q
                        where[q] = q
                continue
            need = [q for q in positions if q >= 0 and q != n - 1]
            hit_slots = [where[q] for q in need if q in where]
            missed = [q for q in need if q not in where]
            selected += len(need)
            hits += len(hit_slots)
            base, clock = clock, clock + 2 * H
            if policy == "old":
                hit_slots.sort(key=lambda slot: stamp[slot])
            elif policy == "reverse":
                hit_slots.reverse()
            if missed:
                free = stamp.copy()
                free[hit_slots] = np.iinfo(np.int64).max
                m = len(missed)
                pick = np.argpartition(free, m - 1)[:m] if m < H else np.arange(H)
                victims = pick[np.argsort(free[pick])]
                for v, q in zip(victims.tolist(), missed):
                    where.pop(slot_pos[v], None)
                    slot_pos[v] = q
                    where[q] = v
                stamp[victims] = base + np.arange(m)
            stamp[hit_slots] = base + len(missed) + np.arange(len(hit_slots))
        out[policy] = HitRate(H, selected, hits)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace", help="Parquet trace written by TopkTraceRecorder")
    p.add_argument("--buffer", type=int, action="append", required=True, help="hot slots (repeatable)")
    p.add_argument("--policy", action="append", choices=POLICIES,
                   help="replay the hot-buffer model with this hit order (repeatable); default: "
                        "the resolver itself")
    args = p.parse_args(argv)
    table = pq.read_table(args.trace)
    if args.policy:
        print(f"{'buffer':>8} {'policy':>8} {'selected':>10} {'hits':>10} {'hit rate':>9}")
        for h in args.buffer:
            for name, r in replay_policies(table, h, tuple(args.policy)).items():
                print(f"{h:>8} {name:>8} {r.selected:>10} {r.hits:>10} {r.rate:>9.3f}")
        return 0
    print(f"{'buffer':>8} {'selected':>10} {'hits':>10} {'hit rate':>9}")
    for h in args.buffer:
        r = replay_hit_rate(table, h)
        print(f"{h:>8} {r.selected:>10} {r.hits:>10} {r.rate:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
